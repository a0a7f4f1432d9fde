"""What the training loop checks after every step, in one place: a non-finite loss stops the
run naming the step; a Ctrl-C or SIGTERM on any process stops every process after the same
step (h2jax.runtime.signals); under MPI the step watchdog hears that this rank is alive
(h2jax.runtime.watchdog)."""

from __future__ import annotations

import math

from h2jax.runtime.pipeline import NonFiniteLossError
from h2jax.runtime.signals import RunInterrupted, StopSignals, stop_signal


class RunGuard:
    """`guard = RunGuard(plan, learner)`; `guard.after_step(step, metrics)` after every step
    (every process, the same steps); `guard.close()` at the end (restores signal handlers).
    `learner` is a Trainer (its transport makes the stop decision a collective) or the
    unpipelined reference."""

    def __init__(self, plan, learner, label: str = "h2jax"):
        self.plan = plan
        self.transport = getattr(learner, "transport", None)
        executors = getattr(learner, "executors", {})
        self.led = [i for i, ex in executors.items() if getattr(ex, "is_stage_leader", True)]
        self.stops = StopSignals(label).__enter__()
        self.watchdog = None
        role = getattr(learner, "role", None)
        if role is not None and role.world > 1:
            self.watchdog = _watchdog_for(role)

    def after_step(self, step: int, metrics) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step, metrics.step_time_s)
        if not math.isfinite(metrics.loss):  # the pipeline stops a non-finite gradient itself
            where = "the unpipelined model" if self.transport is None else "the loss"
            raise NonFiniteLossError(f"the loss is {metrics.loss}", None, where, self.plan, step, updated=True)
        signum = stop_signal(self.stops, self.transport, self.led, self.plan.n_stages)
        if signum is not None:
            raise RunInterrupted(signum, step)

    def close(self) -> None:
        self.stops.__exit__(None, None, None)
        if self.watchdog is not None:
            self.watchdog.close()


def _watchdog_for(role):
    from mpi4py import MPI

    from h2jax.runtime import ranks
    from h2jax.runtime.watchdog import StepWatchdog

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # the watchdog's thread needs MPI from two threads
        return None

    def describe(rank: int) -> str:
        stage = max(i for i, first in enumerate(role.first_rank) if first <= rank)
        return f"rank {rank} (stage {stage})"

    return StepWatchdog(ranks.comm_world(), describe)
