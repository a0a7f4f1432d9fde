"""Simulating plans: a plan's stages, costed by the planner's cost model, replayed by the
event simulator (`h2jax.sim`); the simulated step beside the cost model's prediction; and the
planner's best plans re-ranked by simulated step time (`h2jax plan --refine-with-sim`, and
`--schedule auto`'s check of a ZB-H1 winner).

Apart from `h2jax.sim` so the simulator itself imports nothing of the planner but the stage
costs it replays: the cost model replays a schedule whose closed form is not exact (ZB-H1)
through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from h2jax import names as N
from h2jax import schedules as sched
from h2jax.planner.stage_cost import StageCost
from h2jax.sim import SimResult, simulate


def simulate_plan(
    plan: Any,
    costs: Sequence[StageCost] | None = None,
    *,
    schedule: str | None = None,
    cluster: Any = None,
    profile: Any = None,
    jitter: float = 0.0,
    seed: int = 0,
    record: bool = False,
    virtual_stages: int | None = None,
) -> SimResult:
    """Simulate a plan. Costs come from the planner's cost model unless given. Another
    `schedule` than the plan's runs the same stages under it (interleaved: v = 2 unless given)."""
    if costs is None:
        from h2jax.planner.cost_model import stage_costs

        costs = stage_costs(plan, cluster, profile=profile)
    name = schedule or plan.schedule
    v = virtual_stages if virtual_stages is not None else (
        plan.virtual_stages if name == plan.schedule else (2 if sched.get_schedule(name).virtual else 1))
    clip = getattr(getattr(plan, "optimizer", None), "clip_norm", 1.0) is not None
    return simulate(costs, plan.n_micro, name, virtual_stages=v, jitter=jitter, seed=seed,
                    global_clip=clip, record=record)


def under_schedule(plan: Any, schedule: str, virtual_stages: int = 1) -> Any:
    """The same stages under another schedule: interleaved splits each stage's layers into v
    chunks (h2jax.planner.space.chunk_ranges), so its costs carry the last stage's wrap send."""
    from h2jax.planner.space import chunk_ranges

    chunks = chunk_ranges([s.n_layers for s in plan.stages], virtual_stages)
    stages = [dataclasses.replace(s, layers=c[0], chunks=None if len(c) == 1 else c)
              for s, c in zip(plan.stages, chunks)]
    return dataclasses.replace(plan, schedule=schedule, virtual_stages=virtual_stages, stages=tuple(stages))


def chips_for(plan: Any, cluster: Any = None) -> Any:
    """The chip types a plan's costs come from: the cluster's (with its per-group overrides)
    when given, else each named chip's file in backends/."""
    if cluster is not None:
        return cluster
    from h2jax.cluster import load_chip

    return {s.chip: load_chip(s.chip) for s in plan.stages}


def plan_report(plan: Any, costs: Sequence[StageCost], result: SimResult) -> dict[str, Any]:
    """The simulated step beside the cost model's (its closed form; a ZB-H1 plan's order
    replayed), per plan and per stage."""
    from h2jax.planner import cost_model

    v = result.virtual_stages
    closed = cost_model.iteration_time(list(costs), result.n_micro, result.schedule, v)
    tokens_per_s = plan.tokens_per_step / result.iteration_s
    gib = 2.0**30
    stages = []
    for i, (s, c) in enumerate(zip(plan.stages, costs)):
        stages.append({
            "chip": s.chip, "data": s.mesh.data, "tensor": s.mesh.tensor,
            "layers": list(s.layers) if s.chunks is None else [list(c) for c in s.chunks],
            "recompute": s.recompute,
            "forward_s": c.forward_s, "backward_s": c.backward_s,
            "backward_weight_s": c.backward_weight_s, "send_s": c.send_s,
            "dp_reduce_s": c.dp_reduce_s, "optimizer_s": c.optimizer_s,
            "busy_s": result.busy_s[i], "idle_s": result.idle_s[i],
            "peak_in_flight": result.peak_in_flight[i],
            "peak_deferred": result.peak_deferred[i] if result.peak_deferred else 0,
            "peak_memory_gib": result.peak_memory_bytes[i] / gib,
        })
    return {
        "schedule": result.schedule,
        "n_stages": result.n_stages,
        "n_micro": result.n_micro,
        "n_chips": plan.n_devices,
        "tokens_per_step": plan.tokens_per_step,
        N.STEP_TIME_S: result.iteration_s,
        "pipeline_s": result.pipeline_s,
        "virtual_stages": v,
        N.PREDICTED: {N.STEP_TIME_S: closed},
        "sim_minus_closed_s": result.iteration_s - closed,
        "relative_difference": (result.iteration_s - closed) / closed,
        N.TOKENS_PER_S: tokens_per_s,
        N.TOKENS_PER_CHIP_PER_S: tokens_per_s / plan.n_devices,
        # the schedule's bubble for this plan: the same number `h2jax plan`, compare and the
        # demo print; the replayed timeline's own value beside it
        N.BUBBLE_FRACTION: cost_model.bubble_fraction(list(costs), result.n_micro, result.schedule, v),
        "simulated_bubble_fraction": result.bubble_fraction,
        "stages": stages,
    }


def rerank_by_simulation(
    plans: Sequence[Any],
    cluster: Any = None,
    profile: Any = None,
    schedule: str | None = None,
) -> list[tuple[Any, SimResult]]:
    """`h2jax plan --refine-with-sim K`: the planner's best K plans, re-ordered by simulated
    step time (the closed form ranks them; the simulator sees link contention, per-stage
    gradient-reduction overlap and fill/drain exactly). Ties keep the planner's order."""
    from h2jax.planner import cost_model

    scored = []
    for rank, plan in enumerate(plans):
        costs = cost_model.stage_costs(plan, chips_for(plan, cluster), profile)
        result = simulate_plan(plan, costs, schedule=schedule)
        scored.append((result.iteration_s, rank, plan, result))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [(plan, result) for _, _, plan, result in scored]
