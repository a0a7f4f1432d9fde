"""The step watchdog of an MPI job: a stopped (SIGSTOP) or hung rank must not stall the job.

Every rank runs a thread that sends a small heartbeat (its last finished step) to rank 0 every
second, on a communicator of its own; rank 0's thread sends its heartbeat to every rank. Rank 0
aborts the whole job, naming the rank, when one goes silent (no heartbeat: the process is
stopped or wedged) or when no rank has finished a step for the limit (naming the ranks that
are furthest behind); the other ranks do the same for rank 0. The heartbeats come from a
thread, so a rank that merely waits for a slow peer keeps beating.

At the end each rank tells the ranks it beats to that it is closing and receives what the
ranks it watches sent until they say the same (at most `DRAIN_S` seconds): a heartbeat left
unreceived at MPI_Finalize makes MPICH's UCX layer print a warning on standard output, after
the run's own output (`h2jax run --json`'s last line).

The limit: `H2JAX_STEP_TIMEOUT` seconds when set, else the larger of 300 s and 20 times the
slowest step so far; until the first step has finished (compilation),
`H2JAX_FIRST_STEP_TIMEOUT` (default 1800 s).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

_TAG = 7_301
MIN_LIMIT_S = 300.0
STEP_FACTOR = 20.0
FIRST_STEP_S = 1800.0
DRAIN_S = 5.0  # how long close() waits for the watched ranks' closing message
STALE_BEATS = 3  # heartbeats a beating rank cannot miss: one quiet this long when the job stalls is named
_CLOSING = None  # the message a rank sends when it stops beating


def step_limit(slowest_step_s: float | None, env=os.environ) -> float:
    """Seconds a rank may go without a heartbeat or the job without a finished step."""
    if slowest_step_s is None:
        return float(env.get("H2JAX_FIRST_STEP_TIMEOUT", FIRST_STEP_S))
    if env.get("H2JAX_STEP_TIMEOUT"):
        return float(env["H2JAX_STEP_TIMEOUT"])
    return max(MIN_LIMIT_S, STEP_FACTOR * slowest_step_s)


class StepWatchdog:
    """Create on every rank at the same point (it duplicates `comm`, a collective); call
    `beat(step, seconds)` after each finished step and `close()` at the end."""

    def __init__(self, comm, describe: Callable[[int], str], interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.describe, self.interval_s, self.clock = describe, interval_s, clock
        self.step, self.slowest = 0, None
        now = clock()
        self.heard = {r: now for r in self._watched()}  # rank -> when its last heartbeat came
        self.steps = {r: 0 for r in self._watched()}
        self.furthest, self.progress_at = 0, now  # the job's furthest finished step, and since when
        self._sends: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="h2jax-watchdog", daemon=True)
        self._thread.start()

    def _watched(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank] if self.rank == 0 else [0]

    def beat(self, step: int, seconds: float) -> None:
        self.step = step
        self.slowest = seconds if self.slowest is None else max(self.slowest, seconds)
        self._progressed(step, self.clock())

    def _progressed(self, step: int, now: float) -> None:
        if step > self.furthest:
            self.furthest, self.progress_at = step, now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._drain()

    def _targets(self) -> list[int]:
        return list(range(1, self.size)) if self.rank == 0 else [0]

    def _drain(self) -> None:
        """Send the closing message; receive heartbeats until every watched rank has sent its
        own (messages between two ranks arrive in order: nothing of theirs follows it), or
        DRAIN_S has passed (a peer that failed: the job is being aborted anyway)."""
        for dest in self._targets():
            self._sends.append(self.comm.isend(_CLOSING, dest=dest, tag=_TAG))
        open_ = set(self._watched())
        deadline = time.monotonic() + DRAIN_S
        while open_ and time.monotonic() < deadline:
            for src, message in self._pending():
                if message is _CLOSING:
                    open_.discard(src)
            if open_:
                time.sleep(0.002)
        while self._sends and time.monotonic() < deadline:  # small messages: already delivered
            self._sends = [r for r in self._sends if not r.Test()]

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._send()
            self._receive()
            verdict = self.verdict(self.clock())
            if verdict is not None:
                self._abort(verdict)

    def _send(self) -> None:
        self._sends = [r for r in self._sends if not r.Test()]
        message = (self.step, self.slowest)
        for dest in self._targets():
            self._sends.append(self.comm.isend(message, dest=dest, tag=_TAG))

    def _pending(self) -> list[tuple[int, object]]:
        """(source, message) of every heartbeat that has arrived."""
        from mpi4py import MPI

        out, status = [], MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
            src = status.Get_source()
            out.append((src, self.comm.recv(source=src, tag=_TAG)))
        return out

    def _receive(self) -> None:
        for src, message in self._pending():
            if message is not _CLOSING:
                step, slowest = message
                self.heard_from(src, step, slowest, self.clock())

    def heard_from(self, src: int, step: int, slowest: float | None, now: float) -> None:
        self.heard[src] = now
        self.steps[src] = step
        self._progressed(step, now)
        if slowest is not None:
            self.slowest = slowest if self.slowest is None else max(self.slowest, slowest)

    def verdict(self, now: float) -> str | None:
        """Why to abort the job now, or None."""
        limit = step_limit(self.slowest)
        silent = [r for r, t in self.heard.items() if now - t > limit]
        if silent:
            return self._silent(silent[0], now, limit)
        if self.rank == 0 and now - self.progress_at > limit:
            # a rank that has also stopped beating (for several heartbeats) is why: its last
            # heartbeat can come after the job's last finished step, so the stall reaches the
            # limit first. Name the rank, not the stall.
            quiet = [r for r, t in self.heard.items() if now - t > STALE_BEATS * self.interval_s]
            if quiet:
                return self._silent(min(quiet, key=self.heard.get), now, limit)
            steps = {0: self.step, **self.steps}
            behind = min(steps.values())
            late = [r for r, s in steps.items() if s == behind]
            return (f"no step finished for {now - self.progress_at:.0f} s (limit {limit:.0f} s); furthest behind: "
                    + ", ".join(self.describe(r) for r in late) + f" at step {behind}; aborting the job "
                    "(H2JAX_STEP_TIMEOUT sets the limit)")
        return None

    def _silent(self, r: int, now: float, limit: float) -> str:
        return (f"{self.describe(r)} sent no heartbeat for {now - self.heard[r]:.0f} s (limit {limit:.0f} s): "
                "it is stopped or hung; aborting the job (H2JAX_STEP_TIMEOUT sets the limit)")

    def _abort(self, reason: str) -> None:
        sys.stderr.write(f"h2jax [{self.describe(self.rank)}]: step watchdog: {reason}\n")
        sys.stderr.flush()
        self.comm.Abort(1)
        os._exit(1)
