"""Ctrl-C and SIGTERM during training: finish the step, stop every process after the same
step, end with one line (and, where a run keeps checkpoints, save first).

`StopSignals` records a SIGINT/SIGTERM instead of raising in the middle of a step (which would
leave the other ranks of an MPI job waiting on a message that never comes); a second signal
ends the process at once, with one line. `stop_signal(stops, transport)` is the one check the
training loop makes after each step: every process learns whether any process was asked to
stop, so they all stop together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """Training stopped on a signal after a whole step; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, note: str = ""):
        self.signum, self.step = signum, step
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}" + (f"; {note}" if note else ""))


class StopSignals:
    """`with StopSignals() as stops:` -- `stops.signum` is the first SIGINT/SIGTERM received
    (None before). Handlers are installed only in the main thread (Python delivers signals
    there) and the previous ones come back on exit."""

    def __init__(self, label: str = "h2jax"):
        self.label, self.signum, self._previous = label, None, {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # asked twice: do not wait for the step to end
            sys.stderr.write(f"{self.label}: {signal.Signals(signum).name} again; exiting now\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        sys.stderr.write(f"{self.label}: {signal.Signals(signum).name} received; stopping after this step "
                         "(send it again to exit at once)\n")
        sys.stderr.flush()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def stop_signal(stops: StopSignals | None, transport=None, stages=(), n_stages: int = 1) -> int | None:
    """The signal to stop on after this step, agreed by every process: SIGTERM if any process
    received one, else SIGINT if any did, else None (go on). With a `transport` it is a
    collective over the job (`stages`: the stages this process leads, of `n_stages`); every
    process must call it after every step."""
    mine = stops.signum if stops is not None else None
    if transport is None:
        return mine
    # A sum of one value per stage is the collective every transport has: SIGINT counts 1 and
    # SIGTERM n_stages + 1, so the sum says whether any stage saw a SIGTERM.
    weight = {None: 0.0, signal.SIGINT: 1.0, signal.SIGTERM: float(n_stages + 1)}[mine]
    total = transport.sum_across_stages({i: weight for i in stages})
    if total >= n_stages + 1:
        return signal.SIGTERM
    return signal.SIGINT if total > 0 else None


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop, raised like Ctrl-C's KeyboardInterrupt."""

    signum = signal.SIGTERM


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within: SIGTERM raises `Terminated` (a KeyboardInterrupt), so a command ends on it the
    way it ends on Ctrl-C, with one line (the training loop's StopSignals takes over inside)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
