"""Event-level simulator: replays a plan's per-stage action lists with per-stage costs.

Input: the schedule's action lists (`h2jax.schedule`, never re-derived here) and one
`StageCost` per stage. The replay is a timestamp recurrence over the lists:

- each stage has one compute stream; F, B and W run on it in list order, each starting when
  the stream is free and its input has arrived;
- SEND_ACT k / SEND_GRAD k start when the compute that produced the data has finished and the
  link in that direction is free (a link carries one transfer at a time, FIFO in list order);
  the data arrives `send_s + link_latency_s` after the transfer starts. Sends never block the
  compute stream (the runtime posts them non-blocking);
- RECV_ACT k / RECV_GRAD k only order the replay: the compute that needs the data waits for it;
- once a stage's last gradient computation ends, its data-parallel reduction runs (overlapping
  the backward still running on other stages), then, after one cross-stage scalar all-reduce
  for the global grad norm, every stage steps its optimizer.

Stages are advanced in any order that respects the sends (a stage blocked on a receive is
woken by the matching send), so the work is linear in the number of actions: no event heap.

ZB-H1's W placement depends on the costs: `zb_h1_orders` builds it by a greedy pass that puts
each W in an idle gap it fits, then checks every stage against 1F1B (see its docstring for
why the result is never slower than 1F1B).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any, Sequence

from h2jax import schedule as sched
from h2jax.planner.stage_cost import StageCost
from h2jax.trace import TraceEvent

# Integer action codes: the replay loop compares ints, not strings.
_F, _B, _W, _SA, _RA, _SG, _RG = range(7)
_CODE = {
    sched.F: _F, sched.B: _B, sched.W: _W,
    sched.SEND_ACT: _SA, sched.RECV_ACT: _RA, sched.SEND_GRAD: _SG, sched.RECV_GRAD: _RG,
}
_NAME = {v: k for k, v in _CODE.items()}


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What one simulated optimizer step looks like. Times in seconds, memory in bytes."""

    schedule: str
    n_stages: int
    n_micro: int
    iteration_s: float  # whole step: pipeline, data-parallel reduction, optimizer
    pipeline_s: float  # first compute start to last compute end, over all stages
    busy_s: tuple[float, ...]  # compute time per stage
    idle_s: tuple[float, ...]  # pipeline_s - busy_s per stage
    bubble_fraction: float  # sum(idle) / (n_stages * pipeline_s)
    grads_done_s: tuple[float, ...]  # end of each stage's last gradient computation
    dp_done_s: tuple[float, ...]  # end of each stage's data-parallel reduction
    peak_in_flight: tuple[int, ...]  # micro-batches whose activations are held, at peak
    peak_activation_bytes: tuple[int, ...]
    peak_memory_bytes: tuple[int, ...]  # static (params, grads, optimizer) + activations
    events: tuple[TraceEvent, ...] = ()  # per-action slices when run with record=True

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("events")
        return out


# ----------------------------------------------------------------------------- replay


def _encode(actions: Sequence[sched.Action]) -> tuple[list[int], list[int]]:
    code = _CODE
    return [code[a.kind] for a in actions], [a.micro for a in actions]


def _jitter_factors(lengths: list[int], jitter: float, seed: int) -> list[list[float]] | None:
    """Per-action multiplicative noise, lognormal with mean 1 and log-sd `jitter`."""
    if jitter <= 0:
        return None
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        rng.lognormal(-0.5 * jitter * jitter, jitter, size=n).tolist() for n in lengths
    ]


@dataclasses.dataclass
class _Run:
    """Raw per-stage outputs of one replay (mutable, internal)."""

    f_start: list[list[float]]
    b_start: list[list[float]]
    busy: list[float]
    last_end: list[float]  # end of the stage's last compute action
    grads_done: list[float]
    peak_live: list[int]
    events: list[TraceEvent]


def _replay(
    lists: Sequence[Sequence[sched.Action]],
    costs: Sequence[StageCost],
    n_micro: int,
    factors: list[list[float]] | None,
    record: bool,
) -> _Run:
    p, m = len(costs), n_micro
    split = any(a.kind == sched.W for acts in lists for a in acts)
    enc = [_encode(acts) for acts in lists]
    fwd = [c.forward_s for c in costs]
    bwd = [c.backward_s - c.backward_weight_s if split else c.backward_s for c in costs]
    wgt = [c.backward_weight_s for c in costs]
    send = [c.send_s for c in costs]  # link i <-> i+1, both directions
    lat = [c.link_latency_s for c in costs]
    release = _W if split else _B  # activations are held until this action

    # act_in[i][k]: arrival of micro k's activation at stage i (None: not sent yet);
    # grad_in[i][k]: arrival of its output gradient. Stage 0 and the last stage need none.
    act_in: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(p - 1)]
    grad_in: list[list[float | None]] = [[None] * m for _ in range(p - 1)] + [[0.0] * m]
    f_end = [[0.0] * m for _ in range(p)]
    b_end = [[0.0] * m for _ in range(p)]
    f_start = [[0.0] * m for _ in range(p)]
    b_start = [[0.0] * m for _ in range(p)]
    link_fwd = [0.0] * p  # when link i -> i+1 is free
    link_bwd = [0.0] * p  # when link i+1 -> i is free
    t_free = [0.0] * p
    pc_at = [0] * p
    busy = [0.0] * p
    live_at = [0] * p
    peak_at = [0] * p
    grads_done = [0.0] * p
    waiting = [-1] * p  # micro k awaited as an activation, or m + k as a gradient
    events: list[TraceEvent] = []

    # Each action's duration, computed once per stage: the loop below only adds and compares.
    durs: list[list[float]] = []
    for i in range(p):
        base = [fwd[i], bwd[i], wgt[i], send[i] if i < p - 1 else 0.0, 0.0,
                send[i - 1] if i > 0 else 0.0, 0.0]
        d_i = [base[c] for c in enc[i][0]]
        if factors is not None:
            d_i = [d * x for d, x in zip(d_i, factors[i])]
        durs.append(d_i)

    stack = list(range(p - 1, -1, -1))
    while stack:
        i = stack.pop()
        kinds, micros = enc[i]
        dur = durs[i]
        n = len(kinds)
        t, pc, live, peak = t_free[i], pc_at[i], live_at[i], peak_at[i]
        acts, grads, fe, be, fs, bs = act_in[i], grad_in[i], f_end[i], b_end[i], f_start[i], b_start[i]
        busy_i, done_i = busy[i], grads_done[i]
        while pc < n:
            kd = kinds[pc]
            k = micros[pc]
            if kd == _F:
                ready = acts[k]
                s = t if t > ready else ready
                d = dur[pc]
                t = s + d
                fs[k] = s
                fe[k] = t
                busy_i += d
                live += 1
                if live > peak:
                    peak = live
                if record:
                    events.append(TraceEvent(i, f"F{k}", s, d, {"micro": k}))
            elif kd == _B:
                ready = grads[k]
                s = t if t > ready else ready
                d = dur[pc]
                t = s + d
                bs[k] = s
                be[k] = t
                busy_i += d
                if release == _B:
                    live -= 1
                    done_i = t
                if record:
                    events.append(TraceEvent(i, f"B{k}", s, d, {"micro": k}))
            elif kd == _SA:
                d = dur[pc]
                ready = fe[k]
                lf = link_fwd[i]
                s = lf if lf > ready else ready
                link_fwd[i] = s + d
                act_in[i + 1][k] = s + d + lat[i]
                if waiting[i + 1] == k:
                    waiting[i + 1] = -1
                    stack.append(i + 1)
                if record:
                    events.append(TraceEvent(
                        i, f"SEND_ACT{k}", s, d,
                        {"micro": k, "bytes": costs[i].send_bytes, "latency_s": lat[i]}, "comm"))
            elif kd == _SG:
                d = dur[pc]
                ready = be[k]
                lb = link_bwd[i - 1]
                s = lb if lb > ready else ready
                link_bwd[i - 1] = s + d
                grad_in[i - 1][k] = s + d + lat[i - 1]
                if waiting[i - 1] == m + k:
                    waiting[i - 1] = -1
                    stack.append(i - 1)
                if record:
                    events.append(TraceEvent(
                        i, f"SEND_GRAD{k}", s, d,
                        {"micro": k, "bytes": costs[i - 1].send_bytes, "latency_s": lat[i - 1]},
                        "comm"))
            elif kd == _RA:
                if acts[k] is None:
                    waiting[i] = k
                    break
                if record:
                    events.append(TraceEvent(i, f"RECV_ACT{k}", acts[k], 0.0, {"micro": k}, "comm"))
            elif kd == _RG:
                if grads[k] is None:
                    waiting[i] = m + k
                    break
                if record:
                    events.append(TraceEvent(i, f"RECV_GRAD{k}", grads[k], 0.0, {"micro": k}, "comm"))
            else:  # _W
                d = dur[pc]
                s = t
                t = s + d
                busy_i += d
                live -= 1
                done_i = t
                if record:
                    events.append(TraceEvent(i, f"W{k}", s, d, {"micro": k}))
            pc += 1
        t_free[i], pc_at[i], live_at[i], peak_at[i] = t, pc, live, peak
        busy[i], grads_done[i] = busy_i, done_i

    stuck = {i: lists[i][pc_at[i]] for i in range(p) if pc_at[i] < len(lists[i])}
    if stuck:
        raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    return _Run(f_start, b_start, busy, t_free, grads_done, peak_at, events)


def _finish(
    run: _Run,
    costs: Sequence[StageCost],
    name: str,
    n_micro: int,
    global_clip: bool,
) -> SimResult:
    p = len(costs)
    dp_done = [run.grads_done[i] + costs[i].dp_reduce_s for i in range(p)]
    if global_clip:
        # The global grad norm needs every stage's reduced gradients: one scalar all-reduce
        # across stages (latency-bound), then each stage steps.
        sync = max(dp_done) + max((c.link_latency_s for c in costs), default=0.0)
        iteration = sync + max(c.optimizer_s for c in costs)
    else:
        iteration = max(dp_done[i] + costs[i].optimizer_s for i in range(p))
    pipeline = max(run.last_end)
    idle = [pipeline - b for b in run.busy]
    bubble = sum(idle) / (p * pipeline) if pipeline > 0 else 0.0
    act = [run.peak_live[i] * costs[i].activation_bytes for i in range(p)]
    return SimResult(
        schedule=name,
        n_stages=p,
        n_micro=n_micro,
        iteration_s=iteration,
        pipeline_s=pipeline,
        busy_s=tuple(run.busy),
        idle_s=tuple(idle),
        bubble_fraction=bubble,
        grads_done_s=tuple(run.grads_done),
        dp_done_s=tuple(dp_done),
        peak_in_flight=tuple(run.peak_live),
        peak_activation_bytes=tuple(act),
        peak_memory_bytes=tuple(costs[i].static_bytes + act[i] for i in range(p)),
        events=tuple(run.events),
    )


def replay(
    lists: Sequence[Sequence[sched.Action]],
    costs: Sequence[StageCost],
    n_micro: int,
    *,
    name: str = "custom",
    jitter: float = 0.0,
    seed: int = 0,
    global_clip: bool = True,
    record: bool = False,
) -> SimResult:
    """Replay given per-stage action lists. A list with W actions is a zero-bubble list: its
    B costs `backward_s - backward_weight_s` and its W `backward_weight_s`."""
    if len(lists) != len(costs):
        raise ValueError(f"{len(lists)} action lists but {len(costs)} stage costs")
    factors = _jitter_factors([len(a) for a in lists], jitter, seed)
    run = _replay(lists, costs, n_micro, factors, record)
    return _finish(run, costs, name, n_micro, global_clip)


def simulate(
    costs: Sequence[StageCost],
    n_micro: int,
    schedule: str = "1f1b",
    *,
    jitter: float = 0.0,
    seed: int = 0,
    global_clip: bool = True,
    record: bool = False,
    zb_max_in_flight: Sequence[int] | None = None,
) -> SimResult:
    """Simulate one optimizer step of `schedule` over stages with these costs.

    `jitter` > 0 multiplies every compute and transfer time by seeded lognormal noise (mean 1,
    log-sd `jitter`). `global_clip` adds the cross-stage grad-norm sync before the optimizer
    (plans clip by default). `zb_max_in_flight` caps each stage's held micro-batches under
    ZB-H1 (default: min(p, m), the peak of 1F1B's first stage, as in the ZB-H1 paper).
    """
    if not costs:
        raise ValueError("need at least one stage")
    if n_micro < 1:
        raise ValueError(f"n_micro must be >= 1, got {n_micro}")
    p = len(costs)
    if schedule == "zb-h1":
        orders = zb_h1_orders(costs, n_micro, zb_max_in_flight, global_clip=global_clip)
        lists = sched.build_sim(schedule, p, n_micro, orders)
    else:
        lists = sched.build_sim(schedule, p, n_micro)
    return replay(lists, costs, n_micro, name=schedule, jitter=jitter, seed=seed,
                  global_clip=global_clip, record=record)


# ----------------------------------------------------------------------------- ZB-H1


def _zb_greedy(
    costs: Sequence[StageCost],
    m: int,
    defer: list[bool],
    caps: list[int],
) -> tuple[list[list[tuple[str, int]]], _Run]:
    """Build ZB-H1 compute orders by simulating them (same timing rules as `_replay`).

    A stage with `defer[i]` keeps 1F1B's F/B order and holds each W back; it runs a held W
    only where it ends before the next F/B's input arrives (so it never delays an F or B), or
    when an F would exceed the stage's cap of held micro-batches. Other stages run each W
    right after its B. Leftover W's run after the last B.
    """
    p = len(costs)
    fwd = [c.forward_s for c in costs]
    bwd = [c.backward_s - c.backward_weight_s for c in costs]
    wgt = [c.backward_weight_s for c in costs]
    send = [c.send_s for c in costs]
    lat = [c.link_latency_s for c in costs]
    fb = [sched.compute_order_1f1b(i, p, m) for i in range(p)]
    orders: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    act_in: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(p - 1)]
    grad_in: list[list[float | None]] = [[None] * m for _ in range(p - 1)] + [[0.0] * m]
    f_start = [[0.0] * m for _ in range(p)]
    b_start = [[0.0] * m for _ in range(p)]
    link_fwd, link_bwd = [0.0] * p, [0.0] * p
    t_free, idx_at, busy = [0.0] * p, [0] * p, [0.0] * p
    live_at, peak_at, grads_done = [0] * p, [0] * p, [0.0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    waiting = [-1] * p

    stack = list(range(p - 1, -1, -1))
    while stack:
        i = stack.pop()
        t, idx, live, peak = t_free[i], idx_at[i], live_at[i], peak_at[i]
        order, held, w = orders[i], pending[i], wgt[i]
        while idx < len(fb[i]):
            kind, k = fb[i][idx]
            ready = act_in[i][k] if kind == sched.F else grad_in[i][k]
            if ready is None:
                waiting[i] = k if kind == sched.F else m + k
                break
            if defer[i]:
                while held and kind == sched.F and live + 1 > caps[i]:
                    j = held.popleft()
                    order.append((sched.W, j))
                    t += w
                    busy[i] += w
                    live -= 1
                while held and t + w <= ready:
                    j = held.popleft()
                    order.append((sched.W, j))
                    t += w
                    busy[i] += w
                    live -= 1
            s = t if t > ready else ready
            order.append((kind, k))
            if kind == sched.F:
                t = s + fwd[i]
                f_start[i][k] = s
                busy[i] += fwd[i]
                live += 1
                peak = max(peak, live)
                if i < p - 1:
                    ls = max(t, link_fwd[i])
                    link_fwd[i] = ls + send[i]
                    act_in[i + 1][k] = ls + send[i] + lat[i]
                    if waiting[i + 1] == k:
                        waiting[i + 1] = -1
                        stack.append(i + 1)
            else:
                t = s + bwd[i]
                b_start[i][k] = s
                busy[i] += bwd[i]
                if i > 0:
                    ls = max(t, link_bwd[i - 1])
                    link_bwd[i - 1] = ls + send[i - 1]
                    grad_in[i - 1][k] = ls + send[i - 1] + lat[i - 1]
                    if waiting[i - 1] == m + k:
                        waiting[i - 1] = -1
                        stack.append(i - 1)
                if defer[i]:
                    held.append(k)
                else:
                    order.append((sched.W, k))
                    t += w
                    busy[i] += w
                    live -= 1
            idx += 1
        if idx == len(fb[i]):
            for j in held:
                order.append((sched.W, j))
                t += w
                busy[i] += w
                live -= 1
            held.clear()
            grads_done[i] = t
        t_free[i], idx_at[i], live_at[i], peak_at[i] = t, idx, live, peak
    if any(idx_at[i] < len(fb[i]) for i in range(p)):  # pragma: no cover - 1F1B never deadlocks
        raise RuntimeError("ZB-H1 construction deadlocked")
    return orders, _Run(f_start, b_start, busy, t_free, grads_done, peak_at, [])


def zb_h1_orders(
    costs: Sequence[StageCost],
    n_micro: int,
    max_in_flight: Sequence[int] | None = None,
    *,
    global_clip: bool = True,
) -> list[list[tuple[str, int]]]:
    """Cost-aware ZB-H1 compute orders (F, B, W per stage), never slower than 1F1B.

    Why never slower: first replay 1F1B. Then every stage defers its W's (`_zb_greedy`),
    and any stage on which some F or B would start later than under 1F1B, or whose gradient
    reduction would end later, reverts to running each W right after its B. Repeat until no
    stage reverts (at most p rounds: stages only ever revert). A reverted stage runs 1F1B's
    order with its B's input-gradient part sending earlier, so with inputs arriving no later
    than under 1F1B its F's and B's are no later either; a deferring stage was checked
    directly. By induction over the pipeline every F/B and every stage's reduction ends no
    later than under 1F1B, and so does the step.
    """
    p, m = len(costs), n_micro
    caps = [min(p, m)] * p if max_in_flight is None else list(max_in_flight)
    if len(caps) != p:
        raise ValueError(f"max_in_flight has {len(caps)} entries for {p} stages")
    # Never below what 1F1B itself holds: W right after B needs min(p - i, m).
    caps = [max(c, min(p - i, m)) for i, c in enumerate(caps)]
    ref = _replay(sched.build("1f1b", p, m), costs, m, None, False)
    ref_dp = [ref.grads_done[i] + costs[i].dp_reduce_s for i in range(p)]
    scale = max(max(ref.last_end), 1e-300)
    tol = 1e-12 * scale
    defer = [True] * p
    while True:
        orders, run = _zb_greedy(costs, m, defer, caps)
        reverted = False
        for i in range(p):
            if not defer[i]:
                continue
            late = run.grads_done[i] + costs[i].dp_reduce_s > ref_dp[i] + tol or any(
                a > b + tol for a, b in zip(run.f_start[i], ref.f_start[i])
            ) or any(a > b + tol for a, b in zip(run.b_start[i], ref.b_start[i]))
            if late:
                defer[i] = False
                reverted = True
        if not reverted:
            return orders


# ----------------------------------------------------------------------------- plans


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
) -> SimResult:
    """Simulate a plan. Costs come from the planner's cost model unless given."""
    if costs is None:
        from h2jax import planner

        costs = planner.stage_costs(plan, cluster, profile=profile)
    name = schedule or plan.schedule
    caps = zb_caps(plan, costs) if name == "zb-h1" else None
    clip = getattr(getattr(plan, "optimizer", None), "clip_norm", 1.0) is not None
    return simulate(costs, plan.n_micro, name, jitter=jitter, seed=seed, global_clip=clip,
                    record=record, zb_max_in_flight=caps)


def zb_caps(plan: Any, costs: Sequence[StageCost]) -> list[int]:
    """Held micro-batches each stage can afford under ZB-H1: what fits in the chip's memory
    beside its static bytes, between 1F1B's min(p - i, m) and the paper's min(p, m)."""
    from h2jax.cluster import load_chip

    p, m = len(costs), plan.n_micro
    caps = []
    for i, (stage, c) in enumerate(zip(plan.stages, costs)):
        low, high = min(p - i, m), min(p, m)
        try:
            mem = load_chip(stage.chip).usable_memory_gib * 2**30
        except Exception:  # an unknown chip was already reported by plan validation
            caps.append(low)
            continue
        fits = math.floor((mem - c.static_bytes) / c.activation_bytes) if c.activation_bytes else high
        caps.append(max(low, min(high, fits)))
    return caps


def closed_form_uniform_1f1b(f: float, b: float, n_stages: int, n_micro: int) -> float:
    """(m + p - 1)(f + b): 1F1B's step over uniform stages without communication."""
    return (n_micro + n_stages - 1) * (f + b)


def chips_for(plan: Any, cluster: Any = None) -> Any:
    """The chip types a plan's costs come from: the cluster's (with its per-group overrides)
    when given, else each named chip's file in backends/."""
    if cluster is not None:
        return cluster
    from h2jax.cluster import load_chip

    return {s.chip: load_chip(s.chip) for s in plan.stages}


def plan_report(plan: Any, costs: Sequence[StageCost], result: SimResult) -> dict[str, Any]:
    """The simulated step beside the cost model's closed form, per plan and per stage."""
    from h2jax.planner import cost_model

    closed = None
    if result.schedule in sched.COMPUTE_ORDERS:
        closed = cost_model.iteration_time(list(costs), result.n_micro, result.schedule)
    tokens_per_s = plan.tokens_per_step / result.iteration_s
    gib = 2.0**30
    stages = []
    for i, (s, c) in enumerate(zip(plan.stages, costs)):
        stages.append({
            "chip": s.chip, "data": s.mesh.data, "tensor": s.mesh.tensor,
            "layers": list(s.layers), "recompute": s.recompute,
            "forward_s": c.forward_s, "backward_s": c.backward_s,
            "backward_weight_s": c.backward_weight_s, "send_s": c.send_s,
            "dp_reduce_s": c.dp_reduce_s, "optimizer_s": c.optimizer_s,
            "busy_s": result.busy_s[i], "idle_s": result.idle_s[i],
            "peak_in_flight": result.peak_in_flight[i],
            "peak_memory_gib": result.peak_memory_bytes[i] / gib,
        })
    return {
        "schedule": result.schedule,
        "n_stages": result.n_stages,
        "n_micro": result.n_micro,
        "n_chips": plan.n_devices,
        "tokens_per_step": plan.tokens_per_step,
        "iteration_s": result.iteration_s,
        "pipeline_s": result.pipeline_s,
        "closed_form_s": closed,
        "sim_minus_closed_s": None if closed is None else result.iteration_s - closed,
        "relative_difference": None if closed is None else (result.iteration_s - closed) / closed,
        "tokens_per_s": tokens_per_s,
        "tgs": tokens_per_s / plan.n_devices,
        "bubble_fraction": result.bubble_fraction,
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
