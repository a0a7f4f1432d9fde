"""`h2jax compare --cluster FILE --model NAME --seq-len S --global-batch-tokens T`: plan and
simulate the mixed cluster and each chip type alone, and print the HeteroSpeedupRatio against
baselines at the same global batch (the honest number) and, with
`--baseline-global-batch-tokens T0`, labelled as the paper's method, against baselines at T0."""

from __future__ import annotations

import argparse
import json

from h2jax.cli.options import positive_int
from h2jax.cluster import load_cluster
from h2jax.speedup import compare, parse_tokens


def add_parser(sub) -> None:
    from h2jax.schedules import AUTO, NAMES

    p = sub.add_parser("compare", help="HeteroSpeedupRatio of a mixed cluster, batch-matched",
                       description=__doc__)
    p.add_argument("--cluster", required=True, help="cluster file (TOML), e.g. plans/cluster-1024.toml")
    p.add_argument("--model", required=True, help="model preset, e.g. llama-100b")
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--global-batch-tokens", required=True,
                   help="tokens per optimizer step, e.g. 4194304 or 4M (binary suffixes)")
    p.add_argument("--baseline-global-batch-tokens",
                   help="also compare with homogeneous baselines at this batch (the paper's method)")
    p.add_argument("--schedule", default=AUTO, choices=(AUTO, *NAMES),
                   help="pipeline schedule (default auto: the fastest registered schedule per run)")
    p.add_argument("--profile", help="measured profile (from `h2jax profile`)")
    p.add_argument("--time-limit", type=float, default=60.0,
                   help="stop the mixed-cluster search after this many seconds with the best plan "
                        "found, marked not proved optimal (default 60)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    profile = None
    if args.profile:
        from h2jax.planner.profile import load_profile

        profile = load_profile(args.profile)
    cluster = load_cluster(args.cluster)
    tokens = parse_tokens(args.global_batch_tokens, "--global-batch-tokens")
    base = (parse_tokens(args.baseline_global_batch_tokens, "--baseline-global-batch-tokens")
            if args.baseline_global_batch_tokens else None)
    result = compare(cluster, args.model, args.seq_len, tokens, base, args.schedule, profile,
                     time_limit_s=args.time_limit)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    _print(result.to_dict())
    return 0


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print(d: dict) -> None:
    from rich.table import Table

    from h2jax.cli.console import make_console

    console = make_console()
    table = Table(title=f"{d['cluster']}: planned by the cost model, timed by the simulator")
    for col in ("run", "chips", "used", "batch", "stages", "m", "schedule", "bubble", "s/step sim",
                "s/step model", "tokens/s", "TGS"):
        table.add_column(col, justify="right")
    rows = [("mixed", d["mixed"])] + list(d["baselines_same_batch"].items())
    if d["baselines_fixed_batch"]:
        rows += [(f"{k} @T0", v) for k, v in d["baselines_fixed_batch"].items()]
    for name, r in rows:
        table.add_row(
            name, str(r["cluster_chips"]), _fmt(r["chips_used"], "d"),
            f"{r['global_batch_tokens'] / 2**20:g}M", _fmt(r["stages"], "d"), _fmt(r["n_micro"], "d"),
            r["schedule"] or "-", _fmt(r["predicted"]["bubble_fraction"], ".1%"),
            _fmt(r["simulated"]["step_time_s"], ".3f"), _fmt(r["predicted"]["step_time_s"], ".3f"),
            _fmt(r["simulated"]["tokens_per_s"], ",.0f"), _fmt(r["simulated"]["tokens_per_chip_per_s"], ",.0f"),
        )
    console.print(table)
    for name, r in rows:
        if r["error"]:
            console.print(f"{name}: no plan: {r['error']}")
    console.print(
        f"HeteroSpeedupRatio, baselines at the same global batch ({d['global_batch_tokens']:,} tokens): "
        f"[bold]{_fmt(d['hetero_speedup_ratio'], '.1%')}[/bold] "
        f"(cost model alone: {_fmt(d['hetero_speedup_ratio_cost_model'], '.1%')})"
    )
    if d["baselines_fixed_batch"] is not None:
        console.print(
            f"HeteroSpeedupRatio, paper's method (baselines at {d['baseline_global_batch_tokens']:,} "
            f"tokens): {_fmt(d['hetero_speedup_ratio_paper_method'], '.1%')}; of that, "
            f"{_fmt(d['batch_size_effect'], '+.1%')} is the batch-size effect, not the mixing"
        )
