"""The exact search: boxes of (steady, tail) thresholds, Lagrangian bounds, enumeration.

A plan's iteration time is (m - 1) * steady + tail + fill (cost_model.py), with steady one
component under 1F1B (the largest forward + backward of a stage, or send) and two under GPipe
(the largest forward plus the largest backward). The search covers, per micro-batch size b,
the space of thresholds x = (steady components..., tail) with boxes [lo, hi]; every plan
whose steady components and tail fall in a box costs at least

    sum_d w_d * lo_d + lagrangian_fill(hi)        (w: m - 1 per steady component, 1 the tail;
                                                   the fill bound: positions.py)

Boxes are taken best bound first (a heap over all micro-batch sizes). A box whose bound cannot
beat the incumbent (the K-th best, for top-K) is dropped; a box ends where the incumbent
would be beaten by its width alone (lo_d + gap / w_d); a wide one is halved along its
costliest side (so its bound rises); a narrow one (or any box of a micro-batch size with at
most RESOLVE_LISTS stage lists) is *resolved*: a depth-first enumeration of the stage lists
whose Lagrangian bound in the box can still win, blocks from the end of the pipeline, any
chip type not used yet next, each partial list bounded by its cost so far plus the best
front completion by the types left (`front_dp`) and dropped where its stages with the most
layers any such front part holds (`front_dp` over capacity weights) cannot hold the model in
the box; each list that survives is solved exactly by `best_split` (the real objective,
not the thresholds). A plan in the box that beats the incumbent has a list whose bound in
the box is below it, so that list is solved: when the heap is empty, the incumbent is the
optimum of the space. Incumbents come from shallow dives of the same enumeration at the
smallest feasible bottleneck of the most promising micro-batch sizes and a few multiples.

Where what a stage holds depends on the pipeline's length p, not only on its position from
the end (ZB-H1: min(p, m) micro-batches at every stage; interleaved 1F1B: about (v - 1)/v * p
more than 1F1B), bounds over every length let a short pipeline's stages hold what only a
long one's last stages hold. There a micro-batch size's root box, once it cannot be dropped,
is taken apart into ranges of lengths (`length_ranges`, at most LENGTH_RATIO wide), each
with its own tables: the least each position holds over the range's lengths, and a list's
front block ending only at one of them (`positions.position_holds`). A range's root box is
bounded first at the lambda its whole box's bound found (`_bounds`' center, then steps
beside it), not over a fresh grid: on 2,432 chips, under `auto`'s cutoff, ZB-H1's search then
bounds 955 rows instead of 1,538 (interleaved 1F1B: 478 and 545 instead of 724 and 798).
The boxes a generation bounds are bounded per micro-batch size, not per table: those of its
ranges (and its box over every length) in one DP per lambda round (`pos.Boxes.of_groups`:
the ranges' tables hold the same shapes, their memory caps and ends per row), where one DP
per range and round took a call's fixed cost each for a row or two.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from h2jax.planner import positions as pos
from h2jax.planner.space import Context, SearchStats
from h2jax.planner.split import (
    Envelope, OutOfTime, Staircase, TopK, envelope_bottleneck, envelope_bound, shape_tables, solve,
)

RESOLVE_FRACTION = 2.0  # resolve a box once its width costs at most this share of its gap,
RESOLVE_GAP = 0.02  # ... and its bound is within this share of the incumbent,
RESOLVE_WIDTH = 0.01  # ... or once it is this narrow (a share of the incumbent)
RESOLVE_LISTS = 4096  # a micro-batch size with at most this many stage lists: resolved at its root box
GENERATION = 8  # boxes split per batched bound evaluation
DIVE_FACTORS = (1.0, 1.05, 1.15, 1.4)
DIVE_BATCHES = 2
BRACKET_NEAR = 1.3  # `_make_batch`'s first probes of the smallest feasible steady reach this far above its bound
DIVE_LEAVES = 3
# a box's lambda: its parent's, then these relative steps either side, then these wider
# steps beyond a step that won, then these factors beyond the farthest while it still wins
LAMBDA_STEPS = np.array([-0.02, 0.02])
LAMBDA_WIDER = np.array([0.06, 0.15, 0.4])
LAMBDA_FARTHER = np.array([1.5, 2.5])
LAMBDA_ROUNDS = 5  # rounds in all (batched DPs): center, steps, wider, two farther
# A box whose bound after a round is below this share of what would drop it (`_bounds`'
# `enough`) keeps that lambda, untuned: the rounds left would not drop it. Its children are
# bounded with every round, so looseness does not pile up down the splits (on a random
# 4-type cluster, llama-7b, the search took 16 s instead of 0.8 s when it did), and it is
# walked only once its lambda is tuned: the walk prunes by it (walked at its first lambda,
# that search went past the 60 s limit). Not in a search with a work limit (a two-shape
# proof's node): the bound it reports when it stops is its open boxes' least. On the shipped
# clusters `auto` bounds 14-22 % fewer rows, ZB-H1 alone 17-22 %, 1F1B as many (8 % fewer
# on 64 chips), the same plans.
LAMBDA_FAR_BELOW = 0.3


@dataclasses.dataclass
class _Batch:
    """One micro-batch size's tables. Its thresholds are K steady components (1F1B: the
    stages' forward + backward; GPipe: forward, backward), each weighted m - 1 in the
    iteration time, and the tail, weighted 1."""

    b: int
    m: int
    tables: list[pos.TypeTable]
    lengths: tuple[int, int] | None  # its lists' stage counts, p_lo..p_hi (None: every length)
    v_feasible: float  # 1F1B: every plan's steady is >= this (GPipe: 0)
    v_fits: float  # some stage list holds the model with every steady component under it
    lam_grid: np.ndarray
    tail_max: float  # no stage's tail exceeds this
    steady_max: np.ndarray  # (K,) per steady component: every shape holds all L layers under it
    steady_weight: float = math.nan  # each steady component's weight (m - 1 under 1F1B)
    rows: int = 0  # bound rows evaluated, for SearchStats
    staged: dict = dataclasses.field(default_factory=dict)  # (id of a shape, k) -> its option of k stages
    fits: dict = dataclasses.field(default_factory=dict)  # a box's upper corner (bytes) -> 1 if it holds L layers, else 0
    # over every length, of a schedule whose positions' holds depend on it (`length_ranges`):
    # the ranges its box is taken apart into instead of being split or resolved (None: split)
    ranges: list | None = None

    def with_stages(self, option, k: int):
        """The shape `option` (one of the tables') with k stages, made once."""
        key = (id(option), k)
        out = self.staged.get(key)
        if out is None:
            out = self.staged[key] = dataclasses.replace(option, stages=k)
        return out

    @property
    def lists(self) -> int:
        """Stage lists of its space (every order of the chip types)."""
        return ordered_lists([int(t.k_max.sum()) for t in self.tables])

    @property
    def K(self) -> int:
        return self.tables[0].steady_a.shape[0]

    @property
    def weight(self) -> np.ndarray:
        """Each threshold's weight in the iteration time: m - 1 per steady component, 1 the tail."""
        return np.array([self.steady_weight] * self.K + [1.0])

    def corner(self, V: float, tau: float) -> np.ndarray:
        """Thresholds with every steady component at V."""
        return np.array([V] * self.K + [tau])


def _bounds(
    batch: _Batch | Sequence[_Batch], L: int, corners: Sequence[np.ndarray], centers: Sequence[float | None],
    enough: Sequence[float] | None = None, far_below: Sequence[float] | None = None,
) -> list[tuple[float, float, bool]]:
    """Per box corner (its thresholds, steady components then tail): (fill bound, lambda,
    whether that lambda is tuned). Any lambda gives a valid bound, the best one the tightest:
    a known good `centers[i]` (the parent box's) alone, then, unless that already reaches
    `enough[i]` (the box is dropped at that bound: most children of a split are; -inf: the
    center alone), a step either side of it, then, where the best was a step, wider steps
    beyond it, then farther ones while the farthest still wins (up to LAMBDA_ROUNDS rounds in
    all); without a center, a coarse grid, then a finer grid between its best point's
    neighbours. No further round, and the lambda not tuned, for a corner whose bound after a
    round past the grid is below `far_below[i]` times a positive `enough[i]`
    (LAMBDA_FAR_BELOW; -inf: every round). Each round is one batched DP, over every corner:
    `batch` is the corners' batch, or one per corner (batches of one micro-batch size, its
    ranges of lengths: the same shapes, `pos.Boxes.of_groups`)."""
    batches = [batch] * len(corners) if isinstance(batch, _Batch) else list(batch)
    enough = [math.inf] * len(corners) if enough is None else enough
    far_below = [-math.inf] * len(corners) if far_below is None else far_below
    tuned = [True] * len(corners)
    cand = [np.array([c]) if c is not None and c > 0 else bt.lam_grid for c, bt in zip(centers, batches)]
    stage = ["center" if c is not None and c > 0 else "grid" for c in centers]
    best = [(-math.inf, 0.0)] * len(corners)
    sign = [1.0] * len(corners)
    todo = list(range(len(corners)))
    # the corners grouped by batch (a DP row's box: its index in that order), for every round
    groups: dict[int, list[int]] = {}
    for i, bt in enumerate(batches):
        groups.setdefault(id(bt), []).append(i)
    order = [i for members in groups.values() for i in members]
    row_of = np.empty(len(order), dtype=np.int64)
    row_of[order] = np.arange(len(order))
    corners = np.array(corners)[order]
    row_batches = [batches[i] for i in order]
    boxes = pos.Boxes.of_groups([
        (batches[members[0]].tables, corners[row_of[members], :-1], corners[row_of[members], -1])
        for members in groups.values()
    ])
    for round_ in range(LAMBDA_ROUNDS):
        box = np.concatenate([np.full(len(cand[i]), row_of[i]) for i in todo])
        vals = _lagrangian_rows(row_batches, L, boxes, corners, box, np.concatenate([cand[i] for i in todo]))
        nxt, start = [], 0
        for i in todo:
            c = cand[i]
            v = vals[start: start + len(c)]
            start += len(c)
            j = int(np.argmax(v))
            if not np.isfinite(v[j]):
                best[i] = (math.inf, float(c[j]))
                continue
            improved = v[j] > best[i][0]
            if improved:
                best[i] = (float(v[j]), float(c[j]))
            if best[i][0] >= enough[i]:
                continue
            far = stage[i] != "grid" and 0.0 < enough[i] < math.inf and best[i][0] < far_below[i] * enough[i]
            if stage[i] == "grid":
                cand[i] = np.linspace(c[max(j - 1, 0)], c[min(j + 1, len(c) - 1)], 7)[1:-1]
                stage[i] = "done"
                nxt.append(i)
            elif stage[i] == "center":
                cand[i] = c[0] * (1.0 + LAMBDA_STEPS)
                stage[i] = "steps"
                nxt.append(i)
            elif stage[i] == "steps" and improved:  # a step beat the center: wider beyond it
                sign[i] = -1.0 if j == 0 else 1.0
                cand[i] = c[j] * (1.0 + sign[i] * LAMBDA_WIDER)
                stage[i] = "wider"
                nxt.append(i)
            elif stage[i] in ("wider", "farther") and improved and j == len(c) - 1:  # still rising at the edge
                cand[i] = c[j] * LAMBDA_FARTHER ** sign[i]
                stage[i] = "farther"
                nxt.append(i)
            if far and nxt and nxt[-1] == i and round_ < LAMBDA_ROUNDS - 1:
                nxt.pop()  # far below: the rounds left would not drop it
                tuned[i] = False
        if not nxt:
            break
        todo = nxt
    return [(fill, lam, ok) for (fill, lam), ok in zip(best, tuned)]


MAX_ROWS = 12  # rows per DP call: larger arrays fall out of the caches and cost more per row


def _lagrangian_rows(
    batches: Sequence[_Batch], L: int, boxes: pos.Boxes, corners: np.ndarray, box: np.ndarray, lams: np.ndarray,
) -> np.ndarray:
    """pos.lagrangian of rows (box[r]: an index into corners (B, K+1), made into `boxes`, of
    batches[box[r]]) in chunks of at most MAX_ROWS rows."""
    out = np.empty(len(box))
    for i in box.tolist():
        batches[i].rows += 1
    keys = [c.tobytes() for c in corners]
    fits = np.array([bt.fits.get(k, -1) for bt, k in zip(batches, keys)], dtype=np.int8)
    for start in range(0, len(box), MAX_ROWS):
        sl = slice(start, start + MAX_ROWS)
        out[sl] = pos.lagrangian(boxes, L, box[sl], lams[sl], fits)
    for bt, k, f in zip(batches, keys, fits.tolist()):
        bt.fits[k] = f
    return out


def _root_bound(ctx: Context, b: int) -> tuple[float, float]:
    """(iteration, steady): lower bounds for micro-batch b before its tables are built, from
    the per-shape layer caps at one micro-batch in flight (search.py's envelope: the most
    layers the cluster holds under a steady V) and the cheapest way to place the layers
    (its staircase): min over V of (m - 1) * V + fill(V)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    shapes = ctx.type_shapes(b, prune_unfit=True)
    if not any(shapes):
        return math.inf, math.inf
    # per type (made once per type and chip count): its envelope and staircase
    parts = [
        ctx.per_type("root", name, b, lambda: _envelope_and_staircase(shape_tables(opts, L, 1, m)))
        for name, opts in zip(ctx.order, shapes)
    ]
    rest = Envelope.zero()
    for envelope, _ in parts:
        rest = rest + envelope
    cheapest = min(o.fill for opts in shapes for o in opts)
    stairs = [stair for _, stair in parts]
    weight = ctx.sched.closed_form.steady_weight(m, ctx.v)
    return envelope_bound(weight, L, rest, cheapest, stairs), envelope_bottleneck(L, rest)


def _envelope_and_staircase(tables: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[Envelope, Staircase]:
    """A type's envelope and staircase (`_root_bound`) from its shapes' one `shape_tables`."""
    c, table, fill = tables
    return Envelope.of_tables(c, table), Staircase(c, table, fill)


def _make_batch(ctx: Context, b: int, v_balance: float, bracket: bool,
                lengths: tuple[int, int] | None = None) -> _Batch | None:
    """The tables of micro-batch b, for the stage lists of `lengths` stages (None: all);
    `bracket`: also bracket the smallest feasible steady (v_fits, where the dives start; else
    v_fits is unknown and v_feasible = v_balance)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    weight = ctx.sched.closed_form.steady_weight(m, ctx.v)
    tables = pos.type_tables(ctx, b, lengths)
    if not any(t.size for t in tables):
        return None
    a = np.concatenate([t.a for t in tables if t.size])
    grid = np.unique(np.quantile(a, np.linspace(0.0, 1.0, 9)))
    t_max = float(max(t.tail_layer.max() * L + t.end_tail.max() for t in tables if t.size))

    K = tables[0].steady_a.shape[0]
    steady_max = np.array([
        max(float(t.steady_a[k].max() * L + t.steady_end[k].max()) for t in tables if t.size) for k in range(K)
    ])

    def fits(V: np.ndarray) -> np.ndarray:  # every steady component at V
        return pos.max_layers(pos.live_tables(tables, np.repeat(V[:, None], K, 1), np.full(len(V), math.inf)), L) >= L

    # the smallest V at which some stage list holds L layers (tau unlimited), bracketed by a
    # batched bisection: 8 probes per round. Under 1F1B the envelope bound v_balance bounds
    # every plan's steady from below; GPipe's two components have no such bound: 0.
    hi = float(steady_max.max())
    lo = min(v_balance, hi)
    floor = lo if K == 1 else 0.0
    ranges = length_ranges(ctx, m) if lengths is None else [None]  # over every length: those its box is taken apart into
    if ranges == [None]:  # (1F1B, GPipe, or a range's own batch: its boxes are split on thresholds)
        ranges = None
    batch = _Batch(b, m, tables, lengths, floor, math.nan, grid, t_max, steady_max, weight, ranges=ranges)
    if not bracket or batch.lists <= RESOLVE_LISTS:  # (a small space is resolved at once: no dives)
        return batch
    # The first round probes hi and 8 values from lo up to lo * BRACKET_NEAR: v_fits mostly
    # lies there (1-22 % above the envelope bound on the shipped clusters), one more round then
    # brackets it within 0.4 %; elsewhere three rounds from there to hi
    probes = np.append(np.geomspace(lo, min(lo * BRACKET_NEAR, hi), 9)[1:], hi)
    ok = fits(probes)
    if not ok[-1]:
        return None
    first = int(np.argmax(ok))
    lo = float(probes[first - 1]) if first > 0 else lo
    if first < len(probes) - 1:
        hi = float(probes[first])
    for _ in range(1 if first < len(probes) - 1 else 3):
        probes = np.geomspace(lo, hi, 10)[1:-1]
        ok = fits(probes)
        first = int(np.argmax(ok)) if ok.any() else len(probes)
        lo = float(probes[first - 1]) if first > 0 else lo
        hi = float(probes[first]) if first < len(probes) else hi
    return _Batch(b, m, tables, lengths, lo if K == 1 else 0.0, hi, grid, t_max, steady_max, weight, ranges=ranges)


LENGTH_RATIO = 1.25  # a range of stage counts p_lo..p_hi (`length_ranges`) spans at most this ratio


def length_ranges(ctx: Context, m: int) -> list[tuple[int, int] | None]:
    """The ranges p_lo..p_hi of stage counts the search takes apart at m micro-batches, each
    with its own tables (`positions.position_holds`): [None] (one range, every length) where
    what a position holds does not depend on the pipeline's length (1F1B, GPipe); else the
    lengths the schedule runs, each range spanning at most LENGTH_RATIO. ZB-H1 holds min(p, m)
    micro-batches at every stage and interleaved 1F1B about (v - 1) / v * p more than 1F1B:
    bounds taken over every length let a short pipeline's stages hold what only a long one's
    last stages hold."""
    L, sched, v = ctx.model.n_layers, ctx.sched, ctx.v
    same = all(
        sched.memory_in_flight(0, j, m, v) == sched.memory_in_flight(L - j, L, m, v)
        and sched.deferred(0, j, m, v) == sched.deferred(L - j, L, m, v) for j in range(1, L + 1)
    )
    if same:
        return [None]
    out: list[tuple[int, int] | None] = []
    for p in np.flatnonzero(pos.run_lengths(ctx, m)).tolist():
        if out and p <= out[-1][0] * LENGTH_RATIO:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def range_halves(batch: _Batch) -> list[tuple[int, int]]:
    """A range's two halves (its run lengths split in two, the shorter ones first), or []
    where the batch is no range or runs one length. A box about to be resolved is taken apart
    into them instead: each half's tables hold at least the range's at every position (the
    least over fewer lengths), so its bound is no lower and its enumeration refuses more lists
    early."""
    if batch.lengths is None:
        return []
    runs = np.flatnonzero(batch.tables[0].ends).tolist()  # the range's run lengths (`position_holds`)
    if len(runs) < 2:
        return []
    half = len(runs) // 2
    return [(runs[0], runs[half - 1]), (runs[half], runs[-1])]


def ordered_lists(blocks: Sequence[int]) -> int:
    """Stage lists made of at most one block per chip type, in any order, given each type's
    number of blocks: sum over sets S of types of |S|! * prod of their counts."""
    poly = [1]  # poly[j]: ways to choose j types and a block of each
    for n in blocks:
        poly = [a + (poly[j - 1] * n if j else 0) for j, a in enumerate(poly + [0])]
    return sum(math.factorial(j) * c for j, c in enumerate(poly)) - 1


class _Enumerator:
    """Depth-first over stage lists in one box, blocks from the end of the pipeline, each chip
    type in at most one block, in any order (the front completion bound `front_dp` is per set
    of types left)."""

    def __init__(self, ctx: Context, batch: _Batch, top: TopK, stats: SearchStats, solved: set, deadline: float,
                 budget: "_Budget | None" = None):
        self.ctx, self.batch, self.top, self.stats, self.solved = ctx, batch, top, stats, solved
        self.deadline, self.budget = deadline, budget
        self.L = ctx.model.n_layers

    def run(self, lo: np.ndarray, hi: np.ndarray, lam: float, max_leaves: int | None = None) -> None:
        """Solve every stage list whose bound in the box [lo, hi] (thresholds: steady
        components, then tail) is below the incumbent (at most `max_leaves` of them)."""
        L = self.L
        live = pos.live_tables(self.batch.tables, hi[None, :-1], hi[-1:])
        self.tables = [t for t, _ in live]
        # two rows: lambda's weights, and the capacity weights w = -u (the front DP's second
        # row is minus the most layers a front part holds)
        self.ws = [pos.weights(t, u, np.array([lam, 0.0]), np.zeros(2, dtype=np.int64), np.array([False, True]))
                   for t, u in live]
        G = pos.front_dp(self.tables, self.ws, L)
        self.G, self.G_cap = [g[0] for g in G], [g[1] for g in G]
        self.base = float(self.batch.weight @ lo) + lam * L
        # the most layers each stage holds within the box's upper corner (caps per role, shape
        # and position), and the middle stages' prefix sums over positions
        self.u = [u[0] for _, u in live]
        self.mid_sum = [np.concatenate([np.zeros((u.shape[1], 1)), np.cumsum(u[pos.MID], axis=-1)], axis=-1)
                        for u in self.u]
        self.leaves_left = max_leaves
        self.memo: dict = {}
        # a front block ends the list: a child only where its end is a pipeline length the
        # schedule runs (interleaved 1F1B: p divides m)
        self.ends = self.batch.tables[0].ends
        self._visit((1 << len(self.tables)) - 1, 0, 0.0, 0.0, ())

    def _children(self, left: int, q: int) -> tuple[np.ndarray, ...]:
        """The blocks that can come next (in front of the q stages placed), of a type of the
        set `left` (a bit mask), as arrays sorted by their bound less the base and the cost
        behind them (which the caller adds): (that part of the bound, type, shape, stages,
        is it the front block, its own cost, the most layers its stages hold in the box, and
        those with the most any front part in front of it holds). The same (left, q) is
        reached behind many different blocks: made once per run."""
        key = (left, q)
        found = self.memo.get(key)
        if found is not None:
            return found
        L = self.L
        parts = []
        for t2 in pos._bits(left):
            table, w, G = self.tables[t2], self.ws[t2], self.G[left & ~(1 << t2)]
            ahead = -self.G_cap[left & ~(1 << t2)]  # (-inf: no front part)
            if not table.size or q >= L:
                continue
            K = int(min(table.k_max.max(), L - q))
            k = np.arange(1, K + 1)
            end = q + k
            Wm, first, mid_ok = w.Wm[0], w.first[0], w.mid_ok[0]
            start = (w.last1[0] - Wm[:, 1])[:, None] if q == 0 else -Wm[:, q:q + 1]
            fits = k[None, :] <= table.k_max[:, None]
            mid = Wm[:, end] + start
            mid_b = np.where(fits & mid_ok[:, end], mid + G[end][None, :], np.inf)
            front = Wm[:, end - 1] + first[:, end] + start
            front_ok = fits & mid_ok[:, end - 1] & self.ends[end][None, :]
            if q == 0:
                front[:, 0] = w.only1[0]
                front_ok[:, 0] = self.ends[1]
            front_b = np.where(front_ok, front, np.inf)
            u, cum = self.u[t2], self.mid_sum[t2]
            # layers held: middle stages at positions q+1 .. (the last stage's own cap at 1),
            # and a front block's first stage at its front position q+k
            held = cum[:, end] - cum[:, q:q + 1]
            if q == 0:
                held = held + (u[pos.LAST, :, :1] - u[pos.MID, :, :1])
            held_front = held - u[pos.MID][:, end - 1] + u[pos.FIRST][:, end - 1]
            if q == 0:
                held_front[:, 0] = u[pos.ONLY, :, 0]
            for arr, cost, is_front, most, reach in (
                (mid_b, mid, False, held, held + ahead[end][None, :]), (front_b, front, True, held_front, held_front),
            ):
                s_idx, k_idx = np.nonzero(arr < np.inf)
                parts.append((arr[s_idx, k_idx], np.full(len(s_idx), t2), s_idx, k_idx + 1,
                              np.full(len(s_idx), is_front), cost[s_idx, k_idx], most[s_idx, k_idx],
                              reach[s_idx, k_idx]))
        if not parts:
            found = (np.empty(0),) * 8
        else:
            cols = [np.concatenate(c) for c in zip(*parts)]
            order = np.argsort(cols[0], kind="stable")
            found = tuple(c[order] for c in cols)
        self.memo[key] = found
        return found

    def _visit(self, left: int, q: int, C: float, held: float, blocks: tuple) -> None:
        """Below the q stages `blocks` (cost C, holding at most `held` layers in the box)."""
        found = self._children(left, q)
        # the children whose bound base + C + rel is below the incumbent's (a margin for the
        # rounding of the sum: each child's own sum decides, below)
        top, base = self.top, self.base
        room = top.bound - base - C
        n = int(np.searchsorted(found[0], room + 1e-9 * (abs(room) + abs(base) + abs(C)), side="right"))
        if not n:
            return
        if time.perf_counter() > self.deadline:
            raise OutOfTime
        if self.budget is not None:
            self.budget.spend(lists=1)
        bound = top.bound
        for r, t2, s, k, is_front, cost, most, reach in zip(*(c[:n].tolist() for c in found)):
            if base + C + r >= bound or self.leaves_left == 0:
                return
            if held + reach < self.L:
                # a list that cannot hold the L layers within the box's upper corner (whatever
                # its front part) has no plan in the box: the box its best plan lies in solves it
                continue
            here = ((t2, s, k),) + blocks
            if is_front:
                self._leaf(here)
                bound = top.bound
            elif left & ~(1 << t2):
                self._visit(left & ~(1 << t2), q + k, C + cost, held + most, here)
                bound = top.bound

    def _leaf(self, blocks: tuple) -> None:
        # (by the shapes' identities: the batch's tables keep them for the whole search)
        key = (self.batch.b, tuple((id(self.tables[t].options[s]), k) for t, s, k in blocks))
        if key in self.solved:
            return
        if time.perf_counter() > self.deadline:
            raise OutOfTime
        if self.budget is not None:
            self.budget.spend(lists=1)
        self.solved.add(key)
        if self.leaves_left is not None:
            self.leaves_left -= 1
        chosen = [self.batch.with_stages(self.tables[t].options[s], k) for t, s, k in blocks]
        # (by the chips' own names: a proof's nodes name a type's blocks' chips t#1 and t#2)
        same = (self.batch.b, tuple((self.ctx.chips[o.chip].name, o.shape, o.stages) for o in chosen))
        bound, beaten = self.top.bound, self.ctx._beaten
        if beaten.get(same, -math.inf) >= bound:
            return  # solved before, no faster than a time no lower than this one
        if not solve(self.ctx, self.batch.b, chosen, self.top, self.stats):
            beaten[same] = max(beaten.get(same, -math.inf), bound)


class OverBudget(Exception):
    """A search given `max_work` did that much and is not done (`left` holds its boxes)."""


LIST_WORK = 1 / 50  # a stage list walked or solved, in bound rows (~150 us against ~7 ms on the 768-chip proof)


class _Budget:
    """Work a search may do: bound rows plus LIST_WORK per stage list walked or solved."""

    def __init__(self, limit: float) -> None:
        self.limit, self.rows, self.lists = limit, 0, 0

    def spend(self, lists: int = 0, rows: int | None = None) -> None:
        """Count `lists` more, and the rows bound so far (when given); OverBudget past the limit."""
        self.lists += lists
        if rows is not None:
            self.rows = rows
        if self.rows + self.lists * LIST_WORK >= self.limit:
            raise OverBudget


@dataclasses.dataclass(order=True)
class _Box:
    """A box [lo, hi] of thresholds (steady components, then tail) at one micro-batch size, or
    (batch None) a micro-batch size b whose tables are not built yet, behind its cheap bound."""

    lb: float
    order: int
    batch: _Batch | None = dataclasses.field(compare=False)
    lo: np.ndarray | None = dataclasses.field(compare=False)
    hi: np.ndarray | None = dataclasses.field(compare=False)
    lam: float | None = dataclasses.field(compare=False)
    b: int = dataclasses.field(compare=False, default=0)
    v_balance: float = dataclasses.field(compare=False, default=0.0)
    lengths: tuple[int, int] | None = dataclasses.field(compare=False, default=None)  # its batch's
    fresh: bool = dataclasses.field(compare=False, default=True)  # bounded with this search's tables
    tuned: bool = dataclasses.field(compare=False, default=True)  # lam tuned to it (LAMBDA_FAR_BELOW)


class _ToBound(NamedTuple):
    """A box `push_all` bounds: `lam` the lambda to start from; `how` "tune" (the rounds
    `_bounds` takes, LAMBDA_FAR_BELOW's early stop included), "full" (every round: a child of
    a box whose lambda is not tuned) or "center" (that lambda alone: a box bounded again with
    its own lambda)."""

    batch: _Batch
    lo: np.ndarray
    hi: np.ndarray
    lam: float | None
    how: str = "tune"


def _shrink(batch: _Batch, lo: np.ndarray, hi: np.ndarray, gap: float) -> np.ndarray:
    """Every plan of a box costs at least its bound plus w_d * (x_d - lo_d) for each threshold
    d (weight w_d): beyond lo_d + gap / w_d none beats the incumbent, so the box ends there."""
    w = batch.weight
    return np.where(w > 0, np.minimum(hi, lo + gap / np.where(w > 0, w, 1.0)), hi)


def search(
    ctx: Context, micro_batches: Sequence[int], top: TopK, stats: SearchStats, deadline: float = math.inf,
    dives: int = DIVE_BATCHES, start: Sequence[_Box] | None = None, left: list[_Box] | None = None,
    max_work: float | None = None, after_dives: Callable[[], None] | None = None,
) -> None:
    """Fill `top` with the K best stage lists of the space, exactly; raises OutOfTime (with
    stats.lower_bound_s a valid lower bound on the optimum) when the deadline passes.

    `start`: the boxes another search left open (its `left`) in a space that holds this one,
    with a `top` no lower than this one's: every plan of this space that can beat `top`
    lies in one of them (at least their bounds), so the search starts from them instead of
    its micro-batch sizes' roots (and makes no dives). `left`: where an exception (OutOfTime,
    OverBudget, or the caller's `top` ending the search) leaves the boxes still open: those on
    the heap, those being split and the one being resolved. `max_work`: raise OverBudget once
    the search has bound that many rows, plus LIST_WORK per stage list walked or solved.
    `after_dives()` runs once the dives have found their incumbents, before the boxes are
    searched: it may lower `top.bound` (search._Starts' ceiling: a two-shape plan found from
    them), and the search then proves only what beats it."""
    L = ctx.model.n_layers
    solved: set = set()
    counter = itertools.count()
    heap: list[_Box] = []
    budget = None if max_work is None else _Budget(max_work)
    # (a search with a work limit reports its open boxes' bounds: each as tight as it gets)
    far_below = LAMBDA_FAR_BELOW if budget is None else -math.inf
    # micro-batch sizes by a cheap bound; each one's tables are built when its turn comes
    def root(b: int) -> tuple:
        if time.perf_counter() > deadline:  # a global batch with thousands of divisors takes a while
            raise OutOfTime
        return _root_bound(ctx, b) + (b,)

    if start is not None:
        pending, dives = [], 0
        if not start:
            return
        heap = [dataclasses.replace(box, order=next(counter)) for box in start]
        heapq.heapify(heap)
        stats.lower_bound_s = heap[0].lb
    else:
        pending = sorted((root(b) for b in micro_batches), key=lambda r: r[0])
        pending = [r for r in pending if math.isfinite(r[0])]
        if not pending:
            return
        stats.lower_bound_s = pending[0][0]
    batches: dict[tuple, _Batch | None] = {}  # per micro-batch size and range of lengths
    counted: set[int] = set()  # micro-batch sizes in stats.space_size

    def rows_bound() -> int:  # the bound rows of this search's tables so far
        return sum(b.rows for b in batches.values() if b is not None)

    def build(b: int, lengths: tuple[int, int] | None, v_balance: float, bracket: bool = False) -> _Batch | None:
        if (b, lengths) not in batches:
            if time.perf_counter() > deadline:
                raise OutOfTime
            batch = batches[b, lengths] = _make_batch(ctx, b, v_balance, bracket, lengths)
            if batch is not None and b not in counted:
                counted.add(b)
                stats.space_size += batch.lists
        return batches[b, lengths]

    # incumbents: shallow dives at the smallest feasible bottleneck of the most promising
    # micro-batch sizes and a few multiples of it (over every length: the best plan may have any).
    # Under a cutoff (another schedule's best: `auto`) the cutoff is the incumbent, and most
    # such searches have no plan under it to find: they bracket the smallest feasible steady
    # (their root boxes' lower corner) and do not dive (on the shipped clusters `auto` then
    # bounds 467 / 1,227 / 1,502 / 2,136 rows instead of 739 / 1,492 / 1,774 / 2,397, before
    # LAMBDA_FAR_BELOW)
    for _, v_bal, b in pending[:dives]:
        batch = build(b, None, v_bal, bracket=True)
        if batch is None or batch.lists <= RESOLVE_LISTS or math.isfinite(top.cutoff):  # (small: resolved)
            continue
        enum = _Enumerator(ctx, batch, top, stats, solved, deadline)
        (_, lam, _), = _bounds(batch, L, [batch.corner(batch.v_fits * DIVE_FACTORS[1], math.inf)], [None])
        corners = [batch.corner(batch.v_fits * f, math.inf) for f in DIVE_FACTORS]
        for hi, (lb, lam_f, _) in zip(corners, _bounds(batch, L, corners, [lam] * len(corners))):
            if math.isfinite(lb):
                enum.run(batch.corner(batch.v_feasible, 0.0), hi, lam_f, max_leaves=DIVE_LEAVES)
    if after_dives is not None:
        after_dives()

    def push_all(boxes: list[_ToBound]) -> None:
        """Bound boxes, those of one micro-batch size in one DP per round, and push those that
        can win."""
        found = _bounds([x.batch for x in boxes], L, [x.hi for x in boxes], [x.lam for x in boxes],
                        [-math.inf if x.how == "center" else top.bound - float(x.batch.weight @ x.lo) for x in boxes],
                        [far_below if x.how == "tune" else -math.inf for x in boxes])
        for (batch, lo, hi, _, _), (fill, lam, tuned) in zip(boxes, found):
            lb = float(batch.weight @ lo) + fill
            if lb < top.bound:
                heapq.heappush(heap, _Box(lb, next(counter), batch, lo, _shrink(batch, lo, hi, top.bound - lb), lam,
                                          batch.b, lengths=batch.lengths, tuned=tuned))

    def root(batch: _Batch, lam: float | None = None) -> tuple | None:
        """A batch's root box (for push_all), or None where it is empty."""
        live = [t for t in batch.tables if t.size]
        # a send counts in every steady component
        send = max(t.send_bytes.max() for t in live) * max(t.link_s_per_byte.max() for t in live)
        hi = np.append(np.maximum(batch.steady_max, send), batch.tail_max)
        lo = batch.corner(batch.v_feasible, 0.0)
        if top.heap:  # what the incumbent allows: sum of weight * lo <= its time
            hi = _shrink(batch, lo, hi, top.bound - float(batch.weight @ lo))
        return _ToBound(batch, lo, hi, lam) if (hi > lo).all() else None

    for lb, v_bal, b in pending:
        heapq.heappush(heap, _Box(lb, next(counter), None, None, None, None, b, v_bal))
    while heap:
        # per micro-batch size, boxes to bound (of its batch over every length, or of its
        # ranges of lengths: one DP per round for them all)
        generation: dict[int, list] = {}
        open_boxes: list[_Box] = []  # popped, not done with: being split or resolved
        try:
            if budget is not None:
                budget.spend(rows=rows_bound())
            while heap and len(generation) < GENERATION and sum(map(len, generation.values())) < 2 * GENERATION:
                box = heapq.heappop(heap)
                if box.lb >= top.bound:
                    heap.clear()  # every box left is at least as bad
                    break
                open_boxes.append(box)
                if time.perf_counter() > deadline:
                    raise OutOfTime
                if box.batch is None:  # a micro-batch size whose turn has come, or a box of `start`
                    batch = build(box.b, box.lengths, box.v_balance)
                    if box.lo is None or batch is None:
                        found = root(batch, box.lam) if batch is not None else None
                        if found is None:
                            open_boxes.pop()
                        else:  # (open until it is bounded)
                            generation.setdefault(batch.b, []).append(found)
                        continue
                    box = open_boxes[-1] = dataclasses.replace(box, batch=batch)
                batch = box.batch
                if not box.fresh:  # a box of `start`: bounded again, with this search's tables and its lambda, first
                    generation.setdefault(batch.b, []).append(
                        _ToBound(batch, box.lo, box.hi, box.lam, "center"))
                    continue
                if batch.ranges and batch.lists > RESOLVE_LISTS:
                    # a box over every length (its root): taken apart into its ranges of lengths,
                    # each under the box's bound until its own tables are built and bounded
                    for lengths in batch.ranges:
                        heapq.heappush(heap, _Box(box.lb, next(counter), None, None, None, box.lam, batch.b,
                                                  batch.v_feasible, lengths))
                    open_boxes.pop()
                    continue
                gap = top.bound - box.lb  # the incumbent may have improved since the push
                lo, hi = box.lo, _shrink(batch, box.lo, box.hi, gap)
                widths = batch.weight * (hi - lo)
                if (widths.sum() <= RESOLVE_FRACTION * gap and gap <= RESOLVE_GAP * top.bound) or (
                    widths.sum() <= RESOLVE_WIDTH * top.bound
                ) or batch.lists <= RESOLVE_LISTS:
                    halves = range_halves(batch) if batch.lists > RESOLVE_LISTS else []
                    # a range of several lengths: its halves instead, each bounded again with
                    # its own tables (no lower) before it is split or resolved
                    for lengths in halves:
                        heapq.heappush(heap, _Box(box.lb, next(counter), None, lo, hi, box.lam, batch.b,
                                                  batch.v_feasible, lengths, fresh=False, tuned=box.tuned))
                    if not halves:
                        lam, lb = box.lam, box.lb
                        if not box.tuned:  # its lambda tuned first (LAMBDA_FAR_BELOW): the walk prunes by it
                            base = float(batch.weight @ lo)
                            (fill, lam, _), = _bounds(batch, L, [hi], [lam], [top.bound - base])
                            lb = base + fill
                        if lb < top.bound:
                            _Enumerator(ctx, batch, top, stats, solved, deadline, budget).run(lo, hi, lam)
                    open_boxes.pop()
                    continue
                how = "tune" if box.tuned else "full"  # (an untuned lambda's children tune theirs)
                d = int(np.argmax(widths))  # halve the costliest side
                mid = 0.5 * (lo[d] + hi[d])
                upper_lo, lower_hi = lo.copy(), hi.copy()
                upper_lo[d], lower_hi[d] = mid, mid
                generation.setdefault(batch.b, []).extend(
                    [_ToBound(batch, lo, lower_hi, box.lam, how), _ToBound(batch, upper_lo, hi, box.lam, how)]
                )
            for children in generation.values():
                push_all(children)
        except Exception:  # OutOfTime, or a caller's `top` ending the search (chip_split): the bound so far
            stats.lower_bound_s = min([*(b.lb for b in open_boxes), *(b.lb for b in heap)], default=top.bound)
            if left is not None:  # (another context's search builds its own tables)
                left.extend(dataclasses.replace(b, batch=None, v_balance=b.batch.v_feasible if b.batch else b.v_balance,
                                                fresh=False)
                            for b in [*open_boxes, *heap])
            stats.bound_rows = rows_bound()
            raise
    if top.heap:  # (a bound lowered below every plan in `top`, `after_dives`'s, is what was proved)
        stats.lower_bound_s = min(top.sorted()[0].time_s, top.bound)
    stats.bound_rows = rows_bound()
