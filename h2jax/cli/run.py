"""`h2jax run --plan FILE --steps N`: train a plan (pipelined, or the unpipelined reference)."""

from __future__ import annotations

import argparse
import json
import sys

from h2jax.cli.options import output_path, positive_int
from h2jax.cli.progress import training_progress
from h2jax.plan import load_plan


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train a plan file", description=__doc__)
    p.add_argument("--plan", required=True, help="plan file (JSON)")
    p.add_argument("--steps", type=positive_int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--data", help="token file (uint8 bytes); default: the Python stdlib corpus")
    p.add_argument("--unpipelined", action="store_true",
                   help="run the same model on the same data as one jitted function on one device")
    p.add_argument("--json", action="store_true", help="print one final JSON line instead of a progress bar")
    p.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the measured run (open in ui.perfetto.dev); "
                        "the same tracks as `h2jax simulate --trace`")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)  # validates before JAX starts
    if args.steps < 1:
        raise SystemExit("h2jax run: error: --steps must be >= 1")
    from h2jax.runtime import ranks
    from h2jax.runtime.train import run

    # One loop in one process and under mpiexec; only the job's first process reports.
    reports = not ranks.in_mpi_job() or ranks.mpi_rank() == 0
    from h2jax.data import TokenDataset

    dataset = TokenDataset(args.data, plan.seq_len, plan.seed) if args.data else None
    n_chips = 1 if args.unpipelined else plan.n_devices
    with training_progress(args.steps, plan.tokens_per_step, n_chips, enabled=not args.json and reports) as on_step:
        result = run(plan, args.steps, dataset=dataset, unpipelined=args.unpipelined, on_step=on_step,
                     trace=output_path(args.trace) if args.trace else None)
    if not reports:  # another MPI rank prints
        return 0
    if args.trace:
        print(f"measured trace written to {args.trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(
            f"{args.steps} steps: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
            f"{result.step_time_s * 1e3:.1f} ms/step, {result.tokens_per_s:,.0f} tokens/s"
            + (f" ({result.emulation_note})" if result.emulation_note else "")
        )
    return 0
