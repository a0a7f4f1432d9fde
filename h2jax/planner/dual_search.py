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
from h2jax.planner.search import SearchStats, _Context, _OutOfTime, _solve, _TopK

import os

_DEBUG = bool(os.environ.get("H2JAX_DEBUG_SEARCH"))
RESOLVE_FRACTION = 1.0  # resolve a box once its width costs at most this share of its gap,
RESOLVE_GAP = 0.02  # ... and its bound is within this share of the incumbent,
RESOLVE_WIDTH = 0.01  # ... or once it is this narrow (a share of the incumbent)
GENERATION = 8  # boxes split per batched bound evaluation
DIVE_FACTORS = (1.0, 1.05, 1.1, 1.2, 1.4, 2.0)
DIVE_BATCHES = 3
DIVE_LEAVES = 3
LAMBDA_STEPS = np.array([-0.05, -0.015, 0.0, 0.015, 0.05])


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


def _bounds(
    batch: _Batch, L: int, V: Sequence[float], tau: Sequence[float], centers: Sequence[float | None]
) -> list[tuple[float, float]]:
    """Per box corner (V[i], tau[i]): (fill bound, lambda), all boxes in one batched DP per
    round. Any lambda gives a valid bound, the best one the tightest: first a few steps around
    a known good `centers[i]` (the parent box's), or the grid; where the best lies on the edge
    of the steps, the grid next; where it came from the grid, a finer grid between the best
    one's neighbours."""
    cand = [c * (1.0 + LAMBDA_STEPS) if c is not None and c > 0 else batch.lam_grid for c in centers]
    best = [(-math.inf, 0.0)] * len(V)
    todo = list(range(len(V)))
    for _ in range(3):
        if not todo:
            break
        box = np.concatenate([np.full(len(cand[i]), k) for k, i in enumerate(todo)])
        vals = pos.lagrangian(
            batch.tables, L, np.array([V[i] for i in todo]), np.array([tau[i] for i in todo]), box,
            np.concatenate([cand[i] for i in todo]),
        )
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
                cand[i] = np.linspace(c[max(j - 1, 0)], c[min(j + 1, len(c) - 1)], 9)
                nxt.append(i)
            elif len(c) == len(LAMBDA_STEPS) and j in (0, len(c) - 1) and c[j] == best[i][1]:
                cand[i] = batch.lam_grid
                nxt.append(i)
        todo = nxt
    return best


def _balance_bound(ctx: _Context, b: int) -> tuple[float, float]:
    """(iteration, steady): cheap lower bounds for micro-batch b before its tables are built.
    A stage of per-layer time a holds at most V/a layers under a steady V and a type offers at
    most k_max such stages, so V >= L / sum over types of max over shapes of k_max/a; every
    layer costs at least the cheapest a in the fill."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    shapes = ctx.type_shapes(b, prune_unfit=True)
    speed = sum(max((min(o.stages, L) / o.layer_s for o in opts), default=0.0) for opts in shapes)
    if speed <= 0:
        return math.inf, math.inf
    cheapest = min(o.layer_s for opts in shapes for o in opts)
    V = L / speed
    return (m - 1) * V + L * cheapest, V


def _make_batch(ctx: _Context, b: int, v_balance: float) -> _Batch | None:
    L, m = ctx.model.n_layers, ctx.global_batch // b
    tables = pos.type_tables(ctx, b)
    if not any(t.size for t in tables):
        return None
    a = np.concatenate([t.a for t in tables if t.size])
    grid = np.unique(np.quantile(a, np.linspace(0.0, 1.0, 17)))
    t_max = float(max(t.tail_layer.max() * L + t.end_tail.max() for t in tables if t.size))

    def fits(V: np.ndarray) -> np.ndarray:
        return pos.max_layers(pos.live_tables(tables, V, np.full(len(V), math.inf)), L) >= L

    # the smallest V at which some stage list holds L layers (tau unlimited), bracketed by a
    # batched bisection: 8 probes per round
    hi = float(max(t.a.max() * L + t.end_time.max() for t in tables if t.size))
    if not fits(np.array([hi]))[0]:
        return None
    lo = min(v_balance, hi)
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


def search(
    ctx: _Context, micro_batches: Sequence[int], top: _TopK, stats: SearchStats, deadline: float = math.inf
) -> None:
    """Fill `top` with the K best stage lists of the space (1F1B), exactly; raises _OutOfTime."""
    L = ctx.model.n_layers
    solved: set = set()
    # micro-batch sizes by a cheap bound; each one's tables are built when its turn comes
    pending = sorted((_balance_bound(ctx, b) + (b,) for b in micro_batches), key=lambda r: r[0])
    pending = [r for r in pending if math.isfinite(r[0])]
    batches: dict[int, _Batch | None] = {}

    def build(b: int, v_balance: float) -> _Batch | None:
        if b not in batches:
            if time.perf_counter() > deadline:
                raise _OutOfTime
            batches[b] = _make_batch(ctx, b, v_balance)
            if batches[b] is not None:
                stats.space_size += math.prod(int(t.k_max.sum()) + 1 for t in batches[b].tables) - 1
        return batches[b]

    # incumbents: shallow dives at the smallest feasible bottleneck of the most promising
    # micro-batch sizes and a few multiples of it
    for _, v_bal, b in pending[:DIVE_BATCHES]:
        batch = build(b, v_bal)
        if batch is None:
            continue
        enum = _Enumerator(ctx, batch, top, stats, solved, deadline)
        Vs = [batch.v_fits * f for f in DIVE_FACTORS]
        for V, (lb, lam_f) in zip(Vs, _bounds(batch, L, Vs, [math.inf] * len(Vs), [None] * len(Vs))):
            if math.isfinite(lb):
                enum.run(batch.v_feasible, V, 0.0, math.inf, lam_f, max_leaves=DIVE_LEAVES)
    # the boxes, best bound first
    counter = itertools.count()
    heap: list = []

    def push_all(batch: _Batch, boxes: list[tuple[float, float, float, float, float | None]]) -> None:
        found = _bounds(batch, L, [x[1] for x in boxes], [x[3] for x in boxes], [x[4] for x in boxes])
        for (V_lo, V_hi, t_lo, t_hi, _), (fill, lam) in zip(boxes, found):
            lb = (batch.m - 1) * V_lo + t_lo + fill
            if lb < top.bound:
                # every plan of the box costs >= (m-1)*V + tau + fill: above V_lo + gap/(m-1)
                # or tau_lo + gap none can win, so the box shrinks to that
                gap = top.bound - lb
                if batch.m > 1:
                    V_hi = min(V_hi, V_lo + gap / (batch.m - 1))
                t_hi = min(t_hi, t_lo + gap)
                heapq.heappush(heap, (lb, next(counter), batch, V_lo, V_hi, t_lo, t_hi, lam))

    def root(batch: _Batch) -> None:
        live = [t for t in batch.tables if t.size]
        V_hi = float(max(t.a.max() * L + t.end_time.max() for t in live))
        V_hi = max(V_hi, max(t.send_bytes.max() for t in live) * max(t.link_s_per_byte.max() for t in live))
        t_hi = batch.tail_max
        if top.heap:
            if batch.m > 1:
                V_hi = min(V_hi, top.bound / (batch.m - 1))
            t_hi = min(t_hi, top.bound - (batch.m - 1) * batch.v_feasible)
        if V_hi > batch.v_feasible:
            push_all(batch, [(batch.v_feasible, V_hi, 0.0, t_hi, None)])

    for lb, v_bal, b in pending:  # the rest wait in the heap behind their cheap bound
        heapq.heappush(heap, (lb, next(counter), None, v_bal, b, 0.0, 0.0, None))
    while heap:
        if time.perf_counter() > deadline:
            stats.lower_bound_s = min(h[0] for h in heap)
            raise _OutOfTime
        todo: dict[int, tuple[_Batch, list]] = {}
        while heap and len(todo) < GENERATION and sum(len(v[1]) for v in todo.values()) < 2 * GENERATION:
            lb, _, batch, V_lo, V_hi, t_lo, t_hi, lam = heapq.heappop(heap)
            if lb >= top.bound:
                heap.clear()
                break
            if batch is None:  # a micro-batch size whose turn has come: its root box
                batch = build(V_hi, V_lo)
                if batch is not None:
                    root(batch)
                continue
            gap = top.bound - lb  # the incumbent may have improved since the push: shrink again
            if batch.m > 1:
                V_hi = min(V_hi, V_lo + gap / (batch.m - 1))
            t_hi = min(t_hi, t_lo + gap)
            wV, wt = (batch.m - 1) * (V_hi - V_lo), t_hi - t_lo
            if _DEBUG:
                print(f"pop b={batch.b} lb={lb:.4f} inc={top.bound:.4f} V=[{V_lo:.5f},{V_hi:.5f}] "
                      f"t=[{t_lo:.4f},{t_hi:.4f}] wV={wV:.4f} wt={wt:.4f} heap={len(heap)} solved={len(solved)}")
            if (wV + wt <= RESOLVE_FRACTION * gap and gap <= RESOLVE_GAP * top.bound) or (
                wV + wt <= RESOLVE_WIDTH * top.bound
            ):
                _Enumerator(ctx, batch, top, stats, solved, deadline).run(V_lo, V_hi, t_lo, t_hi, lam)
                continue
            children = todo.setdefault(batch.b, (batch, []))[1]
            if wV >= wt:
                mid = 0.5 * (V_lo + V_hi)
                children += [(V_lo, mid, t_lo, t_hi, lam), (mid, V_hi, t_lo, t_hi, lam)]
            else:
                mid = 0.5 * (t_lo + t_hi)
                children += [(V_lo, V_hi, t_lo, mid, lam), (V_lo, V_hi, mid, t_hi, lam)]
        for batch, children in todo.values():
            push_all(batch, children)
    if top.heap:
        stats.lower_bound_s = top.sorted()[0].time_s
