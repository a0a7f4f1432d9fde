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
(and, where c = u1, P's t#2 too many for the second). A node with lo = hi holds only plans
within the types' chips (u1 + u2 <= hi + C_t - lo = C_t), so the halving ends.

Nodes go best bound first (a half inherits its node's bound, the root's 0, or the bound the
exact search reached when the time ran out). Both halves start their search from the boxes
their node's search left open when it stopped (`dual_search.search`'s `start`): a half's
plans are its node's, so those boxes hold every plan of it that can beat the best so far
(but those its node's search found: the best so far takes them first), and the half bounds
each again with its own tables before splitting it, instead of descending from its
micro-batch sizes' roots again (on the 768-chip cluster: a third fewer bound rows, the proof
0.85 times as long). A virtual type's shapes, tables and root bounds are made once per chip
count and shared by every node (`Context.per_type`); a node's search does not dive for
incumbents (the best so far seeds it; on the 768-chip cluster the proof then reaches a
tighter bound in the same time). When none is left below the best plan, that
plan is the optimum of the two-shape space. The relaxation is loose where a few chips more
make a stage fit (on the 64-chip cluster, llama-100b, the root's virtual optimum is 39 %
under the real one), so the proof takes many nodes (hundreds on the 768-chip cluster, a few
minutes); where the time limit stops it, it reports a valid lower bound (figures:
docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from typing import Mapping, Sequence

from h2jax.planner import dual_search
from h2jax.planner.mixed_shapes import merged
from h2jax.planner.space import Candidate, Context, SearchStats
from h2jax.planner.split import OutOfTime, TopK

NODE_DIVES = 0  # a node search's dives for incumbents (dual_search.DIVE_BATCHES): none, the best so far seeds it
SEP = "#"  # virtual type names: "<chip>#1", "<chip>#2"


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

    def __init__(self, best: Candidate, counts: Mapping[str, int]) -> None:
        super().__init__(1)
        self.counts = counts
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


def _better(top: _FirstOver, best: Candidate) -> Candidate:
    """The best plan within the types' chips that a node's search found, if faster than `best`."""
    found = top.sorted()[0]
    return as_real(found) if found.time_s < best.time_s else best


def prove(ctx: Context, micro_batches: Sequence[int], incumbent: Candidate, stats: SearchStats,
          deadline: float = math.inf) -> Candidate:
    """The optimum of the two-shape space (`incumbent`: the best plan known, e.g. the local
    search's). Sets `stats.two_shapes_proved`, `two_shape_nodes` and
    `two_shape_lower_bound_s`: on reaching `deadline` it returns the best plan found, not
    proved, with the least bound of the nodes left open."""
    root = {name: (0, ctx.counts[name] // 2) for name in ctx.order}
    counter = itertools.count()
    heap = [_Node(0.0, next(counter), root)]
    best = incumbent
    stats.two_shapes_proved = False
    while heap:
        node = heapq.heappop(heap)
        if node.bound >= best.time_s:
            heap.clear()  # every node left is at least as bad
            break
        if time.perf_counter() > deadline:
            heapq.heappush(heap, node)
            break
        stats.two_shape_nodes += 1
        top = _FirstOver(best, ctx.counts)
        inner, left = SearchStats(), []
        try:
            dual_search.search(virtual_context(ctx, node.bounds), micro_batches, top, inner, deadline,
                               dives=NODE_DIVES, start=node.start, left=left)
        except OutOfTime:  # the node's bound so far stays a valid bound on its plans
            best = _better(top, best)
            heapq.heappush(heap, dataclasses.replace(node, bound=max(node.bound, inner.lower_bound_s), start=left))
            break
        except _Over as e:  # split the node; the search's bound so far bounds both halves
            best = _better(top, best)  # (a plan it found first: the boxes left no longer hold it)
            found, bound = e.cand, max(node.bound, inner.lower_bound_s)
            over = {name: u for name, u in usage(found).items() if sum(u) > ctx.counts[name]}
            name = max(over, key=lambda n: sum(over[n]) - ctx.counts[n])
            (lo, hi), u1 = node.bounds[name], over[name][0]
            cut = min(u1, (lo + hi) // 2 + 1)
            for child in ((lo, cut - 1), (cut, hi)):  # lo < cut <= hi: u1 > C_t - u2 >= lo
                if child[0] <= child[1]:
                    heapq.heappush(heap, _Node(bound, next(counter), {**node.bounds, name: child}, left))
            continue
        best = _better(top, best)  # the node's optimum, if within the types' chips and faster
    stats.two_shapes_proved = not heap
    stats.two_shape_lower_bound_s = best.time_s if not heap else min(heap[0].bound, best.time_s)
    return best
