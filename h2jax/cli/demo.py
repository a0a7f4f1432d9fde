"""`h2jax demo`: train the checked-in heterogeneous-layout plan on forced CPU devices."""

from __future__ import annotations

import argparse

from rich.console import Console

from h2jax.cli._jaxsetup import force_cpu_devices
from h2jax.cli.progress import training_progress
from h2jax.cli.show import plan_table
from h2jax.cluster import REPO_ROOT
from h2jax.plan import load_plan

DEMO_PLAN = REPO_ROOT / "plans" / "demo.json"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train a small model on a heterogeneous pipeline of CPU devices",
                       description=__doc__)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--plan", default=str(DEMO_PLAN), help="plan file (default: plans/demo.json)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    console = Console()
    plan = load_plan(args.plan)
    force_cpu_devices(plan.n_devices)
    from h2jax.runtime.train import run

    console.print(f"[bold]h2jax demo[/]: model {plan.model_name or 'custom'} "
                  f"({plan.model.param_count() / 1e6:.2f}M parameters) as a {plan.n_stages}-stage "
                  f"pipeline on {plan.n_devices} forced CPU devices, each stage on its own mesh")
    console.print(plan_table(plan))
    console.print("Training on the Python standard library's own source code (byte-level tokens)...")
    with training_progress(args.steps, plan.tokens_per_step, plan.n_devices) as on_step:
        result = run(plan, args.steps, on_step=on_step)
    console.print(
        f"Trained {args.steps} steps: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} "
        f"({result.step_time_s * 1e3:.0f} ms/step, {result.tokens_per_s:,.0f} tokens/s, "
        f"{result.tokens_per_chip_s:,.0f} tokens/chip/s)."
    )
    if not result.losses[-1] < result.losses[0]:
        console.print("[red]the loss did not fall[/]")
        return 1
    return 0
