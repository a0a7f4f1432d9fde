"""Each cost term of docs/planner.md moves the prediction in the direction and by the amount
its equation says: memory-bound work at HBM bandwidth, the per-chip matmul efficiency curve,
the fixed cost per stage compute, same-node sends, NICs shared by a node's chips, and tied
embeddings. Chip figures are parsed and refused like the others."""

import dataclasses
import itertools

import pytest

from h2jax.cluster import ChipType, EfficiencyCurve, Precision, chip_from_dict
from h2jax.config import PRESETS, ConfigError, ModelConfig
from h2jax.plan import Mesh, Plan, Stage
from h2jax.planner import Profile
from h2jax.planner import cost_model as cm
from h2jax.planner import memory_model as mm
from h2jax.planner.profile import ProfileError, profile_from_dict
from h2jax.planner.stage_shape import StageShape

TINY = PRESETS["tiny"]  # V 256, d 64, 4 layers, h 4, g 2, e 16, F 128
S = 32


def chip(name="x", per_node=4, intra=100.0, inter=10.0, **figures) -> ChipType:
    return ChipType(name, "cpu", 1.0, 1.0, per_node, intra, inter, "test figures",
                    precision=Precision("float32", "float32"), **figures)


def terms(c, b=2, data=1, tensor=1, recompute="none", first=False, last=False, model=TINY, profile=None):
    return cm.stage_terms(StageShape(model, S, b, c, data, tensor, recompute), first, last, 1, profile)


# ----------------------------------------------------------------------------- memory-bound work


def test_memory_bound_bytes_per_token_by_hand():
    # 4 bytes x (10 d replicated + (2 (h + g) e + 3 F) / T)
    assert cm.memory_bound_bytes_per_token(TINY, 1, 4) == 4 * (640 + 2 * 6 * 16 + 3 * 128) == 4864
    assert cm.memory_bound_bytes_per_token(TINY, 2, 4) == 4 * (640 + (192 + 384) / 2)


@pytest.mark.parametrize("recompute, backward_multiple", [("none", 2), ("selective", 2), ("full", 3)])
def test_doubling_hbm_bandwidth_halves_the_memory_bound_time(recompute, backward_multiple):
    slow, fast = chip(hbm_gbps=10.0), chip(hbm_gbps=20.0)
    t_slow, t_fast = terms(slow, recompute=recompute), terms(fast, recompute=recompute)
    n = 2 * S
    # element-wise bytes plus the XLA attention's scores (f32 logits and probabilities) at HBM speed
    fwd_bytes = n * (4864 + 4 * S * (8 + 2 * 4))
    assert t_slow.fwd_layer - t_fast.fwd_layer == pytest.approx(fwd_bytes * (1 / 10e9 - 1 / 20e9), rel=1e-9)
    # backward: element-wise twice (three times when the forward is recomputed), scores twice
    # (XLA attention backward) plus once more when the attention core is recomputed
    scores = n * 4 * S * 16
    score_multiple = 2 + (recompute != "none")
    bwd_bytes = backward_multiple * n * 4864 + score_multiple * scores
    assert t_slow.bwd_layer - t_fast.bwd_layer == pytest.approx(bwd_bytes * (1 / 10e9 - 1 / 20e9), rel=1e-9)


def test_optimizer_update_runs_at_hbm_bandwidth_not_peak_over_200():
    c = chip(hbm_gbps=7.0)
    t = terms(c)
    assert t.tail_layer - t.dp_layer == pytest.approx(28 * TINY.layer_param_count() / 7e9, rel=1e-12)
    # without the figure: the documented default, peak / MACHINE_BALANCE
    d = terms(chip())
    assert d.tail_layer == pytest.approx(28 * TINY.layer_param_count() / (1e12 / cm.MACHINE_BALANCE), rel=1e-12)
    assert chip().hbm_bytes_per_s == 1e12 / 200


# ----------------------------------------------------------------------------- matmul efficiency


def test_efficiency_falls_with_small_shapes_along_the_chips_curve():
    curve = EfficiencyCurve(max=0.6, half_tokens=100.0, half_width=50.0)
    assert cm.efficiency(100, 50, curve) == pytest.approx(0.6 / 4)
    assert cm.efficiency(16, 64, curve) < cm.efficiency(4096, 64, curve) < cm.efficiency(4096, 4096, curve) < 0.6


def test_chip_curve_scales_the_matmul_time_by_the_efficiency_ratio():
    base = chip(hbm_gbps=1e9)  # HBM time negligible: the layer is its matmuls
    tuned = dataclasses.replace(base, efficiency=EfficiencyCurve(0.5, 1000.0, 10.0))
    n, w = 2 * S, 64
    ratio = cm.efficiency(n, w) / cm.efficiency(n, w, tuned.efficiency)
    a, b = terms(base), terms(tuned)
    assert b.fwd_layer == pytest.approx(a.fwd_layer * ratio, rel=1e-6)
    assert b.bwd_weight_layer == pytest.approx(a.bwd_weight_layer * ratio, rel=1e-12)


def test_a_profiles_fitted_curve_overrides_the_chip_file():
    c = chip(hbm_gbps=30.0)
    fit = {"efficiency": {"max": 0.5, "half_tokens": 1000.0, "half_width": 10.0}, "hbm_gbps": 60.0}
    prof = Profile(TINY, S, {}, fits={"x": fit})
    same = dataclasses.replace(c, efficiency=EfficiencyCurve(0.5, 1000.0, 10.0), hbm_gbps=60.0)
    assert terms(c, profile=prof) == terms(same)
    assert terms(c, profile=prof) != terms(c)


# ----------------------------------------------------------------------------- fixed cost per compute


def _plan(p: int, m: int, chip_name="x", data=1, tensor=1, model=TINY) -> Plan:
    per = model.n_layers // p
    stages = tuple(Stage(chip_name, Mesh(data, tensor), (i * per, (i + 1) * per)) for i in range(p))
    return Plan(model, S, m * data, data, stages, model_name=None)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 4), (4, 8), (4, 16)])
def test_dispatch_adds_two_fixed_costs_per_micro_batch_slot(p, m):
    """1F1B over uniform stages: (m + p - 1) slots of f + b, then the tail; each f and b and
    the update carry one dispatch, so the step grows by (2 (m + p - 1) + 1) x dispatch."""
    none, some = chip(dispatch_us=0.0), chip(dispatch_us=100.0)
    plan = _plan(p, m)
    t0 = cm.iteration_time(cm.stage_costs(plan, {"x": none}), m, "1f1b")
    t1 = cm.iteration_time(cm.stage_costs(plan, {"x": some}), m, "1f1b")
    assert t1 - t0 == pytest.approx((2 * (m + p - 1) + 1) * 100e-6, rel=1e-9)


def test_profile_entry_pays_one_dispatch_per_stage_not_per_layer():
    c = chip(dispatch_us=1000.0)
    from h2jax.planner import ProfileEntry

    prof = Profile(TINY, S, {"x": (ProfileEntry(1, 2 * S, 0.010, 0.020),)})
    t = terms(c, profile=prof)
    assert t.fwd_layer == pytest.approx(0.009) and t.bwd_layer == pytest.approx(0.019)
    assert t.fwd_end == pytest.approx(0.001) and t.bwd_end == pytest.approx(0.001)
    assert t.fwd(1) == pytest.approx(0.010)  # a one-layer stage: exactly the measurement


# ----------------------------------------------------------------------------- stage-to-stage sends


def test_stages_that_fit_one_node_send_at_intra_node_bandwidth():
    c = chip(per_node=8, intra=100.0, inter=10.0)
    nbytes = 2 * S * 64 * 4
    sec, _ = cm.send_terms(TINY, S, 2, c, 2, 2, c, 2, 2)  # 4 + 4 chips fit a node of 8
    assert sec == pytest.approx(nbytes / (4 * 100e9), rel=1e-12)
    sec, _ = cm.send_terms(TINY, S, 2, c, 4, 2, c, 1, 1)  # 8 + 1 > 8: across nodes
    assert sec == pytest.approx(nbytes / (1 * 10e9), rel=1e-12)
    other = dataclasses.replace(c, name="y")  # another chip type never shares a node
    sec, _ = cm.send_terms(TINY, S, 2, c, 1, 1, other, 1, 1)
    assert sec == pytest.approx(nbytes / 10e9, rel=1e-12)
    assert cm.same_node(c, 4, c, 4) and not cm.same_node(c, 5, c, 4) and not cm.same_node(c, 1, other, 1)


# ----------------------------------------------------------------------------- NICs shared by a node


def test_chips_of_a_node_share_its_nics_for_inter_node_sends():
    per_chip_nic = chip("a", per_node=8, inter=10.0)  # default: one NIC per chip
    two_nics = chip("a", per_node=8, inter=10.0, nics_per_node=2)
    other = chip("b", per_node=8, inter=1000.0)
    nbytes = 2 * S * 64 * 4
    # 8 sending chips: 8 x 10 GB/s with a NIC each, 2 x 10 GB/s when they share two
    sec8, _ = cm.send_terms(TINY, S, 2, per_chip_nic, 2, 4, other, 1, 8)
    sec2, _ = cm.send_terms(TINY, S, 2, two_nics, 2, 4, other, 1, 8)
    assert sec8 == pytest.approx(nbytes / 80e9, rel=1e-12)
    assert sec2 == pytest.approx(nbytes / 20e9, rel=1e-12)
    # one chip alone gets one NIC, never more
    assert two_nics.inter_node_share_gbps(1) == 10.0 and two_nics.inter_node_share_gbps(8) == 2.5
    assert two_nics.inter_node_share_gbps(64) == 2.5  # at most a node's chips share its NICs


def test_data_parallel_reduction_across_nodes_uses_the_nic_share():
    one, shared = chip(per_node=4, inter=8.0), chip(per_node=4, inter=8.0, nics_per_node=1)
    a = terms(one, b=16, data=16)
    b = terms(shared, b=16, data=16)
    grad = 4 * TINY.layer_param_count()
    ring = 2 * 15 / 16 * grad
    assert a.dp_layer == pytest.approx(ring / 8e9, rel=1e-9)
    assert b.dp_layer == pytest.approx(ring / 2e9, rel=1e-9)  # 4 chips share 8 GB/s


# ----------------------------------------------------------------------------- tied embeddings


TIED = dataclasses.replace(TINY, tie_embeddings=True)


def test_tied_embeddings_counted_once_when_one_stage_holds_both_ends():
    V, d = 256, 64
    assert TIED.param_count() == TINY.param_count() - V * d
    assert mm.end_params(TIED, True, True) == V * d + d
    assert mm.end_params(TINY, True, True) == 2 * V * d + d
    # different stages: a copy on each end, as untied
    assert mm.end_params(TIED, True, False) == mm.end_params(TINY, True, False) == V * d
    assert mm.end_params(TIED, False, True) == mm.end_params(TINY, False, True) == V * d + d
    c = chip()
    one_tied, one = terms(c, first=True, last=True, model=TIED), terms(c, first=True, last=True)
    per_param = 4 + 4 + 8  # f32 params, f32 grads, AdamW m and v (data 1)
    assert one.mem.params_end - one_tied.mem.params_end == pytest.approx(V * d * per_param)


def test_tied_embeddings_add_one_gradient_all_reduce_between_the_ends():
    c = chip(per_node=4, inter=10.0, nics_per_node=1)
    V, d, T = 256, 64, 2
    extra = 4 * V * d / T / (10e9 / 2) + 2 * cm.ALPHA_S  # two chips of the node share one NIC
    for first, last in ((True, False), (False, True)):
        tied = terms(c, tensor=T, first=first, last=last, model=TIED)
        untied = terms(c, tensor=T, first=first, last=last)
        assert tied.dp_end - untied.dp_end == pytest.approx(extra, rel=1e-12)
        assert tied.tail_end - untied.tail_end == pytest.approx(extra, rel=1e-12)
    for first, last in ((False, False), (True, True)):  # a middle stage; one stage holds both
        tied = terms(c, tensor=T, first=first, last=last, model=TIED)
        untied = terms(c, tensor=T, first=first, last=last)
        assert tied.dp_end - untied.dp_end == pytest.approx(0.0, abs=1e-15)


def test_tie_embeddings_must_be_a_bool():
    with pytest.raises(ConfigError, match="model.tie_embeddings must be true or false"):
        ModelConfig(256, 64, 4, 4, 2, 128, tie_embeddings="yes")


# ----------------------------------------------------------------------------- chip files and fits


BASE = {"platform": "cpu", "memory_gib": 1.0, "peak_tflops": 1.0, "chips_per_node": 8,
        "intra_node_gbps": 10.0, "inter_node_gbps": 1.0, "source": "t"}


def test_chip_file_figures_parse_with_defaults():
    c = chip_from_dict("c", BASE, "c.toml")
    assert (c.hbm_gbps, c.nics) == (None, 8) and c.dispatch_s == pytest.approx(50e-6)
    assert c.efficiency == EfficiencyCurve(0.75, 256.0, 256.0)
    c = chip_from_dict("c", {**BASE, "hbm_gbps": 900, "nics_per_node": 2, "dispatch_us": 0,
                             "efficiency": {"max": 0.6, "half_tokens": 128}}, "c.toml")
    assert (c.hbm_gbps, c.nics, c.dispatch_s) == (900.0, 2, 0.0)
    assert c.efficiency == EfficiencyCurve(0.6, 128.0, 256.0)


@pytest.mark.parametrize("extra, message", [
    ({"hbm_gbps": 0}, "hbm_gbps must be a finite positive number"),
    ({"hbm_gbps": "fast"}, "hbm_gbps must be a finite positive number"),
    ({"nics_per_node": 0}, "nics_per_node must be an integer >= 1"),
    ({"nics_per_node": 1.5}, "nics_per_node must be an integer >= 1"),
    ({"dispatch_us": -1}, "dispatch_us must be a finite number >= 0"),
    ({"efficiency": {"max": 1.5}}, "efficiency.max must be <= 1"),
    ({"efficiency": {"half_width": -1}}, "half_width must be a finite positive number"),
    ({"efficiency": {"peak": 1}}, "unknown key\\(s\\) \\['peak'\\] in \\[efficiency\\]"),
])
def test_bad_chip_figures_are_refused_naming_the_field(extra, message):
    with pytest.raises(ConfigError, match=message):
        chip_from_dict("c", {**BASE, **extra}, "c.toml")


def test_shipped_chip_files_carry_hbm_and_nic_figures():
    from h2jax.cluster import known_chips, load_chip

    for name in known_chips():
        c = load_chip(name)
        assert c.hbm_gbps is not None and c.hbm_gbps > 0, name
    assert load_chip("nvidia-h100").hbm_gbps == 3350.0 and load_chip("cpu").nics == 1


@pytest.mark.parametrize("fit, message", [
    ({"hbm": 1.0}, "unknown field\\(s\\) \\['hbm'\\]"),
    ({"hbm_gbps": 0}, "hbm_gbps must be a positive number"),
    ({"efficiency": {"max": 2.0, "half_tokens": 1.0, "half_width": 1.0}}, "efficiency.max must be a positive number <= 1"),
    ({"efficiency": {"max": 0.5}}, "efficiency must be an object with exactly"),
])
def test_bad_profile_fits_are_refused(fit, message):
    raw = {"format_version": 1, "model": "tiny", "seq_len": S, "chips": {}, "fits": {"x": fit}}
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(raw)


def test_profile_fits_round_trip(tmp_path):
    from h2jax.planner import load_profile, save_profile

    fit = {"hbm_gbps": 12.0, "dispatch_us": 30.0, "efficiency": {"max": 0.5, "half_tokens": 64.0, "half_width": 32.0}}
    prof = Profile(TINY, S, {}, model_name="tiny", fits={"x": fit})
    save_profile(prof, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.fits == {"x": fit}
    assert back.apply_fits(chip()).dispatch_s == pytest.approx(30e-6)


def test_the_runtime_model_refuses_tied_embeddings_instead_of_training_them_untied():
    from h2jax.model import StageModel

    with pytest.raises(ConfigError, match="model.tie_embeddings: the planner prices tied embeddings"):
        StageModel(TIED, 0, TIED.n_layers, 0)


# ----------------------------------------------------------------------------- the head's loss


def test_the_loss_over_the_vocabulary_is_memory_bound_and_head_scale_multiplies_the_head():
    c = chip(hbm_gbps=10.0, dispatch_us=0.0)
    n, V = 2 * S, 256
    last, mid = terms(c, last=True), terms(c)
    rate = 1e12 * cm.efficiency(n, 64)
    logits = n * 2 * 64 * V / rate
    loss = n * V * 12 / 10e9
    assert last.fwd_end - mid.fwd_end == pytest.approx(logits + loss, rel=1e-12)
    assert last.bwd_end - mid.bwd_end == pytest.approx(2 * logits + loss, rel=1e-12)
    doubled = terms(dataclasses.replace(c, head_scale=2.0), last=True)
    assert doubled.fwd_end == pytest.approx(2 * last.fwd_end, rel=1e-12)
    assert doubled.bwd_weight_end == pytest.approx(2 * last.bwd_weight_end, rel=1e-12)


# ----------------------------------------------------------------------------- a split backward as run


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("first, last", [(False, False), (True, False), (False, True)])
def test_a_split_backward_is_priced_as_run_b_less_w_then_a_whole_backward(recompute, first, last):
    """Under ZB-H1 B drops the weight-gradient matmuls (b - w) and W re-runs the whole
    backward (b): B + W = 2b - w and W = b, per layer and in the end terms; the forward,
    tail and memory are the same."""
    c = chip(dispatch_us=100.0)
    one = cm.stage_terms(StageShape(TINY, S, 2, c, 1, 1, recompute), first, last, 2, deferred=2)
    split = cm.stage_terms(StageShape(TINY, S, 2, c, 1, 1, recompute), first, last, 2, deferred=2, splits_backward=True)
    assert split.bwd_layer == pytest.approx(2 * one.bwd_layer - one.bwd_weight_layer, rel=1e-12)
    assert split.bwd_weight_layer == one.bwd_layer
    assert split.bwd_end == pytest.approx(2 * one.bwd_end - one.bwd_weight_end, rel=1e-12)
    assert split.bwd_weight_end == one.bwd_end  # W's own dispatch with it
    assert split.bwd_layer - split.bwd_weight_layer == pytest.approx(one.bwd_layer - one.bwd_weight_layer)  # B
    assert (split.fwd_layer, split.fwd_end, split.tail_layer, split.tail_end, split.mem) == (
        one.fwd_layer, one.fwd_end, one.tail_layer, one.tail_end, one.mem)


def test_a_zb_h1_plan_is_priced_with_its_split_backward_and_a_1f1b_plan_without():
    plan = _plan(2, 4)
    zb = dataclasses.replace(plan, schedule="zb-h1")
    for i, (a, b) in enumerate(zip(cm.plan_stage_terms(plan, {"x": chip()}), cm.plan_stage_terms(zb, {"x": chip()}))):
        assert b.bwd_layer == pytest.approx(2 * a.bwd_layer - a.bwd_weight_layer, rel=1e-12)
        assert b.bwd_weight_layer == a.bwd_layer
    costs = cm.stage_costs(zb, {"x": chip()})
    plain = cm.stage_costs(plan, {"x": chip()})
    assert costs[0].backward_weight_s == pytest.approx(plain[0].backward_s, rel=1e-12)  # W: a whole backward


def test_a_measured_entrys_split_backward_inverts_to_its_whole_backward():
    """Calibration from a ZB-H1 run stores the whole backward: the entry priced as run gives
    back the measured B + W."""
    share = cm.entry_weight_share(TINY, S, 2 * S, 1, "none", "xla")
    assert 0 < share < 0.5
    b = 0.02
    split_s = cm.split_backward_as_run(b, share * b)[0]
    assert cm.whole_backward_of_split(split_s, share) == pytest.approx(b, rel=1e-12)


def test_a_layers_work_and_memory_made_once_give_the_terms_made_whole():
    """The search's context makes a shape's `layer_work` once per tokens a device sees (every
    data size and micro-batch that give as many share it) and its `layer_memory` once per
    shape, for every role and place: the stage terms are those `stage_terms` makes whole."""
    from h2jax.cluster import ChipGroup, Cluster
    from h2jax.planner.space import Option, make_context

    c = chip(hbm_gbps=50.0, dispatch_us=20.0)
    ctx = make_context(Cluster((ChipGroup(c, 16),)), "tiny", S, 16, "zb-h1")
    for b, data, tensor, recompute, first, last, held, deferred in itertools.product(
            (2, 4, 8), (1, 2), (1, 2), ("none", "selective", "full"), (False, True), (False, True), (1, 3.5), (0, 2)):
        o = Option("x", 1, data, tensor, recompute, 0.0)
        made = ctx.terms(b, o, first, last, held, deferred)
        whole = cm.stage_terms(StageShape(TINY, S, b, c, data, tensor, recompute), first, last, held, None, ctx.options,
                               deferred, True)
        assert made == whole
    shape, shared, _ = ctx._layer(4, Option("x", 1, 2, 1, "none", 0.0))
    assert ctx._layer(4, Option("x", 1, 2, 1, "none", 0.0))[0] is shape  # one StageShape per shape
    assert ctx._layer(8, Option("x", 1, 4, 1, "none", 0.0))[1] is shared  # 2 sequences a device either way
    assert ctx._layer(8, Option("x", 1, 2, 1, "none", 0.0))[1] is not shared
