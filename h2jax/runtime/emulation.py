"""Emulated chips: compute stretched in wall-clock time, and memory checked before a stage runs.

An emulated chip type (a chip file with an `[emulate]` table) runs on the CPU backend. Each
forward, backward and optimizer update is run to completion and timed; the chip is then busy
for `slowdown` times that long. The stretch is real waiting, so tokens/s measured around a
step are wall-clock figures — labelled as emulation wherever they are printed.

When one process runs several stages (the local transport), the stages share the host's
cores, so sleeping inside each compute call would serialize a pipeline whose chips, in the
system being emulated, run concurrently. Instead each stage keeps a `StageClock`: the time
its chip becomes free. A compute starts when the host dispatches it, the chip is free and
its input has arrived (the sender's clock when it sent), and ends `slowdown * measured`
later; `ClockedTransport` carries the arrival times across boundaries. The step then waits
until every chip is free, so its wall time is the emulated pipeline's makespan (or the
host's own time, if that is longer). A process that runs one stage sleeps right after each
compute, which is the same thing.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import jax

from h2jax.transport.base import Tag, Transport, endpoints


def sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class StageClock:
    """When one stage's (emulated) chip is free; `slowdown` 1 for a real chip."""

    def __init__(self, slowdown: float, defer: bool):
        self.slowdown, self.defer = slowdown, defer
        self.free_at = 0.0  # time.perf_counter() at which the chip finishes its queued work
        self._input_at = 0.0  # arrival of the input the next compute consumes
        self.measured_s = 0.0  # host compute seconds, summed (reset by the caller)
        self.busy_s = 0.0  # emulated seconds, summed
        self.last_interval = (0.0, 0.0)  # (start, end) of the latest compute, emulated

    def arrive(self, t: float) -> None:
        self._input_at = max(self._input_at, t)

    def run(self, fn: Callable, *args):
        """Run `fn(*args)` to completion and occupy the chip for `slowdown` times as long."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        elapsed = time.perf_counter() - t0
        start = max(t0, self.free_at, self._input_at)
        self._input_at = 0.0
        self.free_at = start + self.slowdown * elapsed
        self.last_interval = (start, self.free_at)
        self.measured_s += elapsed
        self.busy_s += self.slowdown * elapsed
        if not self.defer:
            sleep_until(self.free_at)
        return out

    def wait(self) -> None:
        sleep_until(self.free_at)


class ClockedTransport(Transport):
    """Wraps a transport; every message carries its sender's clock to its receiver's clock.

    A message to a stage this process runs is handed over at once (the receiver's clock
    starts its compute no earlier than the sender's chip finished); a message to another
    process leaves only when the sender's chip has finished, in wall-clock time.
    """

    def __init__(self, inner: Transport, clocks: Mapping[int, StageClock]):
        self.inner, self.clocks = inner, dict(clocks)
        self._sent_at: dict[Tag, float] = {}
        self._boundaries = None

    def connect(self, boundary_shape, dtype, layouts, boundaries=None) -> None:
        self._boundaries = None if boundaries is None else dict(boundaries)
        if boundaries is None:
            self.inner.connect(boundary_shape, dtype, layouts)
        else:
            self.inner.connect(boundary_shape, dtype, layouts, boundaries)

    def send(self, tag: Tag, value) -> None:
        src, dst = endpoints(tag, self._boundaries)
        done = self.clocks[src].free_at
        if dst in self.clocks:
            self._sent_at[tag] = done
        else:
            sleep_until(done)
        self.inner.send(tag, value)

    def ready(self, tag: Tag) -> bool:
        return self.inner.ready(tag)

    def recv(self, tag: Tag):
        value = self.inner.recv(tag)
        arrived = self._sent_at.pop(tag, None)
        self.clocks[endpoints(tag, self._boundaries)[1]].arrive(time.perf_counter() if arrived is None else arrived)
        return value

    def prepost(self, tags) -> None:
        self.inner.prepost(tags)

    def sum_across_stages(self, local) -> float:
        return self.inner.sum_across_stages(local)

    def share_from_stage(self, stage, values):
        return self.inner.share_from_stage(stage, values)

    def gather_to_first(self, value):
        return self.inner.gather_to_first(value)

    def describe(self) -> dict:
        return self.inner.describe()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):  # e.g. LocalTransport.bytes_moved
        return getattr(self.inner, name)
