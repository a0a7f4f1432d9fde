"""`h2jax align --chips A,B[,...] --steps 300`: train the same model on the same data under each
chip type's backend and precision policy; pass when every loss curve's mean relative error
against the first chip's is under 1.5% (the H2 paper's criterion), fail loudly otherwise."""

from __future__ import annotations

import argparse
import contextlib
import json

from rich.table import Table

from h2jax.cli.console import make_console

from h2jax.runtime.jaxsetup import force_cpu_devices
from h2jax.cli.progress import training_progress
from h2jax.cli.options import positive_float, positive_int
from h2jax.cluster import load_chip


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="check that chip types train to the same loss curve", description=__doc__)
    p.add_argument("--chips", required=True, help="chip types, comma-separated; the first is the reference")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--model", default="tiny", help="model preset (default tiny: fast on CPU)")
    p.add_argument("--seq-len", type=positive_int, default=32, help="sequence length (default 32)")
    p.add_argument("--global-batch", "--batch", dest="global_batch", type=positive_int, default=8,
                   help="sequences per step (default 8)")
    p.add_argument("--learning-rate", type=positive_float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    chips = [c.strip() for c in args.chips.split(",") if c.strip()]
    loaded = [load_chip(c) for c in chips]  # unknown names fail before JAX starts
    force_cpu_devices(1)
    from h2jax.align import TOLERANCE, align

    console = make_console()
    bars = contextlib.ExitStack()

    def progress_bar(chip: str):
        """One bar per chip type: the previous chip's bar closes as the next one opens."""
        bars.close()
        if args.json:
            return None
        return bars.enter_context(training_progress(args.steps, args.global_batch * args.seq_len, 1, label=chip))

    with bars:
        result = align(
            chips, args.steps, model=args.model, seq_len=args.seq_len, batch=args.global_batch,
            learning_rate=args.learning_rate, on_step=progress_bar,
        )
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0 if result.passed else 1
    table = Table(title=f"loss-curve alignment vs {result.reference} over {args.steps} steps "
                  f"(pass: mean relative error < {TOLERANCE:.1%})")
    for col in ("chip", "params", "compute", "matmul", "final loss", "mean rel. error", "worst step", "result"):
        table.add_column(col)
    policy = {c.name: c.precision for c in loaded}
    errors = {e.chip: e for e in result.errors}
    for name in chips:
        p = policy[name]
        e = errors.get(name)
        row = [name, p.param_dtype, p.compute_dtype, p.matmul_precision, f"{result.losses[name][-1]:.4f}"]
        if e is None:
            row += ["(reference)", "", ""]
        else:
            verdict = "[green]pass[/]" if e.passed else "[bold red]FAIL[/]"
            row += [f"{e.mean_relative_error:.3%}", f"{e.worst_step} ({e.worst_relative_error:.2%})", verdict]
        table.add_row(*row)
    console.print(table)
    if not result.passed:
        console.print(f"[bold red]ALIGNMENT FAILED[/]: {result.failure_message()}")
        return 1
    console.print(f"[green]aligned[/]: every curve within {TOLERANCE:.1%} of {result.reference}")
    return 0
