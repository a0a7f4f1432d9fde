"""HeteroAuto end to end: search a cluster, fill the plan's `predicted`, compare with baselines."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

from h2jax.cluster import Cluster
from h2jax.config import ModelConfig, get_config
from h2jax.planner.hosts import assign_hosts
from h2jax.plan import RECOMPUTE_POLICIES, Optimizer, Plan
from h2jax import names as N
from h2jax.planner import cost_model as cm
from h2jax.planner.baselines import Baseline, hetero_speedup_ratio, homogeneous_baselines
from h2jax.planner.chip_split import ProofProgress
from h2jax.planner.memory_model import GIB
from h2jax.planner.profile import Profile
from h2jax.planner.search import Candidate, PlannerError, SearchStats, candidate_plan, top_k
from h2jax.planner.space import chunk_ranges
from h2jax.schedules import get_schedule


@dataclasses.dataclass
class PlanResult:
    plan: Plan  # the best plan, `predicted` filled
    candidates: list[Candidate]  # the top-k stage lists, fastest first (candidates[0] is `plan`)
    stats: SearchStats
    baselines: dict[str, Baseline]  # each chip type alone at the same global batch
    hetero_speedup_ratio: float | None
    uniform_split: dict[str, Any] | None  # the same stages with layers split evenly, for contrast
    fixed_batch_baselines: dict[str, Baseline] | None = None  # paper-style, batch-mismatched
    cluster: Cluster | None = None  # where the candidates' hosts come from

    def candidate_plans(self) -> list[Plan]:
        """The top-k candidates as plans (no `predicted`), fastest first under the cost model."""
        p = self.plan
        plans = [candidate_plan(c, p.model, p.seq_len, p.global_batch, optimizer=p.optimizer) for c in self.candidates]
        return plans if self.cluster is None else [assign_hosts(q, self.cluster) for q in plans]


def predict(
    plan: Plan,
    cluster: Cluster,
    profile: Profile | None = None,
    options: cm.CostOptions | None = None,
) -> dict[str, Any]:
    """The figures `predicted` holds, computed through the public stage_costs/iteration_time."""
    options = options or cm.CostOptions.of(plan)
    costs = cm.stage_costs(plan, cluster, profile, options)
    terms = cm.plan_stage_terms(plan, cluster, profile, options)
    t = cm.iteration_time(costs, plan.n_micro, plan.schedule, plan.virtual_stages)
    # what the search optimised, where the schedule's closed form is not exact (ZB-H1: t
    # replays its order)
    closed = None if get_schedule(plan.schedule).closed_form.exact else cm.iteration_time(
        costs, plan.n_micro, plan.schedule, plan.virtual_stages, closed_form=True)
    tokens_per_s = plan.tokens_per_step / t
    used = Counter()
    for s in plan.stages:
        used[s.chip] += s.mesh.size
    peak = sum(cluster.chips[c].peak_tflops * 1e12 * n for c, n in used.items())
    memory = [term.mem.total_bytes(s.n_layers) for term, s in zip(terms, plan.stages)]
    for i, (mem, term) in enumerate(zip(memory, terms)):
        if not term.mem.fits(plan.stages[i].n_layers):  # never emit a plan that does not fit
            raise PlannerError(
                f"stages[{i}] needs {mem / GIB:.2f} GiB per chip but {plan.stages[i].chip} has "
                f"{term.mem.capacity / GIB:.2f} GiB; this is a planner bug, please report it"
            )
    return {
        N.STEP_TIME_S: t,
        **({} if closed is None else {N.CLOSED_FORM_STEP_TIME_S: closed}),
        N.TOKENS_PER_S: tokens_per_s,
        N.TOKENS_PER_CHIP_PER_S: tokens_per_s / cluster.n_chips,
        N.TOKENS_PER_USED_CHIP_PER_S: tokens_per_s / sum(used.values()),
        "mfu": cm.model_flops_per_token(plan.model, plan.seq_len) * tokens_per_s / peak,
        "bubble_fraction": cm.bubble_fraction(costs, plan.n_micro, plan.schedule, plan.virtual_stages),
        "n_micro": plan.n_micro,
        "memory_gib": [m / GIB for m in memory],
        "memory_capacity_gib": [term.mem.capacity / GIB for term in terms],
        "chips_used": dict(used),
        "chips_unused": {c: n - used.get(c, 0) for c, n in cluster.counts.items() if n - used.get(c, 0)},
        "cost_model": "profile" if profile is not None else "analytical",
        "optimizer_sharded_over_data": options.shard_optimizer,
    }


# `plan_cluster` searches the baselines at once (`workers` > 1) where its own search took this
# long: on the 768-chip cluster and up each type alone takes tenths of a second (auto, two
# shapes), on 64 chips hundredths, and starting processes would cost more than they save
BASELINES_AT_ONCE_AFTER_S = 1.5


def plan_cluster(
    cluster: Cluster,
    model: ModelConfig | str,
    seq_len: int,
    global_batch: int,
    schedule: str = "1f1b",
    exhaustive: bool = False,
    profile: Profile | None = None,
    *,
    k: int = 1,
    micro_batches: Iterable[int] | None = None,
    recompute: Sequence[str] = RECOMPUTE_POLICIES,
    optimizer: Optimizer = Optimizer(),
    shard_optimizer: bool = True,
    baselines: bool = True,
    baseline_global_batch: int | None = None,
    time_limit_s: float | None = None,
    virtual_stages: int | None = None,
    mixed_shapes: bool = True,
    prove_two_shapes: bool = False,
    workers: int = 1,
    proof_progress: Callable[[ProofProgress], None] | None = None,
) -> PlanResult:
    """The fastest plan for `cluster` under the cost model, with homogeneous baselines.

    `global_batch` is in sequences. `k` > 1 keeps the k best stage lists in `candidates`
    (for re-ranking with the simulator). `baseline_global_batch` adds paper-style baselines at
    a different batch, labelled batch-mismatched; the ratio always uses the matched ones.
    `mixed_shapes` (default) lets a chip type's stages take two shapes (search.top_k);
    `prove_two_shapes` proves the plan optimal among those (chip_split.prove, within the time
    limit; `proof_progress` hears from the plan's proof after each node). `workers`: processes
    the search may use at once (search.top_k: `--schedule auto`'s schedules after the first,
    the proof's nodes; and the baselines, each type in a process of its own, where the plan's
    search took BASELINES_AT_ONCE_AFTER_S and proved nothing): the same plan with any number.
    The baselines are searched the same way, but not proved where Ctrl-C stopped the plan's
    proof (search.top_k: the plan is then the best found).
    """
    model = get_config(model)
    optimizer = dataclasses.replace(optimizer, shard_over_data=shard_optimizer)  # the plan records it
    options = cm.CostOptions.of_optimizer(optimizer)
    search_kwargs = dict(
        schedule=schedule, exhaustive=exhaustive, profile=profile,
        micro_batches=micro_batches, recompute=recompute, options=options, time_limit_s=time_limit_s,
        virtual_stages=virtual_stages, mixed_shapes=mixed_shapes, prove_two_shapes=prove_two_shapes,
        workers=workers,
    )
    candidates, stats = top_k(cluster, model, seq_len, global_batch, k=k, proof_progress=proof_progress,
                              **search_kwargs)
    if stats.proof_interrupted:  # Ctrl-C stopped the proof: the baselines are not proved either
        search_kwargs["prove_two_shapes"] = False
    best = candidates[0]
    plan = candidate_plan(best, model, seq_len, global_batch, optimizer=optimizer)
    predicted = predict(plan, cluster, profile, options)
    searched = predicted.get(N.CLOSED_FORM_STEP_TIME_S, predicted[N.STEP_TIME_S])
    if not math.isclose(searched, best.time_s, rel_tol=1e-9):
        raise PlannerError(
            f"internal: search predicted {best.time_s} s but stage_costs gives "
            f"{searched} s for the same plan; please report this"
        )
    predicted.update(
        search_time_s=stats.search_time_s,
        plans_evaluated=stats.plans_evaluated,
        configs_visited=stats.configs_visited,
        space_size=stats.space_size,
        proved_optimal=stats.proved_optimal,
        lower_bound_s=stats.lower_bound_s,
        exhaustive=exhaustive,
    )
    if stats.one_shape_time_s is not None:  # the best plan with one shape per type (the search's objective)
        predicted["one_shape_step_time_s"] = stats.one_shape_time_s
        predicted["one_shape_proved"] = stats.one_shape_proved  # (False: the best one-shape plan found)
        predicted["two_shapes_faster_by"] = 1.0 - best.time_s / stats.one_shape_time_s
    if stats.two_shapes_proved is not None:  # prove_two_shapes: the two-shape space's proof
        predicted["two_shapes_proved"] = stats.two_shapes_proved
        predicted["two_shape_lower_bound_s"] = stats.two_shape_lower_bound_s
        predicted["two_shape_nodes"] = stats.two_shape_nodes
        if stats.two_shapes_stopped is not None:
            predicted["two_shapes_stopped_by"] = stats.two_shapes_stopped
    if len(stats.schedule_times) + len(stats.schedule_bounds) > 1:  # --schedule auto: each schedule's best, the plan's first, then fastest first
        predicted["schedule_times_s"] = dict(sorted(stats.schedule_times.items(),
                                                    key=lambda kv: (kv[0] != best.label, kv[1])))
    if stats.schedule_bounds:  # --schedule auto: schedules with no plan faster than the best before them
        predicted["schedule_bounds_s"] = dict(stats.schedule_bounds)
    if stats.schedules_left_out:  # --schedule auto: schedules never faster than one searched
        predicted["schedules_left_out"] = dict(stats.schedules_left_out)
    if stats.auto_simulated:  # ZB-H1 fastest under the cost model: the simulator's step of it and the next
        predicted["auto_simulated_s"] = dict(stats.auto_simulated)

    base: dict[str, Baseline] = {}
    ratio = None
    fixed = None
    # the baselines at once, each in a process of its own, where the plan's search took long
    # enough that each type alone takes a good part of a second (and not proved: the proofs
    # use the processes themselves)
    large = stats.search_time_s >= BASELINES_AT_ONCE_AFTER_S
    at_once = workers if large and not search_kwargs["prove_two_shapes"] else 1
    if baselines:
        base = homogeneous_baselines(cluster, model, seq_len, global_batch, at_once, **search_kwargs)
        ratio = hetero_speedup_ratio(predicted["tokens_per_s"], base)
        predicted["hetero_speedup_ratio"] = ratio
        predicted["baselines"] = {c: b.to_dict(batch_matched=True) for c, b in base.items()}
        if baseline_global_batch is not None:
            fixed = homogeneous_baselines(cluster, model, seq_len, baseline_global_batch, at_once, **search_kwargs)
            fixed_ratio = hetero_speedup_ratio(predicted["tokens_per_s"], fixed)
            predicted["fixed_batch_baselines"] = {c: b.to_dict(batch_matched=False) for c, b in fixed.items()}
            predicted["hetero_speedup_ratio_batch_mismatched"] = fixed_ratio
    uniform = uniform_split(plan, cluster, profile, options)
    if uniform is not None:
        predicted["uniform_split"] = uniform
    plan = assign_hosts(dataclasses.replace(plan, predicted=predicted), cluster)  # after the search: where each process runs
    return PlanResult(plan, candidates, stats, base, ratio, uniform, fixed, cluster)


def even_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    q, r = divmod(n_layers, n_stages)
    out, start = [], 0
    for i in range(n_stages):
        n = q + (1 if i < r else 0)
        out.append((start, start + n))
        start += n
    return out


def uniform_split(
    plan: Plan, cluster: Cluster, profile: Profile | None, options: cm.CostOptions
) -> dict[str, Any] | None:
    """The planned stages with layers split evenly: what the layer split is worth (None if unfit)."""
    if plan.n_stages > plan.model.n_layers:
        return None
    counts = [end - start for start, end in even_layers(plan.model.n_layers, plan.n_stages)]
    chunks = chunk_ranges(counts, plan.virtual_stages)
    stages = [dataclasses.replace(s, layers=c[0], chunks=None if len(c) == 1 else c) for s, c in zip(plan.stages, chunks)]
    even = plan.with_stages(stages)
    terms = cm.plan_stage_terms(even, cluster, profile, options)
    fits = all(t.mem.fits(s.n_layers) for t, s in zip(terms, even.stages))
    t = cm.iteration_time(cm.stage_costs(even, cluster, profile, options), even.n_micro, even.schedule, even.virtual_stages)
    return {N.STEP_TIME_S: t, N.TOKENS_PER_S: even.tokens_per_step / t, "fits_in_memory": fits}


def describe(result: PlanResult) -> Mapping[str, Any]:
    """A compact dict of the plan's stages for tables and logs."""
    p = result.plan
    return {
        "stages": [
            {"chip": s.chip, "data": s.mesh.data, "tensor": s.mesh.tensor, "layers": list(s.layers),
             "recompute": s.recompute, "memory_gib": p.predicted["memory_gib"][i]}
            for i, s in enumerate(p.stages)
        ]
    }
