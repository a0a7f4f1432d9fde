"""A measured timeline of a real run, in the simulator's trace format (`h2jax.trace`).

Dispatch is asynchronous: when the driver returns from a stage's forward, the device may not
have started it. So each compute is stamped twice: when the host dispatched it, and when its
outputs became ready (a watcher thread per stage waits on them in dispatch order, which is the
order the stage's devices run them). The watcher does not wait on the outputs themselves: the
stage's next program may donate them (the gradient accumulator) before the watcher gets there,
and a donated array can no longer be waited on. At dispatch, one element of one output is
copied by a tiny program that runs once the compute has finished, and the watcher waits on
that copy, which nothing donates. The compute ran from max(dispatch, the stage's previous
compute end) to that ready time. An emulated chip's compute is known exactly: its clock holds
the emulated interval. Receives are slices on the "comm" lane from the moment the stage
needed the message to the moment it had it (waiting, if any); sends are instants.

Times are seconds since the tracer started, on a clock shared by every process of the job
(wall time), so an MPI job's ranks gather their events into one file.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from h2jax.trace import TraceEvent


class StepTracer:
    """Collects TraceEvents of the stages this process runs."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time):
        self.clock = clock
        self._offset = wall() - clock()  # clock() + offset = wall time
        self.events: list[TraceEvent] = []
        self._lock = threading.Lock()
        self._queues: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self._last_end: dict[int, float] = {}

    def now(self) -> float:
        return self.clock()

    def _wall(self, t: float) -> float:
        return t + self._offset

    def _add(self, event: TraceEvent) -> None:
        with self._lock:
            self.events.append(event)

    def compute(self, stage: int, name: str, dispatched: float, outputs: Any, args=None,
                interval: tuple[float, float] | None = None) -> None:
        """A compute of `stage` dispatched at `dispatched` whose results are `outputs`;
        `interval` (start, end) when it is already known (an emulated chip's clock)."""
        if interval is not None:
            start, end = interval
            self._add(TraceEvent(stage, name, self._wall(start), max(end - start, 0.0), args))
            return
        if stage not in self._queues:
            self._queues[stage] = queue.Queue()
            thread = threading.Thread(target=self._watch, args=(stage,), daemon=True)
            thread.start()
            self._threads.append(thread)
        self._queues[stage].put((name, dispatched, _ready_marker(outputs), args))

    def _watch(self, stage: int) -> None:
        import jax

        q = self._queues[stage]
        while True:
            item = q.get()
            if item is None:
                q.task_done()
                return
            name, dispatched, marker, args = item
            _wait_for(jax.tree.leaves(marker))
            end = self.clock()
            start = max(dispatched, self._last_end.get(stage, dispatched))
            self._last_end[stage] = end
            self._add(TraceEvent(stage, name, self._wall(start), max(end - start, 0.0), args))
            q.task_done()

    def comm(self, stage: int, name: str, start: float, end: float, args=None) -> None:
        self._add(TraceEvent(stage, name, self._wall(start), max(end - start, 0.0), args, "comm"))

    def drain(self) -> None:
        """Wait until every compute dispatched so far has been stamped."""
        for q in self._queues.values():
            q.join()

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues, self._threads = {}, []

    def relative_events(self, origin: float) -> list[TraceEvent]:
        """The events with times relative to wall time `origin` (e.g. the job's earliest)."""
        self.drain()
        with self._lock:
            return sorted(
                (e._replace(start_s=e.start_s - origin) for e in self.events), key=lambda e: (e.stage, e.start_s)
            )


def _ready_marker(outputs):
    """An array ready exactly when the program that produced `outputs` has finished and that
    no later program donates: the first element of the first device's shard of the smallest
    output, copied by a one-element program dispatched now (before anything can donate the
    outputs). On a CPU that is one tiny dispatch per traced compute."""
    import jax

    leaves = [a for a in jax.tree.leaves(outputs) if isinstance(a, jax.Array) and not a.is_deleted()]
    if not leaves:
        return None
    smallest = min(leaves, key=lambda a: a.size)
    return _first_element(smallest.addressable_shards[0].data)


def _first_element(x):
    import jax

    global _FIRST
    if _FIRST is None:
        _FIRST = jax.jit(lambda a: a.reshape(-1)[:1])
    return _FIRST(x)


_FIRST = None


def _wait_for(arrays) -> None:
    """Block until `arrays` are computed (a deleted one has nothing left to wait for)."""
    for a in arrays:
        try:
            if not a.is_deleted():
                a.block_until_ready()
        except RuntimeError:  # donated while we waited
            pass


def busy_fractions(events: list[TraceEvent]) -> dict[int, float]:
    """Per stage: the share of its timeline (first start to last end) its computes fill."""
    out: dict[int, float] = {}
    for stage in sorted({e.stage for e in events}):
        mine = [e for e in events if e.stage == stage and e.lane == "compute"]
        if not mine:
            continue
        span = max(e.start_s + e.duration_s for e in mine) - min(e.start_s for e in mine)
        out[stage] = sum(e.duration_s for e in mine) / span if span > 0 else 1.0
    return out


def overlapping_stages(events: list[TraceEvent]) -> int:
    """The most stages computing at one instant (1: stages strictly take turns)."""
    edges = []
    for e in events:
        if e.lane == "compute" and e.duration_s > 0:
            edges += [(e.start_s, 1, e.stage), (e.start_s + e.duration_s, -1, e.stage)]
    edges.sort(key=lambda x: (x[0], x[1]))  # an end before a start at the same instant
    active: dict[int, int] = {}
    best = 0
    for _, step, stage in edges:
        active[stage] = active.get(stage, 0) + step
        best = max(best, sum(1 for n in active.values() if n > 0))
    return best
