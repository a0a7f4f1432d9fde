"""`h2jax show PLAN`: print a plan file as a table (validates it on the way)."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from h2jax.cli.console import count, gib, make_console
from h2jax.names import format_layers
from h2jax.plan import Plan, load_plan


def plan_table(plan: Plan, title: str | None = None) -> Table:
    table = Table(title=title or f"{plan.n_stages}-stage plan, {plan.schedule}, "
                  f"{count(plan.n_micro, 'micro-batch')} of {plan.micro_batch} x {plan.seq_len} tokens")
    for col in ("stage", "chip", "data", "tensor", "layers", "recompute"):
        table.add_column(col)
    memory = (plan.predicted or {}).get("memory_gib")
    if memory:
        table.add_column("memory GiB (pred.)")
    hosts = all(s.hosts is not None for s in plan.stages)
    if hosts:
        table.add_column("hosts")
    for i, s in enumerate(plan.stages):
        row = [str(i), s.chip, str(s.mesh.data), str(s.mesh.tensor),
               format_layers(s.layer_ranges if getattr(s, "layer_ranges", None) else [s.layers]), s.recompute]
        if memory:
            row.append(gib(memory[i]))
        if hosts:  # each process's host and chips, as `h2jax launch` will place them
            row.append(", ".join(f"{h.host}:{_ids(h.devices)}" for h in s.hosts))
        table.add_row(*row)
    return table


def _ids(devices) -> str:
    """Chip ids as 0-7 when consecutive, else 0,2,5."""
    d = list(devices)
    if len(d) > 2 and d == list(range(d[0], d[0] + len(d))):
        return f"{d[0]}-{d[-1]}"
    return ",".join(map(str, d))


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="print a plan file as a table", description=__doc__)
    p.add_argument("plan", help="plan file (JSON)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: the validated plan and the figures derived from it")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.json:
        print(json.dumps({
            "plan": plan.to_dict(), "n_stages": plan.n_stages, "n_micro": plan.n_micro,
            "n_devices": plan.n_devices, "n_processes": plan.n_processes,
            "tokens_per_step": plan.tokens_per_step,
        }))
        return 0
    make_console().print(plan_table(plan))
    return 0
