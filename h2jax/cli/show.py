"""`h2jax show PLAN`: print a plan file as a table (validates it on the way)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from h2jax.plan import Plan, load_plan


def plan_table(plan: Plan, title: str | None = None) -> Table:
    table = Table(title=title or f"{plan.n_stages}-stage plan, {plan.schedule}, "
                  f"{plan.n_micro} micro-batches of {plan.micro_batch} x {plan.seq_len} tokens")
    for col in ("stage", "chip", "data", "tensor", "layers", "recompute"):
        table.add_column(col)
    memory = (plan.predicted or {}).get("memory_gib")
    if memory:
        table.add_column("memory GiB (pred.)")
    for i, s in enumerate(plan.stages):
        row = [str(i), s.chip, str(s.mesh.data), str(s.mesh.tensor),
               f"[{s.layers[0]}, {s.layers[1]})", s.recompute]
        if memory:
            row.append(f"{memory[i]:.2f}")
        table.add_row(*row)
    return table


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="print a plan file as a table", description=__doc__)
    p.add_argument("plan", help="plan file (JSON)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    Console().print(plan_table(load_plan(args.plan)))
    return 0
