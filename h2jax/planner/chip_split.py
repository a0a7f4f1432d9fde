"""The two-shape space searched exactly: branch and bound over how each chip type's chips
split between its two blocks (`prove`).

A plan of the two-shape space runs each chip type in at most two blocks, each on one shape,
anywhere in the pipeline, their chips together within the type's. Name a type's blocks by
their chips, x <= y (x = 0: one block or none). Given bounds lo <= x <= hi for every type (a
*node*), every such plan is a plan of the *virtual* cluster in which each type t is two
types, t#1 with hi chips and t#2 with C_t - lo (x <= hi, y <= C_t - x <= C_t - lo): a
one-shape space with twice the types, which the exact search (dual_search.search) searches.
Seeded with the best plan so far, it either proves that no plan of the node beats it (the
node is closed: its best plan within the types' chips, if better, becomes the best so far),
or meets a plan P that beats it and takes more than some type's chips (u1 on t#1, u2 on t#2,
u1 + u2 > C_t). It stops there (`_FirstOver`: the node's optimum is not needed, only a way to
split it) and the node splits at c = min(u1, the middle of [lo, hi] + 1): x < c and x >= c.
Together the halves hold every plan of the node; P's t#1 has too many chips for the first
(and, where c = u1, P's t#2 too many for the second). A range from 0 splits at 1 instead:
x = 0 (the type in one block: no t#1, one virtual type fewer, exact in that type) and
x >= 1. A node whose search has done `node_work` without closing or meeting such a plan
splits too, on its widest range (a few such nodes closed on the 768-chip cluster only after
walking ~10^5 lists each; their halves, narrower, close for far less). A node with lo = hi
holds only plans within the types' chips (u1 + u2 <= hi + C_t - lo = C_t), so the halving
ends; its search has no work limit.

Nodes go best bound first (a half inherits its node's bound, the root's 0, or the bound the
exact search reached when the time ran out). Both halves start their search from the boxes
their node's search left open when it stopped (`dual_search.search`'s `start`): a half's
plans are its node's, so those boxes hold every plan of it that can beat the best so far
(but those its node's search found: the best so far takes them first), and the half bounds
each again with its own tables before splitting it, instead of descending from its
micro-batch sizes' roots again (on the 768-chip cluster: a third fewer bound rows, the proof
0.85 times as long). A virtual type's shapes, tables and root bounds are made once per chip
count and shared by every node (`Context.per_type`), and a stage list an earlier node's walk
solved and found no faster than the best so far is not solved again (`Context._beaten`: a
list's time does not depend on the chip counts; side by side, the 64- and 768-chip proofs
took 0.92-0.95 of the time); a node's search does not dive for incumbents (the best so far
seeds it; on the 768-chip cluster the proof then reaches a tighter bound in the same time).
When none is left below the best plan, that plan is the optimum of the two-shape space. The
relaxation is loose where a few chips more make a stage fit (on the 64-chip cluster,
llama-100b, the root's virtual optimum is 39 % under the real one), so the proof takes many
nodes (about 200 on the 768-chip cluster, tens of seconds); where the time limit stops it, it
reports a valid lower bound (figures: docs/planner.md).

Nodes are independent given the best plan so far, so `prove(workers=N)` searches N at once,
each in a process of its own (`_NodePool`), once the proof has run POOL_AFTER_S: a node
handed out with an older best plan is still searched exactly (it may split where the newer
one would have closed it), and the proof ends as in one process, when no node left open is
below the best plan.

A proof of minutes reports as it goes (`progress`: after each node, the nodes searched and
open, the best plan and the least bound of the nodes open, a valid lower bound on the
two-shape optimum), and Ctrl-C (or SIGTERM, where the caller raises it as KeyboardInterrupt)
stops it the way the time limit does, as a solver's interrupt would: the nodes under way go
back to the open ones at their bounds and the best plan found is returned, not proved, with
that bound.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import signal
import time
from typing import Callable, Mapping, Sequence

from h2jax.planner import dual_search
from h2jax.planner.mixed_shapes import merged
from h2jax.planner.space import TIME_LIMIT, Candidate, Context, SearchStats, schedule_label
from h2jax.planner.split import OutOfTime, TopK
from h2jax.planner.workers import Pool

NODE_DIVES = 0  # a node search's dives for incumbents (dual_search.DIVE_BATCHES): none, the best so far seeds it
SEP = "#"  # virtual type names: "<chip>#1", "<chip>#2"
# A node's search may do this much work (bound rows, and dual_search.LIST_WORK per stage list
# walked or solved) before it is split on its widest type: on the 768-chip cluster a few nodes
# whose virtual optimum sits just above the best plan took 7-21 s each to close, walking
# ~10^5 lists in one box; their halves, a few chips narrower, close for a fraction of it.
# RANGED_NODE_WORK for a schedule whose search takes its lists apart by pipeline length
# (ZB-H1, interleaved 1F1B: dual_search.length_ranges): a node then builds and bounds tables
# per range, a dearer start that every split repeats (ZB-H1 on 768 chips, exploratory: 268 s
# at 100, 63 s at 300; 1F1B there 22 s at 100, 32 s at 300). Seeded with the optimum itself
# (the 64-chip cluster's, since the local search reaches it), fewer plans beat the seed and
# split a node at once, and more nodes run to this limit: 1F1B on 64 chips took 5.0-6.1 s at
# 50 against 6.9-7.2 s at 100, on 768 chips 24.1-24.8 s against 24.9-26.4 s (exploratory,
# 2026-12-06, three and two runs of each in turn).
NODE_WORK = 50.0
RANGED_NODE_WORK = 300.0


def node_work(ctx: Context) -> float:
    """The work a node's search may do before it splits, under the context's schedule."""
    ranged = dual_search.length_ranges(ctx, ctx.global_batch) != [None]
    return RANGED_NODE_WORK if ranged else NODE_WORK


def virtual_context(ctx: Context, bounds: Mapping[str, tuple[int, int]]) -> Context:
    """The context of the virtual cluster of a node: per type t with bounds (lo, hi), t#1
    with hi chips (none when hi = 0) and t#2 with C_t - lo, both on t's chip."""
    chips, counts, order = {}, {}, []
    for name in ctx.order:
        lo, hi = bounds[name]
        for part, count in ((1, hi), (2, ctx.counts[name] - lo)):
            if count > 0:
                virtual = f"{name}{SEP}{part}"
                chips[virtual], counts[virtual] = ctx.chips[name], count
                order.append(virtual)
    # the stage terms, sends and layer caps do not depend on a type's chip count: shared
    return dataclasses.replace(ctx, chips=chips, counts=counts, order=order, _options={})


def real_name(virtual: str) -> str:
    return virtual.rsplit(SEP, 1)[0]


def usage(cand: Candidate) -> dict[str, tuple[int, int]]:
    """Per real type, the chips of a virtual plan's t#1 and t#2 blocks."""
    out: dict[str, list[int]] = {}
    for o in cand.options:
        name, part = o.chip.rsplit(SEP, 1)
        out.setdefault(name, [0, 0])[int(part) - 1] += o.chips
    return {name: (u[0], u[1]) for name, u in out.items()}


def as_real(cand: Candidate) -> Candidate:
    """A virtual plan with its types' real names (adjacent blocks of one shape merged: their
    layers add up)."""
    options = [dataclasses.replace(o, chip=real_name(o.chip)) for o in cand.options]
    return dataclasses.replace(cand, options=merged(options))  # the layers stay per stage


class _Over(Exception):
    """A virtual plan that beats the best so far and takes more than a type's chips."""

    def __init__(self, cand: Candidate) -> None:
        super().__init__()
        self.cand = cand


class _FirstOver(TopK):
    """The best so far, which stops the node's search at the first plan that beats it and
    takes more than a type's chips (the node then splits: no need for its optimum)."""

    def __init__(self, best: Candidate | None, counts: Mapping[str, int], cutoff: float = math.inf) -> None:
        super().__init__(1, cutoff)  # a plan must beat the best so far and the cutoff
        self.counts = counts
        if best is not None:
            super().push(best)

    def push(self, cand: Candidate) -> None:
        if cand.time_s < self.bound and any(sum(u) > self.counts[n] for n, u in usage(cand).items()):
            raise _Over(cand)
        super().push(cand)


@dataclasses.dataclass(order=True)
class _Node:
    bound: float
    order: int
    bounds: dict = dataclasses.field(compare=False)
    start: list | None = dataclasses.field(default=None, compare=False)  # its parent's open boxes


def _time(best: Candidate | None) -> float:
    return math.inf if best is None else best.time_s


def _better(top: _FirstOver, best: Candidate | None) -> Candidate | None:
    """The best plan within the types' chips that a node's search found, if faster than `best`."""
    found = top.sorted()
    return as_real(found[0]) if found and found[0].time_s < _time(best) else best


@dataclasses.dataclass
class _Outcome:
    """How a node's search ended: "closed" (no plan of it beats `best`), "over" (`over` beats
    it and takes more than a type's chips: split the node), "budget" (it did `node_work` and
    is not done: split it too) or "time" (the deadline); `best`
    the best plan so far after it (its plans within the chips count), `bound` the bound its
    search reached, `left` the boxes it left open (the halves', or its own resumption's, start)."""

    kind: str
    best: Candidate | None
    over: Candidate | None
    bound: float
    left: list


def _search_node(ctx: Context, micro_batches: Sequence[int], node: _Node, best: Candidate | None,
                 deadline: float, cutoff: float = math.inf) -> _Outcome:
    """One node's exact search of its virtual cluster, seeded with `best` (and `cutoff`, a
    time to beat from elsewhere)."""
    top = _FirstOver(best, ctx.counts, cutoff)
    inner, left = SearchStats(), []
    try:
        dual_search.search(virtual_context(ctx, node.bounds), micro_batches, top, inner, deadline,
                           dives=NODE_DIVES, start=node.start, left=left,
                           max_work=node_work(ctx) if any(lo < hi for lo, hi in node.bounds.values()) else None)
    except dual_search.OverBudget:
        return _Outcome("budget", _better(top, best), None, max(node.bound, inner.lower_bound_s), left)
    except OutOfTime:  # the node's bound so far stays a valid bound on its plans
        return _Outcome("time", _better(top, best), None, max(node.bound, inner.lower_bound_s), left)
    except _Over as e:  # the search's bound so far bounds both halves
        # (a plan it found first: the boxes left no longer hold it, so it counts now)
        return _Outcome("over", _better(top, best), e.cand, max(node.bound, inner.lower_bound_s), left)
    return _Outcome("closed", _better(top, best), None, math.inf, [])


def _split(ctx: Context, node: _Node, out: _Outcome) -> tuple[str, int]:
    """Where a node splits, (type, c): x < c and x >= c. After `out.over`, on the type most
    over its chips at c = min(u1, middle + 1); after its work ran out, on the type of the
    widest range at its middle + 1. But a range from 0 splits at 1: x = 0, the type in one
    block (a virtual cluster without t#1: one type fewer, exact in that type), and x >= 1."""
    if out.over is None:
        name = max(ctx.order, key=lambda n: node.bounds[n][1] - node.bounds[n][0])
        (lo, hi), u1 = node.bounds[name], node.bounds[name][1]
    else:
        over = {name: u for name, u in usage(out.over).items() if sum(u) > ctx.counts[name]}
        name = max(over, key=lambda n: sum(over[n]) - ctx.counts[n])
        (lo, hi), u1 = node.bounds[name], over[name][0]
    return name, 1 if lo == 0 else min(u1, (lo + hi) // 2 + 1)


def _halves(ctx: Context, node: _Node, out: _Outcome, counter) -> list[_Node]:
    """The two halves of a node (`_split`), each starting from the boxes its search left."""
    name, cut = _split(ctx, node, out)
    lo, hi = node.bounds[name]
    return [_Node(out.bound, next(counter), {**node.bounds, name: child}, out.left)
            for child in ((lo, cut - 1), (cut, hi)) if child[0] <= child[1]]  # lo < cut <= hi


POOL_AFTER_S = 1.0  # a proof with workers searches in this process until then (small ones end first: no processes)


@dataclasses.dataclass(frozen=True)
class ProofProgress:
    """Where a proof stands (`prove`'s `progress`): the schedule it is of, nodes searched and
    still open, the best plan's time, the least bound of the open nodes (a valid lower bound
    on the two-shape optimum: the best plan's time once none is open) and the seconds since
    the proof began."""

    schedule: str
    nodes: int
    open: int
    best_s: float
    bound_s: float
    elapsed_s: float

    @property
    def gap(self) -> float:
        """How much slower the best plan may be than the optimum (0 when proved)."""
        return self.best_s / self.bound_s - 1 if self.bound_s > 0 else math.inf


def prove(ctx: Context, micro_batches: Sequence[int], incumbent: Candidate | None, stats: SearchStats,
          deadline: float = math.inf, workers: int = 1,
          progress: Callable[[ProofProgress], None] | None = None, cutoff: float = math.inf) -> Candidate | None:
    """The optimum of the two-shape space (`incumbent`: the best plan known, e.g. the local
    search's). Sets `stats.two_shapes_proved`, `two_shape_nodes` and
    `two_shape_lower_bound_s`: on reaching `deadline`, or on KeyboardInterrupt (Ctrl-C), it
    returns the best plan found, not proved, with the least bound of the nodes left open
    (`stats.two_shapes_stopped` says which stopped it). With `workers` > 1, a proof not done
    within POOL_AFTER_S searches that many nodes at once, each in a process of its own
    (`_NodePool`). `progress` is called when the proof begins and after each node.

    `cutoff`: a time to beat from elsewhere (under `--schedule auto`, the best plan of the
    schedules proved before this one). The proof then only shows that no plan beats
    min(its best, cutoff) -- nodes close at that, and it is the bound reported once none is
    open -- and returns its own best plan, which may be slower than the cutoff, or None
    (`incumbent` None: none known, and none found faster than the cutoff)."""
    counter = itertools.count()
    heap: list[_Node] = []
    # every node open: on the heap, or taken off it and not done with (its halves, or its
    # closing, not recorded yet); a node enters before it is pushed and leaves after its
    # halves entered, so wherever an interrupt lands, these hold every plan not yet ruled out
    # (a node and its halves both open is still valid)
    open_nodes: dict[int, _Node] = {}

    def push(node: _Node) -> None:
        open_nodes[node.order] = node
        heapq.heappush(heap, node)

    push(_Node(0.0, next(counter), {name: (0, ctx.counts[name] // 2) for name in ctx.order}))
    best = incumbent
    label = schedule_label(ctx.schedule, ctx.v)

    def target() -> float:  # what a plan must beat
        return min(_time(best), cutoff)

    stats.two_shapes_proved = False
    running: dict = {}  # node order -> (node, its outcome here, or the future of a worker's search)
    t0 = time.perf_counter()
    pool, pool_at = None, t0 + POOL_AFTER_S
    stopped_by = None  # what stopped it before every node was searched

    def report() -> None:
        if progress is not None:
            bound = min((n.bound for n in open_nodes.values()), default=math.inf)
            progress(ProofProgress(label, stats.two_shape_nodes, len(open_nodes), target(),
                                   min(bound, target()), time.perf_counter() - t0))

    try:
        report()
        while heap or running:
            if pool is None and workers > 1 and time.perf_counter() > pool_at:
                pool = _NodePool(ctx, micro_batches, workers)
            while heap and stopped_by is None and len(running) < (workers if pool else 1):
                if heap[0].bound >= target():
                    for n in heap:  # every node left is at least as bad (the running ones may split)
                        del open_nodes[n.order]
                    heap.clear()
                    break
                if time.perf_counter() > deadline:
                    stopped_by = TIME_LIMIT
                    break
                node = heapq.heappop(heap)
                stats.two_shape_nodes += 1
                if pool is None:
                    running[node.order] = (node, _search_node(ctx, micro_batches, node, best, deadline, cutoff))
                else:
                    running[node.order] = (node, pool.submit(node, best, deadline, cutoff))
            if not running:
                break
            node, out = pool.next_done(running) if pool else running.popitem()[1]
            if _time(out.best) < _time(best):
                best = out.best
            if out.kind in ("over", "budget"):
                for half in _halves(ctx, node, out, counter):
                    push(half)
            if out.kind == "time":  # open again, where its search stopped (the same order: it replaces it)
                stopped_by = TIME_LIMIT
                push(dataclasses.replace(node, bound=out.bound, start=out.left))
            else:
                del open_nodes[node.order]
            report()
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM raised as one): stop as the time limit does
        stopped_by = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
    finally:
        if pool is not None:
            pool.close()
    left = [n for n in open_nodes.values() if n.bound < target()]
    stats.two_shapes_proved = not left
    stats.two_shapes_stopped = stopped_by if left else None
    stats.two_shape_lower_bound_s = target() if not left else min(min(n.bound for n in left), target())
    return best


_WORKER: tuple | None = None  # in a pool's process: (context, micro-batch sizes)


def _hold(ctx: Context, micro_batches: Sequence[int]) -> None:
    global _WORKER
    _WORKER = (ctx, micro_batches)


def _work(node: _Node, best: Candidate | None, seconds_left: float, cutoff: float) -> _Outcome:
    ctx, micro_batches = _WORKER
    return _search_node(ctx, micro_batches, node, best, time.perf_counter() + seconds_left, cutoff)


class _NodePool:
    """Processes that search nodes at once (`_search_node`; `workers.Pool`: spawned, a dead
    worker fails the proof with one error). Each gets the context once, its caches empty (a
    process builds the tables of the nodes it searches and keeps them for the next), then per
    node its bounds, start boxes and the best plan so far when it was handed out: a node
    searched against an older best plan is still searched exactly (it may split where a newer
    one would have closed it)."""

    def __init__(self, ctx: Context, micro_batches: Sequence[int], workers: int) -> None:
        self._pool = Pool(workers, "the two-shape proof", _hold, (ctx.with_fresh_caches(), list(micro_batches)))

    def submit(self, node: _Node, best: Candidate | None, deadline: float, cutoff: float = math.inf):
        left = deadline - time.perf_counter() if math.isfinite(deadline) else math.inf  # (clocks are per process)
        return self._pool.submit(_work, node, best, left, cutoff)

    def next_done(self, running: dict) -> tuple[_Node, _Outcome]:
        """The next node whose search ended and how, taken off `running` (order -> (node, future))."""
        from concurrent.futures import FIRST_COMPLETED, wait

        futures = {future: order for order, (_, future) in running.items()}
        done, _ = wait(futures, return_when=FIRST_COMPLETED)
        future = min(done, key=futures.get)
        node, _ = running.pop(futures[future])
        return node, self._pool.result(future)

    def close(self) -> None:
        """Stop the workers now, a node search under way too (on an error or Ctrl-C here)."""
        self._pool.close()
