"""`h2jax` command line. Each subcommand is a module in this package with
`add_parser(subparsers)` and `main(args) -> int`; add new ones to COMMANDS."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from h2jax.config import ConfigError

# Module names under h2jax.cli, in the order `h2jax --help` lists them.
COMMANDS = ["plan", "run", "replan", "demo", "show", "simulate", "compare", "profile", "calibrate", "align", "data", "plot", "launch"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="h2jax",
        description="Train one model across mixed accelerators: plan, simulate, run.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"h2jax.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from h2jax.runtime.signals import RunInterrupted, terminate_as_interrupt

    args = build_parser().parse_args(argv)
    try:
        with terminate_as_interrupt():
            return int(args.func(args) or 0)
    except ConfigError as e:
        # Bad input: one clear line naming the field and the fix, never a traceback.
        print(f"h2jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunInterrupted as e:  # Ctrl-C / SIGTERM during training: after a whole step
        print(f"h2jax {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM anywhere else
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"h2jax {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `h2jax ... | head`: the reader left; nothing more to say
        sys.stderr.close()
        return 0


def run_and_exit(argv: list[str] | None = None) -> None:
    """The `h2jax` console script and `python -m h2jax`: run the command, then leave without
    finalizing the interpreter under live worker threads. XLA's and orbax's threads can be
    inside native code when Python finalizes; a daemon thread that re-enters Python then is
    unwound by the interpreter and, through C++ frames, aborts the process ("FATAL: exception
    not rethrown", status -6) after the command's work is done. By this point every output is
    complete (checkpoints waited for, metrics closed); a stage's jax.distributed group and MPI
    are shut down properly first (`h2jax.runtime.ranks.leave_process`)."""
    code = main(argv)
    if "h2jax.runtime.rank_records" in sys.modules:  # a rank of a launched job ends by itself
        sys.modules["h2jax.runtime.rank_records"].record_end(f"exit {code}")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    if "jax" in sys.modules:
        from jax._src import distributed

        if distributed.global_state.client is not None:
            import jax

            jax.distributed.shutdown()
    if "mpi4py.MPI" in sys.modules:  # MPI_Finalize, then the MPI library's exit hooks
        from h2jax.runtime.ranks import leave_process

        leave_process(code)
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
