"""`h2jax replan --checkpoint DIR --cluster NEW.toml [--out plan.json]`: plan a changed cluster.

Plans the checkpoint's model, sequence length and global batch (kept, so the run stays the same
optimisation) on the new cluster, prints the old and the new plan and their predicted
throughput side by side, and writes the new plan; `h2jax run --plan NEW --checkpoint-dir DIR
--resume` then continues the run on it, each stage reading its own layers from DIR."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from h2jax.plan import Plan


def add_parser(sub) -> None:
    p = sub.add_parser("replan", help="re-plan a checkpointed run for a changed cluster", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (of `h2jax run --checkpoint-dir`)")
    p.add_argument("--cluster", required=True, help="the new cluster file (TOML)")
    p.add_argument("--step", type=int, help="plan for this checkpoint step (default: the newest)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], help="pipeline schedule (default: the old plan's)")
    p.add_argument("--time-limit", type=float, default=60.0, help="search time limit in seconds (default 60)")
    p.add_argument("--out", help="write the new plan (JSON) here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=main)


def replan(old: Plan, cluster: Any, schedule: str | None = None, time_limit_s: float | None = 60.0) -> Plan:
    """The planner's best plan for `cluster` with `old`'s model, sequence length, global batch,
    optimizer and seed (the data order), so it resumes `old`'s checkpoints."""
    from h2jax.planner import plan_cluster

    result = plan_cluster(
        cluster, old.model_name or old.model, old.seq_len, old.global_batch,
        schedule=schedule or old.schedule, optimizer=old.optimizer,
        shard_optimizer=old.optimizer.shard_over_data, baselines=False, time_limit_s=time_limit_s,
    )
    return dataclasses.replace(result.plan, seed=old.seed)


def _stage_text(plan: Plan, i: int) -> str:
    if i >= plan.n_stages:
        return ""
    s = plan.stages[i]
    return f"{s.chip} {s.mesh.data}x{s.mesh.tensor} layers {s.layers[0]}-{s.layers[1] - 1} {s.recompute}"


def _summary(plan: Plan) -> dict[str, Any]:
    pred = plan.predicted or {}
    return {
        "stages": plan.n_stages,
        "chips": plan.n_devices,
        "micro_batch": f"{plan.micro_batch} x {plan.n_micro}",
        "schedule": plan.schedule,
        "predicted tokens/s": f"{pred['tokens_per_s']:,.0f}" if "tokens_per_s" in pred else "not recorded",
        "predicted TGS": f"{pred['tokens_per_chip_per_s']:,.1f}" if "tokens_per_chip_per_s" in pred else "not recorded",
        "predicted step s": f"{pred['step_time_s']:.4g}" if "step_time_s" in pred else "not recorded",
    }


def main(args: argparse.Namespace) -> int:
    from h2jax.cluster import load_cluster
    from h2jax.plan import save_plan
    from h2jax.runtime.checkpoint import open_checkpoint, read_checkpoint

    path, meta = read_checkpoint(args.checkpoint, args.step)
    from h2jax.plan import plan_from_dict

    old = plan_from_dict(meta["plan"])
    cluster = load_cluster(args.cluster)
    new = replan(old, cluster, args.schedule, args.time_limit)
    open_checkpoint(args.checkpoint, new, step=meta["step"], verify=False)  # it resumes this checkpoint
    if args.out:
        save_plan(new, args.out)
    if args.json:
        print(json.dumps({"checkpoint": str(path), "step": meta["step"], "old": old.to_dict(),
                          "new": new.to_dict(), "written_to": args.out}))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=max(100, Console().width))
    table = Table(title=f"{old.model_name or 'model'}, seq {old.seq_len}, global batch {old.global_batch} "
                  f"(kept): checkpoint step {meta['step']} -> {cluster.name}")
    for col in ("", "old plan (wrote the checkpoint)", f"new plan ({cluster.name})"):
        table.add_column(col)
    for key, (a, b) in {k: (v, _summary(new)[k]) for k, v in _summary(old).items()}.items():
        table.add_row(key, str(a), str(b))
    for i in range(max(old.n_stages, new.n_stages)):
        table.add_row(f"stage {i}", _stage_text(old, i), _stage_text(new, i))
    console.print(table)
    if args.out:
        # soft_wrap: a command to copy keeps its one line, however long its paths
        console.print(f"new plan written to {args.out}; continue the run with:\n"
                      f"  h2jax run --plan {args.out} --checkpoint-dir {args.checkpoint} --resume",
                      soft_wrap=True, markup=False)
    return 0
