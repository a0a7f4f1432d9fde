"""HeteroAuto's search: the fastest plan under the cost model, exactly.

The search itself is dual_search.py (boxes of steady/tail thresholds bounded by the
Lagrangian DP of positions.py, for 1F1B and GPipe). This module holds the space, one stage
list's exact layer split (`best_split`), the cheap per-micro-batch bound the search orders
micro-batch sizes by (the per-shape envelope and staircase), the exhaustive reference and
`top_k`, the entry point.

The space (the same for the search and `exhaustive=True`):

- a micro-batch size b among the divisors of the global batch;
- per chip type t, either nothing or an *option* (k, D, T, r): k >= 1 consecutive stages, each
  on a (data=D, tensor=T) mesh with recompute policy r, with D | b, T a divisor of
  chips_per_node that the model's heads and d_ff allow, and k*D*T <= the type's chip count
  (chips may stay unused);
- the pipeline order of the chosen types: any order (the first stage holds the embedding,
  the last the head and the loss; further from the end, 1F1B keeps more micro-batches in
  flight), so a set of j types runs in j! orders;
- a layer split: l_i >= 1 layers per stage, sum l_i = n_layers, every stage within memory.

With `mixed_shapes` a type may also run two options (blocks of any shapes, anywhere in the
pipeline) within its chips: `exhaustive=True` enumerates that space; the fast search proves
the one-shape space and then searches the wider one locally (mixed_shapes.py), and with
`prove_two_shapes` exactly (chip_split.py).

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
import itertools
import math
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from h2jax.config import ModelConfig, get_config, preset_name
from h2jax.plan import RECOMPUTE_POLICIES, Optimizer
from h2jax.planner import cost_model as cm
from h2jax.planner import chip_split, dual_search
from h2jax.planner.memory_model import GIB
from h2jax.planner.mixed_shapes import refine
from h2jax.planner.profile import Profile
from h2jax.planner.space import (  # noqa: F401  (re-exported: the planner's public names)
    Candidate, Context, Option, PlannerError, SearchStats, candidate_plan, divisors, make_context,
    micro_batches_of, pipeline_order, schedule_label, tensor_sizes,
)
from h2jax.planner.split import OutOfTime, TopK, best_split, solve, stage_list_sends  # noqa: F401
from h2jax.planner.workers import Pool
from h2jax.schedules import AUTO, get_schedule, variants
from h2jax.cluster import Cluster


def _search_dual(
    ctx: Context, micro_batches: Sequence[int], k: int, stats: SearchStats, deadline: float = math.inf,
    cutoff: float = math.inf, starts: int = 0, early: _EarlyClimb | None = None,
) -> list[Candidate]:
    """Boxes of (steady, tail) thresholds with Lagrangian bounds (dual_search.py); with a
    `cutoff`, only the plans faster than it. With `starts` > k, the k fastest are followed by
    others, up to `starts` in all (`_Starts`: the local search's); `early` (with them) climbs
    from the dives' plans before the boxes are searched (`_EarlyClimb`)."""
    top = TopK(k, cutoff) if starts <= k else _Starts(k, starts, cutoff, stats)
    after_dives = None if early is None else (lambda: early(top, stats))
    try:
        dual_search.search(ctx, micro_batches, top, stats, deadline, after_dives=after_dives)
    except OutOfTime:
        stats.proved_optimal = False
    return top.sorted()



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


# The exhaustive reference evaluates every layer split of every stage list, vectorised over a
# stage list's splits: beyond these it runs for hours or needs more memory than a machine has.
MAX_EXHAUSTIVE_SPLITS = 50_000_000
MAX_EXHAUSTIVE_ARRAY = 20_000_000  # splits of one stage list (one int64 row of p entries each)


def exhaustive_size(ctx: Context, micro_batches: Sequence[int], two_shapes: bool = False) -> tuple[int, int, int]:
    """(layer splits the exhaustive search evaluates, most splits of one stage list, the bytes
    of that stage list's split array), counted
    without enumerating: stage lists by their number of blocks j and stages p (a product of
    per-type polynomials), times the j! pipeline orders of the blocks and the C(L - 1, p - 1)
    splits of L layers over p stages."""
    L, total, largest, nbytes = ctx.model.n_layers, 0, 0, 0
    for b in micro_batches:
        lists = np.zeros((1, 1), dtype=object)  # lists[j, p]: sets of options, j blocks and p stages in all
        lists[0, 0] = 1
        for blocks in ctx.type_blocks(b, two_shapes):
            # per[n, k]: the type's entries of n blocks and k stages
            per = np.zeros((3, max((sum(o.stages for o in blk) for blk in blocks), default=0) + 1), dtype=object)
            for blk in blocks:
                per[len(blk), sum(o.stages for o in blk)] += 1
            grown = np.zeros((lists.shape[0] + 2, lists.shape[1] + per.shape[1] - 1), dtype=object)
            grown[: lists.shape[0], : lists.shape[1]] += lists  # the type not used
            for n in (1, 2):
                for k in range(1, per.shape[1]):
                    grown[n: n + lists.shape[0], k: k + lists.shape[1]] += lists * per[n, k]
            lists = grown
        for p in range(1, min(L, lists.shape[1] - 1) + 1):
            # each set of j blocks runs in j! pipeline orders
            count = sum(math.factorial(j) * int(lists[j, p]) for j in range(lists.shape[0]))
            if count:
                splits = math.comb(L - 1, p - 1)
                total += count * splits
                largest, nbytes = max(largest, splits), max(nbytes, splits * p * 8)
    return total, largest, nbytes


def check_exhaustive_size(ctx: Context, micro_batches: Sequence[int], two_shapes: bool = False) -> None:
    """Refuse --exhaustive up front, with its size, where it could not finish."""
    total, largest, nbytes = exhaustive_size(ctx, micro_batches, two_shapes)
    if total > MAX_EXHAUSTIVE_SPLITS or largest > MAX_EXHAUSTIVE_ARRAY:
        raise PlannerError(
            f"--exhaustive would evaluate {total:.3g} layer splits ({ctx.model.n_layers} layers; one stage list alone "
            f"has {largest:.3g} splits, {nbytes / 2**30:,.1f} GiB as one array); it checks the search on small "
            f"clusters and models (at most {MAX_EXHAUSTIVE_SPLITS:.0e} splits): drop --exhaustive (the search is exact "
            "under the same cost model) or check it on a smaller cluster or model"
        )


EXHAUSTIVE_CHUNK = 1 << 21  # (stage list, split, stage) entries evaluated in one batch


def _search_exhaustive(
    ctx: Context, micro_batches: Sequence[int], k: int, stats: SearchStats, two_shapes: bool = False
) -> list[Candidate]:
    """Every stage list and every layer split, no bounds, no pruning: the reference. With
    `two_shapes`, a chip type may also run two blocks (of any shapes, anywhere in the pipeline).

    Memory is checked with the memory model's fit test on each split (not its layer caps), and
    each split's time is evaluated from the stage terms with the schedule's closed form,
    vectorised over the splits of a batch of stage lists with the same number of stages.
    """
    L, top = ctx.model.n_layers, TopK(k)
    for b in micro_batches:
        m = ctx.global_batch // b
        per_type = ctx.type_blocks(b, two_shapes)
        rows = _StageRows(ctx, b, m)
        batches: dict[int, list] = {}  # stages -> stage lists waiting to be evaluated
        for combo in itertools.product(*[[None, *blocks] for blocks in per_type]):
            picked = [blk for blk in combo if blk is not None]
            p = sum(o.stages for blk in picked for o in blk)
            if not picked or p > L or ctx.sched.unsupported(p, m, ctx.v) is not None:
                continue
            waiting = batches.setdefault(p, [])
            # every pipeline order of the blocks (a type's two blocks anywhere)
            waiting.extend(itertools.permutations([o for blk in picked for o in blk]))
            if len(waiting) * len(_compositions(L, p)) * p >= EXHAUSTIVE_CHUNK:
                _exhaustive_lists(ctx, b, m, p, batches.pop(p), rows, top, k, stats)
        for p, waiting in batches.items():
            _exhaustive_lists(ctx, b, m, p, waiting, rows, top, k, stats)
    return top.sorted()


class _StageRows:
    """Per (option, position, stages) of one micro-batch size: the fit test at 0..L layers and
    the per-layer and end seconds (forward, backward, weight gradient, tail), computed once
    and kept as rows of two tables (stage lists share them)."""

    def __init__(self, ctx: Context, b: int, m: int):
        self.ctx, self.b, self.m = ctx, b, m
        self.index: dict = {}
        self.fit: list[np.ndarray] = []
        self.coef: list[tuple] = []

    def of(self, o: Option, i: int, p: int) -> int:
        key = (o, i, p)
        row = self.index.get(key)
        if row is None:
            t = self.ctx.terms(self.b, o, i == 0, i == p - 1, *self.ctx.holds(i, p, self.m))
            row = self.index[key] = len(self.fit)
            self.fit.append(np.asarray(t.mem.fits(np.arange(self.ctx.model.n_layers + 1))))
            self.coef.append((t.fwd_layer, t.fwd_end, t.bwd_layer, t.bwd_end, t.bwd_weight_layer,
                              t.bwd_weight_end, t.tail_layer, t.tail_end))
        return row


def _exhaustive_lists(
    ctx: Context, b: int, m: int, p: int, lists: list, rows: _StageRows, top: TopK, k: int, stats: SearchStats
) -> None:
    """Every layer split of stage lists of p stages each, vectorised; the k best offered to `top`."""
    L = ctx.model.n_layers
    stats.space_size += len(lists)
    stats.configs_visited += len(lists)
    shapes = [[o for o in chosen for _ in range(o.stages)] for chosen in lists]
    idx = np.array([[rows.of(o, i, p) for i, o in enumerate(sh)] for sh in shapes])  # (N, p)
    sends = np.array([stage_list_sends(ctx, b, chosen) for chosen in lists])  # (N, 2): largest, links
    splits = _compositions(L, p)  # (S, p)
    fit = np.array(rows.fit)[idx]  # (N, p, L + 1)
    ok = fit[:, np.arange(p)[None, :], splits].all(axis=-1)  # (N, S): every stage holds its layers
    stats.plans_evaluated += int(ok.sum())
    if not ok.any():
        return
    c = np.array(rows.coef)[idx][:, None, :, :]  # (N, 1, p, 8)
    fwd, bwd, wgt, tail = (splits * c[..., 2 * j] + c[..., 2 * j + 1] for j in range(4))  # (N, S, p)
    # the schedule's closed form itself (what cost_model.iteration_time evaluates)
    times = ctx.sched.closed_form.pipeline_time(
        fwd, bwd, wgt, sends[:, 1:2], sends[:, 0:1], m, ctx.v) + tail.max(axis=-1)
    times = np.where(ok, times, np.inf)
    split = times.argmin(axis=1)  # each list's best split (a top-k entry is a stage list)
    best = times[np.arange(len(lists)), split]
    for n in np.argsort(best, kind="stable")[:k]:
        if best[n] < top.bound:
            top.push(Candidate(float(best[n]), b, tuple(lists[n]), tuple(int(x) for x in splits[split[n]]),
                               ctx.schedule, ctx.v))


# ----------------------------------------------------------------------------- entry points


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
    virtual_stages: int | None = None,
    mixed_shapes: bool = False,
    prove_two_shapes: bool = False,
    workers: int = 1,
    proof_progress: Callable[[chip_split.ProofProgress], None] | None = None,
) -> tuple[list[Candidate], SearchStats]:
    """The k fastest stage lists (each with its best layer split), fastest first.

    Exact under the cost model: the fast search and `exhaustive=True` return the same times.
    With `time_limit_s` the fast search returns the best found when time runs out and
    `stats.proved_optimal` says it was stopped. `schedule="auto"` searches every registered
    schedule (and, for interleaved 1F1B, each v in VIRTUAL_STAGES unless `virtual_stages`
    names one) but those never faster than another one it searches (`Schedule.no_faster_than`,
    GPipe's 1F1B: `stats.schedules_left_out`), and returns the fastest plans over all of them;
    `stats.schedule_times` holds each one's best time; a time limit bounds the whole search,
    shared among them. With `workers` > 1 the schedules after the first are searched at once,
    in that many processes (`_Rest`), where the first's exact search took PARALLEL_AFTER_S:
    the same plans and times as one after the other.

    `mixed_shapes` lets a chip type's stages take two shapes: the fast search refines
    REFINE_STARTS of its plans, the best first (`_Starts`), by a local search
    (mixed_shapes.refine; `stats.one_shape_time_s` keeps the best plan with one shape per
    type, which is what `proved_optimal` speaks of) and
    the exhaustive reference enumerates every two-shape stage list. With one schedule and
    k = 1, on a space of more than WIDE_SPACE lists, the local search climbs from the exact
    search's first plans, before it searches its boxes, and the exact search then proves only
    that no one-shape plan beats the plan reached (`_EarlyClimb`; `stats.one_shape_proved`
    false where none did: `one_shape_time_s` is then the best one-shape plan found). `prove_two_shapes` (with
    `mixed_shapes`) then proves the best plan optimal in the two-shape space
    (chip_split.prove; `stats.two_shapes_proved`), within the time limit; `workers`
    processes search its nodes at once once it has run a second (spawned: they import the
    main module, so a script calls this under `if __name__ == "__main__":`), and
    `proof_progress` hears from it after each node (chip_split.ProofProgress). Several
    schedules (`auto`) are all searched first, then proved, the fastest plan's first; each
    later proof only shows that its schedule has no plan faster than the best before it
    (`_prove_all`). Ctrl-C during a proof stops it as the time limit does
    (`stats.two_shapes_stopped`): the proofs after it do not run (their two-shape optimum then
    has no bound but 0); Ctrl-C elsewhere raises KeyboardInterrupt as usual.
    """
    if k < 1:
        raise PlannerError(f"k must be >= 1, got {k}")
    if not isinstance(workers, int) or workers < 1:
        raise PlannerError(f"workers must be a whole number >= 1 (processes for the search), got {workers!r}")
    mixed_shapes = mixed_shapes or prove_two_shapes
    try:
        runs = variants(schedule)
    except ValueError as e:
        raise PlannerError(str(e)) from None
    if virtual_stages is not None:
        runs = [(n, virtual_stages if v > 1 else 1) for n, v in runs]
        runs = list(dict.fromkeys(runs))
    # a schedule never faster than another one searched (`Schedule.no_faster_than`): left out
    left_out = {schedule_label(n, v): get_schedule(n).no_faster_than for n, v in runs
                if get_schedule(n).no_faster_than in {other for other, _ in runs}}
    runs = [(n, v) for n, v in runs if schedule_label(n, v) not in left_out]
    if len(runs) == 1 and not left_out:
        return _top_k_one(cluster, model, seq_len, global_batch, k, *runs[0], exhaustive, profile,
                          micro_batches, recompute, options, time_limit_s, mixed_shapes, prove_two_shapes,
                          workers, proof_progress)
    stats = SearchStats(lower_bound_s=math.inf, schedules_left_out=left_out)
    errors: list[PlannerError] = []
    # One limit for the whole search: each schedule gets an equal share of the time left, so a
    # slow one cannot starve those after it (the proofs, after every search, take what is left:
    # `_prove_all`).
    started = time.perf_counter()
    end = None if time_limit_s is None else started + time_limit_s

    def share(done: int, of: int) -> float | None:
        return None if end is None else max(1e-3, (end - time.perf_counter()) / (of - done))

    # Each schedule after the first is searched only for plans faster than the best ones found
    # before it (`cutoff`: the k-th fastest one-shape plan so far of those that set one,
    # `_Searched.sets_cutoff`): the same plans and times, without proving the slower schedules' own optima (on 768 chips
    # their searches took 9 / 6 / 19 s alone). 1F1B goes first: under the cost model it wins
    # most often, and it is the cheapest to search.
    runs = sorted(runs, key=lambda run: run[0] != "1f1b")
    best_so_far = TopK(k)  # (a later schedule's local search starts from its lists that beat them)
    searched: list[_Searched] = []
    common = (cluster, model, seq_len, global_batch, k, exhaustive, profile, micro_batches, recompute, options)
    # the schedules after the first at once (`_Rest`), from the end of the first's exact search
    at_once = workers > 1 and not exhaustive and len(runs) > 2
    rest = _Rest(common, runs[1:], mixed_shapes, workers) if at_once else None

    def after_exact(ctx: Context, one_shape: list[Candidate]) -> None:  # the first's, before its local search
        if time.perf_counter() - started < PARALLEL_AFTER_S or not ctx.sched.closed_form.exact:
            return  # (a small search: one after the other; an inexact first sets no cutoff)
        cutoff = TopK(k)
        for cand in one_shape:
            cutoff.push(cand)
        rest.start(cutoff.bound, share(1, len(runs)), ctx)

    try:
        for idx, (name, v) in enumerate(runs):
            try:
                exact = rest.outcome(idx - 1) if idx and rest is not None and rest.started else None
                if isinstance(exact, PlannerError):
                    raise exact
                one = _search_one(cluster, model, seq_len, global_batch, k, name, v, exhaustive, profile,
                                  micro_batches, recompute, options, share(idx, len(runs)), mixed_shapes,
                                  best_so_far.bound, searched[0].ctx if searched else None, exact,
                                  after_exact if idx == 0 and rest is not None else None)
            except PlannerError as e:
                errors.append(e)
                continue
            searched.append(one)
            if one.sets_cutoff:
                for cand in one.one_shape:
                    best_so_far.push(cand)
    finally:
        if rest is not None:
            rest.close()
    if prove_two_shapes and not exhaustive:
        _prove_all(searched, k, end, workers, proof_progress)
    found: list[Candidate] = []
    for one in searched:
        st = one.stats
        found += one.found
        if one.found:
            stats.schedule_times[one.found[0].label] = one.found[0].time_s
        else:  # none faster than the cutoff: a lower bound on its best
            stats.schedule_bounds[one.label] = st.lower_bound_s
        for f in ("configs_visited", "plans_evaluated", "space_size", "bound_rows", "search_time_s"):
            setattr(stats, f, getattr(stats, f) + getattr(st, f))
        stats.proved_optimal &= st.proved_optimal
        stats.lower_bound_s = min(stats.lower_bound_s, st.lower_bound_s)
        if st.one_shape_time_s is not None:
            stats.one_shape_time_s = min(st.one_shape_time_s, stats.one_shape_time_s or math.inf)
            stats.one_shape_proved &= st.one_shape_proved
        if st.two_shapes_proved is not None:  # proved for every schedule: the best of them is proved
            stats.two_shapes_proved = st.two_shapes_proved and stats.two_shapes_proved is not False
            stats.two_shape_nodes += st.two_shape_nodes
            stats.two_shape_lower_bound_s = min(st.two_shape_lower_bound_s, stats.two_shape_lower_bound_s or math.inf)
            if not stats.proof_interrupted:  # a signal's stop says more
                stats.two_shapes_stopped = st.two_shapes_stopped or stats.two_shapes_stopped
    if not found:
        raise errors[0]
    # (the whole search's wall time: the schedules' own times add up to more where workers ran them)
    stats.search_time_s = time.perf_counter() - started
    found.sort(key=lambda c: c.time_s)
    found = _zb_h1_confirmed(found, cluster, model, seq_len, global_batch, profile, options, stats)
    return found[:k], stats


# ZB-H1's closed form is exact on uniform stages with at least as many micro-batches as stages
# (the paper's case), but with stages of different speeds, or fewer micro-batches than stages,
# it can fall short of what its order takes: it counts each stage's W's as hidden in bubbles
# the pipeline does not have (against the simulator, up to a third short on random 2-6-stage
# pipelines with m >= p, two thirds with one micro-batch; tests/test_planner.py), where
# 1F1B's and GPipe's are never short and interleaved 1F1B's a few percent at most. So when
# `auto`'s fastest is ZB-H1, the simulator -- which runs each schedule's own order -- decides
# between it and the fastest of the other schedules.
def _zb_h1_confirmed(found: list[Candidate], cluster, model, seq_len, global_batch, profile, options,
                     stats: SearchStats) -> list[Candidate]:
    best = found[0]
    other = next((c for c in found if c.schedule != best.schedule), None)
    if best.schedule != "zb-h1" or other is None:
        return found
    from h2jax.sim_plans import rerank_by_simulation

    # plans with the optimizer `options` models, so their costs are the search's
    optimizer = Optimizer(name=options.optimizer, shard_over_data=options.shard_optimizer)
    plans = [candidate_plan(c, get_config(model), seq_len, global_batch, optimizer=optimizer)
             for c in (best, other)]
    ranked = rerank_by_simulation(plans, cluster, profile)  # `--refine-with-sim`'s ranking: ties keep ZB-H1
    simulated = {id(plan): result.iteration_s for plan, result in ranked}
    stats.auto_simulated = {c.label: simulated[id(plan)] for c, plan in zip((best, other), plans)}
    if ranked[0][0] is plans[1]:
        return [other] + [c for c in found if c is not other]
    return found


# The local search over two shapes per type (mixed_shapes.refine) climbs from this many of the
# best one-shape stage lists (measured on random tiny clusters where two shapes win: from the
# best alone it reached the two-shape optimum in 8 of 11, from the best 3 in 10; one of the 12
# now needs the third, at another micro-batch size, climbing against its own time). On a
# space of more than WIDE_SPACE lists the starts after the best are the exact search's
# incumbents, not its proved next best (`_Starts`), and only those within START_GAP of the
# best: on the 84 random clusters of `benchmarks/planner.py --random-shipped` (seeds 42 and
# 8, two shapes, exploratory, 2026-12-07), 45 with a space that large, a later start improved
# the best plan in 6, each within 0.62 % of the best; none of the 20 starts 1.6 % to 16 %
# slower did, and they cost 4.8 s of 98 s (up to 0.98 s on one cluster); each climbs only
# through lists faster than the best plan so far (mixed_shapes.refine). On a smaller space
# every start climbs (there one 1.5 % slower improved the best, by 0.44 %).
REFINE_STARTS = 3
START_GAP = 0.01


# Where the one-shape space holds at most this many stage lists the local search searches
# wider: it also climbs from the best one-shape lists of the micro-batch sizes beside the
# best's (`_neighbour_starts`: there a stage more or fewer changes a plan the most, and these
# searches are cheap), and a climb that no move improves tries once more with a type's new
# block at any place in the pipeline, not only beside its kept stages or its neighbour, and
# then looks two moves ahead from the best list it found (`mixed_shapes.refine`'s `wide`,
# `mixed_shapes._look_ahead`: about 0.3 s more on the 64-chip cluster). Measured, 1F1B,
# llama-100b: on the 64-chip cluster, 6.4e5 lists, the neighbour starts find the two-shape
# optimum, 2.2 % faster, for 0.35 s more; on
# the 768-, 1,024- and 2,432-chip clusters, 9e10 to 3e15 lists, they found nothing faster and
# would cost 0.5 to 2 s, and new blocks anywhere 0.15 s more at 2,432 chips. On random small
# clusters of shipped chips (`benchmarks/planner.py --random-two-shapes`; 3e4 to 7e8 lists)
# both together reach the proved two-shape optimum in more of them (figures: docs/planner.md).
WIDE_SPACE = 10**9


def _near_the_best(plans: Sequence[Candidate]) -> list[Candidate]:
    """The local search's starts on a large space: the first REFINE_STARTS of `plans`
    (fastest first) within START_GAP of the first."""
    return [c for c in plans[:REFINE_STARTS] if c.time_s <= plans[0].time_s * (1 + START_GAP)]


def _small_space(stats: SearchStats) -> bool:
    """Whether the one-shape space the search has met (`stats.space_size`) holds at most
    WIDE_SPACE lists: what `_Starts` prunes by and how widely the local search searches."""
    return stats.space_size <= WIDE_SPACE


class _Starts:
    """The exact search's top k (a TopK to the search) that also keeps the local search's
    starts, the `n` fastest plans that entered it (`sorted()`: the k fastest first). While the
    one-shape space the search has met holds at most WIDE_SPACE lists (`stats.space_size`,
    counted as it builds each micro-batch size's tables), the bound a plan must beat is the
    n-th fastest's, so on a small space they are its n fastest, proved. Beyond it, the bound
    tightens to the k-th fastest's (a search whose bound only falls stays exact), and the
    starts after the k fastest are plans that beat the k-th fastest when offered (the
    search's incumbents as it went), not necessarily the next fastest of the space: proving
    those would cost the large search its tighter bound (on 1,024 chips the whole two-shape
    search took 0.57 s against 0.89 s, side by side), and the climbs from the incumbents
    reached the same plans (figures: docs/planner.md)."""

    def __init__(self, k: int, n: int, cutoff: float, stats: SearchStats) -> None:
        self.best, self.starts, self.stats, self.cutoff = TopK(k, cutoff), TopK(n, cutoff), stats, cutoff
        self.ceiling = math.inf  # a plan of the two-shape space known (`_EarlyClimb`): none slower counts

    @property
    def _ranked(self) -> TopK:
        """The plans whose bound the search prunes by."""
        return self.starts if _small_space(self.stats) else self.best

    @property
    def bound(self) -> float:
        return min(self._ranked.bound, self.ceiling)

    @property
    def heap(self) -> list:
        return self._ranked.heap

    @property
    def k(self) -> int:
        return self._ranked.k

    def push(self, cand: Candidate) -> None:
        if cand.time_s < self.bound:
            self.starts.push(cand)
        self.best.push(cand)

    def sorted(self) -> list[Candidate]:
        return self.starts.sorted()


class _EarlyClimb:
    """On a large one-shape space (more than WIDE_SPACE lists), with k = 1: the local search
    from the exact search's first plans, those its dives found (`dual_search.search`'s
    `after_dives`), before it searches its boxes. The plan it reaches (`plan`) is the
    search's ceiling (`_Starts.ceiling`): the exact search then proves only that no one-shape
    plan beats it (and finds any that does: `_search_one` climbs from those too), not the
    one-shape optimum itself, a proof that on 2,432 chips took about as long again
    (`stats.one_shape_proved` says which was proved). The climb passes through one-shape lists
    as well (the exact search has not yet proved them slower)."""

    def __init__(self, ctx: Context, micro_batches: Sequence[int], deadline: float) -> None:
        self.ctx, self.micro_batches, self.deadline = ctx, micro_batches, deadline
        self.plan: Candidate | None = None

    def __call__(self, top: _Starts, stats: SearchStats) -> None:
        if _small_space(stats) or not top.heap or top.k != 1:
            return  # (a small space: its n fastest one-shape lists proved first, then climbed from)
        proved, stats.proved_optimal = stats.proved_optimal, False  # (one-shape lists climbed through)
        try:
            plans = [refine(self.ctx, [c], self.micro_batches, stats, self.deadline)
                     for c in top.sorted()[:REFINE_STARTS]]
        finally:
            stats.proved_optimal = proved
        self.plan = min(plans, key=lambda c: c.time_s)
        top.ceiling = self.plan.time_s


def _neighbour_starts(ctx: Context, b: int, micro_batches: Sequence[int], starts: Sequence[Candidate],
                      deadline: float) -> list[Candidate]:
    """The local search's starts beside `starts` (the best one-shape lists, the best at
    micro-batch b): the best one-shape list at each micro-batch size next to b (the next
    smaller and larger of `micro_batches`) no start has, each found by the exact search at that
    size alone. Two shapes per type can move the best micro-batch size: on the 64-chip cluster
    the one-shape optimum runs 1, the two-shape one 2, where the best one-shape list is 16 %
    slower than at 1 (and 2 is not among the best three's sizes)."""
    sizes = sorted(micro_batches)
    at = sizes.index(b)
    have = {c.micro_batch for c in starts}
    out = []
    for b2 in sizes[max(at - 1, 0): at] + sizes[at + 1: at + 2]:
        if b2 not in have:
            out += _search_dual(ctx, [b2], 1, SearchStats(), deadline, math.inf)
    return out


@dataclasses.dataclass
class _Searched:
    """One schedule's search, before its two-shape proof: its plans (fastest first; none where
    none beat its cutoff), its exact search's one-shape plans, stats, context and micro-batch
    sizes (what the proof needs), and the deadline it ran under."""

    found: list[Candidate]
    one_shape: list[Candidate]
    stats: SearchStats
    ctx: Context
    micro_batches: list[int]
    deadline: float

    @property
    def label(self) -> str:
        return schedule_label(self.ctx.schedule, self.ctx.v)

    @property
    def sets_cutoff(self) -> bool:
        """Whether its plans bound the schedules after it: not where its closed form is not
        exact (ZB-H1's can be short: the simulator may yet reject its plan, and the fastest
        plan of the others must then be known)."""
        return self.ctx.sched.closed_form.exact


def _search_one(
    cluster, model, seq_len, global_batch, k, schedule, v, exhaustive, profile, micro_batches, recompute,
    options, time_limit_s, mixed_shapes=False, cutoff=math.inf, terms_of=None, exact=None, after_exact=None,
    climb_early=False,
) -> _Searched:
    """One schedule's exact search (and, with `mixed_shapes`, the local search over two shapes
    from its best one-shape lists); with a `cutoff`, only for plans faster than it (none found:
    `found` empty, `stats.lower_bound_s` at least the cutoff where the search finished).
    `terms_of`: another schedule's context of the same search, whose stage terms it shares.
    `exact`: the exact search's (plans, stats), made elsewhere (`_exact_search`, in a worker)
    with a cutoff no lower than this one: its plans under this cutoff are this search's.
    `after_exact(ctx, plans)` hears the exact search's plans before the local search starts.
    `climb_early` (one schedule, k = 1, no cutoff): on a large space the local search runs
    from the exact search's first plans, and the exact search then proves only that no
    one-shape plan beats the plan it reached (`_EarlyClimb`)."""
    ctx = _context(cluster, model, seq_len, global_batch, schedule, v, profile, options, recompute, terms_of)
    mbs = micro_batches_of(global_batch, micro_batches)
    stats = SearchStats()
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s if time_limit_s is not None else math.inf
    if exhaustive:
        check_exhaustive_size(ctx, mbs, mixed_shapes)
        found = [c for c in _search_exhaustive(ctx, mbs, k, stats, mixed_shapes) if c.time_s < cutoff]
        one_shape = found
        stats.lower_bound_s = found[0].time_s if found else cutoff
    else:
        # two shapes: the local search starts from REFINE_STARTS one-shape lists (`_Starts`)
        early = _EarlyClimb(ctx, mbs, deadline) if (
            climb_early and mixed_shapes and k == 1 and exact is None and math.isinf(cutoff)) else None
        found, stats = _exact(ctx, mbs, k, mixed_shapes, deadline, cutoff, early) if exact is None else exact
        # (`exact`, a worker's, was made under a cutoff no lower: its k' fastest under this one
        # are the k' fastest under it; a search made here has none to drop)
        found = [c for c in found if c.time_s < cutoff]
        t0 = time.perf_counter() - stats.search_time_s  # (the exact search's time, wherever it ran)
        one_shape = found
        if not found and stats.proved_optimal:
            stats.lower_bound_s = cutoff  # (infinite without one: nothing fits, below)
        if after_exact is not None:
            after_exact(ctx, one_shape)
        if early is not None and early.plan is not None:
            found = [_after_early_climb(ctx, mbs, found, early.plan, stats, deadline)]
        elif mixed_shapes and found:
            stats.one_shape_time_s = found[0].time_s
            starts = found[:REFINE_STARTS]
            wide = _small_space(stats)
            if wide:
                starts = starts + _neighbour_starts(ctx, found[0].micro_batch, mbs, starts, deadline)
            else:
                starts = _near_the_best(found)
            better = refine(ctx, starts, mbs, stats, deadline, wide)
            found = [better] + [c for c in found if c is not better][: k - 1]
    stats.search_time_s = time.perf_counter() - t0
    if not found and math.isfinite(cutoff):  # beaten (or not proved beaten where time ran out)
        return _Searched([], [], stats, ctx, mbs, deadline)
    if not found and not stats.proved_optimal:
        raise PlannerError(
            f"the search ran out of its time limit ({time_limit_s} s) before finding any plan; "
            "raise the time limit (--time-limit) or plan fewer chip types"
        )
    if not found:
        raise PlannerError(explain_unfit(ctx, mbs))
    stats.schedule_times[found[0].label] = found[0].time_s
    return _Searched(found, one_shape, stats, ctx, mbs, deadline)


def _after_early_climb(ctx: Context, micro_batches: Sequence[int], one_shape: list[Candidate], plan: Candidate,
                       stats: SearchStats, deadline: float) -> Candidate:
    """After the exact search under `_EarlyClimb`'s `plan`: the best one-shape plan found
    (`one_shape`, fastest first: the dives' plans and any the search found faster than
    `plan`) is the one-shape optimum only where it is no slower than `plan` (where the climb
    found nothing faster than its start, or it beats `plan`: `stats.one_shape_proved`); the
    local search climbs from those that beat it, and the faster of its plan and `plan` wins."""
    stats.one_shape_time_s = one_shape[0].time_s
    beat = [c for c in one_shape if c.time_s < plan.time_s]
    stats.one_shape_proved = stats.proved_optimal and one_shape[0].time_s <= plan.time_s
    if not beat:
        return plan
    better = refine(ctx, _near_the_best(beat), micro_batches, stats, deadline)
    return better if better.time_s < plan.time_s else plan


def _context(cluster, model, seq_len, global_batch, schedule, v, profile, options, recompute,
             terms_of: Context | None) -> Context:
    """One schedule's search context, sharing `terms_of`'s stage terms where given (another
    schedule's context of the same search)."""
    ctx = make_context(cluster, model, seq_len, global_batch, schedule, profile, options, recompute, v)
    return ctx if terms_of is None else ctx.sharing_terms(terms_of)


def _exact(ctx: Context, micro_batches: Sequence[int], k: int, mixed_shapes: bool, deadline: float,
           cutoff: float, early: _EarlyClimb | None = None) -> tuple[list[Candidate], SearchStats]:
    """The exact one-shape search (dual_search) for the k fastest plans under `cutoff`, with
    `mixed_shapes` followed by the local search's other starts (`_Starts`, REFINE_STARTS in
    all), and `early` climbing from its first plans; its stats, with its time."""
    stats = SearchStats()
    t0 = time.perf_counter()
    found = _search_dual(ctx, micro_batches, k, stats, deadline, cutoff, REFINE_STARTS if mixed_shapes else k,
                         early)
    stats.search_time_s = time.perf_counter() - t0
    return found, stats


# `--schedule auto` searches the schedules after the first at once (`workers` > 1) only where
# the first took this long: on a small cluster, starting processes costs more than they save
# (on 2,432 chips the first, 1F1B, takes ~0.8 s and the rest ~3 s together)
PARALLEL_AFTER_S = 0.25


class _Rest:
    """The exact searches of `runs` (`--schedule auto`'s schedules after the first) at once,
    each for plans faster than the first's (`start`'s cutoff): workers - 1 of them each in a
    process of its own, ZB-H1's first (the dearest: 1.5 s against 0.9 s for each interleaved
    1F1B on 2,432 chips), the rest here, one after the other, once the first's local search is
    done (`outcome`): the processes start while it runs.

    Searched one after the other, each would have had the cutoff of every schedule before it,
    no higher: `_search_one` keeps the plans under that, the same as it would have found
    itself, and runs the local search from them."""

    def __init__(self, common: tuple, runs: Sequence[tuple[str, int]], mixed_shapes: bool, workers: int) -> None:
        self.common, self.runs, self.mixed_shapes = common, list(runs), mixed_shapes
        order = sorted(range(len(runs)), key=lambda i: runs[i][0] != "zb-h1")
        n_away = min(workers - 1, len(runs) - 1)
        self.away, self.here = order[:n_away], order[n_away:]
        self.pool: Pool | None = None
        self.futures: dict = {}
        self.out: dict[int, Any] | None = None
        self.started = False

    def start(self, cutoff: float, time_limit_s: float | None, terms_of: Context) -> None:
        self.cutoff, self.time_limit_s, self.terms_of, self.started = cutoff, time_limit_s, terms_of, True
        self.pool = Pool(len(self.away), "the search of a schedule")
        self.futures = {i: self.pool.submit(_exact_search, self.common, *self.runs[i], self.mixed_shapes, cutoff,
                                            time_limit_s) for i in self.away}

    def outcome(self, i: int) -> Any:
        """Run i's (plans, stats) or its PlannerError."""
        if self.out is None:
            self.out = {j: _exact_search(self.common, *self.runs[j], self.mixed_shapes, self.cutoff,
                                         self.time_limit_s, self.terms_of) for j in self.here}
            self.out.update((j, self.pool.result(future)) for j, future in self.futures.items())
            self.close()
        return self.out[i]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def _exact_search(common: tuple, schedule: str, v: int, mixed_shapes: bool, cutoff: float,
                  time_limit_s: float | None, terms_of: Context | None = None,
                  ) -> tuple[list[Candidate], SearchStats] | PlannerError:
    """One schedule's exact search (`_exact`; `_Rest`: in a worker, or here sharing `terms_of`'s
    stage terms), or the PlannerError it raised."""
    cluster, model, seq_len, global_batch, k, _, profile, micro_batches, recompute, options = common
    deadline = time.perf_counter() + time_limit_s if time_limit_s is not None else math.inf
    try:
        ctx = _context(cluster, model, seq_len, global_batch, schedule, v, profile, options, recompute, terms_of)
        return _exact(ctx, micro_batches_of(global_batch, micro_batches), k, mixed_shapes, deadline, cutoff)
    except PlannerError as e:
        return e


def _prove(one: _Searched, k: int, deadline: float, workers: int, progress, cutoff: float = math.inf) -> None:
    """The two-shape proof of one schedule's search (chip_split.prove, from its best plan;
    `cutoff`: the best time of the schedules proved before it), its plan first in `one.found`."""
    t0 = time.perf_counter()
    best = one.found[0] if one.found else None
    better = chip_split.prove(one.ctx, one.micro_batches, best, one.stats, deadline, workers, progress, cutoff)
    if better is not None:
        one.found = [better] + [c for c in one.found if c is not better][: k - 1]
        one.stats.schedule_times[better.label] = better.time_s
    one.stats.search_time_s += time.perf_counter() - t0


PROOF_RESERVE = 0.05  # under auto, each proof keeps this share of the proofs' time for each one after it


def _prove_all(searched: list[_Searched], k: int, end: float | None, workers: int, progress) -> None:
    """The two-shape proofs of several schedules' searches (`--schedule auto`), the fastest
    plan's first: each proves only that no plan of its schedule beats the best found before it
    (`cutoff`), which is all the fastest plan's proof needs of it, and far less than its own
    optimum. Each may run until `end` (the time limit's) less PROOF_RESERVE of the proofs' time
    for each proof after it: the first, the longest (it proves the best plan's own optimum),
    gets most of the time, and a slow one still leaves the later ones time to bound theirs.
    After Ctrl-C stops one, the rest are not proved: their two-shape optimum has no bound but 0."""
    cutoff, interrupted = math.inf, None
    todo = sorted(searched, key=lambda one: one.found[0].time_s if one.found else math.inf)
    total = None if end is None else end - time.perf_counter()
    for idx, one in enumerate(todo):
        if interrupted:
            st = one.stats
            st.two_shapes_proved, st.two_shape_lower_bound_s, st.two_shapes_stopped = False, 0.0, interrupted
            continue
        deadline = math.inf if end is None else max(
            end - (len(todo) - idx - 1) * PROOF_RESERVE * total, time.perf_counter() + 1e-3)
        _prove(one, k, deadline, workers, progress, cutoff)
        if one.found and one.sets_cutoff:
            cutoff = min(cutoff, one.found[0].time_s)
        if one.stats.proof_interrupted:
            interrupted = one.stats.two_shapes_stopped


def _top_k_one(
    cluster, model, seq_len, global_batch, k, schedule, v, exhaustive, profile, micro_batches, recompute,
    options, time_limit_s, mixed_shapes=False, prove_two_shapes=False, workers=1, proof_progress=None,
) -> tuple[list[Candidate], SearchStats]:
    one = _search_one(cluster, model, seq_len, global_batch, k, schedule, v, exhaustive, profile, micro_batches,
                      recompute, options, time_limit_s, mixed_shapes, climb_early=True)
    if prove_two_shapes and not exhaustive:  # (out of time already where the search was: the root's bound)
        _prove(one, k, one.deadline, workers, proof_progress)
    return one.found, one.stats


def explain_unfit(ctx: Context, micro_batches: Sequence[int]) -> str:
    """Why nothing fits: per chip type, the most layers a stage holds in the most lenient shape
    the search may use (largest tensor size, most lenient recompute policy allowed), as a middle
    stage and as the first (embedding) and last (head) stage."""
    model, L, b = ctx.model, ctx.model.n_layers, min(micro_batches)
    name = preset_name(model) or "the model"
    policy = next(r for r in ("full", "selective", "none") if r in ctx.recompute)
    lines, total, end_loss = [], 0, [math.inf, math.inf]
    # the last stage's activations in flight (1F1B: one micro-batch; GPipe: all m of them)
    in_flight = ctx.sched.position_in_flight(1, ctx.global_batch // b, ctx.v)
    gpipe = in_flight > 1
    for chip_name in ctx.order:
        chip, count = ctx.chips[chip_name], ctx.counts[chip_name]
        t = max(x for x in tensor_sizes(model, chip) if x <= count)
        d = max(x for x in divisors(b) if x * t <= count)
        probe = Option(chip_name, 1, d, t, policy, 0.0)
        mem = ctx.terms(b, probe, False, False, in_flight).mem
        fits = max(mem.max_layers(), 0)
        first, last = (max(ctx.terms(b, probe, f, la, in_flight).mem.max_layers(), 0) for f, la in ((True, False), (False, True)))
        per_layer = mem.per_layer / GIB
        room = (mem.capacity - mem.reserve - mem.working) / GIB
        stages = count // (d * t)
        total += fits * min(stages, L)
        if stages:  # the pipeline's first and last stages hold less than a middle one
            end_loss = [min(end_loss[0], fits - first), min(end_loss[1], fits - last)]
        lines.append(
            f"{chip_name}: a stage with recompute={policy}, tensor={t}, data={d}, micro-batch {b} and "
            f"{in_flight:g} micro-batch(es) in flight holds at most {fits} layer(s) as a middle stage, "
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
        + (f" (or --schedule 1f1b: {ctx.schedule} keeps more micro-batches' activations until their backward)."
           if gpipe else ".")
    )

