"""`h2jax run --plan FILE --steps N`: train a plan (pipelined, or the unpipelined reference)."""

from __future__ import annotations

import argparse
import json
import sys

from h2jax.cli.options import output_path, positive_int
from h2jax.cli.progress import training_progress
from h2jax.plan import check_schedule_size
from h2jax.plan import LR_SCHEDULES, load_plan, parse_train

TRAIN_FLAGS = ("lr_schedule", "warmup_steps", "decay_steps", "final_lr_fraction", "eval_every",
               "eval_batches", "log_every")


def with_overrides(plan, args: argparse.Namespace):
    """`plan` with the command line's training settings over its `train` section (validated
    the same way, errors naming the flag's field)."""
    import dataclasses

    given = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k, None) is not None}
    if given:
        plan = dataclasses.replace(plan, train=parse_train({**dataclasses.asdict(plan.train), **given}))
    if getattr(args, "learning_rate", None) is not None:
        if not args.learning_rate > 0:
            raise SystemExit("h2jax run: error: --learning-rate must be positive")
        plan = dataclasses.replace(plan, optimizer=dataclasses.replace(plan.optimizer, learning_rate=args.learning_rate))
    return plan


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train a plan file", description=__doc__)
    p.add_argument("--plan", required=True, help="plan file (JSON)")
    p.add_argument("--steps", type=positive_int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--data", help="a dataset directory from `h2jax data prepare`, or a raw uint8 token file; "
                                  "default: the Python stdlib corpus (bytes)")
    p.add_argument("--log-dir", help="write metrics here: metrics.jsonl, TensorBoard event files, run.json "
                                     "(plot them with `h2jax plot LOGDIR`)")
    t = p.add_argument_group("training settings (override the plan's `train` section)")
    t.add_argument("--lr-schedule", choices=LR_SCHEDULES, help="learning-rate schedule; its peak is "
                   "optimizer.learning_rate")
    t.add_argument("--learning-rate", type=float, help="peak learning rate (optimizer.learning_rate)")
    t.add_argument("--warmup-steps", type=int, help="linear warm-up from 0 over this many steps")
    t.add_argument("--decay-steps", type=int, help="the schedule's length, warm-up included (default --steps)")
    t.add_argument("--final-lr-fraction", type=float, help="learning rate at the end of decay / peak")
    t.add_argument("--eval-every", type=int, help="evaluate on the validation split every N steps (0: never)")
    t.add_argument("--eval-batches", type=int, help="validation batches per evaluation")
    t.add_argument("--log-every", type=int, help="write a metrics record every N steps")
    c = p.add_argument_group("checkpoints (by global layer: any plan of the same model resumes them)")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here: every --save-every steps "
                   "(asynchronously), at the end, and on Ctrl-C/SIGTERM (then exit 0)")
    c.add_argument("--save-every", type=positive_int, metavar="N", help="save every N steps (default: only at the end)")
    c.add_argument("--keep", type=positive_int, metavar="K", help="keep the newest K checkpoints (default: all)")
    c.add_argument("--resume", nargs="?", const=True, default=False, type=positive_int, metavar="STEP",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (or STEP); "
                        "--steps more steps")
    p.add_argument("--unpipelined", action="store_true",
                   help="run the same model on the same data as one jitted function on one device")
    p.add_argument("--json", action="store_true", help="print one final JSON line instead of a progress bar")
    p.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the measured run (open in ui.perfetto.dev); "
                        "the same tracks as `h2jax simulate --trace`")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from h2jax.runtime import ranks

    if ranks.in_mpi_job():  # a rank stuck before it starts MPI ends itself (ranks.watch_startup)
        ranks.watch_startup()
    plan = with_overrides(load_plan(args.plan), args)  # validates before JAX starts
    if args.steps < 1:
        raise SystemExit("h2jax run: error: --steps must be >= 1")
    if (args.resume is not False or args.save_every or args.keep) and not args.checkpoint_dir:
        raise SystemExit("h2jax run: error: --resume, --save-every and --keep need --checkpoint-dir DIR")
    from h2jax.runtime.train import run

    # One loop in one process and under mpiexec; only the job's first process reports.
    reports = not ranks.in_mpi_job() or ranks.mpi_rank() == 0
    # What would be refused inside the run is refused before the progress bar starts.
    check_schedule_size(plan)
    if not ranks.in_mpi_job() and not args.unpipelined:
        from h2jax.runtime.jaxsetup import check_host_devices, cpu_devices_needed

        check_host_devices(cpu_devices_needed(plan))
    from h2jax.data import open_dataset

    dataset = open_dataset(args.data, plan.seq_len, plan.seed) if args.data else None
    n_chips = 1 if args.unpipelined else plan.n_devices
    with training_progress(args.steps, plan.tokens_per_step, n_chips, enabled=not args.json and reports) as bar:
        result = run(plan, args.steps, dataset=dataset, unpipelined=args.unpipelined, on_step=bar,
                     on_eval=bar.evaluated if bar else None, trace=output_path(args.trace) if args.trace else None, log_dir=args.log_dir,
                     checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, keep=args.keep,
                     resume=args.resume)
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
            + (f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else "")
            + (f" ({result.emulation_note})" if result.emulation_note else "")
        )
        if result.checkpoint is not None:
            print(f"checkpoint of step {int(result.checkpoint.name[len('step_'):])} written to "
                  f"{result.checkpoint}")
    return 0
