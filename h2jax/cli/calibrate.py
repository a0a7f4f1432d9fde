"""`h2jax calibrate --plan P [--steps N] [--out profile.json]`: run a plan with a trace,
print what each stage measured next to what the cost model predicted (forward, backward,
send, receive wait, data-parallel reduction, optimizer, step time), and write a calibrated
profile for `h2jax plan --profile` (h2jax.calibrate has the rules)."""

from __future__ import annotations

import argparse
import json

from h2jax.cli.options import output_path, positive_int
from h2jax.config import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="run a plan, compare measured and predicted costs, write a calibrated profile",
                       description=__doc__)
    p.add_argument("--plan", required=True, help="plan file (JSON)")
    p.add_argument("--steps", type=positive_int, default=6,
                   help="traced optimizer steps to run, each followed by an untraced one that times the step (default 6; the first compiles and is not measured)")
    p.add_argument("--cluster", help="cluster file whose per-group overrides the prediction uses (default: chip files)")
    p.add_argument("--profile", help="profile the prediction uses; the calibrated profile extends it")
    p.add_argument("--trace", help="calibrate from this measured trace (`h2jax run --trace`) instead of running")
    p.add_argument("--out", help="write the calibrated profile here (plan with `h2jax plan --profile FILE`)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    p.set_defaults(func=main)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def main(args: argparse.Namespace) -> int:
    from h2jax.calibrate import calibrate
    from h2jax.cluster import load_cluster
    from h2jax.plan import load_plan
    from h2jax.planner import load_profile, save_profile

    plan = load_plan(args.plan)
    if args.steps < 2 and not args.trace:
        raise ConfigError("--steps must be >= 2: the first step compiles and is not measured")
    cluster = load_cluster(args.cluster) if args.cluster else None
    profile = load_profile(args.profile) if args.profile else None
    events = None
    if args.trace:
        from h2jax.trace import read_trace

        events = read_trace(args.trace)
    rows, calibrated = calibrate(plan, args.steps, cluster=cluster, profile=profile, events=events)
    if calibrated is None:  # a non-reporting rank of an MPI job
        return 0
    if args.out:
        save_profile(calibrated, output_path(args.out))
    if args.json:
        print(json.dumps({
            "rows": [{"stage": r.stage, "term": r.term, "measured_s": r.measured_s, "predicted_s": r.predicted_s,
                      "unit": r.unit, "ratio": r.ratio} for r in rows],
            "profile": calibrated.to_dict(), **({"written_to": args.out} if args.out else {}),
        }))
        return 0
    from rich.table import Table

    from h2jax.cli.console import make_console

    console = make_console()
    table = Table(title=f"measured vs predicted: {args.plan}")
    for col in ("stage", "term", "unit", "measured ms", "predicted ms", "measured / predicted"):
        table.add_column(col)
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        table.add_row("all" if r.stage is None else str(r.stage), r.term, r.unit, _ms(r.measured_s),
                      _ms(r.predicted_s), ratio)
    console.print(table)
    console.print("dp reduce: measured inside each backward (the runtime reduces every micro-batch's gradient "
                  "in its backward program); send: '-' when no receiver was already waiting for it", highlight=False)
    if args.out:
        console.print(f"wrote {args.out}; plan with it: h2jax plan --profile {args.out} ...", highlight=False)
    return 0
