"""Emulated chips: compute stretched in wall-clock time, and memory checked before a stage runs.

An emulated chip type (a chip file with an `[emulate]` table) runs on the CPU backend. What
its `slowdown` stretches is the chip's own compute, and nothing else:

    compute_s = (CPU seconds the executable's worker threads used) / (devices it ran on)
    busy_s    = slowdown * compute_s

i.e. an emulated chip is `slowdown` times slower than one core of this host, per device.
One program on inputs of one shape takes the same time on a chip every call; the host's
measurement of it does not: CPU seconds too grow when the host is busy (other threads'
work in the window, XLA worker threads spinning for a core, caches and memory bandwidth
shared with other processes), never shrink below the program's own work, and the slowdown
multiplies the noise (measured: one emu-slow stage's F+B from 12.5 to 25 ms of CPU per
call at load 7, 16x that on the chip). So a clock charges each call the LEAST CPU time it
has measured for that program (`program_key`: the function and its inputs' shapes) so far:

    busy_s = slowdown * min(compute_s of this program's calls so far)

over every clock of the process: the runtime names each stage program by what makes it the
same computation (the model, the stage's shape, layers, recompute, mesh, numerics, the end
stages' embedding and head: `StageExecutor.program_identity`), so a run starts from what
earlier runs of the same program measured. Without that sharing a clock's least time keeps
falling through a run (more calls, lower least), and two runs of one plan, say a calibration
and the run it predicts, differed by 3-8 % on a 2-core host from their lengths alone.

CPU time, not wall-clock time, because wall-clock time of a call on a shared host also holds
what the chip would not see (`measure_call`):
- Python dispatch: the calling thread's CPU time is left out (it runs on the host, which
  an emulated chip shares with a real one, and is not stretched);
- waiting for an input still in flight, or for a core another process (or session) holds:
  a thread that waits uses no CPU time;
- the host's cores shared by a data- or tensor-parallel stage's devices: on this host the
  D*T devices of a stage take turns on a few cores, so a call's wall time grows with D*T;
  its CPU time per device does not (each emulated chip has its own compute units).
A real chip (slowdown 1, no `[emulate]`) in the same process is timed by the wall clock: its
time is what the host really takes. `h2jax profile` measures an emulated chip with the same
`measure_call`, so the planner's profile and the emulation mean the same seconds; the profile
keeps the median of its samples where a clock charges the least (they differ by the low half
of the spread the profile reports).

When one process runs several stages (the local transport), sleeping inside each compute
call would serialize a pipeline whose chips, in the system being emulated, run concurrently.
Instead each stage keeps a `StageClock`: the time its chip becomes free. A compute starts
when the chip is free and its input has arrived (the sender's clock when it sent), and ends
`busy_s` later; `ClockedTransport` carries the arrival times across boundaries. The one host
that dispatches every stage's computes in turn does not hold a chip back: in the system
being emulated each chip has a host of its own, whose asynchronous dispatch runs ahead of
its chip. Only the first compute after a synchronization (`wait`: the step's start, the
gradient norm before the update) starts no earlier than the host dispatched it. The step then
waits until every chip is free, so its wall time is the emulated pipeline's makespan, or the
host's own time if that is longer (the emulation cannot run faster than the host computes
every stage in turn; `host_lag_s` counts how far the host fell behind a chip). A process
that runs one stage is its chip's own host: its computes start no earlier than dispatched,
and it sleeps right after each, which is the same thing.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Mapping

import jax

from h2jax.transport.base import Tag, Transport, endpoints


def sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def local_devices(out) -> int:
    """How many of this process's devices the arrays `out` live on (1 for host values)."""
    for leaf in jax.tree.leaves(out):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return max(1, len(sharding.addressable_devices))
    return 1


def measure_call(fn: Callable, *args) -> tuple[Any, float, float]:
    """Run `fn(*args)` to completion -> (outputs, when the host had dispatched it, compute
    seconds per device): the CPU seconds every thread but the calling one used during the
    call (XLA's CPU backend runs executables on its own worker threads; the calling thread
    only dispatches, then waits), over the devices the outputs live on. See the module
    docstring for what this leaves out and why."""
    cpu0, own0 = time.process_time(), time.thread_time()
    out = fn(*args)
    dispatched = time.perf_counter()
    out = jax.block_until_ready(out)
    workers = (time.process_time() - cpu0) - (time.thread_time() - own0)
    return out, dispatched, max(workers, 0.0) / local_devices(out)


def program_key(fn: Callable, args) -> tuple:
    """What makes two calls the same program: the function, and per input leaf its shape and
    dtype (an array) or its type and value (a Python scalar or other host value)."""
    parts = []
    for leaf in jax.tree.leaves(args):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            parts.append((tuple(leaf.shape), str(leaf.dtype)))
        else:
            try:
                hash(leaf)
                parts.append((type(leaf).__name__, leaf))
            except TypeError:
                parts.append((type(leaf).__name__, id(leaf)))
    return (fn, tuple(parts))


# The least per-device CPU seconds measured for each named program (`StageClock.run(...,
# program=...)`) in this process, over every clock: one computation costs an emulated chip
# the same in every run, so a run starts from what earlier runs of it measured (a calibration
# run and the run it predicts, the demo's plans) instead of from its own first calls.
SHARED_LEAST: dict[tuple, float] = {}


class StageClock:
    """When one stage's chip is free. `emulated`: its compute is `slowdown` x the least of
    `measure_call`'s per-device CPU seconds over this program's calls so far (module
    docstring); otherwise (a real chip beside emulated ones) its wall-clock time."""

    def __init__(self, slowdown: float, defer: bool, emulated: bool = True):
        self.slowdown, self.defer, self.emulated = slowdown, defer, emulated
        self.free_at = 0.0  # time.perf_counter() at which the chip finishes its queued work
        self._input_at = 0.0  # arrival of the input the next compute consumes
        # host compute seconds charged (per device, the program's least, if emulated), summed (reset by the caller)
        self.measured_s = 0.0
        self.busy_s = 0.0  # seconds the chip was busy, summed
        # seconds the host dispatched a compute after its chip was free with its input there:
        # how far the one host running every local stage fell behind this chip (reset by the caller)
        self.host_lag_s = 0.0
        self.last_interval = (0.0, 0.0)  # (start, end) of the latest compute on this clock
        self._synced = True  # the next compute is the first after a synchronization (`wait`)
        self._least: dict[tuple, float] = {}  # program_key -> least compute seconds measured

    def arrive(self, t: float) -> None:
        self._input_at = max(self._input_at, t)

    def run(self, fn: Callable, *args, program: Hashable | None = None):
        """Run `fn(*args)` to completion and occupy the chip for its (stretched) compute.
        `program`: what the runtime calls this computation (stable across executors and
        Trainers): its least time is then this process's, shared by every clock
        (`SHARED_LEAST`); without it, the clock's own for `fn`."""
        if self.emulated:
            out, ready, measured = measure_call(fn, *args)
            table = self._least if program is None else SHARED_LEAST
            key = program_key(fn if program is None else program, args)
            measured = min(measured, table.get(key, measured))
            table[key] = measured
        else:
            ready = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            measured = time.perf_counter() - ready
        floor = max(self.free_at, self._input_at)
        start = max(ready, floor) if self._synced or not self.defer else floor
        if floor > 0.0:  # not the clock's first compute
            self.host_lag_s += max(0.0, ready - floor)
        self._input_at, self._synced = 0.0, False
        busy = self.slowdown * measured
        self.free_at = start + busy
        self.last_interval = (start, self.free_at)
        self.measured_s += measured
        self.busy_s += busy
        if not self.defer:
            sleep_until(self.free_at)
        return out

    def wait(self) -> None:
        """Sleep until the chip is free (a synchronization: the host reads its results)."""
        sleep_until(self.free_at)
        self._synced = True


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
