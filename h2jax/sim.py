"""Event-level simulator: replays a plan's per-stage action lists with per-stage costs.

Input: the schedule's action lists (`h2jax.schedules`, the lists the runtime executes, never
re-derived here) and one `StageCost` per stage. The replay is a timestamp recurrence over the lists:

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

A split-backward list (ZB-H1) runs B as the input gradient alone and W as the weight
gradient; with v chunks per stage (interleaved) each chunk's compute costs 1/v of the
stage's, and the last stage's chunk c sends to stage 0's chunk c + 1 over its own link.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from h2jax import schedules as sched
from h2jax.planner.stage_cost import StageCost
from h2jax.trace import TraceEvent

# Integer action codes: the replay loop compares ints, not strings.
_F, _B, _W, _SA, _RA, _SG, _RG = range(7)
_CODE = {
    sched.F: _F, sched.B: _B, sched.W: _W,
    sched.SEND_ACT: _SA, sched.RECV_ACT: _RA, sched.SEND_GRAD: _SG, sched.RECV_GRAD: _RG,
}


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
    bubble_fraction: float  # the one definition (h2jax.schedules) on the replayed timeline
    grads_done_s: tuple[float, ...]  # end of each stage's last gradient computation
    dp_done_s: tuple[float, ...]  # end of each stage's data-parallel reduction
    peak_in_flight: tuple[int, ...]  # (micro-batch, chunk) activations held, at peak
    peak_activation_bytes: tuple[int, ...]
    peak_memory_bytes: tuple[int, ...]  # static (params, grads, optimizer) + activations
    virtual_stages: int = 1
    peak_deferred: tuple[int, ...] = ()  # micro-batches between their B and W, at peak
    events: tuple[TraceEvent, ...] = ()  # per-action slices when run with record=True

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("events")
        return out


# ----------------------------------------------------------------------------- replay


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

    busy: list[float]
    last_end: list[float]  # end of the stage's last compute action
    grads_done: list[float]
    peak_live: list[int]
    peak_deferred: list[int]
    events: list[TraceEvent]


def _replay(
    lists: Sequence[Sequence[sched.Action]],
    costs: Sequence[StageCost],
    n_micro: int,
    v: int,
    factors: list[list[float]] | None,
    record: bool,
) -> _Run:
    p, m = len(costs), n_micro
    split = any(a.kind == sched.W for acts in lists for a in acts)
    n = m * v  # slots per stage: (chunk, micro) -> chunk * m + micro
    fwd = [c.forward_s / v for c in costs]
    bwd = [(c.backward_s - c.backward_weight_s if split else c.backward_s) / v for c in costs]
    wgt = [c.backward_weight_s / v for c in costs]
    # link i joins stage i and stage (i + 1) % p (link p - 1: interleaved's wrap to stage 0);
    # it carries stage i's activations one way and stage i+1's gradients the other
    send = [c.send_s for c in costs]
    lat = [c.link_latency_s for c in costs]

    # act_in[i][slot]: arrival of the activation (None: not sent yet); grad_in: of the output
    # gradient. The first virtual stage needs no activation, the last no gradient.
    act_in: list[list[float | None]] = [[None] * n for _ in range(p)]
    grad_in: list[list[float | None]] = [[None] * n for _ in range(p)]
    act_in[0][:m] = [0.0] * m
    grad_in[p - 1][(v - 1) * m:] = [0.0] * m
    f_end = [[0.0] * n for _ in range(p)]
    b_end = [[0.0] * n for _ in range(p)]
    link_fwd = [0.0] * p  # when link i is free in the activation direction
    link_bwd = [0.0] * p  # ... and in the gradient direction
    t_free = [0.0] * p
    pc_at = [0] * p
    busy = [0.0] * p
    live_at, peak_at = [0] * p, [0] * p
    held_at, held_peak = [0] * p, [0] * p
    grads_done = [0.0] * p
    waiting = [-1] * p  # slot awaited as an activation, or n + slot as a gradient
    events: list[TraceEvent] = []

    enc = []
    durs: list[list[float]] = []
    for i in range(p):
        kinds = [_CODE[a.kind] for a in lists[i]]
        slots = [a.chunk * m + a.micro for a in lists[i]]
        base = [fwd[i], bwd[i], wgt[i], send[i], 0.0, send[(i - 1) % p], 0.0]
        d_i = [base[c] for c in kinds]
        if factors is not None:
            d_i = [d * x for d, x in zip(d_i, factors[i])]
        enc.append((kinds, slots))
        durs.append(d_i)

    def label(kind: str, slot: int) -> str:
        c, k = divmod(slot, m)
        return f"{kind}{k}" + (f"c{c}" if c else "")

    stack = list(range(p - 1, -1, -1))
    while stack:
        i = stack.pop()
        kinds, slots = enc[i]
        dur = durs[i]
        t, pc = t_free[i], pc_at[i]
        acts, grads, fe, be = act_in[i], grad_in[i], f_end[i], b_end[i]
        while pc < len(kinds):
            kd, q = kinds[pc], slots[pc]
            if kd == _F or kd == _B or kd == _W:
                if kd == _W:
                    ready = t
                else:
                    ready = acts[q] if kd == _F else grads[q]
                s = t if t > ready else ready
                d = dur[pc]
                t = s + d
                busy[i] += d
                if kd == _F:
                    fe[q] = t
                    live_at[i] += 1
                    peak_at[i] = max(peak_at[i], live_at[i])
                elif kd == _B:
                    be[q] = t
                    if split:
                        held_at[i] += 1
                        held_peak[i] = max(held_peak[i], held_at[i])
                    else:
                        live_at[i] -= 1
                        grads_done[i] = t
                else:
                    live_at[i] -= 1
                    held_at[i] -= 1
                    grads_done[i] = t
                if record:
                    name = "FBW"[kd]
                    c, k = divmod(q, m)
                    events.append(TraceEvent(i, label(name, q), s, d, {"micro": k, "chunk": c}))
            elif kd == _SA or kd == _SG:
                d = dur[pc]
                c = q // m
                kind = sched.SEND_ACT if kd == _SA else sched.SEND_GRAD
                j, c2 = sched.receiver(i, c, p, kind)
                q2 = c2 * m + q % m
                link = i if kd == _SA else j
                lanes = link_fwd if kd == _SA else link_bwd
                ready = fe[q] if kd == _SA else be[q]
                s = lanes[link] if lanes[link] > ready else ready
                lanes[link] = s + d
                (act_in if kd == _SA else grad_in)[j][q2] = s + d + lat[link]
                if waiting[j] == (q2 if kd == _SA else n + q2):
                    waiting[j] = -1
                    stack.append(j)
                if record:
                    events.append(TraceEvent(
                        i, label(kind, q), s, d,
                        {"micro": q % m, "bytes": costs[link].send_bytes, "latency_s": lat[link]}, "comm"))
            else:  # a receive only orders the replay: the compute that needs the data waits
                arrived = acts[q] if kd == _RA else grads[q]
                if arrived is None:
                    waiting[i] = q if kd == _RA else n + q
                    break
                if record:
                    kind = sched.RECV_ACT if kd == _RA else sched.RECV_GRAD
                    events.append(TraceEvent(i, label(kind, q), arrived, 0.0, {"micro": q % m}, "comm"))
            pc += 1
        t_free[i], pc_at[i] = t, pc

    stuck = {i: lists[i][pc_at[i]] for i in range(p) if pc_at[i] < len(lists[i])}
    if stuck:
        raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    return _Run(busy, t_free, grads_done, peak_at, held_peak, events)


def _finish(
    run: _Run,
    costs: Sequence[StageCost],
    name: str,
    n_micro: int,
    v: int,
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
    # each in-flight unit is one chunk: 1/v of the stage's activations
    act = [run.peak_live[i] * costs[i].activation_bytes // v for i in range(p)]
    return SimResult(
        schedule=name,
        n_stages=p,
        n_micro=n_micro,
        iteration_s=iteration,
        pipeline_s=pipeline,
        busy_s=tuple(run.busy),
        idle_s=tuple(idle),
        bubble_fraction=sched.bubble_fraction(run.busy, pipeline),
        grads_done_s=tuple(run.grads_done),
        dp_done_s=tuple(dp_done),
        peak_in_flight=tuple(run.peak_live),
        peak_activation_bytes=tuple(act),
        peak_memory_bytes=tuple(costs[i].static_bytes + act[i] for i in range(p)),
        virtual_stages=v,
        peak_deferred=tuple(run.peak_deferred),
        events=tuple(run.events),
    )


def replay(
    lists: Sequence[Sequence[sched.Action]],
    costs: Sequence[StageCost],
    n_micro: int,
    *,
    name: str = "custom",
    virtual_stages: int = 1,
    jitter: float = 0.0,
    seed: int = 0,
    global_clip: bool = True,
    record: bool = False,
) -> SimResult:
    """Replay given per-stage action lists. A list with W actions is a split-backward list:
    its B costs `backward_s - backward_weight_s` and its W `backward_weight_s`; with v chunks
    each chunk's actions cost 1/v of the stage's."""
    if len(lists) != len(costs):
        raise ValueError(f"{len(lists)} action lists but {len(costs)} stage costs")
    factors = _jitter_factors([len(a) for a in lists], jitter, seed)
    run = _replay(lists, costs, n_micro, virtual_stages, factors, record)
    return _finish(run, costs, name, n_micro, virtual_stages, global_clip)


def simulate(
    costs: Sequence[StageCost],
    n_micro: int,
    schedule: str = "1f1b",
    *,
    virtual_stages: int = 1,
    jitter: float = 0.0,
    seed: int = 0,
    global_clip: bool = True,
    record: bool = False,
) -> SimResult:
    """Simulate one optimizer step of `schedule` over stages with these costs: the registry's
    action lists (h2jax.schedules), the ones the runtime executes.

    `jitter` > 0 multiplies every compute and transfer time by seeded lognormal noise (mean 1,
    log-sd `jitter`). `global_clip` adds the cross-stage grad-norm sync before the optimizer
    (plans clip by default).
    """
    if not costs:
        raise ValueError("need at least one stage")
    if n_micro < 1:
        raise ValueError(f"n_micro must be >= 1, got {n_micro}")
    lists = sched.get_schedule(schedule).build(len(costs), n_micro, virtual_stages)
    return replay(lists, costs, n_micro, name=schedule, virtual_stages=virtual_stages, jitter=jitter,
                  seed=seed, global_clip=global_clip, record=record)


def closed_form_uniform_1f1b(f: float, b: float, n_stages: int, n_micro: int) -> float:
    """(m + p - 1)(f + b): 1F1B's step over uniform stages without communication."""
    return (n_micro + n_stages - 1) * (f + b)
