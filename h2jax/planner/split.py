"""One stage list's exact layer split (`best_split`), the bounds that decide which stage lists
are worth splitting (the per-shape envelope and staircase, `leaf_bound`), and `solve`, which
offers a solved list to the top k. Shared by the exact search and the exhaustive reference."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from h2jax.planner import cost_model as cm
from h2jax.planner.memory_model import StageMemoryTerms
from h2jax.planner.space import Candidate, Context, Option, SearchStats


# ----------------------------------------------------------------------------- one stage list


@dataclasses.dataclass
class _Leaf:
    lin: np.ndarray  # per-layer fill coefficient of each stage
    const: float  # fill constants: end-stage terms and link latencies
    groups: list[tuple[float, np.ndarray, np.ndarray, float]]  # (weight, a, o, floor)
    caps: np.ndarray


def _leaf(ctx: Context, b: int, options: Sequence[Option], sends: tuple[float, float]) -> _Leaf | None:
    """The objective's coefficients for one stage list (sends: its `stage_list_sends`), or
    None if a stage cannot hold a layer."""
    shapes = [o for o in options for _ in range(o.stages)]
    p, m = len(shapes), ctx.global_batch // b
    terms = [ctx.terms(b, o, i == 0, i == p - 1, *held) for i, (o, held) in enumerate(zip(shapes, ctx.holds_row(p, m)))]
    L = ctx.model.n_layers
    caps = np.minimum(np.array([ctx.layer_cap(t) for t in terms], dtype=np.int64), L - p + 1)
    if caps.min() < 1 or caps.sum() < L:
        return None
    max_send, links = sends
    form, v = ctx.sched.closed_form, ctx.v
    per_layer = np.array([[t.fwd_layer, t.bwd_layer, t.bwd_weight_layer] for t in terms])  # (p, 3)
    ends = np.array([[t.fwd_end, t.bwd_end, t.bwd_weight_end] for t in terms])
    fill = form.fill_coefficients(p, v)
    tail = (1.0, np.array([t.tail_layer for t in terms]), np.array([t.tail_end for t in terms]), -math.inf)
    const = float((fill * ends).sum()) + 2.0 * links
    weight, floor = form.steady_weight(m, v), max_send * form.send_factor(v)
    groups = [(weight, per_layer @ np.array(k, float), ends @ np.array(k, float), floor) for k in form.steady]
    return _Leaf((fill * per_layer).sum(axis=1), const, groups + [tail], caps)


def stage_list_sends(ctx: Context, b: int, chosen: Sequence[Option]) -> tuple[float, float]:
    """(largest send, sum of sends + link latencies) of a stage list given as blocks (each
    Option's `stages` stages in a row); under interleaved 1F1B (v > 1) the last stage also
    sends to the first. A block's stages send to each other: k - 1 sends of one size."""
    blocks = [o for o in chosen if o.stages > 0]
    p = sum(o.stages for o in blocks)
    pairs = [(o, o, o.stages - 1) for o in blocks if o.stages > 1]
    pairs += [(s, r, 1) for s, r in zip(blocks, blocks[1:])]
    if ctx.v > 1 and p > 1:
        pairs.append((blocks[-1], blocks[0], 1))
    sends = [(ctx.send(b, s, r), n) for s, r, n in pairs]
    return max((x for x, _ in sends), default=0.0), sum(n * (x + cm.LINK_LATENCY_S) for x, n in sends)


def _objective(leaf: _Leaf, layers: np.ndarray) -> float:
    value = leaf.const + float(leaf.lin @ layers)
    for w, a, o, floor in leaf.groups:
        value += w * max(floor, float((a * layers + o).max()))
    return value


def _greedy_fill(lin: np.ndarray, order: np.ndarray, caps: np.ndarray, L: int) -> np.ndarray | None:
    """min sum lin_i*l_i s.t. 1 <= l_i <= caps_i, sum l_i = L: cheapest stages first (exact)."""
    layers = np.ones_like(caps)
    left = L - len(caps)
    for i in order:
        if left <= 0:
            break
        add = min(int(caps[i]) - 1, left)
        layers[i] += add
        left -= add
    return layers if left == 0 else None


def _caps_at(v: float, a: np.ndarray, o: np.ndarray, caps: np.ndarray) -> np.ndarray:
    # The 1e-9 absorbs rounding when v was computed as a*l + o itself.
    return np.minimum(caps, np.floor((v - o) / a + 1e-9).astype(np.int64))


def _breakpoints(a: np.ndarray, o: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """The distinct values a_i * l + o_i, 1 <= l <= caps_i, ascending: the bottlenecks a split
    can have. Stages of equal (a_i, o_i) (a block's inner stages: their times differ from
    each other only in memory) give the same run, taken once up to their largest cap."""
    most: dict = {}
    for ai, oi, ci in zip(a.tolist(), o.tolist(), caps.tolist()):
        if ci > most.get((ai, oi), 0):
            most[(ai, oi)] = ci
    runs = [ai * np.arange(1, ci + 1) + oi for (ai, oi), ci in most.items()]
    return np.unique(np.concatenate(runs)) if runs else np.empty(0)


def best_split(leaf: _Leaf, L: int, bound: float, stats: SearchStats) -> tuple[float, np.ndarray] | None:
    """The optimal layer split of one stage list if it beats `bound`, else None (exact)."""
    order = np.argsort(leaf.lin, kind="stable")
    best: list[Any] = [bound, None]

    def fill_cost(caps: np.ndarray) -> float:
        layers = _greedy_fill(leaf.lin, order, caps, L)
        return math.inf if layers is None else float(leaf.lin @ layers)

    def rest_bound(g: int, caps: np.ndarray) -> float:
        lb = leaf.const + fill_cost(caps)
        for w, a, o, floor in leaf.groups[g:]:
            lb += w * max(floor, float((a + o).max()))  # every stage holds >= 1 layer
        return lb

    def visit(g: int, caps: np.ndarray, acc: float) -> None:
        if g == len(leaf.groups):
            layers = _greedy_fill(leaf.lin, order, caps, L)
            if layers is None:
                return
            stats.plans_evaluated += 1
            value = _objective(leaf, layers)
            if value < best[0]:
                best[0], best[1] = value, layers
            return
        w, a, o, floor = leaf.groups[g]
        lb_rest = rest_bound(g + 1, caps)
        values = _breakpoints(a, o, caps)

        def feasible(v: float) -> bool:
            c = _caps_at(v, a, o, caps)
            return c.min() >= 1 and c.sum() >= L

        lo, hi = 0, len(values) - 1  # the largest value keeps every cap: feasible whenever caps are
        if not feasible(values[hi]):
            return
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(values[mid]):
                hi = mid
            else:
                lo = mid + 1
        start = lo
        if floor > values[start]:
            # Every split whose max is below the floor costs the floor: try the loosest of them.
            below = int(np.searchsorted(values, floor, side="right")) - 1
            candidates = itertools.chain([floor], values[below + 1:])
        else:
            candidates = iter(values[start:])
        for v in candidates:
            charged = acc + w * max(floor, v)
            if charged + lb_rest >= best[0]:
                break
            visit(g + 1, _caps_at(v, a, o, caps), charged)

    visit(0, leaf.caps, 0.0)
    return None if best[1] is None else (best[0], best[1])



# ----------------------------------------------------------------------------- the two searches


class Envelope:
    """The most layers some choice among `options` holds under a bottleneck v, as a step function.

    An option of per-layer cost c, k stages and one-micro-batch memory cap `cap1` holds
    k*min(cap1, floor(v/c)) layers when no stage may exceed v: end-stage terms and more
    micro-batches in flight only lower that, so it bounds every position. Several
    envelopes add up (types not chosen yet, for the bound of a partial choice).
    """

    def __init__(self, xs: np.ndarray, hs: np.ndarray) -> None:
        self.xs, self.hs = xs, hs  # breakpoints (increasing) and the layers held from each on

    @classmethod
    def of_tables(cls, c: np.ndarray, table: np.ndarray) -> "Envelope":
        """The most layers one of some options holds under a bottleneck v, from their
        `shape_tables` (c, table): their stages sitting at the pipeline positions that hold
        `in_flight`, `in_flight` + 1, ... micro-batches (at least; capped at m, or all
        `in_flight` when m is None, as under GPipe). Options sharing a shape differ only in
        k, and k stages hold at most the sum of the first k per-position caps
        min(floor(v/c), cap(f_j)), which grows with k: the envelope of a shape is that of
        its largest k."""
        u = np.arange(1, table.shape[1])
        x = np.concatenate([np.zeros(1), (c[:, None] * u[None, :]).ravel()])
        h = np.concatenate([np.zeros(1), table[:, 1:].ravel().astype(float)])
        order = np.argsort(x, kind="stable")
        x, h = x[order], np.maximum.accumulate(h[order])
        keep = np.concatenate([[True], h[1:] > h[:-1]])
        return cls(x[keep], h[keep])

    @classmethod
    def zero(cls) -> "Envelope":
        return cls(np.zeros(1), np.zeros(1))

    def __add__(self, other: "Envelope") -> "Envelope":
        xs = np.union1d(self.xs, other.xs)
        return Envelope(xs, self(xs) + other(xs))

    def __call__(self, v: Any) -> Any:
        return self.hs[np.searchsorted(self.xs, v, side="right") - 1]


def envelope_bottleneck(L: int, rest: Envelope) -> float:
    """A lower bound on every plan's bottleneck (the max of a stage's forward + backward): the
    smallest v at which the envelope holds L layers (inf: it never does)."""
    if rest.hs[-1] < L:
        return math.inf
    return float(rest.xs[int(np.searchsorted(rest.hs, L))]) * (1 - 1e-9)  # below the split's rounding


def shape_tables(
    options: Sequence[Option], L: int, in_flight: int, m: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per shape of `options` (its largest k): (per-layer cost c, table) where table[u] is the
    most layers its stages hold with at most u layers each, the stages sitting at the pipeline
    positions that hold in_flight, in_flight + 1, ... micro-batches (capped at m; all
    `in_flight` when m is None, as under GPipe), clipped at L. Vectorised over shapes."""
    shapes: dict[tuple, Option] = {}
    for o in options:
        if o.shape not in shapes or o.stages > shapes[o.shape].stages:
            shapes[o.shape] = o
    if not shapes:
        return np.zeros(0), np.zeros((0, 1), dtype=np.int64), np.zeros(0)
    opts = list(shapes.values())
    kmax = min(max(o.stages for o in opts), L)
    j = np.arange(kmax)
    f = np.full(kmax, in_flight) if m is None else np.minimum(in_flight + j, m)
    limit = np.array([min(o.cap1, L) for o in opts])[:, None]
    caps = np.minimum(StageMemoryTerms.stacked([o.mem for o in opts]).max_layers(f[None, :]), limit)
    caps[j[None, :] >= np.array([o.stages for o in opts])[:, None]] = 0  # stages it does not have
    caps = np.maximum(caps, 0).astype(np.int64)
    caps[caps < 1] = 0
    umax = int(caps.max(initial=0))
    u = np.arange(umax + 1)
    table = np.minimum(np.minimum(u[None, :, None], caps[:, None, :]).sum(axis=2), L)
    return np.array([o.layer_s for o in opts]), table, np.array([o.fill for o in opts])


class Staircase:
    """The cheapest per-layer cost of a chip type's layers under a bottleneck v: its j-th
    layer costs at least the per-layer time of the cheapest shape that holds j layers under v
    (with its stages at the most lenient positions from `in_flight` on, like `Envelope`).

    Whichever option the type takes, its x layers cost c*x >= the sum of the first x steps,
    so the cheapest `left` steps over all types bound the fill from below. `c` is a shape's
    steady per-layer time (what the bottleneck v limits), `fill` its per-layer share of the
    fill (the step's cost; the same under 1F1B, less under ZB-H1 and interleaved).
    """

    def __init__(self, c: np.ndarray, table: np.ndarray, fill: np.ndarray | None = None) -> None:
        fill = c if fill is None else fill
        order = np.argsort(fill, kind="stable")
        self.c, self.tab, self.fill = c[order], table[order], fill[order]
        self.umax = self.tab.shape[1] - 1
        self.rows = np.arange(len(self.c))

    def steps(self, v: float) -> tuple[np.ndarray, np.ndarray]:
        """(cost, count) of the steps under bottleneck v, costs ascending."""
        if not len(self.c):
            return self.c, np.zeros(0, dtype=np.int64)
        u = np.minimum(np.floor(min(v, 1e30) / self.c + 1e-9), self.umax).astype(np.int64)
        held = np.maximum.accumulate(self.tab[self.rows, u])
        inc = np.diff(held, prepend=0)
        keep = inc > 0
        return self.fill[keep], inc[keep]


def envelope_bound(weight: float, L: int, rest: Envelope, rest_c: float, stairs: Sequence[Staircase]) -> float:
    """A lower bound on every plan's iteration time from the types' envelope and staircases
    (weight: the steady state's, m - 1 under 1F1B; rest_c: the cheapest per-layer fill):

    min over bottlenecks V >= the envelope's of (m-1)*V + fill(V), fill(V) the L cheapest
    staircase steps under V (each type's j-th layer costs at least the cheapest shape that holds
    j layers). Between two breakpoints of the envelope the fill is taken at the interval's right
    end (it only falls with V); the scan stops once (m-1)*V + L*rest_c (every layer at the
    cheapest per-layer cost) cannot beat the best so far.
    """
    v = envelope_bottleneck(L, rest)
    if v == math.inf:
        return v
    floor_fill = L * rest_c
    best = math.inf
    v0 = v
    for _ in range(64):
        if weight * v + floor_fill >= best:
            # No bottleneck from v on does better, and the ones below v could not place L layers.
            return best
        # next bottleneck at which the envelope grows
        nxt = min((float(x) for x in rest.xs[np.searchsorted(rest.xs, v, side="right"):][:1]), default=math.inf)
        steps = [st.steps(nxt) for st in stairs]
        c_all = np.concatenate([c for c, _ in steps])
        n_all = np.maximum(np.concatenate([n for _, n in steps]), 0)
        order = np.argsort(c_all, kind="stable")
        c_all, n_all = c_all[order], n_all[order]
        cum = np.cumsum(n_all)
        if len(cum) and cum[-1] >= L:
            j = int(np.searchsorted(cum, L))
            prev = int(cum[j - 1]) if j else 0
            fill = float(c_all[:j] @ n_all[:j]) + float(c_all[j]) * (L - prev)
            best = min(best, weight * v + fill)
        if nxt == math.inf:
            break
        v = nxt
    else:
        return weight * v0 + floor_fill  # gave up refining: the plain bound
    return best if best < math.inf else weight * v0 + floor_fill


@dataclasses.dataclass
class _ListParts:
    """What `list_bound` weighs of one stage list, per stage (pipeline order)."""

    caps: np.ndarray  # the layer cap at its position's in-flight memory
    c: np.ndarray  # steady-state time per layer
    e: np.ndarray  # steady-state end terms (embedding, head)
    cf: np.ndarray  # per-layer share of the fill (the least over positions)
    weight: float  # the steady state's weight (1F1B: m - 1)
    floor: float  # the steady state's floor: the largest send
    fill_end: float  # the fill's terms that no layer count changes: end stages, sends, latencies
    fill0: float  # the fill's per-layer part at its cheapest split within the caps
    tail0: float  # a lower bound on the tail of every split
    end_tails: tuple[float, float]  # the first and the last stage's tail end terms (embedding, head)


class _Ends(NamedTuple):
    """What a stage list's bound weighs of its end stages and its sends (`_list_ends`): the
    same in `_may_hold`'s per-block relaxation and `_list_parts`' per-stage terms."""

    first: cm.StageTerms  # the first stage's terms (with the embedding; the head too if p == 1)
    last: cm.StageTerms  # the last stage's (with the head)
    e_first: float  # the steady state's end terms on the first stage
    e_last: float  # and on the last (0 when the first is the last)
    floor: float  # the steady state's floor: the largest send
    fill_end: float  # the fill's terms that no layer count changes: end stages, sends, latencies


# no end terms, no sends: what `_may_hold` weighs first (its terms are not read there)
_NO_ENDS = _Ends(None, None, 0.0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]


def _list_ends(ctx: Context, b: int, chosen: Sequence[Option]) -> _Ends:
    """A stage list's `_Ends`."""
    p = sum(o.stages for o in chosen)
    first = ctx.terms(b, chosen[0], True, p == 1, 1)
    last = ctx.terms(b, chosen[-1], p == 1, True, 1)
    g_first = ctx.fill_terms(first, p == 1)[1]  # in the fill
    g_last = 0.0 if p == 1 else ctx.fill_terms(last, True)[1]
    sends = stage_list_sends(ctx, b, chosen)
    # (GPipe: max f + max b >= max (f + b), so the same steady-state bound holds)
    return _Ends(first, last, first.fwd_end + first.bwd_end, 0.0 if p == 1 else last.fwd_end + last.bwd_end,
                 sends[0] * ctx.sched.closed_form.send_factor(ctx.v), g_first + g_last + 2.0 * sends[1])


def _list_parts(ctx: Context, b: int, chosen: Sequence[Option], ends: _Ends | None = None) -> _ListParts | None:
    """`list_bound`'s terms but the tail's per stage (`_tail_terms`: only for the lists that
    pass the first test), or None when the list cannot hold the model (`ends`: the list's
    `_list_ends`, made here when not given)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    p = sum(o.stages for o in chosen)
    ks = [o.stages for o in chosen]
    caps = np.minimum(ctx.position_caps(chosen, m), L - p + 1)
    if caps.min() < 1 or caps.sum() < L:
        return None
    ends = ends or _list_ends(ctx, b, chosen)
    e = np.zeros(p)
    e[0] += ends.e_first  # in the steady state
    e[-1] += ends.e_last
    # the fill: its per-layer part at least the cheapest split within the memory caps (the
    # cheapest stages filled first)
    cf = np.repeat([o.fill for o in chosen], ks)
    layers = _greedy_fill(cf, np.argsort(cf, kind="stable"), caps, L)
    form = ctx.sched.closed_form
    tail0 = _tail_floor(chosen, L)
    return _ListParts(
        caps, np.repeat([o.layer_s for o in chosen], ks), e, cf, form.steady_weight(m, ctx.v),
        ends.floor, ends.fill_end, float(cf @ layers), tail0, (ends.first.tail_end, ends.last.tail_end),
    )


def _tail_floor(chosen: Sequence[Option], L: int) -> float:
    """A lower bound on the tail of every split of a stage list: every stage holds a layer,
    and with each tail_i * l_i <= X the stages hold at most X * sum_i 1 / tail_i layers."""
    return float(tail_bound(L, sum(per_tail(o, o.stages) for o in chosen), max(o.tail1 for o in chosen)))


def per_tail(o: "Option | NewShapes", k):
    """k stages of `o`'s shape in `tail_bound`'s sum: k / tail1 (inf where tail1 is 0;
    elementwise for an array k, and for `NewShapes`' columns)."""
    if isinstance(o.tail1, np.ndarray):
        return np.divide(k, o.tail1, out=np.full(np.broadcast(k, o.tail1).shape, math.inf), where=o.tail1 > 0)
    return k / o.tail1 if o.tail1 > 0 else math.inf


def tail_bound(L: int, inv_tail: float, tail_max: float) -> float:
    """`_tail_floor` from its sums: of `per_tail` over the stages, and their largest tail1
    (elementwise for arrays)."""
    return np.maximum(tail_max, L / inv_tail)


_ROUND = 1 - 1e-9  # the bounds' margin for the rounding of the sums they bound


def _tail_terms(ctx: Context, b: int, chosen: Sequence[Option], parts: _ListParts) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, the tail's (dp-reduce + optimizer) seconds per layer, the same at every
    position (its gradients and optimizer state), and its end terms (the end stages' embedding
    and head, the update's dispatch)."""
    ks = [o.stages for o in chosen]
    tl = np.maximum(np.repeat([o.tail1 for o in chosen], ks), 1e-300)
    te = np.repeat([ctx.terms(b, o, False, False, 1).tail_end for o in chosen], ks)
    te[-1], te[0] = parts.end_tails[1], parts.end_tails[0]
    return tl, te


def _least(ctx: Context, b: int, chosen: Sequence[Option], parts: _ListParts, bound: float) -> float:
    """min over bottlenecks V of (weight * max(V, floor) + fill(V) + tail(V)), or some value
    >= `bound` when that is not below it:

    a split whose largest c_i * l_i + e_i is V holds l_i <= u_i(V) = min(cap_i,
    floor((V - e_i) / c_i)) layers on stage i, so its fill is at least the cheapest split
    within the caps u(V) (cheapest stages first) and its tail at least the least X at which
    the stages hold L layers with each tl_i * l_i + te_i <= X and l_i <= u_i(V). V runs over
    the values c_i * l + e_i (the bottlenecks a split can have), up to where weight * V alone
    with the cheapest fill and tail reaches `bound`."""
    L = ctx.model.n_layers
    rest0 = parts.fill_end + parts.fill0 + parts.tail0
    most = (bound / _ROUND - rest0) / parts.weight if parts.weight > 0 else math.inf
    if parts.floor >= most or float(_held(parts, most)[0]) < L:
        return bound  # no bottleneck up to `most` holds the layers: nothing below bound
    caps, c, e = parts.caps, parts.c, parts.e
    tl, te = _tail_terms(ctx, b, chosen, parts)
    groups = _runs(c, e, tl, te)
    # the candidate bottlenecks: per run of stages that share c and e (a block's inner stages,
    # each end stage alone), c * l + e up to the run's largest cap
    V = np.unique(np.concatenate([c[lo] * np.arange(1, caps[lo:hi].max() + 1) + e[lo] for lo, hi in groups]))
    V = V[V <= most]
    U = np.minimum(caps[:, None], np.floor((V[None, :] - e[:, None]) / c[:, None] + 1e-9))
    ok = (U.min(axis=0) >= 1) & (U.sum(axis=0) >= L)
    if not ok.any():
        return bound
    V, U = V[ok], U[:, ok]
    # fill(V) and tail(V) only fall as V grows (its caps u(V) rise): at the largest V, beside
    # the weighted least one, they bound every V's sum from below. Nearly every list the local
    # search asks about that gets this far ends here, without the fill and tail at every V.
    last = U[:, -1:]
    if (parts.weight * max(float(V[0]), parts.floor) + _fill_within(parts, last, L)[0]
            + _least_tail(tl, te, caps, groups, last, L)[0] + parts.fill_end) * _ROUND >= bound:
        return bound
    fill, tail = _fill_within(parts, U, L), _least_tail(tl, te, caps, groups, U, L)
    return float(((parts.weight * np.maximum(V, parts.floor) + fill + tail).min() + parts.fill_end) * _ROUND)


def _fill_within(parts: _ListParts, U: np.ndarray, L: int) -> np.ndarray:
    """Per column of U (each stage's layer cap), the fill's per-layer part of the cheapest
    split within it: cheapest stages first, each from one layer up to its cap."""
    return parts.cf.sum() + _cheapest_extra(parts.cf, U - 1.0, L - len(parts.caps))


def _cheapest_extra(fill: np.ndarray, room: np.ndarray, extra) -> np.ndarray:
    """Per column, the fill of `extra` layers (beyond a layer a stage) put on the rows
    (stages, or blocks) of least `fill` per layer first, each row up to its `room` (>= 0);
    `fill` one per row, or one per row and column."""
    fill = fill.reshape(len(fill), -1)
    order = np.argsort(fill, axis=0, kind="stable")
    if fill.shape[1] == 1:  # one order for every column
        fill, room = fill[order[:, 0]], room[order[:, 0]]
    else:
        cols = np.arange(fill.shape[1])
        fill, room = fill[order, cols], room[order, cols]
    before = np.cumsum(room, axis=0) - room
    return (fill * np.clip(extra - before, 0.0, room)).sum(axis=0)


def _runs(*per_stage: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) of the runs of consecutive stages equal in every array of `per_stage`."""
    keys = np.stack(per_stage)
    cut = np.nonzero((keys[:, 1:] != keys[:, :-1]).any(axis=0))[0] + 1
    edges = [0, *cut.tolist(), keys.shape[1]]
    return list(zip(edges, edges[1:]))


def _least_tail(
    tl: np.ndarray, te: np.ndarray, caps: np.ndarray, groups: list[tuple[int, int]], U: np.ndarray, L: int,
) -> np.ndarray:
    """Per column of U (each stage's layer cap, at most `caps`), the least tail X = tl_i * l +
    te_i at which the stages hold L layers (each at least one): a batched bisection over the
    sorted values X can take (per run of equal stages in `groups`, up to the run's largest cap)."""
    X = np.unique(np.concatenate([tl[lo] * np.arange(1, caps[lo:hi].max() + 1) + te[lo] for lo, hi in groups]))
    X = X[X >= float((tl + te).max())]  # every stage holds a layer
    lo, hi = np.zeros(U.shape[1], dtype=np.int64), np.full(U.shape[1], len(X) - 1)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        held = np.minimum(U, np.floor((X[mid][None, :] - te[:, None]) / tl[:, None] + 1e-9)).clip(min=0).sum(axis=0)
        good = held >= L
        hi, lo = np.where(good, mid, hi), np.where(good | (lo >= hi), lo, mid + 1)
    return X[lo]


def list_bound(ctx: Context, b: int, chosen: Sequence[Option]) -> float:
    """A lower bound on one stage list's time over every layer split (inf: it cannot hold the
    model), without building its leaf (`_least`): each position's in-flight memory cap, the
    end stages' embedding/logits time, the list's sends (`stage_list_sends`: the largest, a
    floor of the steady state; all of them and their latencies, twice in the fill) and the
    tail, with the fill and the tail of the splits at each bottleneck."""
    parts = _list_parts(ctx, b, chosen)
    return math.inf if parts is None else _least(ctx, b, chosen, parts, math.inf)


def _held(parts: _ListParts, bottleneck: np.ndarray | float) -> np.ndarray:
    """The most layers the stages hold with every stage's time within `bottleneck` (per column
    of a (1, n) array; a scalar gives one column)."""
    per_stage = np.floor((bottleneck - parts.e[:, None]) / parts.c[:, None] + 1e-9)
    return np.minimum(parts.caps[:, None], per_stage).clip(min=0).sum(axis=0)


def list_may_beat(ctx: Context, b: int, chosen: Sequence[Option], bound: float) -> bool:
    """Whether `list_bound` is below `bound`, looking only at the bottlenecks that can be:
    none when the stages cannot hold the layers at the largest bottleneck the cheapest fill
    and tail leave under `bound` (the local search asks this of ~10^4 lists a round, nearly
    all of which fail there; `_may_hold` asks it first, per block)."""
    ends = _may_hold(ctx, b, chosen, bound)
    if ends is None:
        return False
    parts = _list_parts(ctx, b, chosen, ends)
    return parts is not None and _least(ctx, b, chosen, parts, bound) < bound


def _may_hold(ctx: Context, b: int, chosen: Sequence[Option], bound: float) -> _Ends | None:
    """Whether `_least` may be below `bound`, on a relaxation of `_list_parts` per block
    instead of per stage (a few Python numbers, not the list's arrays; `_Blocks`): the list's
    `_list_ends` where it may (made only then), None where it cannot.

    Every stage of a block takes the block's largest cap, so the blocks' fill and tail
    (`_Blocks.rest`) are no larger than the stages' at any bottleneck, the largest bottleneck
    they leave under `bound` no smaller, and the layers the stages hold there no fewer: where
    even these are short of L, or the largest send reaches that bottleneck, no bottleneck
    beats `bound`. Then again with each block's cap cut to the layers it holds at that
    bottleneck (at every bottleneck below it the stages hold no more): a dearer fill and tail,
    a smaller bottleneck. First on a looser relaxation, each block's cap its shape's `cap1`
    (the most layers a stage holds with one micro-batch in flight: no position holds fewer)
    and without the list's end terms and sends (`_NO_ENDS`: none makes a split cheaper), which
    needs nothing of the list's positions or ends: a list it rejects, the tighter test rejects
    too (`Beside.cannot_beat` is this first test, for many lists at once). On 2,432 chips 94 %
    of the local search's lists that `sums_bound` leaves end there; then with each block's
    largest cap at its positions and the list's ends (2 % pass both)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    weight = ctx.sched.closed_form.steady_weight(m, ctx.v)
    if weight <= 0:
        return _list_ends(ctx, b, chosen)
    blocks = _Blocks(chosen)
    most_per_stage = L - blocks.p + 1
    if not blocks.may_hold([min(o.cap1, most_per_stage) for o in chosen], L, weight, bound, _NO_ENDS):
        return None
    ends = _list_ends(ctx, b, chosen)
    return ends if blocks.may_hold(_block_caps(ctx, b, chosen), L, weight, bound, ends) else None


def _block_caps(ctx: Context, b: int, chosen: Sequence[Option]) -> list[int]:
    """Per block of a stage list, the largest of its stages' layer caps (at most L - p + 1)."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    most = L - sum(o.stages for o in chosen) + 1
    return [min(c, most) for c in ctx.block_cap_maxima(chosen, m)]


class _Blocks:
    """A stage list's blocks as `_may_hold` weighs them, every stage of a block on one cap
    (given per block to each test): each block's stages, per-layer time, fill and tail1, and
    what no cap changes (their sums; the blocks by fill)."""

    def __init__(self, chosen: Sequence[Option]) -> None:
        self.stages = [o.stages for o in chosen]
        self.layer_s = [o.layer_s for o in chosen]
        self.fill = [o.fill for o in chosen]
        self.tail1 = [o.tail1 for o in chosen]
        self.p = sum(self.stages)
        self.fill0 = sum(k * f for k, f in zip(self.stages, self.fill))  # a layer a stage
        self.by_fill = sorted(range(len(chosen)), key=self.fill.__getitem__)
        self.inv_tail = sum(k / t for k, t in zip(self.stages, self.tail1) if t > 0)
        self.tail_max = max(self.tail1)

    def may_hold(self, caps: list[int], L: int, weight: float, bound: float, ends: _Ends) -> bool:
        """`_may_hold`'s two tests with each block's stages within caps[j] layers and the
        list's end terms and sends `ends`."""
        for _ in range(2):
            rest = self.rest(caps, L)
            if rest is None:
                return False
            # (rest rounded down: summed in another order)
            most = (bound / _ROUND - (rest + ends.fill_end) * _ROUND) / weight
            if not math.isfinite(most):
                return True
            if ends.floor >= most:
                return False
            each = self.holding(most, caps)
            if self.held(most, caps, ends.e_first, ends.e_last, each) < L:
                return False
            caps = each  # (the second pass: each block's cap cut to the layers it holds at `most`)
        return True

    def holding(self, bottleneck: float, caps: Sequence[int]) -> list[int]:
        """Per block, the layers a stage of it holds with its time within `bottleneck`."""
        return [max(0, min(c, math.floor(bottleneck / a + 1e-9))) for c, a in zip(caps, self.layer_s)]

    def rest(self, caps: Sequence[int], L: int) -> float | None:
        """A lower bound on the fill's per-layer part and the tail of every split with each
        stage of block j within caps[j] layers (None: no such split holds L layers): the
        cheapest fill (a layer a stage, the L - p beyond on the cheapest blocks first), and the
        least X at which the stages hold L layers with each tail1 * l <= X (l continuous, the
        tail's end terms 0)."""
        stages = self.stages
        if min(caps) < 1 or sum(k * c for k, c in zip(stages, caps)) < L:
            return None
        rest, extra = self.fill0, L - self.p
        for j in self.by_fill:
            if extra <= 0:
                break
            take = min(extra, stages[j] * (caps[j] - 1))
            rest, extra = rest + take * self.fill[j], extra - take
        # the tail: blocks in the order they reach their cap as X grows, the rest at X / tail1
        tail1 = self.tail1
        capped, per_x, tail = 0.0, self.inv_tail, 0.0
        for j in sorted(range(len(stages)), key=lambda j: tail1[j] * caps[j]):
            tail = tail1[j] * caps[j]
            if per_x > 0 and (L - capped) / per_x <= tail:
                tail = (L - capped) / per_x
                break
            capped += stages[j] * caps[j]
            per_x -= stages[j] / tail1[j] if tail1[j] > 0 else 0.0
        return rest + max(tail, self.tail_max)

    def held(self, bottleneck: float, caps: Sequence[int], e_first: float = 0.0, e_last: float = 0.0,
             each: Sequence[int] | None = None) -> int:
        """The most layers the blocks hold with every stage within `bottleneck`, the first
        stage's time e_first more and the last's e_last more (`_Ends`); `each`: per block,
        `holding`'s at `bottleneck`, where the caller has it."""
        each = self.holding(bottleneck, caps) if each is None else each
        held = sum(k * h for k, h in zip(self.stages, each))
        for e, j in ((e_first, 0), (e_last, len(caps) - 1)):
            if e:  # (that stage alone)
                held += max(0, min(caps[j], math.floor((bottleneck - e) / self.layer_s[j] + 1e-9))) - each[j]
        return held


class TopK:
    """The k fastest plans offered, and `bound`, the time a plan must beat to enter: the k-th
    fastest's, and at most `cutoff` (a time to beat from elsewhere: plans no faster are not
    kept, so a search with one only shows that none beats it)."""

    def __init__(self, k: int, cutoff: float = math.inf) -> None:
        self.k, self.heap, self.counter, self.cutoff = k, [], itertools.count(), cutoff

    @property
    def bound(self) -> float:
        return min(-self.heap[0][0] if len(self.heap) >= self.k else math.inf, self.cutoff)

    def push(self, cand: Candidate) -> None:
        if cand.time_s >= self.cutoff:
            return
        key = (cand.micro_batch, cand.options)
        if any(c.micro_batch == key[0] and c.options == key[1] for _, _, c in self.heap):
            return  # an incumbent pass already found this stage list
        item = (-cand.time_s, -next(self.counter), cand)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif cand.time_s < self.bound:
            heapq.heapreplace(self.heap, item)

    def sorted(self) -> list[Candidate]:
        return [c for _, _, c in sorted(self.heap, key=lambda x: (-x[0], -x[1]))]


class OutOfTime(Exception):
    pass



class ListSums(NamedTuple):
    """Sums over a stage list's stages, all `sums_bound` needs (`list_sums`; the local search
    adds a move's stages to the rest of a list's without building the list)."""

    speed: float  # of Option.speed: layers per second at balance
    fill: float  # of Option.fill: one layer a stage in the fill
    stages: int
    cheapest: float  # the least Option.fill of a stage
    inv_tail: float  # of `per_tail`
    tail_max: float  # the largest Option.tail1

    def plus(self, o: "Option | NewShapes", k) -> "ListSums":
        """These sums with k more stages of `o`'s shape (elementwise for an array k, and for
        `NewShapes`' columns)."""
        return ListSums(self.speed + k / o.layer_s, self.fill + k * o.fill, self.stages + k,
                        np.minimum(self.cheapest, o.fill), self.inv_tail + per_tail(o, k),
                        np.maximum(self.tail_max, o.tail1))


class NewShapes(NamedTuple):
    """A new block's shape per column (of the local search's moves: several shapes of one
    chip, each at several numbers of stages), what `ListSums.plus` and `Beside.cannot_beat`
    read of an Option, as arrays."""

    layer_s: np.ndarray
    fill: np.ndarray
    cap1: np.ndarray
    tail1: np.ndarray

    @classmethod
    def of(cls, shapes: Sequence[Option]) -> "NewShapes":
        """One column per shape."""
        return cls(*(np.array(x, dtype=float) for x in zip(*((o.layer_s, o.fill, o.cap1, o.tail1) for o in shapes))))

    def take(self, which: np.ndarray) -> "NewShapes":
        """Columns `which` (indices into these)."""
        return NewShapes(*(a[which] for a in self))


def list_sums(chosen: Sequence[Option]) -> ListSums:
    """The sums of a stage list (of none: zeros, the cheapest fill inf)."""
    return ListSums(sum(o.speed for o in chosen), sum(o.stages * o.fill for o in chosen),
                    sum(o.stages for o in chosen), min((o.fill for o in chosen), default=math.inf),
                    sum(per_tail(o, o.stages) for o in chosen), max((o.tail1 for o in chosen), default=0.0))


def sums_bound(weight: float, L: int, sums: ListSums) -> float:
    """The cheapest bound on a stage list's time, from sums over its stages: the bottleneck
    is at least the continuous balance L / speed, weighted as the steady state; every stage
    runs a layer in the fill, and the L - p layers beyond those at least at the cheapest
    stage's fill; the tail is at least `_tail_floor`. (Caps, sends and end terms left out:
    `list_may_beat` weighs them, dearer, for the lists this leaves.) Elementwise for sums of
    arrays (the local search's one move at every number of stages)."""
    return (weight * L / sums.speed + sums.fill + np.maximum(L - sums.stages, 0) * sums.cheapest
            + tail_bound(L, sums.inv_tail, sums.tail_max))


class Beside:
    """The blocks beside a new block of the local search's moves (the rest of a stage list),
    made once for every shape and number of stages the new block may take: their sums
    (`ListSums`) and, per block, its stages, `Option.cap1`, per-layer time and fill, all
    `cannot_beat` weighs."""

    def __init__(self, blocks: Sequence[Option]) -> None:
        self.sums = list_sums(blocks)
        self.stages = _column([o.stages for o in blocks])
        self.cap1 = _column([o.cap1 for o in blocks])
        self.layer_s = _column([o.layer_s for o in blocks])
        self.fill = np.array([o.fill for o in blocks], dtype=float)

    def cannot_beat(self, weight: float, L: int, new: "Option | NewShapes", ks: np.ndarray, bound: float
                    ) -> np.ndarray:
        """Per number of stages k in `ks`, whether no list of these blocks and k stages of
        `new`'s shape (its column's, of `NewShapes`), in any order, can beat `bound`: where
        `sums_bound` reaches it, or where `_may_hold`'s first test (both its passes) would
        reject every such list with each stage's cap taken as its shape's `cap1` (the most
        layers it holds with one micro-batch in flight, at least its block's largest cap in
        any list: a stage holds at least one micro-batch in flight), the sends and end terms as
        0 and the tail at its floor (`tail_bound`: no larger than `_Blocks.rest`'s within any
        caps). Larger caps and a cheaper tail leave a fill and rest no dearer, a bottleneck no
        smaller and no fewer layers held at it, in both passes, so a list this rejects
        `_may_hold` rejects too, and `list_may_beat` after it. (With the first pass alone, on
        2,432 chips 2,035 of the local search's new-block lists passed here and failed
        `_may_hold`'s first test; the second pass leaves out 1,755 of them.)"""
        sums = self.sums.plus(new, ks)
        out = sums_bound(weight, L, sums) >= bound
        if weight <= 0 or not math.isfinite(bound) or out.all():
            return out
        live = ~out

        def alive(x):  # per k left (a scalar stays one)
            return x[live] if np.ndim(x) else x

        k, p = ks[live].astype(float), sums.stages[live]
        most_per_stage = L - p + 1.0
        caps, cap_new = np.minimum(self.cap1, most_per_stage), np.minimum(alive(new.cap1), most_per_stage)
        layer_new = alive(new.layer_s)
        fill = np.vstack([np.broadcast_to(self.fill[:, None], (len(self.fill), len(k))),
                          np.broadcast_to(alive(new.fill), k.shape)])
        tail = tail_bound(L, alive(sums.inv_tail), alive(sums.tail_max))
        rejected = np.zeros(len(k), dtype=bool)
        for _ in range(2):
            # `_Blocks.rest` with the tail at its floor: a layer a stage in the fill, the L - p
            # layers beyond those on the cheapest blocks first, within the caps
            room = np.vstack([self.stages * (caps - 1.0), k * (cap_new - 1.0)]).clip(min=0.0)
            rest = tail + sums.fill[live] + _cheapest_extra(fill, room, L - p)
            most = (bound / _ROUND - rest * _ROUND) / weight
            # the layers a stage of each block holds at that bottleneck
            each = np.minimum(caps, np.floor(most / self.layer_s + 1e-9)).clip(min=0.0)
            each_new = np.minimum(cap_new, np.floor(most / layer_new + 1e-9)).clip(min=0.0)
            held = (self.stages * each).sum(axis=0) + k * each_new
            no_split = (np.minimum(caps.min(axis=0, initial=np.inf), cap_new) < 1) | (  # (`_Blocks.rest`'s None)
                (self.stages * caps).sum(axis=0) + k * cap_new < L)
            rejected |= no_split | (np.isfinite(most) & (held < L))
            caps, cap_new = each, each_new  # (the second pass: each block's cap cut to those)
        out[live] = rejected
        return out


def _column(values: Sequence[float]) -> np.ndarray:
    """(n, 1) floats: one row a block, against a row of numbers of stages."""
    return np.array(values, dtype=float).reshape(-1, 1)


def solve(ctx: Context, b: int, chosen: Sequence[Option], top: "TopK", stats: SearchStats) -> bool:
    """Solve one stage list's layer split exactly and offer it; True if it entered the top k."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    sums = list_sums(chosen)
    if sums.stages > L or ctx.sched.unsupported(sums.stages, m, ctx.v) is not None:
        return False
    weight = ctx.sched.closed_form.steady_weight(m, ctx.v)
    if sums_bound(weight, L, sums) >= top.bound:
        return False
    if not list_may_beat(ctx, b, chosen, top.bound):
        return False
    leaf = _leaf(ctx, b, chosen, stage_list_sends(ctx, b, chosen))
    if leaf is None:
        return False
    stats.configs_visited += 1
    found = best_split(leaf, L, top.bound, stats)
    if found is None:
        return False
    before = top.bound
    top.push(Candidate(found[0], b, tuple(chosen), tuple(int(x) for x in found[1]), ctx.schedule, ctx.v))
    return top.bound < before or len(top.heap) < top.k

