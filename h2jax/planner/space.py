"""The planner's search space: options (k stages of one chip type on one mesh shape), the
search context (cached stage terms per micro-batch), candidates and the plan they make.
Shared by the exact search (dual_search.py), one stage list's split (split.py) and the
exhaustive reference (search.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from h2jax.cluster import ChipType, Cluster
from h2jax.config import ConfigError, ModelConfig, get_config, preset_name
from h2jax.plan import RECOMPUTE_POLICIES, Mesh, Optimizer, Plan, Stage
from h2jax.planner import cost_model as cm
from h2jax.planner import memory_model as mm
from h2jax.planner.memory_model import StageMemoryTerms
from h2jax.planner.profile import Profile
from h2jax.planner.stage_shape import StageShape
from h2jax.schedules import AUTO, Schedule, get_schedule


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
    layer_s: float  # forward + backward of one layer (middle stage): the steady state's cost
    # a middle stage's memory terms at one micro-batch in flight (None: not probed): the caps
    # below are the fit test's (memory_model `fits`) at other in-flight counts
    mem: StageMemoryTerms | None = dataclasses.field(default=None, compare=False, hash=False)
    cap1: int = 0  # max_layers(1), kept for the bounds
    tail1: float = 0.0  # dp reduce + optimizer of one layer: every stage pays at least this tail
    # one layer's share of the schedule's fill (its closed form's fill coefficients, the least
    # over pipeline positions): layer_s under 1F1B and GPipe, less under ZB-H1 and interleaved
    fill_s: float = math.nan

    def max_layers(self, in_flight):
        """Most layers a middle stage holds with `in_flight` micro-batches (elementwise for an
        array); an end stage, or one with deferred weight gradients, holds no more (a bound)."""
        return self.mem.max_layers(in_flight)

    @property
    def fill(self) -> float:
        return self.layer_s if math.isnan(self.fill_s) else self.fill_s

    @property
    def chips(self) -> int:
        return self.stages * self.data * self.tensor

    @property
    def shape(self) -> tuple[int, int, str]:
        """(data, tensor, recompute): what its stages run on, whatever their number."""
        return (self.data, self.tensor, self.recompute)

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
    schedule: str = "1f1b"
    virtual_stages: int = 1  # chunks per stage (interleaved)

    def stages(self) -> list[Stage]:
        shapes = [o for o in self.options for _ in range(o.stages)]
        chunks = chunk_ranges(self.layers, self.virtual_stages)
        return [
            Stage(chip=o.chip, mesh=Mesh(o.data, o.tensor), layers=c[0],
                  recompute=o.recompute, chunks=None if len(c) == 1 else c)
            for o, c in zip(shapes, chunks)
        ]

    @property
    def label(self) -> str:
        return schedule_label(self.schedule, self.virtual_stages)


def schedule_label(schedule: str, v: int) -> str:
    return f"{schedule} (v={v})" if v > 1 else schedule


TIME_LIMIT = "time limit"  # SearchStats.two_shapes_stopped when the time limit stopped the proof


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
    # --schedule auto: the best iteration time of each schedule searched (label -> seconds)
    schedule_times: dict = dataclasses.field(default_factory=dict)
    # --schedule auto: the schedules searched against a cutoff (the best plans of those searched
    # before them) with no plan found faster than it (label -> a lower bound on their best, s:
    # at least the cutoff where the search finished, less where the time limit stopped it)
    schedule_bounds: dict = dataclasses.field(default_factory=dict)
    # --schedule auto: the schedules not searched, each never faster than a schedule searched
    # (label -> that schedule's name: `Schedule.no_faster_than`; no plan of it beats that one's)
    schedules_left_out: dict = dataclasses.field(default_factory=dict)
    # --schedule auto, where ZB-H1 was fastest under the cost model: the simulated step of it
    # and of the next schedule's best (label -> seconds); the faster is the plan
    auto_simulated: dict = dataclasses.field(default_factory=dict)
    # mixed_shapes: the best plan with one shape per chip type (the space proved_optimal speaks
    # of), before the two-shape local search (mixed_shapes.refine); None when not searched
    one_shape_time_s: float | None = None
    # whether one_shape_time_s is the one-shape optimum (with proved_optimal): False where the
    # two-shape plan the local search reached from the exact search's first plans was faster
    # than every one-shape plan, and the exact search proved only that (search._EarlyClimb)
    one_shape_proved: bool = True
    # prove_two_shapes (chip_split.prove): whether the plan is proved the optimum of the two-shape
    # space (None: not tried), the nodes it took, and a valid lower bound on that optimum
    two_shapes_proved: bool | None = None
    two_shape_nodes: int = 0
    two_shape_lower_bound_s: float | None = None
    # what stopped the proof before it proved the plan: "time limit", or the signal ("SIGINT":
    # Ctrl-C; "SIGTERM") that stopped it and kept the best plan found; None when it finished
    two_shapes_stopped: str | None = None

    @property
    def proof_interrupted(self) -> bool:
        """A signal (Ctrl-C, SIGTERM), not the time limit, stopped the two-shape proof."""
        return self.two_shapes_stopped not in (None, TIME_LIMIT)


# ----------------------------------------------------------------------------- the space


def pipeline_order(cluster: Cluster) -> list[ChipType]:
    """Chip types in the order the search lists them (largest memory first; ties: faster
    first, then by name): the order of its per-type tables, not the pipeline's, which is
    searched."""
    return sorted(cluster.chips.values(), key=lambda c: (-c.usable_memory_gib, -c.peak_tflops, c.name))


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, built from its prime factors: trial division stops at the
    square root of what is left, so a batch like 10**15 = 2**15 * 5**15 factors at once."""
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    out = [1]
    for p, e in factors.items():
        out = [d * p**k for d in out for k in range(e + 1)]
    return sorted(out)


def tensor_sizes(model: ModelConfig, chip: ChipType) -> list[int]:
    """Divisors of a node that divide the model's heads, kv heads and d_ff."""
    return [
        t for t in divisors(chip.chips_per_node)
        if model.n_heads % t == 0 and model.n_kv_heads % t == 0 and model.d_ff % t == 0
    ]


@dataclasses.dataclass
class Context:
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
    v: int = 1  # chunks per stage (interleaved)
    _terms: dict = dataclasses.field(default_factory=dict)
    _sends: dict = dataclasses.field(default_factory=dict)
    _options: dict = dataclasses.field(default_factory=dict)
    _caps: dict = dataclasses.field(default_factory=dict)
    # per chip type and its chip count, what is built of its shapes at a micro-batch size
    # (`per_type`): a virtual context (chip_split.py) with a type of the same count shares it
    _per_type: dict = dataclasses.field(default_factory=dict)
    # stage lists the exact search's walks solved and found no faster than a time to beat:
    # (micro-batch, ((chip, shape, stages) per block, by the chips' own names)) -> the highest
    # such time. A list's time does not depend on the cluster's chip counts, so a virtual
    # context (chip_split.py: a two-shape proof's nodes) shares it: a node need not solve again
    # what an earlier node's search showed cannot beat a time no lower than its own.
    _beaten: dict = dataclasses.field(default_factory=dict)

    def with_fresh_caches(self) -> "Context":
        """This context with every cache (the fields named with a leading underscore) empty:
        what a worker process starts from, so that it builds only what its own searches need."""
        return dataclasses.replace(self, **{f.name: type(getattr(self, f.name))()
                                            for f in dataclasses.fields(self) if f.name.startswith("_")})

    @property
    def sched(self) -> Schedule:
        return get_schedule(self.schedule)

    def sharing_terms(self, other: "Context") -> "Context":
        """This context with `other`'s caches of stage terms and sends (of the same cluster,
        model, profile and cost options, under another schedule: a stage's terms depend on
        its micro-batches in flight and deferred gradients and whether the schedule splits
        the backward, all in their keys, not on the schedule otherwise)."""
        same = (self.model, self.seq_len, self.chips, self.profile, self.options)
        if same != (other.model, other.seq_len, other.chips, other.profile, other.options):
            raise ValueError("contexts of different clusters, models or costs share no stage terms")
        return dataclasses.replace(self, _terms=other._terms, _sends=other._sends)

    def holds(self, i: int, p: int, m: int) -> tuple[float, int]:
        """(in flight, deferred) of position i of p under the schedule (the memory model's)."""
        return self.holds_row(p, m)[i]

    def holds_row(self, p: int, m: int) -> list[tuple[float, int]]:
        """`holds` of every position 0..p-1 of p (cached per p and m: a stage list's leaf
        asks it of each of its stages)."""
        key = ("holds row", p, m)
        row = self._caps.get(key)
        if row is None:
            row = self._caps[key] = [cm.memory_holds(self.schedule, j, p, m, self.v) for j in range(p)]
        return row

    def in_flight_row(self, p: int, m: int) -> np.ndarray:
        """`holds`' in-flight micro-batches at every position 0..p-1 of p (cached per p and m:
        the caps below take a block's slice of it, not one call per stage)."""
        key = ("in flight", p, m)
        row = self._caps.get(key)
        if row is None:
            row = self._caps[key] = np.array([held for held, _ in self.holds_row(p, m)], dtype=float)
        return row

    def fill_terms(self, t: cm.StageTerms, last: bool) -> tuple[float, float]:
        """(per layer, end) seconds of a stage's share of the schedule's fill."""
        cf, cb, cw = self._fill_coefficients()[last]
        return (cf * t.fwd_layer + cb * t.bwd_layer + cw * t.bwd_weight_layer,
                cf * t.fwd_end + cb * t.bwd_end + cw * t.bwd_weight_end)

    def _fill_coefficients(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """The schedule's fill coefficients of (f, b, w), scale included: (not last, last). Cached."""
        found = self._caps.get("fill coefficients")
        if found is None:
            form = self.sched.closed_form
            found = self._caps["fill coefficients"] = tuple(
                tuple(float(x) * form.fill_scale(self.v) for x in c) for c in (form.fill, form.fill_last))
        return found

    def terms(self, b: int, o: Option, first: bool, last: bool, in_flight: float, deferred: int = 0) -> cm.StageTerms:
        # by the chip's own name: a virtual type (chip_split.py) shares its chip's terms
        split = self.sched.splits_backward
        key = (b, self.chips[o.chip].name, o.data, o.tensor, o.recompute, first, last, in_flight, deferred, split)
        t = self._terms.get(key)
        if t is None:
            shape, work, memory = self._layer(b, o)
            t = cm.stage_terms(shape, first, last, in_flight, self.profile, self.options, deferred, split, work, memory)
            self._terms[key] = t
        return t

    def _layer(self, b: int, o: Option) -> tuple[StageShape, cm.LayerWork, mm.LayerMemory]:
        """The shape at micro-batch b, its `cm.layer_work` and its `memory_model.layer_memory`,
        made once: the work per chip, tokens a device sees, tensor size and recompute mode (every
        data size that gives as many tokens shares it), the shape and its memory per shape; all
        for every role and place of a stage."""
        chip = self.chips[o.chip]
        key = ("layer", chip.name, b, o.data, o.tensor, o.recompute)
        found = self._terms.get(key)
        if found is None:
            shape = StageShape(self.model, self.seq_len, b, chip, o.data, o.tensor, o.recompute)
            work_key = ("work", chip.name, b / o.data, o.tensor, o.recompute)
            work = self._terms.get(work_key)
            if work is None:
                work = self._terms[work_key] = cm.layer_work(
                    self.model, self.seq_len, shape.tokens, cm.calibrated(chip, self.profile),  # (as stage_terms)
                    o.tensor, o.recompute, self.profile)
            memory = mm.layer_memory(shape, self.options.shard_optimizer, self.options.optimizer, work.measured_act)
            found = self._terms[key] = (shape, work, memory)
        return found

    def layer_cap(self, t: cm.StageTerms) -> int:
        """The most layers a stage of these (cached) terms holds: the fit test's, cached."""
        key = ("cap", id(t.mem))  # t: one of self._terms' (alive)
        cap = self._caps.get(key)
        if cap is None:
            cap = self._caps[key] = t.mem.max_layers()
        return cap

    def position_caps(self, options: Sequence[Option], m: int) -> np.ndarray:
        """Per stage of a stage list, the most layers its shape holds as a middle stage with
        its position's in-flight micro-batches (the fit test's; a bound: an end stage or one
        with deferred weight gradients holds no more). Cached per block and position."""
        p, i, out = sum(o.stages for o in options), 0, []
        for o in options:
            out.append(self._block_caps(o, p, m, i))
            i += o.stages
        return np.concatenate(out)

    def block_cap_maxima(self, options: Sequence[Option], m: int) -> list[int]:
        """Per block of a stage list, the largest of its stages' `position_caps` (cached):
        the cap at the fewest in-flight micro-batches among its positions (a stage holds no
        more layers with more activations in flight: the fit test's bytes grow with them)."""
        p, i, out = sum(o.stages for o in options), 0, []
        for o in options:
            key = ("max", id(o.mem), p, m, i, o.stages)
            most = self._caps.get(key)
            if most is None:
                fewest = float(self.in_flight_row(p, m)[i: i + o.stages].min())
                most = self._caps[key] = int(o.max_layers(fewest))
            out.append(most)
            i += o.stages
        return out

    def _block_caps(self, o: Option, p: int, m: int, i: int) -> np.ndarray:
        """`position_caps` of one block at positions i.. of p (cached)."""
        key = (id(o.mem), p, m, i, o.stages)  # o.mem: one of the cached terms' (alive)
        caps = self._caps.get(key)
        if caps is None:
            held = self.in_flight_row(p, m)[i: i + o.stages]
            caps = self._caps[key] = np.atleast_1d(o.max_layers(held))
        return caps

    def send(self, b: int, s: Option, r: Option) -> float:
        key = (b, self.chips[s.chip].name, s.data, s.tensor, self.chips[r.chip].name, r.data, r.tensor)
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

    def type_blocks(self, b: int, two_shapes: bool) -> list[list[tuple[Option, ...]]]:
        """Per chip type (pipeline order), what it may run at micro-batch b: one option, or
        with `two_shapes` also two options (blocks placed anywhere in the pipeline, of any two
        shapes, each pair once), within the type's chips and the layers (the exhaustive
        reference's space; shapes not pruned)."""
        out = []
        for name, opts in zip(self.order, self.type_options(b, prune_unfit=False)):
            blocks: list[tuple[Option, ...]] = [(o,) for o in opts]
            if two_shapes:
                blocks += [
                    (f, k) for i, f in enumerate(opts) for k in opts[i:]
                    if f.chips + k.chips <= self.counts[name] and f.stages + k.stages <= self.model.n_layers
                ]
            out.append(blocks)
        return out

    def per_type(self, kind: str, name: str, b: int, make: Callable[[], Any]) -> Any:
        """`make()`, made once per kind, chip type (its name and chip count) and micro-batch size."""
        key = (kind, name, self.counts[name], b)
        if key not in self._per_type:
            self._per_type[key] = make()
        return self._per_type[key]

    def type_shapes(self, b: int, prune_unfit: bool) -> list[list[Option]]:
        """Per chip type, one option per shape (D, T, r) with its most stages, min(L, chips // D*T):
        all the bounds need (they see a shape through its largest k). Cached."""
        key = ("shapes", b, prune_unfit)
        if key not in self._options:
            self._options[key] = [
                self.per_type(f"shapes{prune_unfit:d}", name, b, lambda: self._shapes_of(name, b, prune_unfit))
                for name in self.order
            ]
        return self._options[key]

    def _shapes_of(self, name: str, b: int, prune_unfit: bool) -> list[Option]:
        """One chip type's shapes (`type_shapes`) at micro-batch b."""
        L = self.model.n_layers
        chip, count = self.chips[name], self.counts[name]
        opts = []
        for t in tensor_sizes(self.model, chip):
            for d in divisors(b):
                if d * t > count:
                    break
                for r in self.recompute:
                    probe = Option(name, 1, d, t, r, 0.0)
                    mid = self.terms(b, probe, False, False, 1)
                    most = mid.mem.max_layers()
                    if prune_unfit and most < 1:
                        continue
                    c = mid.fwd_layer + mid.bwd_layer
                    cap1 = min(L, most)
                    fill = min(self.fill_terms(mid, False)[0], self.fill_terms(mid, True)[0])
                    opts.append(Option(
                        name, min(L, count // (d * t)), d, t, r, c, mid.mem, cap1, mid.tail_layer, fill,
                    ))
        return opts


def micro_batches_of(global_batch: int, requested: Iterable[int] | None) -> list[int]:
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
    v: int = 1,
) -> Context:
    model = get_config(model)
    try:
        get_schedule(schedule).check_v(v)
    except ValueError as e:
        raise PlannerError(str(e)) from None
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlannerError(f"{name} must be a positive integer, got {value!r}")
    bad = [r for r in recompute if r not in RECOMPUTE_POLICIES]
    if bad or not recompute:
        raise PlannerError(f"recompute policies {list(recompute)} invalid; choose from {', '.join(RECOMPUTE_POLICIES)}")
    if profile is not None:
        profile.check_matches(model, seq_len)
    order = [c.name for c in pipeline_order(cluster)]
    return Context(
        model, seq_len, global_batch, schedule, dict(cluster.chips), dict(cluster.counts), order,
        profile, options, tuple(recompute), v,
    )



def candidate_plan(
    cand: Candidate,
    model: ModelConfig,
    seq_len: int,
    global_batch: int,
    schedule: str | None = None,
    optimizer: Optimizer = Optimizer(),
) -> Plan:
    """The plan of a candidate (its own schedule and chunks unless `schedule` names one)."""
    return Plan(
        model=model,
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch=cand.micro_batch,
        stages=tuple(cand.stages()),
        schedule=cand.schedule if schedule in (None, AUTO) else schedule,
        virtual_stages=cand.virtual_stages,
        optimizer=optimizer,
        model_name=preset_name(model),
    )


def chunk_ranges(layers: Sequence[int], v: int) -> list[tuple[tuple[int, int], ...]]:
    """Per stage, the layer ranges of its v chunks, given each stage's layer count: chunk c of
    stage i is virtual stage c*p + i, so the model's layers run through the stages v times;
    stage i's l_i layers split as evenly as possible over its chunks (the first ones larger;
    a chunk may be empty when l_i < v)."""
    p = len(layers)
    sizes = [[l // v + (c < l % v) for c in range(v)] for l in layers]
    out: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    start = 0
    for c in range(v):
        for i in range(p):
            out[i].append((start, start + sizes[i][c]))
            start += sizes[i][c]
    return [tuple(r) for r in out]

