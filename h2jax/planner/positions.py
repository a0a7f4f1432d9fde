"""Lower bounds over pipeline positions: a Lagrangian DP that prices the layer count.

Under 1F1B a plan's iteration time is

    (m - 1) * steady + tail + fill

(cost_model.py): `steady` the largest per-micro-batch stage time or send, `tail` the largest
dp-reduce + optimizer time, `fill` the sum of the stage times and twice the links. Fix two
thresholds, steady <= V and tail <= tau. Every stage then holds at most

    u_s(j) = min(memory cap at position j, floor((V - o_s) / a_s), floor((tau - te_s) / tl_s))

layers (a_s: per-layer time, o_s / te_s: its end-stage time / tail terms, position j counted
from the end: 1F1B keeps min(j, m) micro-batches in flight there), and every plan that meets
both thresholds costs at least (m - 1) * V_lo + tau_lo + minfill(V, tau) for any V_lo <= its
steady, tau_lo <= its tail. `minfill` couples the stages only through the layer count
sum l_i = L; pricing it at lambda per layer (Lagrangian relaxation),

    minfill(V, tau) >= lambda * L + min over stage lists of sum_i w_i(lambda),
    w_i(lambda) = c_i + min over 1 <= l <= u_i of (a_i - lambda) * l,

with c_i the stage's end-stage time and its own share of its send (each send costs at least
the sender's bytes over its fastest links: `send_rates`). Any lambda gives a valid bound. The
stage lists are the search space's (each chip type nothing or one block of k <= K_s
consecutive stages of one shape s, the blocks in any order) and the min over them is a DP
from the end of the pipeline, its state the set S of types behind (a bit mask) and the
number q of stages they fill:

    F(S + t, q') = min over s, k of F(S, q' - k) + W_s(q') - W_s(q' - k)     (t not in S)

with W_s the prefix sums of w over positions: a sliding-window minimum over q, vectorised
over shapes, lambdas and the sets of one size. The first and last stages (embedding, head)
take their own terms. Over every order the DP has 2^T sets and T * 2^(T-1) transitions
(T types: 32 for 4) where one fixed order had T.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Sequence

import numpy as np

from h2jax.planner import cost_model as cm
from h2jax.planner.memory_model import StageMemoryTerms

MID, FIRST, LAST, ONLY = 0, 1, 2, 3
ROLE_FLAGS = ((False, False), (True, False), (False, True), (True, True))  # (first, last)
_EPS = 1e-9  # the time caps' rounding slack (a time computed as a*l + o keeps its l); memory caps are the fit test's


@dataclasses.dataclass(frozen=True)
class TypeTable:
    """One chip type's stage shapes at one micro-batch size, as arrays over shapes."""

    options: list  # search.Option per shape, `stages` = its most stages K_s
    a: np.ndarray  # (S,) a layer's share of the fill (the schedule's fill coefficients, least over roles)
    tail_layer: np.ndarray  # (S,) dp-reduce + optimizer seconds per layer
    own_send: np.ndarray  # (S,) seconds: every send it makes takes at least this (its own end)
    send_bytes: np.ndarray  # (S,) bytes of one micro-batch's activation it sends
    link_s_per_byte: np.ndarray  # (S,) the most seconds per byte of its end of any send (send_rates)
    k_max: np.ndarray  # (S,) most stages (chips // stage size, at most L)
    end_time: np.ndarray  # (4, S) per role: end-stage seconds of the fill
    end_tail: np.ndarray  # (4, S) per role: tail seconds that do not scale with layers
    memcap: np.ndarray  # (4, S, L) per role and position j = 1..L: most layers in memory (clip_caps)
    # the steady state's components (the schedule's closed form: 1F1B forward + backward; GPipe
    # forward, backward), each at most its threshold: per-layer seconds (K, S) and end-stage
    # seconds (K, 4, S)
    steady_a: np.ndarray
    steady_end: np.ndarray
    # (L+1,) bool: whether the table's lists may have p stages (the schedule runs p stages at
    # this micro-batch size, and p is in the table's lengths; index 0 False): a list's front
    # block ends only at such a p
    ends: np.ndarray

    @property
    def size(self) -> int:
        return len(self.options)


def type_tables(ctx, b: int, lengths: tuple[int, int] | None = None) -> list[TypeTable]:
    """Per chip type (pipeline order), its shapes' arrays at micro-batch b, over the stage
    lists of `lengths` (p_lo, p_hi) stages (None: every length; `position_holds`). Each made
    once per type and chip count (`Context.per_type`)."""
    shapes = ctx.type_shapes(b, prune_unfit=True)
    out = []
    for name, opts in zip(ctx.order, shapes):
        table, mem = ctx.per_type("table", name, b, lambda: _type_table(ctx, b, opts))
        if lengths is not None:  # the same shapes and times, the range's memory caps and ends
            table = ctx.per_type(f"table{lengths}", name, b, lambda: _over_lengths(ctx, b, table, mem, lengths))
        out.append(table)
    return out


def run_lengths(ctx, m: int) -> np.ndarray:
    """(L+1,) bool: whether the schedule runs a pipeline of p stages at m micro-batches (index
    0 False; interleaved 1F1B: p divides m)."""
    return np.array([p > 0 and ctx.sched.unsupported(p, m, ctx.v) is None for p in range(ctx.model.n_layers + 1)])


def position_holds(ctx, m: int, lengths: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a stage at position j = 1..L from the end holds at least, over the pipelines of p
    stages the schedule runs with p in `lengths` (p_lo, p_hi; None: every length): (in-flight
    activations (L,), deferred-W gradients (L,), whether the schedule runs p stages (L+1,)).

    Without lengths: the schedule's `position_in_flight` (1F1B min(j, m), GPipe m), no
    deferred gradients. With them, the least of each over those p (ZB-H1's min(p, m) and
    interleaved 1F1B's grow with p: the search splits its lists by length, `length_ranges`,
    and each range's caps are then far tighter than the least over every length)."""
    L, sched, v = ctx.model.n_layers, ctx.sched, ctx.v
    ends = run_lengths(ctx, m)
    if lengths is None:
        return np.array([sched.position_in_flight(j, m, v) for j in range(1, L + 1)]), np.zeros(L), ends
    lo, hi = lengths
    ends[:lo] = False
    ends[hi + 1:] = False
    in_flight, deferred = np.full(L, np.inf), np.full(L, np.inf)
    for p in np.flatnonzero(ends).tolist():
        for j in range(1, p + 1):
            in_flight[j - 1] = min(in_flight[j - 1], sched.memory_in_flight(p - j, p, m, v))
            deferred[j - 1] = min(deferred[j - 1], sched.deferred(p - j, p, m, v))
    unreached = ~np.isfinite(in_flight)  # beyond the longest p: no stage (memcap 0, below)
    in_flight[unreached], deferred[unreached] = 1.0, 0.0
    return in_flight, deferred, ends


def _type_table(ctx, b: int, shapes) -> tuple[TypeTable, StageMemoryTerms | None]:
    """One chip type's table (`type_tables`) of its shapes at micro-batch b, over every length,
    and its shapes' memory terms stacked (per shape, per role: `_over_lengths` takes them)."""
    L = ctx.model.n_layers
    form = ctx.sched.closed_form
    scale = form.fill_scale(ctx.v)
    # by most stages: shapes of one k_max are then one slice for the DP's window minima
    shapes = sorted(shapes, key=lambda o: min(o.stages, L))
    S = len(shapes)
    tl, own, kmax, nb, rho = (np.zeros(S) for _ in range(5))
    end_tail = np.zeros((4, S))
    end_s = np.zeros((4, S, 3))  # per role and shape: (f, b, w) end seconds
    layer = np.zeros((S, 3))  # per shape: (f, b, w) seconds per layer (a middle stage's)
    mems = []  # per shape, per role
    for i, o in enumerate(shapes):
        chip = ctx.chips[o.chip]
        for role, (first, last) in enumerate(ROLE_FLAGS):
            t = ctx.terms(b, o, first, last, 1)
            end_s[role, i] = t.fwd_end, t.bwd_end, t.bwd_weight_end
            end_tail[role, i] = t.tail_end
            mems.append(t.mem)
            if role == MID:
                layer[i] = t.fwd_layer, t.bwd_layer, t.bwd_weight_layer
                tl[i] = t.tail_layer
        nbytes = b * ctx.seq_len * ctx.model.d_model * cm.dtype_bytes(chip.precision.compute_dtype)
        fast, slow = send_rates(cm.calibrated(chip, ctx.profile), o.data * o.tensor)
        nb[i], rho[i], own[i] = nbytes, slow, nbytes * fast
        kmax[i] = min(o.stages, L)
    # the closed form's coefficients of (f, b, w), taken term by term (the same sums for every shape)
    def times(x: np.ndarray, c) -> np.ndarray:
        return x[..., 0] * c[0] + x[..., 1] * c[1] + x[..., 2] * c[2]

    last_role = np.array([last for _, last in ROLE_FLAGS])[:, None]
    end_time = scale * np.where(last_role, times(end_s, form.fill_last), times(end_s, form.fill))
    steady_end = np.stack([times(end_s, k) for k in form.steady])
    a = scale * np.minimum(times(layer, form.fill), times(layer, form.fill_last))
    steady_a = np.stack([times(layer, k) for k in form.steady])
    mem = StageMemoryTerms.stacked(mems) if mems else None
    memcap, ends = _memory_caps(ctx, b, mem, S, None)
    return TypeTable(
        list(shapes), a, tl, own, nb, rho, kmax.astype(np.int64), end_time, end_tail, memcap,
        steady_a, steady_end, ends,
    ), mem


def _over_lengths(ctx, b: int, table: TypeTable, mem: StageMemoryTerms | None,
                  lengths: tuple[int, int]) -> TypeTable:
    """A table over every length (`_type_table`'s, with its stacked memory terms) for the
    lists of `lengths` stages: only its memory caps and ends differ."""
    memcap, ends = _memory_caps(ctx, b, mem, table.size, lengths)
    return dataclasses.replace(table, memcap=memcap, ends=ends)


def _memory_caps(ctx, b: int, mem: StageMemoryTerms | None, S: int,
                 lengths: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(memcap (4, S, L), ends) of a table's shapes (their memory terms stacked, per shape
    per role; None: no shape) over the lists of `lengths` stages (`position_holds`)."""
    L = ctx.model.n_layers
    key = ("holds", b, lengths)  # (the same for every type)
    if key not in ctx._caps:
        ctx._caps[key] = position_holds(ctx, ctx.global_batch // b, lengths)
    in_flight, deferred, ends = ctx._caps[key]
    # the fit test's caps at each position's least in-flight and deferred counts
    memcap = np.zeros((4, S, L), dtype=cap_dtype(L))
    if mem is not None:
        caps = mem.max_layers(in_flight[None, :], deferred=deferred[None, :])
        memcap = np.ascontiguousarray(clip_caps(caps, L).reshape(S, 4, L).transpose(1, 0, 2))
    # a list's front block ends only at a pipeline length the schedule runs (`ends`; interleaved
    # 1F1B: p divides m, so p <= m) and positions beyond the longest hold no stage: the bounds
    # and walks then leave out the lists the leaves would refuse
    memcap[..., int(np.flatnonzero(ends)[-1]) if ends.any() else 0:] = 0
    return memcap, ends


def cap_dtype(L: int) -> type:
    """The smallest integer type that holds every layer cap, -1 .. L (caps below 1 all mean
    "no stage here"): the caps' arrays are the DP's largest, and 16-bit ones move a quarter
    of the bytes of 64-bit ones."""
    return np.int16 if L < 2**15 else np.int64


def clip_caps(caps: np.ndarray, L: int) -> np.ndarray:
    """Layer caps (float or int; NaN: no stage) clipped to -1 .. L, as cap_dtype(L)."""
    caps = np.asarray(caps, dtype=float)
    return np.clip(np.where(np.isnan(caps), -1.0, caps), -1, L).astype(cap_dtype(L))


def send_rates(chip, chips: int) -> tuple[float, float]:
    """(least, most) seconds per byte of a stage's own end of a send (cost_model.send_terms:
    bytes / (chips * GB/s), at intra-node bandwidth when the neighbour shares the node, else
    the stage's share of its node's NICs): whatever the neighbour, a send takes at least the
    least (the Lagrangian's send term) and no end takes more than the most (the root box)."""
    rates = [chip.inter_node_share_gbps(chips)]
    if cm.same_node(chip, chips, chip, 1):  # a one-chip stage of the same type could share the node
        rates.append(chip.intra_node_gbps)
    return 1.0 / (chips * max(rates) * 1e9), 1.0 / (chips * min(rates) * 1e9)


def stage_caps(table: TypeTable, V: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """(R, 4, S, L) most layers per row, role, shape and position with each steady component
    k at most V[r, k] (V: (R, K)) and the tail at most tau[r] (< 1: the stage cannot be there)."""
    V = np.asarray(V, dtype=float).reshape(len(tau), -1)
    tau = np.asarray(tau, dtype=float)[:, None, None]
    uv = np.floor((V.T[:, :, None, None] - table.steady_end[:, None]) / table.steady_a[:, None, None, :] + _EPS)
    ut = np.floor((tau - table.end_tail[None]) / table.tail_layer + _EPS)
    L = table.memcap.shape[-1]
    u = np.minimum(table.memcap[None], clip_caps(np.minimum(uv.min(axis=0), ut), L)[..., None])
    # a send counts in every steady component: it cannot outpace the sender's own links
    sends = _SENDS[None, :, None] & (table.own_send[None, None, :] > V.min(axis=1)[:, None, None])
    u[np.broadcast_to(sends, u.shape[:3])] = 0
    return u


_SENDS = np.array([True, True, False, False])  # roles that send to a next stage


def live_tables(tables: Sequence[TypeTable], V: np.ndarray, tau: np.ndarray) -> list[tuple[TypeTable, np.ndarray]]:
    """Per chip type, the shapes that can hold a stage somewhere in some row, with their caps."""
    return _live_groups([(tables, V, tau)])


def _live_groups(groups: Sequence[tuple[Sequence[TypeTable], np.ndarray, np.ndarray]]) -> list[tuple[TypeTable, np.ndarray]]:
    """`live_tables` of the rows of several groups (tables, V, tau) in turn, the groups'
    tables of the same shapes (a micro-batch size's ranges of lengths: only their memory caps
    and ends differ): per type, the first group's table (the caps u hold every group's)."""
    out = []
    rows = sum(len(tau) for _, _, tau in groups)
    for i, t in enumerate(groups[0][0]):
        if not t.size:
            out.append((t, np.zeros((rows, 4, 0, t.memcap.shape[-1]))))
            continue
        parts = [stage_caps(tables[i], V, tau) for tables, V, tau in groups]
        u = parts[0] if len(parts) == 1 else np.concatenate(parts)
        alive = (u >= 1).any(axis=(0, 1, 3))
        if alive.all():
            out.append((t, u))
            continue
        keep = np.nonzero(alive)[0]
        out.append((_subset(t, keep), u[:, :, keep]))
    return out


def _subset(t: TypeTable, keep: np.ndarray) -> TypeTable:
    """The table of the shapes `keep` (indices, ascending: the order by k_max stays)."""
    return TypeTable(
        [t.options[i] for i in keep], t.a[keep], t.tail_layer[keep], t.own_send[keep], t.send_bytes[keep],
        t.link_s_per_byte[keep], t.k_max[keep], t.end_time[:, keep], t.end_tail[:, keep], t.memcap[:, keep],
        t.steady_a[:, keep], t.steady_end[:, :, keep], t.ends,
    )


def _stage_constants(table: TypeTable) -> np.ndarray:
    """(4, S) per role, a stage's Lagrangian terms that do not scale with its layers: its
    end-stage fill and, where it sends, its own share of the send both ways and the latency."""
    const = table.end_time.copy()
    const[MID] += 2.0 * (table.own_send + cm.LINK_LATENCY_S)
    const[FIRST] += 2.0 * (table.own_send + cm.LINK_LATENCY_S)
    return const


def undominated(live: Sequence[tuple[TypeTable, np.ndarray]]) -> list[tuple[TypeTable, np.ndarray]]:
    """`live` (per type: its table and caps u (B, 4, S, L)) without the shapes another shape of
    the type dominates in every row: as many stages or more (k_max), a per-layer fill term and
    stage constants no larger, and caps no smaller at every role and position (any cap below
    1, no stage there, counted as 0). Then its w is no larger wherever the dominated shape's
    is finite, for every lambda (w = c + a - lambda + min(a - lambda, 0) * (u - 1)) and as a
    capacity row (w = -u), so every block of the dominated shape costs at least the same
    block of its dominator: the DP's minimum, over fewer shapes, is the same. Of shapes equal
    in all of it, the first is kept."""
    out = []
    for t, u in live:
        S = t.size
        if S < 2:
            out.append((t, u))
            continue
        const = _stage_constants(t)
        # may[i, j]: shape i may dominate shape j (the cheap terms first, then the caps)
        may = (t.k_max[:, None] >= t.k_max[None, :]) & (t.a[:, None] <= t.a[None, :])
        may &= (const[:, :, None] <= const[:, None, :]).all(axis=0)
        np.fill_diagonal(may, False)
        i, j = np.nonzero(may)
        if len(i) == 0:
            out.append((t, u))
            continue
        # caps below 1 all mean "no stage here" (weights): compared as 0 (caps: clip_caps's type)
        U = np.maximum(np.moveaxis(u, 2, 0).reshape(S, -1), 0)
        dom = np.zeros((S, S), dtype=bool)
        dom[i, j] = (U[i] >= U[j]).all(axis=1)
        # j goes if a shape dominates it strictly, or equals it and comes first
        gone = (dom & ~(dom.T & (np.arange(S)[:, None] > np.arange(S)[None, :]))).any(axis=0)
        if not gone.any():
            out.append((t, u))
            continue
        keep = np.nonzero(~gone)[0]
        out.append((_subset(t, keep), u[:, :, keep]))
    return out


def _window_min(H: np.ndarray, k_max: np.ndarray) -> np.ndarray:
    """M[..., s, i] = min of H[..., s, q] over q in [max(0, i + 1 - k_max[s]), i], i = 0..n-1
    (the windows of the DP: q' = i + 1 stages, the block's k <= k_max[s] stages in front of q).

    A window of length k is covered by two blocks of length 2**floor(log2 k), one starting at
    its start and one ending at its end (minima over 2**v-blocks by doubling, each level built
    only for the shapes whose windows need it: the shapes come sorted by k_max); a window cut
    at 0 (i < k - 1) is a prefix minimum, covered the same way by the block at 0 and one
    ending at i. The steps depend only on k_max and n: planned once (`_window_plan`)."""
    n = H.shape[-1]
    plan = _window_plan(np.asarray(k_max, dtype=np.int64).tobytes(), n)
    if plan.order is not None:
        return _window_min(H[..., plan.order, :], np.asarray(k_max)[plan.order])[..., plan.inverse, :]
    out = np.empty_like(H)
    if plan.n_short < H.shape[-2]:  # windows that span the row: prefix minima
        out[..., plan.n_short:, :] = np.minimum.accumulate(H[..., plan.n_short:, :], axis=-1)
    level = H[..., : plan.n_short, :]  # level v: minima over 2**v positions, of the shapes with k >= 2**v
    for op, a, b, c, d, e, f in plan.steps:
        if op == _NEXT_LEVEL:  # a: the shapes kept (from the current level's first), b: 2**v
            rows = level[..., a:, :]
            level = np.minimum(rows[..., : rows.shape[-1] - b], rows[..., b:])
        elif op == _PREFIX:  # shapes a:b (c:d of the level), prefix minima at positions e-1 .. f-2
            m = f - e
            out[..., a:b, e - 1: f - 1] = np.minimum(level[..., c:d, :1], level[..., c:d, :m])
        else:  # _WINDOWS: shapes a:b (c:d of the level) of window e, blocks of f
            P = level[..., c:d, :]
            out[..., a:b, e - 1:] = np.minimum(P[..., : n - e + 1], P[..., e - f: n - f + 1])
    return out


_NEXT_LEVEL, _PREFIX, _WINDOWS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _WindowPlan:
    """`_window_min`'s steps for one k_max and row length n: `order` / `inverse` where k_max is
    not sorted (the steps are those of the sorted k_max), else the shapes [n_short, ..) whose
    windows span the row, and per step (op, a, b, c, d, e, f) as `_window_min` reads them."""

    order: np.ndarray | None
    inverse: np.ndarray | None
    n_short: int
    steps: tuple[tuple[int, int, int, int, int, int, int], ...]


@functools.lru_cache(maxsize=4096)
def _window_plan(k_bytes: bytes, n: int) -> _WindowPlan:
    k = [min(x, n) for x in np.frombuffer(k_bytes, dtype=np.int64).tolist()]
    if any(a > b for a, b in zip(k, k[1:])):
        order = np.argsort(k, kind="stable")
        return _WindowPlan(order, np.argsort(order), 0, ())
    n_short = bisect.bisect_left(k, n)  # shapes [0, n_short) have windows shorter than a row
    steps, first, v = [], 0, 0  # the level's first shape, its v
    top = (k[n_short - 1].bit_length() - 1) if n_short else -1
    while v <= top:
        span = 1 << v
        # prefix minima at positions span-1 .. 2*span-2 (i + 1 in [span, 2 * span)): min of the
        # block at 0 and the one ending at i; the shapes that still need them: k - 2 >= span - 1
        lo, hi = bisect.bisect_left(k, span + 1), n_short
        end = min(2 * span, max(k[lo:hi], default=0))  # positions i <= k - 2 of the largest k
        if lo < hi and end > span:
            steps.append((_PREFIX, lo, hi, lo - first, hi - first, span, end))
        # the windows of the shapes whose 2**floor(log2 k) is this level's span
        lo, hi = bisect.bisect_left(k, span), bisect.bisect_left(k, 2 * span, hi=n_short)
        for kk in sorted(set(k[lo:hi])):
            a, b = bisect.bisect_left(k, kk), bisect.bisect_right(k, kk)
            steps.append((_WINDOWS, a, b, a - first, b - first, kk, span))
        if v < top:  # the next level, for the shapes whose k needs it
            start = bisect.bisect_left(k, 2 * span)
            steps.append((_NEXT_LEVEL, start - first, span, 0, 0, 0, 0))
            first = start
        v += 1
    return _WindowPlan(None, None, n_short, tuple(steps))


@dataclasses.dataclass
class Weights:
    """Per chip type, the Lagrangian stage terms w per row (thresholds and lambda)."""

    Wm: np.ndarray  # (R, S, L+1): sum of w over mid positions 1..j (infeasible ones as 0)
    first: np.ndarray  # (R, S, L+1): w of a first stage at position j (index 0 unused)
    last1: np.ndarray  # (R, S): w of the last stage (position 1)
    only1: np.ndarray  # (R, S): w of a one-stage pipeline
    mid_ok: np.ndarray  # (R, S, L+1): positions 2..j all hold a mid stage of the shape


def weights(
    table: TypeTable, u: np.ndarray, lams: np.ndarray, rows: np.ndarray | None = None,
    capacity: np.ndarray | bool = False, sums: MidSums | None = None,
) -> Weights:
    """w per row r from the caps u (B, 4, S, L) of its box rows[r] (default: row r) and lams[r];
    capacity rows (`capacity[r]`) take w = -u instead: the DP then gives minus the most layers
    any stage list holds.

    w = c + (a - lambda) * (u if lambda > a else 1) = base + coef * (u - 1) with per-row base
    and coef, so the prefix sums over positions are base * (#feasible) + coef * sum(u - 1), the
    two sums taken once per box (`sums`: already taken, by `mid_sums`)."""
    B, _, S, L = u.shape
    rows = np.arange(B) if rows is None else rows
    R = len(rows)
    cap_rows = np.broadcast_to(np.asarray(capacity, dtype=bool), (R,))
    const = _stage_constants(table)
    slope = table.a[None, :] - np.asarray(lams, dtype=float)[:, None]  # (R, S)
    slope[cap_rows] = -1.0
    coef = np.where(slope < 0, slope, 0.0)  # lambda above the per-layer time: every layer allowed
    cr = cap_rows[:, None]

    def base(role: int) -> np.ndarray:  # (R, S)
        return np.where(cr, 0.0, const[role][None, :]) + slope

    sums = mid_sums(u) if sums is None else sums
    Wm = base(MID)[:, :, None] * sums.n_ok[rows] + coef[:, :, None] * sums.extra[rows]
    uf = u[:, FIRST]
    first = np.full((R, S, L + 1), np.inf)
    first[..., 1:] = np.where((uf >= 1)[rows], base(FIRST)[:, :, None] + coef[:, :, None] * (uf - 1.0)[rows], np.inf)
    end = u[:, :, :, 0][rows]  # (R, 4, S): position 1

    def at_one(role: int) -> np.ndarray:
        return np.where(end[:, role] >= 1, base(role) + coef * (end[:, role] - 1.0), np.inf)

    return Weights(Wm, first, at_one(LAST), at_one(ONLY), sums.mid_ok[rows])


@dataclasses.dataclass
class MidSums:
    """Per box, shape and middle position j = 0..L, what `weights` needs of the caps u that
    does not depend on lambda: prefix sums over positions 1..j of the positions that hold a
    stage and of their layers beyond one, and whether positions 2..j all hold one."""

    n_ok: np.ndarray  # (B, S, L+1)
    extra: np.ndarray  # (B, S, L+1)
    mid_ok: np.ndarray  # (B, S, L+1)


def mid_sums(u: np.ndarray) -> MidSums:
    """MidSums of the caps u (B, 4, S, L)."""
    B, _, S, L = u.shape
    ok = u[:, MID] >= 1  # (B, S, L)
    n_ok = np.zeros((B, S, L + 1))
    np.cumsum(ok, axis=-1, out=n_ok[..., 1:])
    extra = np.zeros((B, S, L + 1))
    np.cumsum(np.where(ok, u[:, MID] - 1.0, 0.0), axis=-1, out=extra[..., 1:])
    mid_ok = np.ones((B, S, L + 1), dtype=bool)
    mid_ok[..., 2:] = np.logical_and.accumulate(ok[..., 1:], axis=-1)
    return MidSums(n_ok, extra, mid_ok)


def _bits(mask: int) -> list[int]:
    return [t for t in range(mask.bit_length()) if mask >> t & 1]


def back_dp(tables: Sequence[TypeTable], ws: Sequence[Weights], L: int, R: int,
            ends: np.ndarray | None = None) -> np.ndarray:
    """min over stage lists of sum_i w_i, per row (inf: none feasible): blocks from the end of
    the pipeline, each chip type in at most one block and the types in any order. F[S][q] is
    the least cost of blocks of exactly the types of S (a bit mask over `tables`) filling the
    last q stages; a block of type t extends F[S] (t not in S) to F[S | t]. Per level |S|
    and type t, the masks of that level are one batched window minimum. `ends` (R, L+1):
    per row, the lengths a list may have (default: the tables', `TypeTable.ends`)."""
    live = [t for t, table in enumerate(tables) if table.size]
    ans = np.full(R, np.inf)
    if not live:
        return ans
    # (a front block ends the list: only at a length p the schedule runs, the same for every type)
    ends = tables[live[0]].ends[None] if ends is None else ends  # (R or 1, L+1)
    # per type, the block's own terms where its positions hold a middle stage (else inf): as
    # the front block (first stage at q' + 1) and as a block with more in front of it
    as_front = {t: np.where(ws[t].mid_ok[..., 1:L] & ends[:, None, 2:], ws[t].Wm[..., 1:L] + ws[t].first[..., 2:], np.inf)
                for t in live}
    as_block = {t: np.where(ws[t].mid_ok[..., 1:], ws[t].Wm[..., 1:], np.inf) for t in live}
    front: dict[int, np.ndarray] = {}  # per type, (R, L-1): its cheapest front block in front of q = 1..L-1
    F: dict[int, np.ndarray | None] = {0: None}  # the empty back part: the block is the last
    for level in range(len(live)):
        nxt: dict[int, np.ndarray] = {}
        for t in live:
            masks = [S for S in F if not S >> t & 1]
            if not masks:
                continue
            table, w = tables[t], ws[t]
            if level == 0:  # the block is the last: H is finite at q = 0 only, M its value up to k_max
                M = np.where(np.arange(L) < table.k_max[:, None], (w.last1 - w.Wm[..., 1])[..., None], np.inf)[None]
                ans = np.minimum(ans, (as_front[t] + M[..., 1:]).min(axis=(0, 2, 3), initial=np.inf))
                ans = np.minimum(ans, np.where(ends[:, 1], w.only1.min(axis=1), np.inf))
            else:
                Fs = np.stack([F[S] for S in masks])[..., 1:L]  # (n, R, L-1): q = 1..L-1 stages behind
                if t not in front:
                    # a front block at positions q+1 .. i+1 (i in q .. q+k-1): its terms at i,
                    # the least over the window ahead of q, less Wm at q; the least over shapes
                    ahead = _window_min(as_front[t][..., ::-1], table.k_max)[..., ::-1]
                    front[t] = (ahead - w.Wm[..., 1:L]).min(axis=1, initial=np.inf)
                ans = np.minimum(ans, (Fs + front[t][None]).min(axis=(0, 2), initial=np.inf))
            if level == len(live) - 1:
                continue  # every type is behind: nothing more in front
            lo, end = 0, min(L, int(table.k_max.max()))  # the block's last stage at q' = lo+1 .. end
            if level == 0:  # the last block: k <= k_max stages
                M = M[..., :end]
            else:
                # only q = lo..hi-1 stages behind hold a finite F (of any mask or row): the
                # window minima are finite only for q' - 1 in lo .. hi - 2 + k_max, and
                # computed there alone (H is inf before lo, so a window cut at lo is exact)
                behind = np.flatnonzero(np.isfinite(Fs).any(axis=(0, 1)))
                if not len(behind):
                    continue
                lo, end = int(behind[0]) + 1, min(L, int(behind[-1]) + 1 + int(table.k_max.max()))
                H = Fs[:, :, None, lo - 1: end - 1] - w.Wm[None, ..., lo:end]  # H[q], q = lo..end-1
                M = _window_min(H, table.k_max)  # (n, R, S, end-lo): q' = lo+1..end, k <= k_max stages
            block = (as_block[t][..., lo:end] + M).min(axis=2)  # (n, R, end-lo)
            for S, blk in zip(masks, block):
                if not np.isfinite(blk).any():
                    continue
                key = S | 1 << t
                if key not in nxt:
                    nxt[key] = np.full((R, L + 1), np.inf)
                np.minimum(nxt[key][:, 1 + lo: 1 + end], blk, out=nxt[key][:, 1 + lo: 1 + end])
        F = nxt
        if not F:
            break
    return ans


def _front_step(table: TypeTable, w: Weights, g: np.ndarray, L: int) -> np.ndarray:
    """(n, R, L+2) per row of g (n, R, L+2) (R: the weights' rows): the least cost, for q =
    1..L, of a front part whose block nearest the end is of this type at positions q+1, ...
    and whose types in front of that block cost g."""
    Wm, first, mid_ok = w.Wm, w.first, w.mid_ok  # (R, S, L+1)
    # X[j]: blocks ending at position j with more types in front; Y[j]: the block is the front
    X = np.where(mid_ok, Wm + g[:, :, None, : L + 1], np.inf)
    Y = np.full(Wm.shape, np.inf)
    Y[..., 1:] = np.where(mid_ok[..., :L] & table.ends[1:], Wm[..., :L] + first[..., 1:], np.inf)  # p = j
    Z = np.minimum(X, Y)
    # the block ends at a position in q+1 .. q+k_max: a window ending at index L-q-1 of Z
    # reversed (positions L .. 0)
    ahead = _window_min(Z[..., ::-1], table.k_max)  # (n, R, S, L+1)
    best = np.full(ahead.shape[:-1] + (L,), np.inf)  # q = 1..L (none fits in front of q = L)
    if L > 1:
        best[..., : L - 1] = ahead[..., L - 2:: -1]
    out = np.full(g.shape, np.inf)
    out[..., 1: L + 1] = (best - Wm[..., 1:]).min(axis=-2)
    return out


def front_dp(tables: Sequence[TypeTable], ws: Sequence[Weights], L: int) -> list[np.ndarray]:
    """G[A][r, q] per row r of the weights, A a bit mask over `tables`: the least cost of a
    nonempty front part made of distinct types of A, in any order, whose stages sit at
    positions q+1, q+2, ... (q >= 1 stages behind it), its first stage in front. By number
    of types: G[A] from the G[A minus t] of the level below, one batched step per type."""
    T = len(tables)
    R = ws[0].Wm.shape[0] if ws else 1
    G: list[np.ndarray | None] = [None] * (1 << T)
    G[0] = np.full((R, L + 2), np.inf)
    for level in range(1, T + 1):
        masks = [A for A in range(1, 1 << T) if A.bit_count() == level]
        best = np.full((len(masks), R, L + 2), np.inf)
        for t in range(T):
            rows = [i for i, A in enumerate(masks) if A >> t & 1]
            if not rows:
                continue
            g = np.stack([G[masks[i] & ~(1 << t)] for i in rows])  # the types in front of t's block
            cand = np.minimum(g, _front_step(tables[t], ws[t], g, L)) if tables[t].size else g  # (or t not used)
            best[rows] = np.minimum(best[rows], cand)
        for A, row in zip(masks, best):
            G[A] = row
    return G


def max_layers(live: Sequence[tuple[TypeTable, np.ndarray]], L: int) -> np.ndarray:
    """Per row, the most layers any stage list holds with every stage within its caps."""
    B = live[0][1].shape[0]
    live = undominated(live)
    ws = [weights(t, u, np.zeros(B), capacity=True) for t, u in live]
    return -back_dp([t for t, _ in live], ws, L, B)


@dataclasses.dataclass
class Boxes:
    """What the bound needs of a set of box corners, made once for all the lambdas tried at
    them: per chip type the shapes that can hold a stage in some box and that no other shape
    of the type dominates in every box (`undominated`: dominated in every box of the set, a
    shape is dominated in any subset of them, the rows of a later lambda round), their caps
    u (B, 4, S, L) and their `mid_sums`."""

    n: int  # boxes B
    live: list  # per type (table, u, MidSums)
    ends: np.ndarray | None = None  # (B, L+1) per box, the lengths its lists may have (None: the tables')

    @classmethod
    def of(cls, tables: Sequence[TypeTable], V: np.ndarray, tau: np.ndarray) -> "Boxes":
        """The boxes whose upper corners are (V[b], tau[b]): V (B, K) steady components, tau (B,)."""
        return cls.of_groups([(tables, V, tau)])

    @classmethod
    def of_groups(cls, groups: Sequence[tuple[Sequence[TypeTable], np.ndarray, np.ndarray]]) -> "Boxes":
        """The boxes of several groups (tables, V, tau) in turn, their tables of the same shapes
        with their own memory caps and ends (a micro-batch size's ranges of lengths): one DP
        then bounds rows of every group (a DP call's fixed cost is that of a few rows)."""
        live = undominated(_live_groups(groups))
        ends = None
        if len(groups) > 1:
            ends = np.concatenate([np.repeat(tables[0].ends[None], len(tau), 0) for tables, _, tau in groups])
        return cls(sum(len(tau) for _, _, tau in groups), [(t, u, mid_sums(u)) for t, u in live], ends)


def lagrangian(
    boxes: Boxes, L: int, box: np.ndarray, lams: np.ndarray, fits: np.ndarray | None = None,
) -> np.ndarray:
    """Per row r: lams[r] * L + min over stage lists of sum_i w_i(lams[r]) at the upper corner
    of boxes' box[r]: a lower bound on the fill of every plan with steady <= V and tail <= tau
    there; inf where no stage list holds the L layers under them. One DP: the rows, then one
    capacity row per box whose `fits` (per box: 1 holds L layers, 0 does not, -1 unknown;
    default unknown) is not known; `fits` is filled in."""
    box = np.asarray(box, dtype=np.int64)
    R = len(box)
    fits = np.full(boxes.n, -1, dtype=np.int8) if fits is None else fits
    unknown = np.nonzero(fits < 0)[0]
    rows = np.concatenate([box, unknown])
    lam_rows = np.concatenate([np.asarray(lams, dtype=float), np.zeros(len(unknown))])
    capacity = np.arange(len(rows)) >= R
    ws = [weights(t, u, lam_rows, rows, capacity, sums) for t, u, sums in boxes.live]
    dp = back_dp([t for t, _, _ in boxes.live], ws, L, len(rows), None if boxes.ends is None else boxes.ends[rows])
    fits[unknown] = -dp[R:] >= L
    return np.where(fits[box] > 0, lam_rows[:R] * L + dp[:R], np.inf)
