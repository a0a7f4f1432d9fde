"""Calibrate the cost model from a measured run: what each stage really spent, next to what
the model predicted, and a profile that makes the model predict it.

Python API (the `h2jax calibrate` command is a thin wrapper)::

    from h2jax.calibrate import calibrate
    rows, profile = calibrate(plan, steps=6)              # runs the plan with a trace
    rows, profile = calibrate(plan, events=trace_events)  # or from a measured trace

- `plan`: a Plan or a plan-file path. `steps` >= 2 traced steps (the first compiles and is
  not measured), each followed by an untraced one whose time is the measured step (a trace
  slows a step down). `cluster` / `profile`: as for `h2jax.planner.predict` (chip files and no profile
  by default); the returned profile extends `profile`.
- `events`: TraceEvents of a run of `plan` (h2jax.trace.read_trace of `h2jax run --trace`);
  without it the plan is trained with `h2jax.run(plan, 2 * steps, trace=..., trace_every=2)`
  and its trace read (given events, the measured step is the traced one).
- `rows`: one `Row(stage, term, measured_s, predicted_s, unit)` per stage and term, plus a
  step-time row (stage None). Terms: "forward" and "backward" (per micro-batch; a fused
  F+B is split in the predicted proportion), "send" (per micro-batch: from the send's post
  to the receive's end, over messages whose receiver was already waiting; None when none
  was), "receive wait" (per step: the stage's time blocked in receives, predicted as the
  step's pipeline time less the stage's own compute), "dp reduce" (per step: a data-parallel
  stage's one reduction of its ranks' gradients, its own program; None on one rank), "optimizer" (per step), and "step" (median step time).
- `profile`: a Profile (h2jax.planner.profile) for the plan's model and sequence length.
  Per stage, one entry (chip, tensor, tokens per device, recompute) whose one-layer-stage
  forward and backward reproduce the measured stage times under the cost model (entry =
  (measured - predicted stage-end terms) / layers + dispatch); entries of stages with the
  same key are averaged. Per chip type, fits: `peak_tflops` scaled by predicted / measured
  compute (forward + backward less dispatches, median over the type's stages: the end
  terms, embedding and logits, follow), `hbm_gbps` from the measured optimizer step (its
  bytes / (measured - dispatch)). The entries are computed last, under those fits. The
  send is reported, not fitted: the search prices sends from the chip files' bandwidths. A shape the last stage shares with other
  stages takes its per-layer times from them (layers summed); the last stage's remainder,
  over the modelled head and loss, is its chip's `head_scale` fit (>= 0.05): then that
  stage's forward + backward is reproduced, not each alone. A plan of real chips alone
  whose traced stages would make the model predict a longer step than was measured (their
  intervals hold input waits: `fit_real_stages_to_step`) has its stages' forward and
  backward scaled by one factor until the model reproduces the measured step. A plan with
  an emulated stage whose untraced step is longer than its traced stages' closed form has
  every chip type's dispatch raised by one delta until the model reproduces it (the host's
  time per compute, which the clocks do not see: `fit_host_to_step`). Give the
  profile to `h2jax plan --profile` (or `predict`). Save it with
  `h2jax.planner.save_profile`.

Measurement units: trace seconds. Everything but `calibrate(..., events=None)` is a pure
function of the events (tests inject traces).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from h2jax.config import ConfigError, preset_name
from h2jax.plan import Plan, load_plan
from h2jax.planner import cost_model as cm
from h2jax.planner.profile import Profile, ProfileEntry
from h2jax.planner.stage_shape import StageShape
from h2jax.schedules import get_schedule
from h2jax.trace import TraceEvent

_ACTION = re.compile(r"(SEND_ACT|RECV_ACT|SEND_GRAD|RECV_GRAD)(\d+)(?:c(\d+))?$")


class Row(NamedTuple):
    stage: int | None  # None: the whole step
    term: str
    measured_s: float | None
    predicted_s: float
    unit: str  # "per micro-batch" or "per step"

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when either is missing or the prediction is 0)."""
        if self.measured_s is None or not self.predicted_s:
            return None
        return self.measured_s / self.predicted_s


@dataclasses.dataclass(frozen=True)
class StageMeasure:
    """Medians over the measured steps (the first, compiling, step left out)."""

    forward_s: float  # per micro-batch (all chunks)
    backward_s: float  # per micro-batch, weight gradient included
    recv_wait_s: float  # per step
    optimizer_s: float | None  # per step
    send_s: float | None  # per micro-batch: post to delivery, receiver waiting
    dp_reduce_s: float | None = None  # per step: the data ranks' gradient reduction (None: one rank)


@dataclasses.dataclass(frozen=True)
class Measured:
    stages: tuple[StageMeasure, ...]
    step_s: float  # median step time
    steps: int  # steps measured


def _steps_of(events: Sequence[TraceEvent], stage: int) -> list[list[TraceEvent]]:
    """A stage's events cut into steps: each step ends with the stage's optimizer event."""
    mine = sorted((e for e in events if e.stage == stage), key=lambda e: e.start_s)
    steps, current = [], []
    for e in mine:
        current.append(e)
        if e.name == "optimizer":
            steps.append(current)
            current = []
    return steps


def _split_fused(plan: Plan, costs: Sequence[cm.StageCost], stage: int) -> float:
    """The predicted share of the forward in a fused F+B of `stage`."""
    c = costs[stage]
    return c.forward_s / (c.forward_s + c.backward_s)


def measure(plan: Plan, events: Iterable[Sequence[Any]], costs: Sequence[cm.StageCost]) -> Measured:
    """Per stage medians of a traced run of `plan` (see the module docstring); `costs` (the
    model's StageCosts) only split a fused F+B."""
    events = [e if isinstance(e, TraceEvent) else TraceEvent(*e) for e in events]
    p, m = plan.n_stages, plan.n_micro
    per_stage = [_steps_of(events, i) for i in range(p)]
    n_steps = min(len(s) for s in per_stage)
    if n_steps < 2:
        raise ConfigError(
            f"the trace holds {n_steps} whole step(s) of every stage; calibration needs >= 2 "
            "(the first compiles and is left out): run more --steps"
        )
    # receives by (stage, kind, micro, chunk, step index) for the send measurement
    recv_at: dict[tuple, TraceEvent] = {}
    for i, steps in enumerate(per_stage):
        for k, step in enumerate(steps):
            for e in step:
                a = _ACTION.match(e.name)
                if a and a.group(1).startswith("RECV"):
                    recv_at[i, a.group(1)[5:], int(a.group(2)), int(a.group(3) or 0), k] = e
    stages = []
    for i, steps in enumerate(per_stage):
        share = _split_fused(plan, costs, i)
        fwd, bwd, wait, opt, sends, reduces = [], [], [], [], [], []
        for k, step in enumerate(steps[1:n_steps], start=1):
            f = b = w = 0.0
            o = None
            for e in step:
                a = _ACTION.match(e.name)
                if e.name == "optimizer":
                    o = e.duration_s
                elif e.name == "dp reduce":
                    reduces.append(e.duration_s)
                elif "+" in e.name and e.name.startswith("F"):
                    f += e.duration_s * share
                    b += e.duration_s * (1 - share)
                elif e.lane == "compute" and e.name[:1] in ("F", "B", "W"):
                    if e.name[0] == "F":
                        f += e.duration_s
                    else:
                        b += e.duration_s
                elif a and a.group(1).startswith("RECV"):
                    w += e.duration_s
                elif a and a.group(1).startswith("SEND"):
                    kind, micro, chunk = a.group(1)[5:], int(a.group(2)), int(a.group(3) or 0)
                    to = (i + 1) % p if kind == "ACT" else (i - 1) % p
                    to_chunk = chunk + (1 if kind == "ACT" and i == p - 1 else -1 if kind == "GRAD" and i == 0 else 0)
                    r = recv_at.get((to, kind, micro, to_chunk, k))
                    if r is not None and r.start_s <= e.start_s:  # the receiver was waiting
                        sends.append(r.start_s + r.duration_s - e.start_s)
            fwd.append(f / m)
            bwd.append(b / m)
            wait.append(w)
            if o is not None:
                opt.append(o)
        stages.append(StageMeasure(
            statistics.median(fwd), statistics.median(bwd), statistics.median(wait),
            statistics.median(opt) if opt else None, statistics.median(sends) if sends else None,
            statistics.median(reduces) if reduces else None,
        ))
    step_times = []
    for k in range(1, n_steps):
        starts = [per_stage[i][k - 1][-1].start_s + per_stage[i][k - 1][-1].duration_s for i in range(p)]
        ends = [per_stage[i][k][-1].start_s + per_stage[i][k][-1].duration_s for i in range(p)]
        step_times.append(max(ends) - max(starts))
    return Measured(tuple(stages), statistics.median(step_times), n_steps - 1)


def compare(plan: Plan, measured: Measured, costs: Sequence[cm.StageCost]) -> list[Row]:
    """The rows of the module docstring: each measured term next to the model's."""
    m, v = plan.n_micro, cm.virtual_stages(plan)
    pipe = cm.pipeline_time(list(costs), m, plan.schedule, v)
    rows = []
    for i, (s, c) in enumerate(zip(measured.stages, costs)):
        incoming = costs[i - 1].send_s if i > 0 else 0.0
        busy = m * (c.forward_s + c.backward_s)
        rows += [
            Row(i, "forward", s.forward_s, c.forward_s, "per micro-batch"),
            Row(i, "backward", s.backward_s, c.backward_s, "per micro-batch"),
            Row(i, "send", s.send_s, c.send_s + c.link_latency_s if c.send_bytes else incoming, "per micro-batch"),
            Row(i, "receive wait", s.recv_wait_s, max(pipe - busy, 0.0), "per step"),
            Row(i, "dp reduce", s.dp_reduce_s, c.dp_reduce_s, "per step"),
            Row(i, "optimizer", s.optimizer_s, c.optimizer_s, "per step"),
        ]
    rows.append(Row(None, "step", measured.step_s, cm.iteration_time(list(costs), m, plan.schedule, v), "per step"))
    return rows


def calibrated_profile(
    plan: Plan, measured: Measured, chips: Mapping[str, Any], profile: Profile | None = None,
) -> Profile:
    """A profile under which the cost model reproduces the measured stage times (module
    docstring); extends `profile` (its entries of other shapes and its other fits stay)."""
    options = cm.CostOptions.of(plan)
    fits = {c: dict(f) for c, f in (profile.fits.items() if profile else ())}

    def analytical() -> tuple[list[cm.StageTerms], list[cm.StageCost], Profile]:
        only = Profile(plan.model, plan.seq_len, {}, fits={c: dict(f) for c, f in fits.items()})
        return cm.plan_stage_terms(plan, chips, only, options), cm.stage_costs(plan, chips, only, options), only

    terms, costs, only = analytical()
    stages = list(zip(plan.stages, costs, measured.stages))
    split = get_schedule(plan.schedule).splits_backward
    programs = 3 if split else 2  # a micro-batch's F and B (and W): one dispatch each
    # 1. Effective peak per chip type: the measured compute over the analytical one.
    scale: dict[str, list[float]] = {}
    hbm: dict[str, list[float]] = {}
    for st, c, s in stages:
        chip = cm.calibrated(chips[st.chip], only)
        d = chip.dispatch_s
        predicted, got = c.forward_s + c.backward_s - programs * d, s.forward_s + s.backward_s - programs * d
        if predicted > 0 and got > 0:
            scale.setdefault(st.chip, []).append(got / predicted)
        if s.optimizer_s is not None and s.optimizer_s > d and c.optimizer_s > d:
            opt_bytes = (c.optimizer_s - d) * chip.hbm_bytes_per_s
            hbm.setdefault(st.chip, []).append(opt_bytes / (s.optimizer_s - d) / 1e9)
    for name, values in scale.items():
        fits.setdefault(name, {})["peak_tflops"] = cm.calibrated(chips[name], only).peak_tflops / statistics.median(values)
    for name, values in hbm.items():
        fits.setdefault(name, {})["hbm_gbps"] = statistics.median(values)
    # 3. Per-layer entries: the measured stages less their (re-fitted) end terms, per layer.
    #    A shape shared by the last stage and others takes its layers from the others; the
    #    last stage's remainder then calibrates its chip's head (head_scale).
    p = plan.n_stages
    last = plan.stages[-1].chip
    earlier_head = fits.setdefault(last, {}).get("head_scale")
    fits[last]["head_scale"] = 1.0  # the head as modelled, while the layers are solved
    terms, costs, only = analytical()
    groups: dict[tuple, list[int]] = {}
    for i, st in enumerate(plan.stages):
        tokens = int(round(plan.micro_batch / st.mesh.data * plan.seq_len))
        groups.setdefault((st.chip, st.mesh.tensor, tokens, st.recompute), []).append(i)
    new: dict[tuple, tuple[float, float]] = {}
    for key, members in groups.items():
        layer_from = [i for i in members if i != p - 1] or members
        d = cm.calibrated(chips[key[0]], only).dispatch_s
        layers = sum(plan.stages[i].n_layers for i in layer_from)
        fwd = sum(max(measured.stages[i].forward_s - terms[i].fwd_end, 0.1 * measured.stages[i].forward_s)
                  for i in layer_from) / layers
        bwd = sum(max(measured.stages[i].backward_s - terms[i].bwd_end, 0.1 * measured.stages[i].backward_s)
                  for i in layer_from) / layers
        if split:  # measured B + W as run: the entry holds the whole backward
            chip, tensor, tokens, recompute = key
            share = cm.entry_weight_share(plan.model, plan.seq_len, tokens, tensor, recompute,
                                          chips[chip].attention_kernel)
            new[key] = (fwd + d, cm.whole_backward_of_split(bwd, share) + d)
        else:
            new[key] = (fwd + d, bwd + d)
        if p - 1 in members and p - 1 not in layer_from:
            fits[last]["head_scale"] = _head_scale(plan, chips, only, options, measured.stages[-1],
                                                   terms[-1], fwd + bwd)
        elif p - 1 in members and earlier_head is not None:
            fits[last]["head_scale"] = earlier_head  # not re-fitted here: the earlier profile's stays
    if fits[last]["head_scale"] == 1.0:
        del fits[last]["head_scale"]
    fits = {c: f for c, f in fits.items() if f}
    entries = {c: list(es) for c, es in (profile.chips.items() if profile else ())}
    for (chip, tensor, tokens, recompute), (fwd, bwd) in new.items():
        kept = [e for e in entries.get(chip, []) if (e.tensor, e.tokens, e.recompute) != (tensor, tokens, recompute)]
        entries[chip] = kept + [ProfileEntry(tensor, tokens, fwd, bwd, recompute)]
    source = f"h2jax calibrate: {measured.steps} measured step(s) of a {p}-stage {plan.schedule} plan"
    if profile is not None and profile.source:
        source = f"{profile.source}; {source}"
    return Profile(plan.model, plan.seq_len, {c: tuple(es) for c, es in entries.items()}, source,
                   plan.model_name or preset_name(plan.model), fits)


def _head_scale(plan: Plan, chips: Mapping[str, Any], only: Profile, options: cm.CostOptions,
                measured: StageMeasure, t_last: cm.StageTerms, per_layer: float) -> float:
    """Measured / modelled head and loss of the last stage: its forward + backward less its
    layers (`per_layer` seconds each, from the other stages of its shape) and its other end
    terms, over the head's modelled time (head_scale 1 in `only`)."""
    st, i = plan.stages[-1], plan.n_stages - 1
    held, deferred = cm.memory_holds(plan.schedule, i, plan.n_stages, plan.n_micro, cm.virtual_stages(plan))
    shape = StageShape.of_stage(plan, i, chips[st.chip])
    no_head = cm.stage_terms(shape, i == 0, False, held, only, options, deferred,
                             get_schedule(plan.schedule).splits_backward)
    head = (t_last.fwd_end + t_last.bwd_end) - (no_head.fwd_end + no_head.bwd_end)
    rest = measured.forward_s + measured.backward_s - st.n_layers * per_layer - (no_head.fwd_end + no_head.bwd_end)
    if head <= 0:
        return 1.0
    return max(rest / head, 0.05)


def calibrate(
    plan: Plan | str,
    steps: int = 6,
    *,
    cluster: Any = None,
    profile: Profile | None = None,
    events: Iterable[Sequence[Any]] | None = None,
    **run_kwargs: Any,
) -> tuple[list[Row], Profile | None]:
    """(rows, calibrated profile) for `plan`; see the module docstring. `run_kwargs` go to
    h2jax.run (e.g. dataset) when the plan is run here. Under mpiexec only the reporting
    process gets the trace: the others return ([], None)."""
    plan = load_plan(plan) if isinstance(plan, str) else plan
    if events is None:
        if steps < 2:
            raise ConfigError(f"--steps must be >= 2 (the first step compiles and is not measured), got {steps}")
        traced = traced_run(plan, steps, **run_kwargs)
        if traced is None:
            return [], None
        events, untraced_step_s = traced
    else:
        untraced_step_s = None
    chips = cm.chips_by_name(cluster, plan)
    if profile is not None:
        profile.check_matches(plan.model, plan.seq_len)
    costs = cm.stage_costs(plan, chips, profile)
    measured = measure(plan, events, costs)
    if untraced_step_s is not None:  # what a run without a trace takes: what plans are for
        measured = dataclasses.replace(measured, step_s=untraced_step_s)
    fitted, scale = fit_real_stages_to_step(plan, measured, chips, profile)
    calibrated_ = calibrated_profile(plan, fitted, chips, profile)
    if scale < 1.0:
        calibrated_ = dataclasses.replace(calibrated_, source=(
            f"{calibrated_.source}; the stages' traced forward and backward x {scale:.3f} "
            "(their traced intervals held input waits: the model now reproduces the measured step)"))
    elif untraced_step_s is not None:  # (a traced step also holds the trace's own cost)
        host = fit_host_to_step(plan, measured, chips, profile)
        if host is not None:
            calibrated_, delta = host
            calibrated_ = dataclasses.replace(calibrated_, source=(
                f"{calibrated_.source}; every compute's dispatch + {delta * 1e3:.3f} ms (the host's "
                "time per compute, which the emulated clocks do not see: the model now reproduces "
                "the measured step)"))
    return compare(plan, measured, costs), calibrated_


def fit_host_to_step(
    plan: Plan, measured: Measured, chips: Mapping[str, Any], profile: Profile | None = None,
) -> tuple[Profile, float] | None:
    """(calibrated profile, delta) for a plan with an emulated stage whose model, from the
    traced stages, predicts a shorter step than was measured; else None.

    Why: an emulated chip's traced compute is its clock's interval (h2jax.runtime.emulation),
    exactly the chip's time, but the one host that drives every local stage also spends time
    on each compute (dispatch, the pipeline loop, the transport, the clock's own bookkeeping)
    that no clock shows, and where it falls behind, the chips wait. Measured on a 2-core host
    (the demo's four plans): the untraced step exceeded the traced stages' closed form by 2-11 %,
    1.1-1.7 ms per compute on the critical path. That is the cost model's `dispatch` term, the
    fixed host cost of every forward and backward: calibration raises each chip type's
    dispatch by the one delta (the host is shared) under which the model reproduces the measured
    step, each stage's traced forward and backward taking the same delta more."""
    if not any(chips[st.chip].is_emulated for st in plan.stages):
        return None
    m, v = plan.n_micro, cm.virtual_stages(plan)
    base_fits = {c: dict(f) for c, f in (profile.fits.items() if profile else ())}
    base_dispatch = {st.chip: cm.calibrated(chips[st.chip], profile).dispatch_s for st in plan.stages}

    def with_host(delta: float) -> Profile:
        fits = {c: dict(f) for c, f in base_fits.items()}
        for chip, d in base_dispatch.items():
            fits.setdefault(chip, {})["dispatch_us"] = (d + delta) * 1e6
        raised = (dataclasses.replace(profile, fits=fits) if profile is not None
                  else Profile(plan.model, plan.seq_len, {}, fits=fits))
        shifted = dataclasses.replace(measured, stages=tuple(
            dataclasses.replace(s, forward_s=s.forward_s + delta, backward_s=s.backward_s + delta)
            for s in measured.stages))
        return calibrated_profile(plan, shifted, chips, raised)

    def step(delta: float) -> float:
        return cm.iteration_time(cm.stage_costs(plan, chips, with_host(delta)), m, plan.schedule, v)

    if step(0.0) >= measured.step_s:
        return None
    # step(0) < measured <= step(measured): every compute taking the whole step more
    _, delta = _bisect_to_step(step, measured.step_s, 0.0, measured.step_s)
    return with_host(delta), delta


def fit_real_stages_to_step(
    plan: Plan, measured: Measured, chips: Mapping[str, Any], profile: Profile | None = None,
    lowest: float = 0.1,
) -> tuple[Measured, float]:
    """(measured with the stages' forward and backward times scaled by `scale`, scale) for a
    plan of real chips: the largest scale in [lowest, 1] under which the calibrated model's
    step is no longer than the measured step (1 when it already is, or when not even
    `lowest` makes it so).

    Why: a real chip's traced compute runs from its dispatch (or its previous compute's end)
    to its outputs' readiness (h2jax.runtime.tracing). Where one host dispatches several
    stages ahead of their devices (the local transport: nothing waits for a producer), a
    compute is queued before its input exists, so its interval also holds the wait for the
    upstream stage, and, when the stages share the host's cores, the time it was runnable
    but off a core. Every stage then looks busy for nearly the whole step, and the pipeline's
    closed form, which adds fill and drain slots to m busy slots, predicts about (m + p - 1)/m
    times the run it was calibrated on (measured on this 2-core host: 1.20 for a 2-stage m=4
    plan, 1.22 for a 4-stage m=8 plan, 1.00 for one stage). The traced times are upper
    bounds of the computes; the measured step is not inflated by that. Only a plan of real
    chips alone is refitted: where any stage is emulated, every local stage runs on a clock
    (h2jax.runtime.emulation), a real chip's compute is timed there from its dispatch to its
    end, synchronously, and an emulated chip's interval is its clock's: exact, kept."""
    if any(chips[st.chip].is_emulated for st in plan.stages):
        return measured, 1.0
    m, v = plan.n_micro, cm.virtual_stages(plan)

    def scaled(scale: float) -> Measured:
        return dataclasses.replace(measured, stages=tuple(
            dataclasses.replace(s, forward_s=s.forward_s * scale, backward_s=s.backward_s * scale)
            for s in measured.stages))

    def step(scale: float) -> float:
        calibrated_ = calibrated_profile(plan, scaled(scale), chips, profile)
        return cm.iteration_time(cm.stage_costs(plan, chips, calibrated_), m, plan.schedule, v)

    if step(1.0) <= measured.step_s:
        return measured, 1.0
    if step(lowest) >= measured.step_s:  # the stages' compute does not explain the excess
        return measured, 1.0
    lo, _ = _bisect_to_step(step, measured.step_s, lowest, 1.0)  # step(lowest) < measured <= step(1)
    return scaled(lo), lo


def _bisect_to_step(step, target: float, lo: float, hi: float) -> tuple[float, float]:
    """(lo, hi) within 2**-50 of each other with step(lo) < target <= step(hi), given that
    bracket and a `step` that grows with its argument."""
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if step(mid) < target:
            lo = mid
        else:
            hi = mid
    return lo, hi


def traced_run(plan: Plan, steps: int, **run_kwargs: Any) -> tuple[list[TraceEvent], float] | None:
    """Train `plan` for 2 x `steps` steps, every other one traced (the first included): (the
    traced steps' events, the median time of the untraced steps); None off the reporting
    process. Tracing slows a step (a watcher thread per stage and a marker program per
    compute: measured 1.19x for a 4-stage m=8 plan on 2 cores, 1.05x for 2 stages, 1.01x
    for one), so the step a plan is calibrated to is timed without it."""
    import tempfile
    from pathlib import Path

    import h2jax
    from h2jax.trace import read_trace

    with tempfile.TemporaryDirectory(prefix="h2jax-calibrate-") as tmp:
        path = Path(tmp) / "trace.json"
        result = h2jax.run(plan, 2 * steps, trace=str(path), trace_every=2, **run_kwargs)
        if not path.is_file():  # not the reporting process of an MPI job
            return None
        return read_trace(path), statistics.median(result.step_times_s[1::2])
