"""Fused attention: the same numbers as the explicit path, the planner's terms per kernel, and
the planner choosing less recomputation when the scores are not kept."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h2jax.cluster import ChipGroup, ChipType, Cluster, Kernels, Precision, chip_from_dict, load_chip
from h2jax.config import ATTENTION_BLOCK, PRESETS, ConfigError, ModelConfig, causal_keys_per_query
from h2jax.planner import cost_model as cm
from h2jax.planner import memory_model as mm
from h2jax.planner.stage_shape import StageShape

# Two layers, GQA (4 query heads over 2 kv heads). The stages run one block of the blocked
# kernel (compiles stay fast); the kernel's loop over several blocks and its padded rows are
# checked directly in test_kernels_agree_on_values_and_gradients.
MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
SEQ = 96


# ----------------------------------------------------------------------------- numerics


def test_kernels_agree_on_values_and_gradients():
    from h2jax.model import causal_attention

    key = jax.random.key(0)
    B, S, H, K, E = 2, ATTENTION_BLOCK + 37, 4, 2, 16
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (B, S, n, E)) for i, n in enumerate((H, K, K)))
    w = jax.random.normal(jax.random.fold_in(key, 9), (B, S, H, E))

    def run(kernel):
        f = lambda q, k, v: jnp.sum(causal_attention(q, k, v, kernel, "highest") * w)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    (ref, ref_grads), (out, grads) = run("xla"), run("blocked")
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))
    # causal: nothing after position t reaches output t, under either kernel
    from h2jax.model import causal_attention as attn

    t = 100
    dq = jax.grad(lambda k: jnp.sum(attn(q, k, v, "blocked")[:, t]))(k)
    assert float(jnp.abs(dq[:, t + 1:]).max()) == 0.0 and float(jnp.abs(dq[:, :t + 1]).max()) > 0


def test_unknown_kernel_is_refused():
    from h2jax.model import StageModel

    with pytest.raises(ValueError, match="attention kernel 'flash' is unknown; use one of xla, cudnn, blocked"):
        StageModel(MODEL, 0, 2, 0, attention="flash")


def _step(recompute: str, tensor: int, attention: str, chip: str = "cpu"):
    """One stage holding the whole model: loss and accumulated gradients of one micro-batch,
    through the stage's own forward and backward programs (its recompute policy)."""
    from h2jax.plan import Mesh, Plan, Stage
    from h2jax.runtime.stage import StageExecutor

    plan = Plan(MODEL, SEQ, 2, 2, (Stage(chip, Mesh(1, tensor), (0, MODEL.n_layers), recompute),))
    ex = StageExecutor(plan, 0, jax.devices()[:tensor], attention=attention)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (2, SEQ + 1), dtype=np.int32)
    loss, saved = ex.forward(ex.put_input(tokens[:, :-1]), ex.put_labels(tokens[:, 1:]))
    ex.backward(saved, jnp.float32(1.0))
    return float(loss), ex.params_numpy(), jax.tree.map(np.asarray, ex.grad_acc)


@pytest.mark.parametrize("tensor", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_fused_equals_unfused_per_policy_and_tensor_size(recompute, tensor):
    loss_x, params_x, grads_x = _step(recompute, tensor, "xla")
    loss_f, params_f, grads_f = _step(recompute, tensor, "blocked")
    assert loss_f == pytest.approx(loss_x, rel=1e-5)
    jax.tree.map(np.testing.assert_array_equal, params_f, params_x)  # same initialization
    flat_x, flat_f = jax.tree.leaves(grads_x), jax.tree.leaves(grads_f)
    assert len(flat_x) == len(flat_f) > 0
    for gf, gx in zip(flat_f, flat_x):
        np.testing.assert_allclose(gf, gx, rtol=1e-5, atol=1e-5 * float(np.abs(gx).max()))


def test_fused_equals_unfused_in_bf16_within_the_alignment_tolerance():
    """bf16 compute (cpu-bf16: f32 parameters): the kernels round differently (the fused path
    keeps its logits in f32), so they agree to bf16 precision, not bit for bit."""
    loss_x, _, grads_x = _step("none", 1, "xla", "cpu-bf16")
    loss_f, _, grads_f = _step("none", 1, "blocked", "cpu-bf16")
    assert loss_f == pytest.approx(loss_x, rel=1e-3)
    for gf, gx in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_x)):
        assert np.linalg.norm(gf - gx) <= 2e-2 * np.linalg.norm(gx)  # measured: 0.35% at most


# ----------------------------------------------------------------------------- chip files


def _chip_file(tmp_path, platform="cpu", kernels="", compute="float32"):
    path = tmp_path / "chip.toml"
    path.write_text(
        f'platform = "{platform}"\nmemory_gib = 1.0\npeak_tflops = 1.0\nchips_per_node = 1\n'
        f'intra_node_gbps = 1.0\ninter_node_gbps = 1.0\nsource = "test"\n'
        f'[precision]\ncompute_dtype = "{compute}"\n{kernels}'
    )
    import tomllib

    return chip_from_dict("chip", tomllib.loads(path.read_text()), str(path))


def test_kernels_table_defaults_and_kernel_choice(tmp_path):
    assert _chip_file(tmp_path, "cpu").kernels.attention == "xla"
    assert _chip_file(tmp_path, "cuda", compute="bfloat16").kernels.attention == "fused"
    assert _chip_file(tmp_path, "cuda", compute="bfloat16").attention_kernel == "cudnn"
    # cuDNN's flash kernel has no f32 path: a float32 CUDA chip runs the blocked kernel
    assert _chip_file(tmp_path, "cuda", compute="float32").attention_kernel == "blocked"
    assert _chip_file(tmp_path, "cpu", '[kernels]\nattention = "fused"\n').attention_kernel == "blocked"
    assert _chip_file(tmp_path, "cuda", '[kernels]\nattention = "xla"\n', "bfloat16").attention_kernel == "xla"
    assert load_chip("nvidia-h100").attention_kernel == "cudnn"
    assert load_chip("cpu").attention_kernel == "xla"


def test_kernels_table_refuses_bad_values(tmp_path):
    with pytest.raises(ConfigError, match=r"chip.toml: kernels.attention 'flash' is unknown; use \"fused\""):
        _chip_file(tmp_path, kernels='[kernels]\nattention = "flash"\n')
    with pytest.raises(ConfigError, match=r"chip.toml: unknown key\(s\) \['softmax'\] in \[kernels\]"):
        _chip_file(tmp_path, kernels='[kernels]\nsoftmax = "fused"\n')


# ----------------------------------------------------------------------------- planner terms


def test_activation_terms_per_attention_kernel():
    m = PRESETS["llama-100b"]
    s, n, a, T = 4096, 2 * 4096, 2, 4
    d, h, g, e, F = 10_240, 80, 8, 128, 28_672
    kept = n * a * (4 * d + ((h + 2 * g) * e + d + 3 * F) / T)
    assert mm.layer_activation_bytes(m, s, n, T, "none", a, "xla") == n * a * (4 * d + ((h + 2 * g) * e + d + 3 * F + h * s) / T)
    assert mm.layer_activation_bytes(m, s, n, T, "none", a, "cudnn") == kept + n * 4 * h / T  # f32 log-sum-exp
    assert mm.layer_activation_bytes(m, s, n, T, "none", a, "blocked") == kept
    for kernel in ("xla", "cudnn", "blocked"):
        assert mm.layer_activation_bytes(m, s, n, T, "selective", a, kernel) == kept
        assert mm.layer_activation_bytes(m, s, n, T, "full", a, kernel) == n * a * d
    # at seq 4096 the scores are most of an XLA layer's activations
    assert mm.layer_activation_bytes(m, s, n, T, "none", a, "xla") > 2 * kept
    assert mm.attention_working_bytes(m, s, n, T, "blocked") == n * ATTENTION_BLOCK * h * 8 / T
    assert mm.attention_working_bytes(m, 100, n, T, "blocked") == n * 100 * h * 8 / T
    assert mm.attention_working_bytes(m, s, n, T, "xla") == mm.attention_working_bytes(m, s, n, T, "cudnn") == 0


def _chip(attention: str, platform: str = "cuda") -> ChipType:
    return ChipType("x", platform, 80.0, 1000.0, 8, 450.0, 50.0, "test", precision=Precision("float32", "bfloat16"),
                    kernels=Kernels(attention))


def test_stage_memory_terms_follow_the_chip_kernel():
    m, s, b = PRESETS["llama-7b"], 4096, 2
    n, a, h = b * s, 2, 32
    for recompute in ("none", "selective", "full"):
        xla = mm.stage_memory_terms(StageShape(m, s, b, _chip("xla"), 1, 1, recompute), False, False, 3)
        cudnn = mm.stage_memory_terms(StageShape(m, s, b, _chip("fused"), 1, 1, recompute), False, False, 3)
        blocked = mm.stage_memory_terms(StageShape(m, s, b, _chip("fused", "rocm"), 1, 1, recompute), False, False, 3)
        # one layer's backward (the gradients of what "none" keeps) and, recomputing, the layer
        # being recomputed: its scores under XLA, none under fused kernels
        layers = 1 + (recompute != "none")
        if recompute == "none":
            assert xla.layer_activation - cudnn.layer_activation == n * a * h * s - n * 4 * h
        else:
            assert xla.layer_activation == cudnn.layer_activation
        assert xla.working - cudnn.working == layers * (n * a * h * s - n * 4 * h)
        none_blocked = mm.layer_activation_bytes(m, s, n, 1, "none", a, "blocked")
        weight_gradient = m.layer_param_count() * a
        assert blocked.working - layers * none_blocked - weight_gradient == n * ATTENTION_BLOCK * h * 8


def test_attention_cost_per_kernel():
    m, s = PRESETS["llama-7b"], 4096
    h, e = 32, 128
    assert cm.attention_flops_per_token(m, s, "xla") == cm.attention_flops_per_token(m, s, "blocked") == 4 * s * h * e
    tiles = s // 128
    assert causal_keys_per_query(s, 128) == 128 * sum(range(1, tiles + 1)) / tiles == (s + 128) / 2
    assert cm.attention_flops_per_token(m, s, "cudnn") == 4 * (s + 128) / 2 * h * e
    assert cm.attention_score_bytes_per_token(m, s, "cudnn", 2) == 0
    assert cm.attention_score_bytes_per_token(m, s, "xla", 2) == h * s * 12
    # the backward, per kernel: matmuls twice their forward, the attention core by ATTENTION_BACKWARD
    b = 1
    n = b * s
    for attention, platform, kernel in (("xla", "cuda", "xla"), ("fused", "cuda", "cudnn"), ("fused", "rocm", "blocked")):
        c = _chip(attention, platform)
        t = cm.stage_terms(StageShape(m, s, b, c, 1, 1, "none"), False, False, 1)
        rate = c.peak_tflops * 1e12 * cm.efficiency(n, m.d_model)
        attn = n * cm.attention_flops_per_token(m, s, kernel) / rate + n * cm.attention_score_bytes_per_token(
            m, s, kernel, 2) / (c.peak_tflops * 1e12 / cm.MACHINE_BALANCE)
        mm_s = n * 2 * cm.matmul_params(m) / rate
        mem = n * cm.memory_bound_bytes_per_token(m, 1, 2) / c.hbm_bytes_per_s  # element-wise work
        assert t.fwd_layer == pytest.approx(mm_s + attn + mem, rel=1e-12)
        assert t.bwd_layer == pytest.approx(2 * mm_s + cm.ATTENTION_BACKWARD[kernel] * attn + 2 * mem, rel=1e-12)
        # selective: XLA runs the scores' matmul and softmax again (its output is kept), cuDNN
        # its whole kernel, the blocked kernel nothing its backward does not recompute anyway
        sel = cm.stage_terms(StageShape(m, s, b, c, 1, 1, "selective"), False, False, 1)
        scores = n * cm.attention_score_bytes_per_token(m, s, kernel, 2) / (c.peak_tflops * 1e12 / cm.MACHINE_BALANCE)
        again = {"xla": (attn - scores) / 2 + scores, "cudnn": attn, "blocked": 0.0}[kernel]
        assert sel.bwd_layer == pytest.approx(t.bwd_layer + again, rel=1e-12)
    # flash attention at seq 4096 is faster than XLA's in both directions
    fast = cm.stage_terms(StageShape(m, s, b, _chip("fused"), 1, 1, "none"), False, False, 1)
    slow = cm.stage_terms(StageShape(m, s, b, _chip("xla"), 1, 1, "none"), False, False, 1)
    assert fast.fwd_layer < slow.fwd_layer and fast.bwd_layer < slow.bwd_layer


# ----------------------------------------------------------------------------- the planner's choice


def test_fused_attention_plans_llama_100b_with_less_recomputation():
    """64 H100s, llama-100b at seq 4096: under XLA attention no stage of one shape can keep a
    layer's activations (the h*s scores), so every layer is recomputed; under cuDNN's flash
    kernel the same stages keep them and nothing is recomputed. With two shapes on the type,
    the XLA plan's back stages (fewer micro-batches in flight) keep theirs, the front ones
    still recompute."""
    from h2jax.planner import plan_cluster

    h100 = load_chip("nvidia-h100")
    plans = {}
    for attention in ("xla", "fused"):
        cluster = Cluster((ChipGroup(dataclasses.replace(h100, kernels=Kernels(attention)), 64),))
        plans[attention] = plan_cluster(cluster, "llama-100b", 4096, 512, baselines=False, mixed_shapes=False).plan
        plans[attention + "_cluster"] = cluster
        plans[attention + "_two"] = plan_cluster(cluster, "llama-100b", 4096, 512, baselines=False).plan
    recomputed = {k: sum(s.n_layers for s in plans[k].stages if s.recompute != "none")
                  for k in ("xla", "fused", "xla_two", "fused_two")}
    assert recomputed["fused"] < recomputed["xla"]
    assert recomputed == {"xla": 88, "fused": 0, "xla_two": recomputed["xla_two"], "fused_two": 0}
    assert 0 < recomputed["xla_two"] < 88 and plans["xla_two"].stages[0].recompute != "none"
    assert plans["fused"].predicted["step_time_s"] < plans["xla"].predicted["step_time_s"]
    # the reason: the XLA plan's own stages with recompute "none" all fit under fused attention,
    # but not under XLA attention, where the first stages (most micro-batches in flight) would
    # keep the scores
    xla_plan = plans["xla"]
    keep_all = dataclasses.replace(
        xla_plan, stages=tuple(dataclasses.replace(s, recompute="none") for s in xla_plan.stages)
    )
    fits = {}
    for attention in ("xla", "fused"):
        terms = cm.plan_stage_terms(keep_all, plans[attention + "_cluster"])
        fits[attention] = [t.mem.total_bytes(s.n_layers) <= t.mem.capacity for t, s in zip(terms, keep_all.stages)]
    assert all(fits["fused"])
    assert not fits["xla"][0] and not all(fits["xla"])


def test_cudnn_kernel_refuses_head_dims_it_cannot_run():
    from h2jax.plan import Mesh, Plan, Stage
    from h2jax.runtime.stage import StageExecutor

    model = ModelConfig(vocab_size=64, d_model=24, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=32)  # head dim 6
    plan = Plan(model, 16, 1, 1, (Stage("cpu", Mesh(), (0, 1)),))
    with pytest.raises(ConfigError, match=r"stages\[0\] \(chip cpu\): cuDNN's fused attention needs a head dim "
                                          r"\(d_model / n_heads = 6\).*\[kernels\] attention = \"xla\""):
        StageExecutor(plan, 0, jax.devices()[:1], attention="cudnn")
