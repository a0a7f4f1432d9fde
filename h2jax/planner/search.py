"""HeteroAuto's search: the fastest plan under the cost model, exactly.

The search itself is dual_search.py (boxes of steady/tail thresholds bounded by the
Lagrangian DP of positions.py, for 1F1B and GPipe). This module holds the space, one stage
list's exact layer split (`best_split`), the cheap per-micro-batch bound the search orders
micro-batch sizes by (the per-shape envelope and staircase), the exhaustive reference and
`top_k`, the entry point.

The space (the same for the search and `exhaustive=True`):

- chip types in pipeline order by memory, largest first (they hold the most in-flight
  micro-batches under 1F1B), ties by peak FLOP/s then name;
- a micro-batch size b among the divisors of the global batch;
- per chip type t, either nothing or an *option* (k, D, T, r): k >= 1 consecutive stages, each
  on a (data=D, tensor=T) mesh with recompute policy r, with D | b, T a divisor of
  chips_per_node that the model's heads and d_ff allow, and k*D*T <= the type's chip count
  (chips may stay unused);
- a layer split: l_i >= 1 layers per stage, sum l_i = n_layers, every stage within memory.

The exact layer split of one stage list (`best_split`): the objective is

    sum_i lin_i*l_i + C + sum_g w_g * max(floor_g, max_i(a_gi*l_i + o_gi))

(1F1B: one max for the steady state with weight m-1, one for the dp-reduce + optimizer tail;
GPipe: forward and backward maxima). For each max in turn it enumerates the candidate values
v = a_gi*l + o_gi in ascending order from the smallest feasible one (found by bisection: the
"bisection on the bottleneck time"), caps l_i <= (v - o_gi)/a_gi, and stops as soon as the
accumulated cost plus a lower bound of the rest cannot win; under all caps the remaining linear
part is minimised exactly by filling the cheapest stages first.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from typing import Any, Iterable, Sequence

import numpy as np

from h2jax.cluster import ChipType, Cluster
from h2jax.config import ConfigError, ModelConfig, get_config, preset_name
from h2jax.plan import RECOMPUTE_POLICIES, SCHEDULES, Mesh, Optimizer, Plan, Stage
from h2jax.planner import cost_model as cm
from h2jax.planner.memory_model import GIB
from h2jax.planner.profile import Profile


class PlannerError(ConfigError):
    """The planner cannot produce a plan; the message says which constraint fails and the fix."""


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """k stages of one chip type, each on a (data, tensor) mesh with one recompute policy."""

    chip: str
    stages: int
    data: int
    tensor: int
    recompute: str
    layer_s: float  # forward + backward of one layer (middle stage)
    room: float = math.inf  # bytes per chip for layers (middle stage): capacity - reserve - working
    layer_static: float = 0.0  # bytes per layer: params, grads, optimizer state
    layer_activation: float = 0.0  # bytes per layer per micro-batch in flight
    cap1: int = 0  # max_layers(1), kept for the bounds
    tail1: float = 0.0  # dp reduce + optimizer of one layer: every stage pays at least this tail

    def max_layers(self, in_flight: int) -> int:
        """Most layers a middle stage holds; end stages hold no more (upper bound)."""
        return int(math.floor(self.room / (self.layer_static + in_flight * self.layer_activation) + 1e-9))

    @property
    def chips(self) -> int:
        return self.stages * self.data * self.tensor

    @property
    def speed(self) -> float:
        return self.stages / self.layer_s


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """A point of the space with its predicted iteration time."""

    time_s: float
    micro_batch: int
    options: tuple[Option, ...]  # in pipeline order, types without stages left out
    layers: tuple[int, ...]

    def stages(self) -> list[Stage]:
        out, start = [], 0
        shapes = [o for o in self.options for _ in range(o.stages)]
        for o, n in zip(shapes, self.layers):
            out.append(Stage(chip=o.chip, mesh=Mesh(o.data, o.tensor), layers=(start, start + n), recompute=o.recompute))
            start += n
        return out


@dataclasses.dataclass
class SearchStats:
    configs_visited: int = 0  # leaves whose layer split was solved
    plans_evaluated: int = 0  # (stage list, layer split) pairs whose iteration time was computed
    space_size: int = 0  # stage lists in the space (before layer splits)
    bound_rows: int = 0  # 1F1B: Lagrangian DP rows evaluated (one per box and lambda)
    search_time_s: float = 0.0
    proved_optimal: bool = True  # False when a time limit stopped the search early
    # A valid lower bound on the optimum's iteration time (the best root bound over micro-batch
    # sizes; the optimum itself once proved): with a time limit, the plan is within
    # time_s / lower_bound_s of the optimum.
    lower_bound_s: float = 0.0


# ----------------------------------------------------------------------------- the space


def pipeline_order(cluster: Cluster) -> list[ChipType]:
    """Chip types, largest memory first (ties: faster first, then by name)."""
    return sorted(cluster.chips.values(), key=lambda c: (-c.usable_memory_gib, -c.peak_tflops, c.name))


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tensor_sizes(model: ModelConfig, chip: ChipType) -> list[int]:
    """Divisors of a node that divide the model's heads, kv heads and d_ff."""
    return [
        t for t in divisors(chip.chips_per_node)
        if model.n_heads % t == 0 and model.n_kv_heads % t == 0 and model.d_ff % t == 0
    ]


@dataclasses.dataclass
class _Context:
    model: ModelConfig
    seq_len: int
    global_batch: int
    schedule: str
    chips: dict[str, ChipType]
    counts: dict[str, int]
    order: list[str]
    profile: Profile | None
    options: cm.CostOptions
    recompute: tuple[str, ...]
    _terms: dict = dataclasses.field(default_factory=dict)
    _sends: dict = dataclasses.field(default_factory=dict)
    _options: dict = dataclasses.field(default_factory=dict)

    def terms(self, b: int, o: Option, first: bool, last: bool, in_flight: int) -> cm.StageTerms:
        key = (b, o.chip, o.data, o.tensor, o.recompute, first, last, in_flight)
        t = self._terms.get(key)
        if t is None:
            t = cm.stage_terms(
                self.model, self.seq_len, b, self.chips[o.chip], o.data, o.tensor, o.recompute,
                first, last, in_flight, self.profile, self.options,
            )
            self._terms[key] = t
        return t

    def send(self, b: int, s: Option, r: Option) -> float:
        key = (b, s.chip, s.data, s.tensor, r.chip, r.data, r.tensor)
        v = self._sends.get(key)
        if v is None:
            v = cm.send_terms(
                self.model, self.seq_len, b, self.chips[s.chip], s.data, s.tensor,
                self.chips[r.chip], r.data, r.tensor,
            )[0]
            self._sends[key] = v
        return v

    def type_options(self, b: int, prune_unfit: bool) -> list[list[Option]]:
        """Per chip type (pipeline order), its options at micro-batch b, fastest first (cached)."""
        key = (b, prune_unfit)
        if key not in self._options:
            out = []
            for shapes in self.type_shapes(b, prune_unfit):
                opts = [dataclasses.replace(o, stages=k) for o in shapes for k in range(1, o.stages + 1)]
                opts.sort(key=lambda o: (-o.speed, o.chips, o.stages, o.data, o.tensor, o.recompute))
                out.append(opts)
            self._options[key] = out
        return [list(opts) for opts in self._options[key]]

    def type_shapes(self, b: int, prune_unfit: bool) -> list[list[Option]]:
        """Per chip type, one option per shape (D, T, r) with its most stages, min(L, chips // D*T):
        all the bounds need (they see a shape through its largest k). Cached."""
        key = ("shapes", b, prune_unfit)
        if key in self._options:
            return self._options[key]
        L = self.model.n_layers
        out = []
        for name in self.order:
            chip, count = self.chips[name], self.counts[name]
            opts = []
            for t in tensor_sizes(self.model, chip):
                for d in divisors(b):
                    if d * t > count:
                        break
                    for r in self.recompute:
                        probe = Option(name, 1, d, t, r, 0.0)
                        mid = self.terms(b, probe, False, False, 1)
                        if prune_unfit and mid.mem.max_layers() < 1:
                            continue
                        c = mid.fwd_layer + mid.bwd_layer
                        room = mid.mem.capacity - mid.mem.reserve - mid.mem.working - mid.mem.params_end
                        per_layer = mid.mem.layer_static + mid.mem.layer_activation
                        cap1 = min(L, int(math.floor(room / per_layer + 1e-9)))
                        opts.append(Option(
                            name, min(L, count // (d * t)), d, t, r, c, room, mid.mem.layer_static,
                            mid.mem.layer_activation, cap1, mid.tail_layer,
                        ))
            out.append(opts)
        self._options[key] = out
        return out


# ----------------------------------------------------------------------------- one stage list


@dataclasses.dataclass
class _Leaf:
    lin: np.ndarray  # per-layer fill coefficient of each stage
    const: float  # fill constants: end-stage terms and link latencies
    groups: list[tuple[float, np.ndarray, np.ndarray, float]]  # (weight, a, o, floor)
    caps: np.ndarray


def _leaf(ctx: _Context, b: int, options: Sequence[Option]) -> _Leaf | None:
    """The objective's coefficients for one stage list, or None if a stage cannot hold a layer."""
    shapes = [o for o in options for _ in range(o.stages)]
    p, m = len(shapes), ctx.global_batch // b
    terms = [
        ctx.terms(b, o, i == 0, i == p - 1, cm.in_flight(ctx.schedule, i, p, m)) for i, o in enumerate(shapes)
    ]
    L = ctx.model.n_layers
    caps = np.minimum(np.array([t.mem.max_layers() for t in terms], dtype=np.int64), L - p + 1)
    if caps.min() < 1 or caps.sum() < L:
        return None
    sends = [ctx.send(b, shapes[i], shapes[i + 1]) for i in range(p - 1)]
    max_send = max(sends, default=0.0)
    links = 2.0 * sum(s + cm.LINK_LATENCY_S for s in sends)
    fwd_l = np.array([t.fwd_layer for t in terms])
    bwd_l = np.array([t.bwd_layer for t in terms])
    fwd_e = np.array([t.fwd_end for t in terms])
    bwd_e = np.array([t.bwd_end for t in terms])
    tail = (1.0, np.array([t.tail_layer for t in terms]), np.array([t.tail_end for t in terms]), -math.inf)
    const = float(fwd_e.sum() + bwd_e.sum()) + links
    if ctx.schedule == "1f1b":
        groups = [(float(m - 1), fwd_l + bwd_l, fwd_e + bwd_e, max_send), tail]
    else:
        groups = [(float(m - 1), fwd_l, fwd_e, max_send), (float(m - 1), bwd_l, bwd_e, max_send), tail]
    return _Leaf(fwd_l + bwd_l, const, groups, caps)


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
        values = np.unique(np.concatenate([a[i] * np.arange(1, caps[i] + 1) + o[i] for i in range(len(caps))]))

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


class _Envelope:
    """The most layers some choice among `options` holds under a bottleneck v, as a step function.

    An option of per-layer cost c, k stages and one-micro-batch memory cap `cap1` holds
    k*min(cap1, floor(v/c)) layers when no stage may exceed v: end-stage terms and more
    micro-batches in flight only lower that, so it bounds every position. Several
    envelopes add up (types not chosen yet, for the bound of a partial choice).
    """

    def __init__(self, xs: np.ndarray, hs: np.ndarray) -> None:
        self.xs, self.hs = xs, hs  # breakpoints (increasing) and the layers held from each on

    @classmethod
    def of_options(
        cls, options: Sequence[Option], L: int, in_flight: int = 1, m: int | None = None
    ) -> "_Envelope":
        """The most layers one of `options` holds under a bottleneck v, its stages sitting at
        the pipeline positions that hold `in_flight`, `in_flight` + 1, ... micro-batches (at
        least; capped at m, or all `in_flight` when m is None, as under GPipe).

        Options sharing a shape differ only in k, and k stages hold at most the sum of the
        first k per-position caps min(floor(v/c), cap(f_j)), which grows with k: the envelope
        of a shape is that of its largest k (see `_shape_tables`)."""
        return cls.of_tables(*_shape_tables(options, L, in_flight, m))

    @classmethod
    def of_tables(cls, c: np.ndarray, table: np.ndarray) -> "_Envelope":
        u = np.arange(1, table.shape[1])
        x = np.concatenate([np.zeros(1), (c[:, None] * u[None, :]).ravel()])
        h = np.concatenate([np.zeros(1), table[:, 1:].ravel().astype(float)])
        order = np.argsort(x, kind="stable")
        x, h = x[order], np.maximum.accumulate(h[order])
        keep = np.concatenate([[True], h[1:] > h[:-1]])
        return cls(x[keep], h[keep])

    @classmethod
    def zero(cls) -> "_Envelope":
        return cls(np.zeros(1), np.zeros(1))

    def __add__(self, other: "_Envelope") -> "_Envelope":
        xs = np.union1d(self.xs, other.xs)
        return _Envelope(xs, self(xs) + other(xs))

    def __call__(self, v: Any) -> Any:
        return self.hs[np.searchsorted(self.xs, v, side="right") - 1]


def _envelope_bottleneck(L: int, rest: _Envelope) -> float:
    """A lower bound on every plan's bottleneck (the max of a stage's forward + backward): the
    smallest v at which the envelope holds L layers (inf: it never does)."""
    if rest.hs[-1] < L:
        return math.inf
    return float(rest.xs[int(np.searchsorted(rest.hs, L))]) * (1 - 1e-9)  # below the split's rounding


def _shape_tables(options: Sequence[Option], L: int, in_flight: int, m: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per shape of `options` (its largest k): (per-layer cost c, table) where table[u] is the
    most layers its stages hold with at most u layers each, the stages sitting at the pipeline
    positions that hold in_flight, in_flight + 1, ... micro-batches (capped at m; all
    `in_flight` when m is None, as under GPipe), clipped at L. Vectorised over shapes."""
    shapes: dict[tuple, Option] = {}
    for o in options:
        key = (o.data, o.tensor, o.recompute)
        if key not in shapes or o.stages > shapes[key].stages:
            shapes[key] = o
    if not shapes:
        return np.zeros(0), np.zeros((0, 1), dtype=np.int64)
    opts = list(shapes.values())
    kmax = min(max(o.stages for o in opts), L)
    j = np.arange(kmax)
    f = np.full(kmax, in_flight) if m is None else np.minimum(in_flight + j, m)
    room = np.array([o.room for o in opts])[:, None]
    static = np.array([o.layer_static for o in opts])[:, None]
    act = np.array([o.layer_activation for o in opts])[:, None]
    limit = np.array([min(o.cap1, L) for o in opts])[:, None]
    caps = np.minimum(np.floor(room / (static + f[None, :] * act) + 1e-9), limit)
    caps[j[None, :] >= np.array([o.stages for o in opts])[:, None]] = 0  # stages it does not have
    caps = np.maximum(caps, 0).astype(np.int64)
    caps[caps < 1] = 0
    umax = int(caps.max(initial=0))
    u = np.arange(umax + 1)
    table = np.minimum(np.minimum(u[None, :, None], caps[:, None, :]).sum(axis=2), L)
    return np.array([o.layer_s for o in opts]), table


class _Staircase:
    """The cheapest per-layer cost of a chip type's layers under a bottleneck v: its j-th
    layer costs at least the per-layer time of the cheapest shape that holds j layers under v
    (with its stages at the most lenient positions from `in_flight` on, like `_Envelope`).

    Whichever option the type takes, its x layers cost c*x >= the sum of the first x steps,
    so the cheapest `left` steps over all types bound the fill from below.
    """

    def __init__(self, c: np.ndarray, table: np.ndarray) -> None:
        order = np.argsort(c, kind="stable")
        self.c, self.tab = c[order], table[order]
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
        return self.c[keep], inc[keep]


def _envelope_bound(m: int, L: int, rest: _Envelope, rest_c: float, stairs: Sequence[_Staircase]) -> float:
    """A lower bound on every plan's iteration time from the types' envelope and staircases:

    min over bottlenecks V >= the envelope's of (m-1)*V + fill(V), fill(V) the L cheapest
    staircase steps under V (each type's j-th layer costs at least the cheapest shape that holds
    j layers). Between two breakpoints of the envelope the fill is taken at the interval's right
    end (it only falls with V); the scan stops once (m-1)*V + L*rest_c (every layer at the
    cheapest per-layer cost) cannot beat the best so far.
    """
    v = _envelope_bottleneck(L, rest)
    if v == math.inf:
        return v
    floor_fill = L * rest_c
    best = math.inf
    v0 = v
    for _ in range(64):
        if (m - 1) * v + floor_fill >= best:
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
            best = min(best, (m - 1) * v + fill)
        if nxt == math.inf:
            break
        v = nxt
    else:
        return (m - 1) * v0 + floor_fill  # gave up refining: the plain bound
    return best if best < math.inf else (m - 1) * v0 + floor_fill


def _leaf_bound(L: int, m: int, schedule: str, chosen: Sequence[Option], e_first: float, e_last: float) -> float:
    """Like `_envelope_bound` for a complete stage list, with each position's in-flight memory
    cap and the end stages' embedding/logits time: cheaper than building the leaf."""
    shapes = [o for o in chosen for _ in range(o.stages)]
    p = len(shapes)
    c = np.array([o.layer_s for o in shapes])
    caps = np.minimum([o.max_layers(cm.in_flight(schedule, i, p, m)) for i, o in enumerate(shapes)], L - p + 1)
    if caps.min() < 1 or caps.sum() < L:
        return math.inf
    e = np.zeros(p)
    e[0] += e_first
    e[-1] += e_last
    values = np.unique(np.concatenate([c[i] * np.arange(1, caps[i] + 1) + e[i] for i in range(p)]))
    held = lambda v: np.minimum(caps, np.floor((v - e) / c + 1e-9)).clip(min=0).sum()  # noqa: E731
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if held(values[mid]) >= L:
            hi = mid
        else:
            lo = mid + 1
    # (GPipe: max f + max b >= max (f + b), so the same bound holds)
    fill = float(c.sum()) + (L - p) * float(c.min()) + e_first + e_last
    tail = _tail_lb(chosen, L, 0.0)
    return (m - 1) * float(values[lo]) * (1 - 1e-9) + fill + tail


def _inv_tail(o: Option, L: int) -> float:
    """sum of 1/(tail per layer) over an option's stages (inf if its tail is free)."""
    return min(o.stages, L) / o.tail1 if o.tail1 > 0 else math.inf


def _tail_lb(chosen: Sequence[Option], L: int, open_inv: float) -> float:
    """A lower bound on max_i tail_i (dp-reduce + optimizer, tau_i*l_i + end terms >= tau_i*l_i):
    every stage holds a layer, and with all tau_i*l_i <= X the stages hold at most
    X * sum_i 1/tau_i layers, so X >= L / sum_i 1/tau_i; the open types add at most
    `open_inv` to that sum."""
    one = max((o.tail1 for o in chosen), default=0.0)
    inv = open_inv + sum(_inv_tail(o, L) for o in chosen)
    return max(one, L / inv if inv > 0 else 0.0)


class _TopK:
    def __init__(self, k: int) -> None:
        self.k, self.heap, self.counter = k, [], itertools.count()

    @property
    def bound(self) -> float:
        return -self.heap[0][0] if len(self.heap) >= self.k else math.inf

    def push(self, cand: Candidate) -> None:
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


class _OutOfTime(Exception):
    pass


def _search_dual(
    ctx: _Context, micro_batches: Sequence[int], k: int, stats: SearchStats, deadline: float = math.inf
) -> list[Candidate]:
    """Boxes of (steady, tail) thresholds with Lagrangian bounds (dual_search.py)."""
    from h2jax.planner import dual_search  # late: it builds on this module

    top = _TopK(k)
    try:
        dual_search.search(ctx, micro_batches, top, stats, deadline)
    except _OutOfTime:
        stats.proved_optimal = False
    return top.sorted()


def _solve(ctx: _Context, b: int, chosen: Sequence[Option], top: "_TopK", stats: SearchStats) -> bool:
    """Solve one stage list's layer split exactly and offer it; True if it entered the top k."""
    L, m = ctx.model.n_layers, ctx.global_batch // b
    p = sum(o.stages for o in chosen)
    if p > L:
        return False
    # the bottleneck is at least the continuous balance L / sum(k/c); every stage runs a layer
    if (m - 1) * L / sum(o.speed for o in chosen) + sum(o.stages * o.layer_s for o in chosen) >= top.bound:
        return False
    first = ctx.terms(b, chosen[0], True, p == 1, 1)
    last = ctx.terms(b, chosen[-1], p == 1, True, 1)
    e_first = first.fwd_end + first.bwd_end
    e_last = 0.0 if p == 1 else last.fwd_end + last.bwd_end
    if _leaf_bound(L, m, ctx.schedule, chosen, e_first, e_last) >= top.bound:
        return False
    leaf = _leaf(ctx, b, chosen)
    if leaf is None:
        return False
    stats.configs_visited += 1
    found = best_split(leaf, L, top.bound, stats)
    if found is None:
        return False
    before = top.bound
    top.push(Candidate(found[0], b, tuple(chosen), tuple(int(x) for x in found[1])))
    return top.bound < before or len(top.heap) < top.k


_COMPOSITIONS: dict[tuple[int, int], np.ndarray] = {}


def _compositions(total: int, parts: int) -> np.ndarray:
    """Every way to write `total` as `parts` positive integers in order, one per row."""
    key = (total, parts)
    if key not in _COMPOSITIONS:
        rows = []
        for cuts in itertools.combinations(range(1, total), parts - 1):
            edges = (0, *cuts, total)
            rows.append([edges[i + 1] - edges[i] for i in range(parts)])
        _COMPOSITIONS[key] = np.array(rows, dtype=np.int64).reshape(-1, parts)
    return _COMPOSITIONS[key]


def _search_exhaustive(ctx: _Context, micro_batches: Sequence[int], k: int, stats: SearchStats) -> list[Candidate]:
    """Every stage list and every layer split, no bounds, no pruning: the reference.

    Memory is checked with the memory model's byte totals directly (not its layer caps), and
    each split's time is evaluated from the stage terms, vectorised over all splits.
    """
    L, top = ctx.model.n_layers, _TopK(k)
    for b in micro_batches:
        m = ctx.global_batch // b
        per_type = ctx.type_options(b, prune_unfit=False)
        for combo in itertools.product(*[[None, *opts] for opts in per_type]):
            chosen = [o for o in combo if o is not None]
            p = sum(o.stages for o in chosen)
            if not chosen or p > L:
                continue
            stats.space_size += 1
            stats.configs_visited += 1
            shapes = [o for o in chosen for _ in range(o.stages)]
            terms = [
                ctx.terms(b, o, i == 0, i == p - 1, cm.in_flight(ctx.schedule, i, p, m))
                for i, o in enumerate(shapes)
            ]
            splits = _compositions(L, p)
            per_layer = np.array([t.mem.layer_static + t.mem.in_flight * t.mem.layer_activation for t in terms])
            fixed = np.array([t.mem.params_end + t.mem.working + t.mem.reserve for t in terms])
            capacity = np.array([t.mem.capacity for t in terms])
            splits = splits[(splits * per_layer + fixed <= capacity).all(axis=1)]
            if not len(splits):
                continue
            stats.plans_evaluated += len(splits)
            sends = [ctx.send(b, shapes[i], shapes[i + 1]) for i in range(p - 1)]
            max_send = max(sends, default=0.0)
            fwd = splits * np.array([t.fwd_layer for t in terms]) + np.array([t.fwd_end for t in terms])
            bwd = splits * np.array([t.bwd_layer for t in terms]) + np.array([t.bwd_end for t in terms])
            tail = splits * np.array([t.tail_layer for t in terms]) + np.array([t.tail_end for t in terms])
            links = 2.0 * sum(x + cm.LINK_LATENCY_S for x in sends)
            if ctx.schedule == "1f1b":
                steady = np.maximum((fwd + bwd).max(axis=1), max_send)
            else:
                steady = np.maximum(fwd.max(axis=1), max_send) + np.maximum(bwd.max(axis=1), max_send)
            times = (fwd + bwd).sum(axis=1) + links + (m - 1) * steady + tail.max(axis=1)
            for j in np.argsort(times, kind="stable")[:k]:
                if times[j] < top.bound:
                    top.push(Candidate(float(times[j]), b, tuple(chosen), tuple(int(x) for x in splits[j])))
    return top.sorted()


# ----------------------------------------------------------------------------- entry points


def _micro_batches(global_batch: int, requested: Iterable[int] | None) -> list[int]:
    if requested is None:
        return divisors(global_batch)
    requested = sorted(set(int(b) for b in requested))
    good = [b for b in requested if b >= 1 and global_batch % b == 0]
    if not good:
        raise PlannerError(
            f"global batch {global_batch} is divisible by none of the micro-batch sizes {requested}; "
            f"choose micro-batch sizes among the divisors of {global_batch}: {divisors(global_batch)}"
        )
    return good


def make_context(
    cluster: Cluster,
    model: ModelConfig | str,
    seq_len: int,
    global_batch: int,
    schedule: str = "1f1b",
    profile: Profile | None = None,
    options: cm.CostOptions = cm.CostOptions(),
    recompute: Sequence[str] = RECOMPUTE_POLICIES,
) -> _Context:
    model = get_config(model)
    if schedule not in SCHEDULES:
        raise PlannerError(f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlannerError(f"{name} must be a positive integer, got {value!r}")
    bad = [r for r in recompute if r not in RECOMPUTE_POLICIES]
    if bad or not recompute:
        raise PlannerError(f"recompute policies {list(recompute)} invalid; choose from {', '.join(RECOMPUTE_POLICIES)}")
    if profile is not None:
        profile.check_matches(model, seq_len)
    order = [c.name for c in pipeline_order(cluster)]
    return _Context(
        model, seq_len, global_batch, schedule, dict(cluster.chips), dict(cluster.counts), order,
        profile, options, tuple(recompute),
    )


def top_k(
    cluster: Cluster,
    model: ModelConfig | str,
    seq_len: int,
    global_batch: int,
    k: int = 1,
    schedule: str = "1f1b",
    exhaustive: bool = False,
    profile: Profile | None = None,
    micro_batches: Iterable[int] | None = None,
    recompute: Sequence[str] = RECOMPUTE_POLICIES,
    options: cm.CostOptions = cm.CostOptions(),
    time_limit_s: float | None = None,
) -> tuple[list[Candidate], SearchStats]:
    """The k fastest stage lists (each with its best layer split), fastest first.

    Exact under the cost model: the fast search and `exhaustive=True` return the same times.
    With `time_limit_s` the fast search returns the best found when time runs out and
    `stats.proved_optimal` says it was stopped.
    """
    if k < 1:
        raise PlannerError(f"k must be >= 1, got {k}")
    ctx = make_context(cluster, model, seq_len, global_batch, schedule, profile, options, recompute)
    mbs = _micro_batches(global_batch, micro_batches)
    stats = SearchStats()
    t0 = time.perf_counter()
    if exhaustive:
        found = _search_exhaustive(ctx, mbs, k, stats)
        if found:
            stats.lower_bound_s = found[0].time_s
    else:
        deadline = t0 + time_limit_s if time_limit_s is not None else math.inf
        found = _search_dual(ctx, mbs, k, stats, deadline)
    stats.search_time_s = time.perf_counter() - t0
    if not found and not stats.proved_optimal:
        raise PlannerError(
            f"the search ran out of its time limit ({time_limit_s} s) before finding any plan; "
            "raise the time limit (--time-limit) or plan fewer chip types"
        )
    if not found:
        raise PlannerError(explain_unfit(ctx, mbs))
    return found, stats


def explain_unfit(ctx: _Context, micro_batches: Sequence[int]) -> str:
    """Why nothing fits: per chip type, the most layers a stage holds in the most lenient shape
    the search may use (largest tensor size, most lenient recompute policy allowed), as a middle
    stage and as the first (embedding) and last (head) stage."""
    model, L, b = ctx.model, ctx.model.n_layers, min(micro_batches)
    name = preset_name(model) or "the model"
    policy = next(r for r in ("full", "selective", "none") if r in ctx.recompute)
    lines, total, end_loss = [], 0, [math.inf, math.inf]
    # 1F1B: the last stage holds one micro-batch; GPipe: every stage holds all m of them
    gpipe = ctx.schedule == "gpipe"
    in_flight = ctx.global_batch // b if gpipe else 1
    for chip_name in ctx.order:
        chip, count = ctx.chips[chip_name], ctx.counts[chip_name]
        t = max(x for x in tensor_sizes(model, chip) if x <= count)
        d = max(x for x in divisors(b) if x * t <= count)
        probe = Option(chip_name, 1, d, t, policy, 0.0)
        mem = ctx.terms(b, probe, False, False, in_flight).mem
        fits = max(mem.max_layers(), 0)
        first, last = (max(ctx.terms(b, probe, f, la, in_flight).mem.max_layers(), 0) for f, la in ((True, False), (False, True)))
        per_layer = (mem.layer_static + mem.in_flight * mem.layer_activation) / GIB
        room = (mem.capacity - mem.reserve - mem.working) / GIB
        stages = count // (d * t)
        total += fits * min(stages, L)
        if stages:  # the pipeline's first and last stages hold less than a middle one
            end_loss = [min(end_loss[0], fits - first), min(end_loss[1], fits - last)]
        lines.append(
            f"{chip_name}: a stage with recompute={policy}, tensor={t}, data={d}, micro-batch {b} and "
            f"{in_flight} micro-batch(es) in flight holds at most {fits} layer(s) as a middle stage, "
            f"{first} as the first (embedding), {last} as the last (head) ({per_layer:.2f} GiB per layer, "
            f"{room:.2f} GiB usable per chip); {stages} such stage(s) fit in {count} chips"
        )
    if math.isfinite(end_loss[0]):
        total = max(total - end_loss[0] - end_loss[1], 0)
    return (
        f"no plan fits: {name} ({L} layers, seq_len {ctx.seq_len}) does not fit on this cluster even "
        f"with recompute={policy} (the most lenient policy allowed) and the largest tensor size; the "
        f"cluster's stages hold at most about {total} of the {L} layers"
        + (" (an upper bound: under 1F1B a stage further from the end keeps more micro-batches in flight)"
           if total >= L and not gpipe else "")
        + ". Per chip type: " + "; ".join(lines)
        + ". Add chips, shorten --seq-len, or choose a smaller model"
        + (" (or --schedule 1f1b: GPipe keeps every micro-batch's activations until its backward)." if gpipe else ".")
    )


def candidate_plan(
    cand: Candidate,
    model: ModelConfig,
    seq_len: int,
    global_batch: int,
    schedule: str,
    optimizer: Optimizer = Optimizer(),
) -> Plan:
    return Plan(
        model=model,
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch=cand.micro_batch,
        stages=tuple(cand.stages()),
        schedule=schedule,
        optimizer=optimizer,
        model_name=preset_name(model),
    )
