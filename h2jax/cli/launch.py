"""`h2jax launch --plan FILE [--dry-run] [--launcher mpich|openmpi|slurm] -- ARGS...`: start a
plan's job with every rank on the host its stage names.

Each rank sees only its own chips (CUDA_VISIBLE_DEVICES, ROCR_/HIP_VISIBLE_DEVICES, TPU
process bounds, HABANA_VISIBLE_MODULES, ASCEND_RT_VISIBLE_DEVICES) and loads only its own
platform (JAX_PLATFORMS). ARGS is what every rank runs (default: `h2jax run --plan FILE`).
--dry-run prints the command, the files it would write and the rank table, and runs nothing.

When a rank dies without a word (killed by a signal, a native crash), the launcher stops the
others at once; `h2jax launch` then names the rank, its stage, host and how it died, from
records each rank writes under FILES_DIR/ranks (`h2jax.runtime.rank_records`)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from h2jax.config import ConfigError
from h2jax.runtime import rank_records


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="start a plan's job on its hosts (mpiexec or srun)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="plan file whose stages record hosts (from `h2jax plan`)")
    p.add_argument("--launcher", choices=["mpich", "openmpi", "slurm"], default=None,
                   help="how to start the ranks (default: slurm inside a SLURM allocation, else mpich)")
    p.add_argument("--dry-run", action="store_true", help="print the command, files and rank table; run nothing")
    p.add_argument("--files-dir", default=None,
                   help="where to write the launcher's files (default: next to the plan, PLAN.launch/)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then what every rank runs")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from h2jax.launch.commands import build
    from h2jax.plan import load_plan

    plan = load_plan(args.plan)
    rank_args = list(args.args)
    if rank_args and rank_args[0] == "--":
        rank_args = rank_args[1:]
    if not rank_args:
        rank_args = ["h2jax", "run", "--plan", args.plan]
    launcher = args.launcher or ("slurm" if "SLURM_JOB_ID" in os.environ else "mpich")
    files_dir = Path(args.files_dir) if args.files_dir else Path(args.plan).with_suffix(".launch")
    cmd = build(plan, launcher, rank_args, files_dir)
    if args.dry_run:
        print(f"# {launcher} command")
        print(cmd.shell())
        for path, text in cmd.files.items():
            print(f"\n# file {path}")
            print(text, end="")
        print("\n# ranks")
        print(cmd.table())
        return 0
    for path, text in cmd.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    print(f"h2jax launch: {cmd.shell()}", file=sys.stderr, flush=True)
    records = files_dir / "ranks"
    shutil.rmtree(records, ignore_errors=True)  # this job's records only
    try:
        code, output = _run_teeing(cmd.argv, {**os.environ, **cmd.env, rank_records.ENV: str(records.resolve())})
    except FileNotFoundError:
        raise ConfigError(
            f"{cmd.argv[0]!r} is not on PATH; install the launcher (pip install mpich for mpiexec) "
            "or pick another with --launcher"
        ) from None
    if code != 0:
        for line in rank_records.explain_failure(output, rank_records.read_records(records)):
            print(f"h2jax launch: {line}", file=sys.stderr, flush=True)
    return code


TAIL_BYTES = 1 << 16  # the launcher's last words, where it names the process that failed


def _run_teeing(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run the launcher, passing its output through as it comes (bytes, not lines: progress
    bars redraw with \r), and return its exit code with the tail of what it printed."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tails: dict[str, bytes] = {}

    def pump(name: str, source, sink) -> None:
        tail = b""
        for chunk in iter(lambda: source.read1(1 << 16), b""):
            sink.write(chunk)
            sink.flush()
            tail = (tail + chunk)[-TAIL_BYTES:]
        tails[name] = tail

    threads = [threading.Thread(target=pump, args=("out", proc.stdout, sys.stdout.buffer), daemon=True),
               threading.Thread(target=pump, args=("err", proc.stderr, sys.stderr.buffer), daemon=True)]
    for t in threads:
        t.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the launcher got the Ctrl-C too and stops the ranks
        code = proc.wait()
    for t in threads:
        t.join()
    text = b"\n".join(tails.get(k, b"") for k in ("out", "err")).decode("utf-8", "replace")
    return code, text
