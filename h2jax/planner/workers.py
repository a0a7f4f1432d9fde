"""Worker processes for the planner's independent searches.

The planner runs work that needs nothing from the rest in processes of their own: the
two-shape proof's nodes (chip_split.py), `--schedule auto`'s schedules after the first and
the per-type baselines (search.py, baselines.py). `Pool` is what they share:

- spawned, not forked (the caller may hold threads, e.g. JAX's);
- a worker ignores Ctrl-C: the planner's KeyboardInterrupt ends the pool (`close`);
- a worker whose planner dies (kill -9) exits with it, mid-search too (it watches its parent);
- a worker that dies (kill -9, the OOM killer) fails the work with one PlannerError that
  says what was lost and how to run with fewer processes (`result`), instead of a wait.

A search is exact wherever it runs, so the results do not depend on the number of workers.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from h2jax.planner.space import PlannerError


def _start(initializer: Callable[..., None] | None, initargs: Sequence[Any]) -> None:
    import multiprocessing
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the planner's: it ends the pool
    parent = multiprocessing.parent_process()
    if parent is not None:  # a planner that dies (kill -9) takes its workers with it, mid-search too
        threading.Thread(target=_exit_with, args=(parent,), name="h2jax-planner-parent", daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def _exit_with(parent) -> None:
    parent.join()  # returns when the parent process has ended
    os._exit(1)


class Pool:
    """`workers` spawned processes; `what` names the work in the error a dead worker raises
    (e.g. "the two-shape proof"). `initializer(*initargs)` runs once in each."""

    def __init__(self, workers: int, what: str, initializer: Callable[..., None] | None = None,
                 initargs: Sequence[Any] = ()) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.what = what
        self._pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start,
                                         (initializer, tuple(initargs)))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) in a worker (fn a module-level function, the arguments picklable)."""
        return self._pool.submit(fn, *args)

    def result(self, future: Future) -> Any:
        """The future's result (its exception raised here); a PlannerError where its worker died."""
        from concurrent.futures.process import BrokenProcessPool

        try:
            return future.result()
        except BrokenProcessPool:
            raise PlannerError(
                f"a process of {self.what} died (killed, e.g. out of memory) before its work was done; "
                "run again with fewer processes (--jobs, `workers`) or one (--jobs 1)") from None

    def map(self, fn: Callable[..., Any], calls: Sequence[Sequence[Any]]) -> list[Any]:
        """fn(*args) for each args of `calls`, in workers at once; the results in order."""
        futures = [self.submit(fn, *args) for args in calls]
        return [self.result(f) for f in futures]

    def close(self) -> None:
        """Stop the workers now, work under way too (on an error or Ctrl-C here), or, when all
        is done, let them end."""
        for process in list((getattr(self._pool, "_processes", None) or {}).values()):
            process.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
