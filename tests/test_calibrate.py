"""Calibration from a measured trace (h2jax.calibrate, `h2jax calibrate`): injected traces,
no timing. What a stage measured is read back exactly, each term is printed next to the
model's, and the calibrated profile makes the cost model predict what was measured."""

import json

import pytest

from h2jax.calibrate import calibrate, measure
from h2jax.cluster import load_chip
from h2jax.config import PRESETS, ConfigError
from h2jax.plan import Mesh, Plan, Stage, save_plan
from h2jax.planner import cost_model as cm
from h2jax.planner import load_profile
from h2jax.planner.stage_shape import StageShape
from h2jax.trace import TraceEvent, write_trace

TINY = PRESETS["tiny"]


def two_stage_plan(n_micro=2, micro_batch=1) -> Plan:
    stages = (Stage("emu-fast", Mesh(1, 1), (0, 3)), Stage("emu-slow", Mesh(1, 1), (3, 4)))
    return Plan(TINY, 32, n_micro * micro_batch, micro_batch, stages, model_name="tiny")


def synthetic_trace(plan, steps, fwd, bwd, opt, transfer=0.003, fused_last=False, first_step_scale=50.0):
    """A GPipe-like order per stage, laid out back to back: each stage's receives wait, its
    sends are instants. Stage 1 starts waiting for activation k before stage 0 posts it, so
    each activation's transfer is `transfer` after the post. Step 0 is `first_step_scale`
    times slower (a compile)."""
    events, t = [], 0.0
    m = plan.n_micro
    for step in range(steps):
        s = first_step_scale if step == 0 else 1.0
        t0 = t
        post = []
        clock = t0
        for k in range(m):  # stage 0 forwards
            events.append(TraceEvent(0, f"F{k}", clock, fwd[0] * s, {"micro": k}))
            clock += fwd[0] * s
            events.append(TraceEvent(0, f"SEND_ACT{k}", clock, 0.0, {"micro": k}, "comm"))
            post.append(clock)
        c1 = t0
        for k in range(m):  # stage 1: wait for the activation, then compute
            arrive = post[k] + transfer
            events.append(TraceEvent(1, f"RECV_ACT{k}", c1, max(arrive - c1, 0.0), {"micro": k}, "comm"))
            c1 = max(c1, arrive)
            if fused_last:
                events.append(TraceEvent(1, f"F{k}+B{k}", c1, (fwd[1] + bwd[1]) * s, {"micro": k}))
                c1 += (fwd[1] + bwd[1]) * s
            else:
                events.append(TraceEvent(1, f"F{k}", c1, fwd[1] * s, {"micro": k}))
                c1 += fwd[1] * s
                events.append(TraceEvent(1, f"B{k}", c1, bwd[1] * s, {"micro": k}))
                c1 += bwd[1] * s
            events.append(TraceEvent(1, f"SEND_GRAD{k}", c1, 0.0, {"micro": k}, "comm"))
        for k in range(m):  # stage 0 backwards, after its gradient arrives
            events.append(TraceEvent(0, f"RECV_GRAD{k}", clock, max(c1 - clock, 0.0), {"micro": k}, "comm"))
            clock = max(clock, c1)
            events.append(TraceEvent(0, f"B{k}", clock, bwd[0] * s, {"micro": k}))
            clock += bwd[0] * s
        events.append(TraceEvent(0, "optimizer", clock, opt[0] * s))
        events.append(TraceEvent(1, "optimizer", c1, opt[1] * s))
        t = max(clock + opt[0] * s, c1 + opt[1] * s)
    return events


def _chips(plan):
    return cm.chips_by_name(None, plan)


FWD, BWD, OPT = (0.004, 0.010), (0.009, 0.021), (0.002, 0.0035)


def test_measure_reads_each_stage_back_and_leaves_out_the_compile_step():
    plan = two_stage_plan(n_micro=3)
    events = synthetic_trace(plan, 4, FWD, BWD, OPT)
    got = measure(plan, events, cm.stage_costs(plan, None))
    assert got.steps == 3
    for i in range(2):
        s = got.stages[i]
        assert s.forward_s == pytest.approx(FWD[i]) and s.backward_s == pytest.approx(BWD[i])
        assert s.optimizer_s == pytest.approx(OPT[i])
    assert got.stages[0].send_s == pytest.approx(0.003)  # post to delivery, the receiver waiting
    # stage 1 waits for the first activation (forward 4 ms + transfer 3 ms); the later ones
    # arrive while it computes
    assert got.stages[1].recv_wait_s == pytest.approx(0.007)


def test_fused_forward_backward_is_split_in_the_predicted_proportion():
    plan = two_stage_plan()
    costs = cm.stage_costs(plan, None)
    events = synthetic_trace(plan, 3, FWD, BWD, OPT, fused_last=True)
    got = measure(plan, events, costs).stages[1]
    share = costs[1].forward_s / (costs[1].forward_s + costs[1].backward_s)
    assert got.forward_s == pytest.approx((FWD[1] + BWD[1]) * share)
    assert got.forward_s + got.backward_s == pytest.approx(FWD[1] + BWD[1])


def test_rows_put_each_measured_term_next_to_the_models():
    plan = two_stage_plan()
    costs = cm.stage_costs(plan, None)
    rows, _ = calibrate(plan, events=synthetic_trace(plan, 3, FWD, BWD, OPT))
    by = {(r.stage, r.term): r for r in rows}
    assert {t for _, t in by} == {"forward", "backward", "send", "receive wait", "dp reduce", "optimizer", "step"}
    assert by[0, "forward"].measured_s == pytest.approx(FWD[0]) and by[0, "forward"].predicted_s == costs[0].forward_s
    assert by[1, "backward"].ratio == pytest.approx(BWD[1] / costs[1].backward_s)
    assert by[0, "optimizer"].predicted_s == costs[0].optimizer_s
    assert by[0, "dp reduce"].measured_s is None and by[0, "dp reduce"].ratio is None
    assert by[None, "step"].predicted_s == pytest.approx(cm.iteration_time(costs, plan.n_micro))


def test_a_data_parallel_stages_gradient_reduction_is_measured_per_step():
    """A data-parallel stage reduces its ranks' gradients once per step in its own program,
    traced as "dp reduce" before its optimizer: the row gets its median (the compile step
    left out); a stage without one keeps None."""
    plan = two_stage_plan()
    events = []
    for e in synthetic_trace(plan, 4, FWD, BWD, OPT):
        if e.stage == 0 and e.name == "optimizer":
            n = sum(1 for x in events if x.name == "dp reduce")
            events.append(TraceEvent(0, "dp reduce", e.start_s, (0.005, 0.006, 0.004, 0.007)[n]))
        events.append(e)
    rows, _ = calibrate(plan, events=events)
    by = {(r.stage, r.term): r for r in rows}
    assert by[0, "dp reduce"].measured_s == pytest.approx(0.006)  # median of 6, 4 and 7 ms
    assert by[1, "dp reduce"].measured_s is None


def test_the_calibrated_profile_makes_the_model_predict_what_was_measured():
    plan = two_stage_plan(n_micro=2)
    _, profile = calibrate(plan, events=synthetic_trace(plan, 4, FWD, BWD, OPT, transfer=0.002))
    assert profile.model == TINY and profile.seq_len == 32
    costs = cm.stage_costs(plan, None, profile)
    for i in range(2):
        assert costs[i].forward_s == pytest.approx(FWD[i], rel=1e-9)
        assert costs[i].backward_s == pytest.approx(BWD[i], rel=1e-9)
        assert costs[i].optimizer_s == pytest.approx(OPT[i], rel=1e-9)
    # fitted figures: an effective peak and HBM bandwidth per chip type; sends are not fitted
    # (the search prices them from the chip files)
    assert set(profile.fits["emu-fast"]) == {"peak_tflops", "hbm_gbps"}
    assert costs[0].send_s == cm.stage_costs(plan, None)[0].send_s
    before = cm.stage_costs(plan, None)
    assert profile.fits["emu-fast"]["peak_tflops"] == pytest.approx(
        load_chip("emu-fast").peak_tflops * (before[0].forward_s + before[0].backward_s - 2 * 50e-6)
        / (FWD[0] + BWD[0] - 2 * 50e-6))


def test_a_zb_h1_run_is_calibrated_to_its_measured_b_plus_w():
    """Under ZB-H1 a stage's measured backward is its B and W together, which the cost model
    prices as run (cost_model.split_backward_as_run): the profile's entries hold the whole
    backward, so the model under it predicts the measured B + W again, not more."""
    import dataclasses

    plan = dataclasses.replace(two_stage_plan(n_micro=2), schedule="zb-h1")
    _, profile = calibrate(plan, events=synthetic_trace(plan, 4, FWD, BWD, OPT))
    costs = cm.stage_costs(plan, None, profile)
    for i in range(2):
        assert costs[i].forward_s == pytest.approx(FWD[i], rel=1e-9)
        assert costs[i].backward_s == pytest.approx(BWD[i], rel=1e-9)
    one_f_one_b = dataclasses.replace(plan, schedule="1f1b")  # the same entries: the whole backward
    assert cm.stage_costs(one_f_one_b, None, profile)[0].backward_s < BWD[0]


def test_calibrating_twice_keeps_the_first_profiles_other_entries():
    plan = two_stage_plan(n_micro=2)
    _, first = calibrate(plan, events=synthetic_trace(plan, 3, FWD, BWD, OPT))
    wider = two_stage_plan(n_micro=2, micro_batch=2)  # 64 tokens per device: another shape
    _, second = calibrate(wider, events=synthetic_trace(wider, 3, FWD, BWD, OPT), profile=first)
    assert sorted(e.tokens for e in second.chips["emu-fast"]) == [32, 64]  # beside the old entry
    assert first.source in second.source


def test_too_few_steps_are_refused():
    plan = two_stage_plan()
    with pytest.raises(ConfigError, match="calibration needs >= 2"):
        calibrate(plan, events=synthetic_trace(plan, 1, FWD, BWD, OPT))
    with pytest.raises(ConfigError, match="--steps must be >= 2"):
        calibrate(plan, steps=1)


def test_cli_calibrates_from_a_trace_and_plan_uses_the_profile(tmp_path, capsys):
    from h2jax.cli import main

    plan = two_stage_plan()
    save_plan(plan, tmp_path / "plan.json")
    write_trace(synthetic_trace(plan, 3, FWD, BWD, OPT), tmp_path / "trace.json")
    out = tmp_path / "cal" / "profile.json"
    code = main(["calibrate", "--plan", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"),
                 "--out", str(out), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["written_to"] == str(out)
    fwd0 = next(r for r in printed["rows"] if r["stage"] == 0 and r["term"] == "forward")
    assert fwd0["measured_s"] == pytest.approx(FWD[0])
    assert load_profile(out).fits["emu-slow"]["hbm_gbps"] > 0
    cluster = tmp_path / "c.toml"
    cluster.write_text('[[group]]\nchip = "emu-fast"\ncount = 1\n\n[[group]]\nchip = "emu-slow"\ncount = 1\n')
    code = main(["plan", "--cluster", str(cluster), "--model", "tiny", "--seq-len", "32", "--global-batch", "2",
                 "--profile", str(out), "--no-baselines", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["plan"]["predicted"]["cost_model"] == "profile"


# ----------------------------------------------------------------------------- h2jax profile: samples and fits


def test_stable_median_samples_until_the_median_settles():
    from h2jax.profiler import stable_median

    values = iter([1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 9.0])
    t = stable_median(lambda: next(values), repeats=3, max_repeats=10)
    assert t.median == 2.0 and t.samples == 5  # 3, then 2 more: the median did not move
    drifting = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    t = stable_median(lambda: next(drifting), repeats=2, max_repeats=8)
    assert t.samples == 8 and t.median == 4.5  # never settled: stopped at the cap


def test_spread_is_the_interquartile_range_over_the_median():
    from h2jax.profiler import spread_of

    assert spread_of([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert spread_of([2.0]) == 0.0


def test_a_profile_whose_spread_is_too_large_is_refused_naming_the_shape():
    from h2jax.profiler import Measurement, SpreadError, check_spread

    calm = Measurement(1, 2, 32, 1e-3, 2e-3, None, None, forward_spread=0.05, backward_spread=0.1, samples=9)
    noisy = Measurement(2, 4, 64, 1e-3, 2e-3, None, None, forward_spread=0.4, backward_spread=0.1, samples=36)
    check_spread([("cpu", calm)], 0.25)
    with pytest.raises(SpreadError, match="cpu tensor=2 micro-batch=4: the times vary by 40%.*--max-spread 25%"):
        check_spread([("cpu", calm), ("cpu", noisy)], 0.25)
    check_spread([("cpu", noisy)], 0.5)  # relaxed


def test_overhead_is_the_intercept_of_time_against_tokens():
    from h2jax.planner.fit import fit_overhead

    points = [(1, n, 1e-4 + 2e-6 * n) for n in (16, 32, 64)] + [(2, n, 3e-4 + 1e-6 * n) for n in (16, 64)]
    assert fit_overhead(points) == pytest.approx(2e-4)  # median of the two tensor sizes' intercepts
    assert fit_overhead([(1, 16, 1e-3)]) is None  # one token count resolves nothing
    assert fit_overhead([(1, 16, 1e-3), (1, 32, 3e-3)]) == 0.0  # a negative intercept is clamped


def test_efficiency_curve_is_recovered_from_exact_points():
    from h2jax.cluster import EfficiencyCurve
    from h2jax.planner.fit import _GRID, fit_curve

    true = EfficiencyCurve(0.6, float(_GRID[40]), float(_GRID[30]))
    points = [(n, w, cm.efficiency(n, w, true)) for n in (16.0, 64.0, 256.0, 2048.0) for w in (32.0, 128.0, 512.0)]
    got = fit_curve(points, EfficiencyCurve())
    assert got.max == pytest.approx(0.6) and got.half_tokens == true.half_tokens and got.half_width == true.half_width
    # one width: its half point keeps the prior's
    one = fit_curve([p for p in points if p[1] == 128.0], EfficiencyCurve(half_width=99.0))
    assert one.half_width == 99.0


def test_achieved_efficiency_inverts_the_cost_models_forward():
    import dataclasses

    from h2jax.planner.fit import achieved_efficiency

    c = dataclasses.replace(load_chip("cpu"), dispatch_us=30.0)
    for b, t in ((1, 1), (4, 1), (4, 2)):
        n = b * 32
        fwd = cm.stage_terms(StageShape(TINY, 32, b, c, 1, t, "none"), False, False, 1).fwd(1)  # a one-layer stage
        assert achieved_efficiency(TINY, 32, c, t, n, fwd) == pytest.approx(cm.efficiency(n, 64 / t, c.efficiency))


def test_a_chip_faster_than_its_file_gets_a_higher_peak_and_a_curve_capped_at_one():
    import dataclasses

    from h2jax.planner.fit import chip_fits

    file_chip = dataclasses.replace(load_chip("cpu"), dispatch_us=0.0, hbm_gbps=20.0)
    true_chip = dataclasses.replace(file_chip, peak_tflops=2 * file_chip.peak_tflops)
    fwd = cm.stage_terms(StageShape(TINY, 32, 2, true_chip, 1, 1, "none"), False, False, 1).fwd(1)
    fits = chip_fits(file_chip, TINY, 32, [(1, 64, fwd)], hbm_gbps=20.0)
    assert fits["hbm_gbps"] == 20.0 and "dispatch_us" not in fits  # one token count: no intercept
    assert fits["peak_tflops"] == pytest.approx(2 * 0.75 * file_chip.peak_tflops)
    assert fits["efficiency"] == {"max": 1.0, "half_tokens": 256.0, "half_width": 256.0}


def test_a_shape_shared_with_the_last_stage_takes_its_layers_from_the_others_and_fits_the_head():
    """Stage 0 (3 layers) and stage 1 (1 layer + head) on one chip type and shape: the layers
    come from stage 0, the head's measured remainder becomes head_scale, and the model then
    reproduces stage 0's forward and backward and stage 1's forward + backward."""
    stages = (Stage("emu-fast", Mesh(1, 1), (0, 3)), Stage("emu-fast", Mesh(1, 1), (3, 4)))
    plan = Plan(TINY, 32, 2, 1, stages, model_name="tiny")
    fwd, bwd = (0.006, 0.007), (0.012, 0.009)  # the last stage: 1 layer (2 + 4 ms) + a heavy head
    _, profile = calibrate(plan, events=synthetic_trace(plan, 3, fwd, bwd, OPT))
    assert len(profile.chips["emu-fast"]) == 1  # one entry for the shared shape
    costs = cm.stage_costs(plan, None, profile)
    assert costs[0].forward_s == pytest.approx(fwd[0], rel=1e-9)
    assert costs[0].backward_s == pytest.approx(bwd[0], rel=1e-9)
    assert costs[1].forward_s + costs[1].backward_s == pytest.approx(fwd[1] + bwd[1], rel=1e-9)
    assert profile.fits["emu-fast"]["head_scale"] > 1.0


def busy_trace(plan, steps, step_s, opt_s):
    """A 2-stage trace of real chips as the local transport's async dispatch records it:
    each stage's computes are queued ahead and fill its whole step (input waits included),
    the optimizer last; step k ends at (k + 1) * step_s."""
    m, events = plan.n_micro, []
    order = {0: [f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)],
             1: [x for k in range(m) for x in (f"F{k}", f"B{k}")]}
    slot = (step_s - opt_s) / (2 * m)
    for step in range(steps):
        for stage, names in order.items():
            t = step * step_s
            for name in names:
                events.append(TraceEvent(stage, name, t, slot, {"micro": int(name[1:])}))
                t += slot
            events.append(TraceEvent(stage, "optimizer", t, opt_s))
    return events


def test_a_real_chip_plan_is_calibrated_to_reproduce_its_measured_step():
    """Traced as busy for the whole step, each stage's f + b is t = (S - opt) / m; the 1F1B
    closed form gives (m + p - 1) * t + 2 * links + tail > S. Calibration scales the stages'
    forward and backward by one factor s so that the model's step is the measured S:
    s = (S - tail - 2 * links) / ((m + p - 1) * t)."""
    from h2jax.calibrate import calibrated_profile, fit_real_stages_to_step

    # two real chip types: each stage's own entry reproduces its traced time exactly
    stages = (Stage("cpu", Mesh(1, 1), (0, 2)), Stage("cpu-bf16", Mesh(1, 1), (2, 4)))
    plan = Plan(TINY, 32, 4, 1, stages, model_name="tiny")  # m = 4, p = 2
    S, opt = 0.2, 0.01
    t = (S - opt) / 4
    events = busy_trace(plan, 4, S, opt)
    measured = measure(plan, events, cm.stage_costs(plan, None))
    assert measured.step_s == pytest.approx(S)
    assert measured.stages[0].forward_s + measured.stages[0].backward_s == pytest.approx(t)
    unscaled = cm.stage_costs(plan, None, calibrated_profile(plan, measured, _chips(plan)))
    links = sum(c.send_s + c.link_latency_s for c in unscaled)
    tail = max(c.dp_reduce_s + c.optimizer_s for c in unscaled)
    assert [c.forward_s + c.backward_s for c in unscaled] == [pytest.approx(t), pytest.approx(t)]
    assert cm.iteration_time(unscaled, 4) == pytest.approx(5 * t + 2 * links + tail) and 5 * t > S

    _, scale = fit_real_stages_to_step(plan, measured, _chips(plan))
    assert scale == pytest.approx((S - tail - 2 * links) / (5 * t), rel=1e-9)
    _, profile = calibrate(plan, events=events)
    calibrated_costs = cm.stage_costs(plan, None, profile)
    assert cm.iteration_time(calibrated_costs, 4) == pytest.approx(S, rel=1e-9)
    for c in calibrated_costs:
        assert c.forward_s + c.backward_s == pytest.approx(scale * t, rel=1e-9)
    assert f"x {scale:.3f}" in profile.source  # where the profile says it came from


def test_a_plan_the_model_reproduces_or_with_an_emulated_chip_is_not_rescaled():
    from h2jax.calibrate import fit_real_stages_to_step

    cpu = (Stage("cpu", Mesh(1, 1), (0, 2)), Stage("cpu", Mesh(1, 1), (2, 4)))
    # the GPipe-like trace laid out back to back: the model's 1F1B step is below the measured one
    plan = Plan(TINY, 32, 2, 1, cpu, model_name="tiny")
    got = measure(plan, synthetic_trace(plan, 3, FWD, BWD, OPT), cm.stage_costs(plan, None))
    assert cm.iteration_time(cm.stage_costs(plan, None, calibrate(plan, events=synthetic_trace(
        plan, 3, FWD, BWD, OPT))[1]), 2) < got.step_s
    fitted, scale = fit_real_stages_to_step(plan, got, _chips(plan))
    assert scale == 1.0 and fitted is got
    # an emulated stage: every stage is timed on a clock, its trace is kept as measured
    emulated = Plan(TINY, 32, 4, 1, (Stage("emu-fast", Mesh(1, 1), (0, 2)), cpu[1]), model_name="tiny")
    busy = measure(emulated, busy_trace(emulated, 4, 0.2, 0.01), cm.stage_costs(emulated, None))
    fitted, scale = fit_real_stages_to_step(emulated, busy, _chips(emulated))
    assert scale == 1.0 and fitted is busy


def test_a_run_is_calibrated_to_its_untraced_steps(monkeypatch):
    """calibrate(plan, steps) traces every other step and holds the plan to the untraced
    steps' median (a trace slows a step down): the step row's measurement and the calibrated
    model's step are that time, not the traced one."""
    import h2jax.calibrate as calibration

    stages = (Stage("cpu", Mesh(1, 1), (0, 2)), Stage("cpu-bf16", Mesh(1, 1), (2, 4)))
    plan = Plan(TINY, 32, 4, 1, stages, model_name="tiny")
    traced_step, untraced_step = 0.2, 0.17
    monkeypatch.setattr(calibration, "traced_run",
                        lambda plan, steps, **kw: (busy_trace(plan, steps, traced_step, 0.01), untraced_step))
    rows, profile = calibrate(plan, 4)
    step_row = next(r for r in rows if r.term == "step")
    assert step_row.measured_s == untraced_step
    assert cm.iteration_time(cm.stage_costs(plan, None, profile), 4) == pytest.approx(untraced_step, rel=1e-9)
    _, from_trace = calibrate(plan, events=busy_trace(plan, 4, traced_step, 0.01))  # given events: the traced step
    assert cm.iteration_time(cm.stage_costs(plan, None, from_trace), 4) == pytest.approx(traced_step, rel=1e-9)


def test_an_emulated_plan_is_calibrated_to_its_untraced_step_through_the_hosts_time_per_compute(monkeypatch):
    """An emulated stage's traced compute is its clock's, which does not see the host's own
    time per compute; when the untraced step is longer than the traced stages' closed form,
    calibration raises every chip type's dispatch (the model's fixed cost per forward and
    backward) by one delta until the model reproduces that step: on two stages, every stage's
    forward and backward delta longer, so the 1F1B step grows by 2 * delta * (m + p - 1)."""
    import h2jax.calibrate as calibration

    plan = two_stage_plan(n_micro=4)  # emu-fast, emu-slow; m = 4, p = 2
    _, traced_only = calibrate(plan, events=synthetic_trace(plan, 3, FWD, BWD, OPT))
    before = cm.stage_costs(plan, None, traced_only)
    S0 = cm.iteration_time(before, 4)
    untraced = 1.1 * S0
    monkeypatch.setattr(calibration, "traced_run",
                        lambda plan, steps, **kw: (synthetic_trace(plan, steps, FWD, BWD, OPT), untraced))
    rows, profile = calibrate(plan, 3)
    after = cm.stage_costs(plan, None, profile)
    assert cm.iteration_time(after, 4) == pytest.approx(untraced, rel=1e-9)
    delta = (untraced - S0) / (2 * (4 + 2 - 1))
    for chip in ("emu-fast", "emu-slow"):
        assert profile.fits[chip]["dispatch_us"] == pytest.approx((50e-6 + delta) * 1e6, rel=1e-6)
    for b, a in zip(before, after):
        assert a.forward_s == pytest.approx(b.forward_s + delta, rel=1e-6)
        assert a.backward_s == pytest.approx(b.backward_s + delta, rel=1e-6)
        assert a.optimizer_s == pytest.approx(b.optimizer_s, rel=1e-6)  # the update is measured on its own
    assert "dispatch +" in profile.source
    # a step the traced stages already explain: nothing raised
    monkeypatch.setattr(calibration, "traced_run",
                        lambda plan, steps, **kw: (synthetic_trace(plan, steps, FWD, BWD, OPT), 0.9 * S0))
    _, kept = calibrate(plan, 3)
    assert "dispatch_us" not in kept.fits.get("emu-fast", {})
