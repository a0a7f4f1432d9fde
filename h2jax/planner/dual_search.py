"""The exact 1F1B search: intervals of (steady, tail) thresholds, Lagrangian bounds, enumeration.

Every plan's 1F1B iteration time is (m - 1) * steady + tail + fill (cost_model.py). The
search covers, per micro-batch size b, the plane of thresholds (V, tau) with boxes
[V_lo, V_hi] x [tau_lo, tau_hi]; every plan whose steady and tail fall in a box costs at least

    (m - 1) * V_lo + tau_lo + lagrangian_fill(V_hi, tau_hi)        (positions.py)

Boxes are taken best bound first (a heap over all micro-batch sizes). A box whose bound cannot
beat the incumbent (the K-th best, for top-K) is dropped; a wide one is halved along its
costlier side (so its bound rises); a narrow one is *resolved*: a depth-first enumeration of
the stage lists whose Lagrangian bound in the box can still win, chip types from the end of
the pipeline, each partial list bounded by its cost so far plus the best front completion
(`front_dp`); each list that survives is solved exactly by `best_split` (the real objective,
not the thresholds). A plan in the box that beats the incumbent has a list whose bound in
the box is below it, so that list is solved: when the heap is empty, the incumbent is the
optimum of the space. Incumbents come from shallow dives of the same enumeration at the
smallest feasible bottleneck of each micro-batch size and a few multiples of it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from typing import Sequence

import numpy as np

from h2jax.planner import positions as pos
from h2jax.planner.search import (
    SearchStats, _bottleneck_lb, _Context, _Envelope, _lower_bound, _OutOfTime, _shape_tables, _solve, _Staircase,
    _TopK,
)

RESOLVE_FRACTION = 1.0  # resolve a box once its width costs at most this share of its gap,
RESOLVE_GAP = 0.02  # ... and its bound is within this share of the incumbent,
RESOLVE_WIDTH = 0.01  # ... or once it is this narrow (a share of the incumbent)
GENERATION = 8  # boxes split per batched bound evaluation
DIVE_FACTORS = (1.0, 1.05, 1.15, 1.4)
DIVE_BATCHES = 2
DIVE_LEAVES = 3
LAMBDA_STEPS = np.array([-0.02, 0.0, 0.02])
LAMBDA_WIDER = np.array([0.06, 0.15, 0.4])


@dataclasses.dataclass
class _Batch:
    """One micro-batch size's tables and the bottleneck below which nothing fits."""

    b: int
    m: int
    tables: list[pos.TypeTable]
    v_feasible: float  # every plan's steady is >= this
    v_fits: float  # just above it: some stage list holds the model with every stage under it
    lam_grid: np.ndarray
    tail_max: float  # no stage's tail exceeds this
    rows: int = 0  # bound rows evaluated, for SearchStats


def _bounds(
    batch: _Batch, L: int, V: Sequence[float], tau: Sequence[float], centers: Sequence[float | None]
) -> list[tuple[float, float]]:
    """Per box corner (V[i], tau[i]): (fill bound, lambda). Any lambda gives a valid bound, the
    best one the tightest: a few steps around a known good `centers[i]` (the parent box's) or
    a coarse grid, then, where the best was on an edge, wider steps beyond it, or, where it
    came from the grid, a finer grid between its neighbours. Each round is one batched DP."""
    cand = [c * (1.0 + LAMBDA_STEPS) if c is not None and c > 0 else batch.lam_grid for c in centers]
    best = [(-math.inf, 0.0)] * len(V)
    todo = list(range(len(V)))
    for _ in range(2):
        box = np.concatenate([np.full(len(cand[i]), k) for k, i in enumerate(todo)])
        vals = _lagrangian_rows(batch, L, [V[i] for i in todo], [tau[i] for i in todo], box,
                                np.concatenate([cand[i] for i in todo]))
        nxt, start = [], 0
        for i in todo:
            c = cand[i]
            v = vals[start: start + len(c)]
            start += len(c)
            j = int(np.argmax(v))
            if not np.isfinite(v[j]):
                best[i] = (math.inf, float(c[j]))
                continue
            if v[j] > best[i][0]:
                best[i] = (float(v[j]), float(c[j]))
            if c is batch.lam_grid:
                cand[i] = np.linspace(c[max(j - 1, 0)], c[min(j + 1, len(c) - 1)], 7)[1:-1]
                nxt.append(i)
            elif len(c) > 1 and (j == 0 or j == len(c) - 1):
                sign = -1.0 if j == 0 else 1.0
                cand[i] = c[j] * (1.0 + sign * LAMBDA_WIDER)
                nxt.append(i)
        if not nxt:
            break
        todo = nxt
    return best


MAX_ROWS = 12  # rows per DP call: larger arrays fall out of the caches and cost more per row


def _lagrangian_rows(batch: _Batch, L: int, V: list, tau: list, box: np.ndarray, lams: np.ndarray) -> np.ndarray:
    """pos.lagrangian in chunks of at most MAX_ROWS rows."""
    out = np.empty(len(box))
    batch.rows += len(box)
    for start in range(0, len(box), MAX_ROWS):
        sl = slice(start, start + MAX_ROWS)
        used = np.unique(box[sl])
        where = np.searchsorted(used, box[sl])
        out[sl] = pos.lagrangian(
            batch.tables, L, np.asarray(V)[used], np.asarray(tau)[used], where, lams[sl]
        )
    return out


def _root_bound(ctx: _Context, b: int) -> tuple[float, float]:
    """(iteration, steady): lower bounds for micro-batch b before its tables are built, from
    the per-shape layer caps at one micro-batch in flight (search.py's envelope: the most
    layers the cluster holds under a steady V) and the cheapest way to place the layers
    (its staircase): min over V of (m - 1) * V + fill(V)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    shapes = ctx.type_shapes(b, prune_unfit=True)
    if not any(shapes):
        return math.inf, math.inf
    rest = _Envelope.zero()
    for opts in shapes:
        rest = rest + _Envelope.of_options(opts, L, 1, m)
    cheapest = min(o.layer_s for opts in shapes for o in opts)
    stairs = [_Staircase(*_shape_tables(opts, L, 1, m)) for opts in shapes]
    return _lower_bound(m, L, [], rest, cheapest, False, math.inf, stairs), _bottleneck_lb(L, [], rest)


def _make_batch(ctx: _Context, b: int, v_balance: float, bracket: bool) -> _Batch | None:
    """The tables of micro-batch b; `bracket`: also bracket the smallest feasible steady
    (v_fits, where the dives start; else v_fits is unknown and v_feasible = v_balance)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    tables = pos.type_tables(ctx, b)
    if not any(t.size for t in tables):
        return None
    a = np.concatenate([t.a for t in tables if t.size])
    grid = np.unique(np.quantile(a, np.linspace(0.0, 1.0, 9)))
    t_max = float(max(t.tail_layer.max() * L + t.end_tail.max() for t in tables if t.size))

    def fits(V: np.ndarray) -> np.ndarray:
        return pos.max_layers(pos.live_tables(tables, V, np.full(len(V), math.inf)), L) >= L

    # the smallest V at which some stage list holds L layers (tau unlimited), bracketed by a
    # batched bisection: 8 probes per round
    hi = float(max(t.a.max() * L + t.end_time.max() for t in tables if t.size))
    lo = min(v_balance, hi)
    if not bracket:
        return _Batch(b, m, tables, lo, math.nan, grid, t_max)
    if not fits(np.array([hi]))[0]:
        return None
    for _ in range(3):
        probes = np.geomspace(lo, hi, 10)[1:-1]
        ok = fits(probes)
        first = int(np.argmax(ok)) if ok.any() else len(probes)
        lo = float(probes[first - 1]) if first > 0 else lo
        hi = float(probes[first]) if first < len(probes) else hi
    return _Batch(b, m, tables, lo, hi, grid, t_max)


class _Enumerator:
    """Depth-first over stage lists in one box, chip types from the end of the pipeline."""

    def __init__(self, ctx: _Context, batch: _Batch, top: _TopK, stats: SearchStats, solved: set, deadline: float):
        self.ctx, self.batch, self.top, self.stats, self.solved = ctx, batch, top, stats, solved
        self.deadline = deadline
        self.L = ctx.model.n_layers

    def run(self, V_lo: float, V_hi: float, t_lo: float, t_hi: float, lam: float, max_leaves: int | None = None) -> None:
        L = self.L
        live = pos.live_tables(self.batch.tables, np.array([V_hi]), np.array([t_hi]))
        self.tables = [t for t, _ in live]
        self.ws = [pos.weights(t, u, np.array([lam])) for t, u in live]
        self.G = pos.front_dp(self.tables, self.ws, L)
        self.base = (self.batch.m - 1) * V_lo + t_lo + lam * L
        self.leaves_left = max_leaves
        self._visit(len(self.tables) - 1, 0, 0.0, ())

    def _children(self, t: int, q: int, C: float) -> list[tuple[float, int, int, int, bool, float]]:
        L, bound = self.L, self.top.bound
        out = []
        for t2 in range(t, -1, -1):
            table, w, G = self.tables[t2], self.ws[t2], self.G[t2]
            if not table.size or q >= L:
                continue
            K = int(min(table.k_max.max(), L - q))
            k = np.arange(1, K + 1)
            end = q + k
            Wm, first, mid_ok = w.Wm[0], w.first[0], w.mid_ok[0]
            start = (w.last1[0] - Wm[:, 1])[:, None] if q == 0 else -Wm[:, q:q + 1]
            fits = k[None, :] <= table.k_max[:, None]
            mid = Wm[:, end] + start
            mid_b = np.where(fits & mid_ok[:, end], self.base + C + mid + G[end][None, :], np.inf)
            front = Wm[:, end - 1] + first[:, end] + start
            front_ok = fits & mid_ok[:, end - 1]
            if q == 0:
                front[:, 0] = w.only1[0]
                front_ok[:, 0] = True
            front_b = np.where(front_ok, self.base + C + front, np.inf)
            for arr, cost, is_front in ((mid_b, mid, False), (front_b, front, True)):
                s_idx, k_idx = np.nonzero(arr < bound)
                for s, ki in zip(s_idx.tolist(), k_idx.tolist()):
                    out.append((float(arr[s, ki]), t2, s, ki + 1, is_front, float(cost[s, ki])))
        out.sort()
        return out

    def _visit(self, t: int, q: int, C: float, blocks: tuple) -> None:
        for bound, t2, s, k, is_front, cost in self._children(t, q, C):
            if bound >= self.top.bound or self.leaves_left == 0:
                return
            if time.perf_counter() > self.deadline:
                raise _OutOfTime
            here = ((t2, s, k),) + blocks
            if is_front:
                self._leaf(here)
            elif t2 > 0:
                self._visit(t2 - 1, q + k, C + cost, here)

    def _leaf(self, blocks: tuple) -> None:
        key = (self.batch.b, tuple((self.tables[t].options[s], k) for t, s, k in blocks))
        if key in self.solved:
            return
        self.solved.add(key)
        if self.leaves_left is not None:
            self.leaves_left -= 1
        chosen = [dataclasses.replace(self.tables[t].options[s], stages=k) for t, s, k in blocks]
        _solve(self.ctx, self.batch.b, chosen, self.top, self.stats)


@dataclasses.dataclass(order=True)
class _Box:
    """A box of (steady, tail) thresholds at one micro-batch size, or (batch None) a
    micro-batch size whose tables are not built yet, waiting behind its cheap bound."""

    lb: float
    order: int
    batch: _Batch | None = dataclasses.field(compare=False)
    V_lo: float = dataclasses.field(compare=False)
    V_hi: float = dataclasses.field(compare=False)
    t_lo: float = dataclasses.field(compare=False)
    t_hi: float = dataclasses.field(compare=False)
    lam: float | None = dataclasses.field(compare=False)
    b: int = dataclasses.field(compare=False, default=0)


def search(
    ctx: _Context, micro_batches: Sequence[int], top: _TopK, stats: SearchStats, deadline: float = math.inf
) -> None:
    """Fill `top` with the K best stage lists of the space (1F1B), exactly; raises _OutOfTime
    (with stats.lower_bound_s a valid lower bound on the optimum) when the deadline passes."""
    L = ctx.model.n_layers
    solved: set = set()
    counter = itertools.count()
    heap: list[_Box] = []
    # micro-batch sizes by a cheap bound; each one's tables are built when its turn comes
    pending = sorted((_root_bound(ctx, b) + (b,) for b in micro_batches), key=lambda r: r[0])
    pending = [r for r in pending if math.isfinite(r[0])]
    if not pending:
        return
    stats.lower_bound_s = pending[0][0]
    batches: dict[int, _Batch | None] = {}

    def build(b: int, v_balance: float, bracket: bool = False) -> _Batch | None:
        if b not in batches:
            if time.perf_counter() > deadline:
                raise _OutOfTime
            batches[b] = _make_batch(ctx, b, v_balance, bracket)
            if batches[b] is not None:
                stats.space_size += math.prod(int(t.k_max.sum()) + 1 for t in batches[b].tables) - 1
        return batches[b]

    # incumbents: shallow dives at the smallest feasible bottleneck of the most promising
    # micro-batch sizes and a few multiples of it
    for _, v_bal, b in pending[:DIVE_BATCHES]:
        batch = build(b, v_bal, bracket=True)
        if batch is None:
            continue
        enum = _Enumerator(ctx, batch, top, stats, solved, deadline)
        (_, lam), = _bounds(batch, L, [batch.v_fits * DIVE_FACTORS[1]], [math.inf], [None])
        Vs = [batch.v_fits * f for f in DIVE_FACTORS]
        for V, (lb, lam_f) in zip(Vs, _bounds(batch, L, Vs, [math.inf] * len(Vs), [lam] * len(Vs))):
            if math.isfinite(lb):
                enum.run(batch.v_feasible, V, 0.0, math.inf, lam_f, max_leaves=DIVE_LEAVES)

    def push_all(batch: _Batch, boxes: list[tuple[float, float, float, float, float | None]]) -> None:
        found = _bounds(batch, L, [x[1] for x in boxes], [x[3] for x in boxes], [x[4] for x in boxes])
        for (V_lo, V_hi, t_lo, t_hi, _), (fill, lam) in zip(boxes, found):
            lb = (batch.m - 1) * V_lo + t_lo + fill
            if lb < top.bound:  # shrink to what can still win (see the pop) for the children
                gap = top.bound - lb
                if batch.m > 1:
                    V_hi = min(V_hi, V_lo + gap / (batch.m - 1))
                t_hi = min(t_hi, t_lo + gap)
                heapq.heappush(heap, _Box(lb, next(counter), batch, V_lo, V_hi, t_lo, t_hi, lam))

    def root(batch: _Batch) -> None:
        live = [t for t in batch.tables if t.size]
        V_hi = float(max(t.a.max() * L + t.end_time.max() for t in live))
        V_hi = max(V_hi, max(t.send_bytes.max() for t in live) * max(t.link_s_per_byte.max() for t in live))
        t_hi = batch.tail_max
        if top.heap:  # what the incumbent allows: (m-1)*V + tau <= its time
            if batch.m > 1:
                V_hi = min(V_hi, top.bound / (batch.m - 1))
            t_hi = min(t_hi, top.bound - (batch.m - 1) * batch.v_feasible)
        if V_hi > batch.v_feasible:
            push_all(batch, [(batch.v_feasible, V_hi, 0.0, t_hi, None)])

    for lb, v_bal, b in pending:
        heapq.heappush(heap, _Box(lb, next(counter), None, v_bal, math.nan, 0.0, 0.0, None, b))
    while heap:
        generation: dict[int, tuple[_Batch, list]] = {}  # per micro-batch size, boxes to bound
        open_lbs: list[float] = []
        try:
            while heap and len(generation) < GENERATION and sum(len(v[1]) for v in generation.values()) < 2 * GENERATION:
                box = heapq.heappop(heap)
                if box.lb >= top.bound:
                    heap.clear()  # every box left is at least as bad
                    break
                open_lbs.append(box.lb)
                if time.perf_counter() > deadline:
                    raise _OutOfTime
                if box.batch is None:  # a micro-batch size whose turn has come: its root box
                    batch = build(box.b, box.V_lo)
                    if batch is not None:
                        root(batch)
                    open_lbs.pop()
                    continue
                batch, V_lo, V_hi, t_lo, t_hi = box.batch, box.V_lo, box.V_hi, box.t_lo, box.t_hi
                # above V_lo + gap/(m-1) or tau_lo + gap, every plan of the box costs more than
                # the incumbent ((m-1)*V + tau + fill >= lb + the excess): the box shrinks to that
                gap = top.bound - box.lb
                if batch.m > 1:
                    V_hi = min(V_hi, V_lo + gap / (batch.m - 1))
                t_hi = min(t_hi, t_lo + gap)
                wV, wt = (batch.m - 1) * (V_hi - V_lo), t_hi - t_lo
                if (wV + wt <= RESOLVE_FRACTION * gap and gap <= RESOLVE_GAP * top.bound) or (
                    wV + wt <= RESOLVE_WIDTH * top.bound
                ):
                    _Enumerator(ctx, batch, top, stats, solved, deadline).run(V_lo, V_hi, t_lo, t_hi, box.lam)
                    open_lbs.pop()
                    continue
                children = generation.setdefault(batch.b, (batch, []))[1]
                if wV >= wt:
                    mid = 0.5 * (V_lo + V_hi)
                    children += [(V_lo, mid, t_lo, t_hi, box.lam), (mid, V_hi, t_lo, t_hi, box.lam)]
                else:
                    mid = 0.5 * (t_lo + t_hi)
                    children += [(V_lo, V_hi, t_lo, mid, box.lam), (V_lo, V_hi, mid, t_hi, box.lam)]
            for batch, children in generation.values():
                push_all(batch, children)
        except _OutOfTime:
            stats.lower_bound_s = min([*open_lbs, *(b.lb for b in heap)], default=top.bound)
            stats.bound_rows = sum(b.rows for b in batches.values() if b is not None)
            raise
    if top.heap:
        stats.lower_bound_s = top.sorted()[0].time_s
    stats.bound_rows = sum(b.rows for b in batches.values() if b is not None)
