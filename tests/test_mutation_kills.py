"""Exact checks written where mutation testing (benchmarks/mutation.py) showed the suite blind:
each asserts a number or a message derived by hand, not by the code under test. Fast: no test
here compiles more than a few tiny programs.

Test names carry the module they guard (kills_optim, kills_memory, ...), which is how the
mutation script selects them.
"""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from h2jax.plan import Optimizer, Train, plan_from_dict
from h2jax.runtime import memory as mem
from h2jax.runtime import optim

# ------------------------------------------------------------------------------ runtime/optim.py


def _params():
    return {"w": jnp.asarray([[0.5, -1.0], [2.0, 0.25]], jnp.float32), "b": jnp.asarray([0.1, -0.2], jnp.float32)}


def _grads(scale=1.0):
    return {"w": jnp.asarray([[0.3, 0.2], [-0.1, 0.4]], jnp.float32) * scale,
            "b": jnp.asarray([-0.5, 0.05], jnp.float32) * scale}


def _steps(tx, n=3):
    params, state = _params(), None
    state = tx.init(params)
    for i in range(n):
        updates, state = tx.update(_grads(1.0 + i), state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_kills_optim_make_optimizer_is_optax_with_the_plans_settings(name):
    opt = Optimizer(name=name, learning_rate=0.05, weight_decay=0.2, b1=0.7, b2=0.8, eps=1e-3)
    want = optax.sgd(0.05) if name == "sgd" else optax.adamw(0.05, b1=0.7, b2=0.8, eps=1e-3, weight_decay=0.2)
    got = _steps(optim.make_optimizer(opt))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(_steps(want))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_kills_optim_make_optimizer_follows_a_given_schedule():
    """A schedule passed in replaces the plan's learning rate: lr(n) = 0.1 * (n + 1)."""
    tx = optim.make_optimizer(Optimizer(name="sgd", learning_rate=9.0), schedule=lambda n: 0.1 * (n + 1))
    params, state = _params(), tx.init(_params())
    for n in range(2):
        updates, state = tx.update(_grads(), state, params)
        for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(_grads())):
            np.testing.assert_allclose(np.asarray(u), -0.1 * (n + 1) * np.asarray(g), rtol=1e-6)


def test_kills_optim_learning_rate_at_reads_floats_and_schedules():
    assert optim.learning_rate_at(0.25, 7) == 0.25 and isinstance(optim.learning_rate_at(1, 0), float)
    assert optim.learning_rate_at(lambda n: jnp.float32(n) / 4, 3) == 0.75


def _plan(train=None):
    raw = {"format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 4, "micro_batch": 2,
           "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 4]}]}
    if train:
        raw["train"] = train
    return plan_from_dict(raw)


def test_kills_optim_schedule_length_is_the_runs_unless_the_plan_says():
    cosine = _plan({"lr_schedule": "cosine"})
    assert optim.with_schedule_length(cosine, 30).train.decay_steps == 30
    assert optim.with_schedule_length(cosine, None) is cosine
    fixed = _plan({"lr_schedule": "linear", "decay_steps": 12})
    assert optim.with_schedule_length(fixed, 30) is fixed
    constant = _plan()
    assert optim.with_schedule_length(constant, 30) is constant  # a float: no length needed
    warm = _plan({"warmup_steps": 3})
    assert optim.with_schedule_length(warm, 30).train.decay_steps == 30  # constant after a warm-up


def test_kills_optim_schedules_that_need_a_length_say_so():
    from h2jax.plan import PlanError

    with pytest.raises(PlanError) as e:
        optim.learning_rate_schedule(Optimizer(), Train(lr_schedule="linear"))
    assert str(e.value) == (
        "train.lr_schedule 'linear' needs its length: set train.decay_steps, or give the run's steps "
        "(h2jax.Trainer(plan, steps=N))")
    with pytest.raises(PlanError) as e:
        optim.learning_rate_schedule(Optimizer(), Train(lr_schedule="cosine", warmup_steps=5, decay_steps=4))
    assert str(e.value) == (
        "train.warmup_steps (5) must be less than the schedule's length (4 steps: train.decay_steps, or the "
        "run's steps); shorten the warm-up or lengthen the run")
    # one step of warm-up left is enough
    s = optim.learning_rate_schedule(Optimizer(learning_rate=1.0), Train(lr_schedule="cosine", warmup_steps=4),
                                     steps=5)
    assert optim.learning_rate_at(s, 4) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["constant", "linear"])
def test_kills_optim_warmup_then_decay_by_hand(kind):
    """Warm-up 0 -> peak over 4 steps, then constant or linear to final_lr_fraction at step 12."""
    peak, frac = 2.0, 0.25
    s = optim.learning_rate_schedule(Optimizer(learning_rate=peak),
                                     Train(lr_schedule=kind, warmup_steps=4, final_lr_fraction=frac), steps=12)
    for n in range(15):
        if n < 4:
            want = peak * n / 4
        elif kind == "constant":
            want = peak
        else:
            want = peak + (peak * frac - peak) * min(n - 4, 8) / 8
        assert optim.learning_rate_at(s, n) == pytest.approx(want, rel=1e-6, abs=1e-9), n


def test_kills_optim_clip_at_exactly_the_limit_and_squared_norm_by_hand():
    g = {"a": jnp.asarray([3.0, 4.0], jnp.float32), "b": jnp.asarray([[12.0]], jnp.bfloat16)}
    assert float(optim.squared_norm(g)) == 9.0 + 16.0 + 144.0
    norm = jnp.float32(13.0)
    # norm == max_norm: clipped (g / 13 * 13 rounds: 3 -> 3.0000002), bit for bit as optax does it
    f32 = {"a": g["a"], "b": g["b"].astype(jnp.float32)}
    at_limit = optim.clip(f32, norm, 13.0)
    tx = optax.clip_by_global_norm(13.0)
    want, _ = tx.update(f32, tx.init(f32))
    for got, w in zip(jax.tree.leaves(at_limit), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    assert float(at_limit["a"][0]) != 3.0  # the case where clipping at the limit is visible
    # squares summed in f32 even for bf16 gradients: bf16(1.1)^2 in f32 is not representable in bf16
    x = jnp.asarray([1.1], jnp.bfloat16)
    assert float(optim.squared_norm({"x": x})) == float(np.float32(np.asarray(x, np.float32)[0]) ** 2)
    halved = optim.clip(g, norm, 6.5)
    np.testing.assert_allclose(np.asarray(halved["a"]), [1.5, 2.0], rtol=1e-6)
    assert halved["b"].dtype == jnp.bfloat16 and float(halved["b"][0, 0]) == 6.0


def test_kills_optim_clipped_update_keeps_the_parameters_dtype():
    params = {"w": jnp.asarray([1.0, 2.0], jnp.bfloat16)}
    tx = optax.sgd(1.0)
    grads = {"w": jnp.asarray([0.5, 0.25], jnp.float32)}
    new, _ = optim.apply_clipped_update(tx, params, tx.init(params), grads, jnp.float32(0.559), None)
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new["w"], np.float32), [0.5, 1.75])


def test_kills_optim_one_warmup_step_starts_from_zero():
    s = optim.learning_rate_schedule(Optimizer(learning_rate=2.0), Train(lr_schedule="linear", warmup_steps=1,
                                                                          final_lr_fraction=0.0), steps=5)
    assert [optim.learning_rate_at(s, n) for n in range(6)] == pytest.approx([0.0, 2.0, 1.5, 1.0, 0.5, 0.0])


def test_kills_optim_constant_after_warmup_needs_no_length():
    s = optim.learning_rate_schedule(Optimizer(learning_rate=1.0), Train(warmup_steps=2))  # no steps given
    assert [optim.learning_rate_at(s, n) for n in (0, 1, 2, 50)] == [0.0, 0.5, 1.0, 1.0]
    short = optim.learning_rate_schedule(Optimizer(learning_rate=1.0), Train(warmup_steps=4), steps=3)
    assert optim.learning_rate_at(short, 4) == 1.0  # a constant tail has no length to be shorter than


def test_kills_optim_make_optimizer_follows_the_plans_train_schedule():
    """lr 0 for the first update (warm-up from 0), 0.5 for the second: SGD's updates say so."""
    tx = optim.make_optimizer(Optimizer(name="sgd", learning_rate=1.0), Train(warmup_steps=2, decay_steps=4))
    params, state = _params(), tx.init(_params())
    for lr in (0.0, 0.5, 1.0):
        updates, state = tx.update(_grads(), state, params)
        for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(_grads())):
            np.testing.assert_allclose(np.asarray(u), -lr * np.asarray(g), rtol=1e-6, atol=0)


def test_kills_optim_clipped_adamw_update_in_bf16_equals_optax():
    """bf16 parameters: gradients are cast to the parameters' dtype before the optimizer (its
    moments stay bf16) and AdamW's weight decay sees the parameters."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    tx = optax.adamw(0.1, weight_decay=0.5)
    state = tx.init(params)
    new, new_state = optim.apply_clipped_update(tx, params, state, _grads(), jnp.float32(0.7), 0.35)
    assert [x.dtype for x in jax.tree.leaves(new_state)] == [x.dtype for x in jax.tree.leaves(state)]
    clipped = jax.tree.map(lambda g: (g * 0.5).astype(jnp.bfloat16), _grads())
    updates, _ = tx.update(clipped, state, params)
    want = optax.apply_updates(params, updates)
    for g, w in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# ------------------------------------------------------------------------------ runtime/memory.py


def _analysis(arg=0, out=0, alias=0, temp=0, code=0):
    return types.SimpleNamespace(argument_size_in_bytes=arg, output_size_in_bytes=out, alias_size_in_bytes=alias,
                                 temp_size_in_bytes=temp, generated_code_size_in_bytes=code)


class _Compiled:
    def __init__(self, analysis):
        self.analysis = analysis

    def memory_analysis(self):
        return self.analysis


def _executor(emulated=True, capacity_gib=0.5):
    chip = types.SimpleNamespace(
        name="chip-x", usable_memory_gib=capacity_gib, is_emulated=emulated, memory_gib=8.0,
        emulate=types.SimpleNamespace(memory_gib=capacity_gib) if emulated else None,
    )
    stage = types.SimpleNamespace(layers=(2, 5), mesh=types.SimpleNamespace(data=2, tensor=1), recompute="none")
    return types.SimpleNamespace(chip=chip, stage=stage, index=1)


def _held():
    """[4, 8, 16] f32 split over data=2: 2 x 8 x 16 x 4 = 1,024 bytes per device."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(2, 1), ("data", "tensor"))
    return (jax.ShapeDtypeStruct((4, 8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", None, None))),)


def test_kills_memory_per_device_bytes_by_hand():
    assert mem.per_device_bytes(_held()) == 1024
    assert mem.per_device_bytes({"x": np.zeros((3, 5), np.float16), "y": np.zeros((), np.int32)}) == 30 + 4


def test_kills_memory_figures_from_the_analyses_by_hand():
    update = _Compiled(_analysis(arg=1000, out=900, alias=900, temp=50, code=7))  # working 57
    forward = _Compiled(_analysis(arg=10, out=1500, alias=0, temp=100, code=3))  # 1603; less held: 579
    backward = _Compiled(_analysis(arg=10, out=200, alias=300, temp=400, code=5))  # 405: fresh outputs < 0 -> 0
    m = mem.StageMemory.of(_executor(), update, [forward, backward], _held(), 3, forward)
    assert (m.persistent_bytes, m.per_micro_batch_bytes, m.in_flight) == (1000, 1024, 3)
    assert m.working_bytes == 1603 - 1024
    assert m.capacity_bytes == 2**29
    assert m.needed_bytes == 1000 + 3 * 1024 + 579
    # a forward whose scratch is larger than its outputs less the residuals: the scratch counts
    big_temp = _Compiled(_analysis(out=1100, temp=1000, code=0))  # 2100 - 1024 = 1076 > 1000
    m2 = mem.StageMemory.of(_executor(), update, [big_temp], _held(), 1, big_temp)
    assert m2.working_bytes == 1076
    small_out = _Compiled(_analysis(out=1000, temp=900, code=0))  # 1900 - 1024 = 876 < 900
    assert mem.StageMemory.of(_executor(), update, [small_out], _held(), 1, small_out).working_bytes == 900
    # without a separate forward (a fused step) the largest step's working memory counts as is
    m3 = mem.StageMemory.of(_executor(), update, [backward], (), 0)
    assert (m3.working_bytes, m3.per_micro_batch_bytes, m3.in_flight) == (405, 0, 0)
    # the update runs when nothing is in flight: it counts instead of the steps, when larger
    assert (m.update_bytes, m3.needed_bytes) == (57, 1000 + 405)
    big_update = _Compiled(_analysis(arg=1000, out=900, alias=900, temp=5000, code=7))
    m4 = mem.StageMemory.of(_executor(), big_update, [forward, backward], _held(), 3, forward)
    assert m4.needed_bytes == 1000 + 5007


def test_kills_memory_deferred_weight_gradients_by_hand():
    """Under a split backward (ZB-H1) each micro-batch between its B and its W keeps what B
    hands to W: counted `deferred` times; nothing deferred unless asked."""
    update = _Compiled(_analysis(arg=1000, out=900, alias=900, temp=50, code=7))
    step = _Compiled(_analysis(out=10, temp=20, code=0))
    m = mem.StageMemory.of(_executor(), update, [step], (), 0, deferred=2, deferred_held=_held())
    assert (m.deferred, m.per_deferred_bytes) == (2, 1024)
    assert m.needed_bytes == 1000 + 2 * 1024 + 30  # the step's working memory, not the update's
    plain = mem.StageMemory.of(_executor(), update, [step], (), 0)
    assert (plain.deferred, plain.per_deferred_bytes) == (0, 0)
    over = mem.StageMemory(persistent_bytes=2**29, per_micro_batch_bytes=0, in_flight=0, working_bytes=0,
                           capacity_bytes=2**29, deferred=3, per_deferred_bytes=512)
    with pytest.raises(mem.StageMemoryError) as e:
        over.check(_executor())
    assert "+ 0 micro-batch(es) in flight x 0 B + 3 deferred weight gradient(s) x 512 B + working memory 0 B." \
        in str(e.value)


def test_kills_memory_no_analysis_means_no_figure():
    update = _Compiled(_analysis(arg=1))
    assert mem.StageMemory.of(_executor(), update, [_Compiled(None)], (), 0) is None
    assert mem.StageMemory.of(_executor(), _Compiled(None), [], (), 0) is None


def _memory(needed_extra):
    cap = 2**29
    return mem.StageMemory(persistent_bytes=cap - 3000 + needed_extra, per_micro_batch_bytes=1000, in_flight=2,
                           working_bytes=1000, capacity_bytes=cap)


def test_kills_memory_check_passes_at_exactly_the_capacity():
    assert _memory(0).needed_bytes == 2**29
    assert _memory(0).check(_executor()) is None


@pytest.mark.parametrize("emulated", [True, False])
def test_kills_memory_check_refuses_one_byte_over_with_the_whole_account(emulated):
    m = _memory(1)
    with pytest.raises(mem.StageMemoryError) as e:
        m.check(_executor(emulated))
    cap = "emulated cap [emulate] memory_gib = 0.5" if emulated else "memory_gib = 8.0"
    assert str(e.value) == (
        f"stages[1] (chip chip-x, layers [2, 5], mesh data=2 tensor=1, recompute=none) needs 536,870,913 bytes "
        f"per device but chip chip-x has 536,870,912 bytes ({cap} in backends/chip-x.toml): parameters, "
        "gradients and optimizer state 536,867,913 B + 2 micro-batch(es) in flight x 1,000 B + working memory "
        "1,000 B. Give the stage fewer layers, recompute=\"full\", a smaller micro_batch, more data or tensor "
        "parallelism, or a chip with more memory")
    err = e.value
    assert (err.stage, err.chip, err.needed_bytes, err.capacity_bytes) == (1, "chip-x", 2**29 + 1, 2**29)
    assert isinstance(err, mem.ConfigError)


# ------------------------------------------------------------------------------ model.py


def test_kills_model_unknown_attention_kernel_is_refused_by_name():
    from h2jax.config import PRESETS
    from h2jax.model import Attention

    with pytest.raises(ValueError) as e:
        Attention(PRESETS["tiny"], jax.random.key(0), kernel="flash9")
    assert str(e.value) == "attention kernel 'flash9' is unknown; use one of xla, cudnn, blocked"


def test_kills_model_attention_default_kernel_and_unknown_kernel_message():
    from h2jax.model import causal_attention

    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    kv = jax.random.normal(jax.random.key(1), (1, 8, 1, 4))
    np.testing.assert_array_equal(np.asarray(causal_attention(q, kv, kv)),
                                  np.asarray(causal_attention(q, kv, kv, kernel="xla")))
    with pytest.raises(ValueError) as e:
        causal_attention(q, kv, kv, kernel="flash9")
    assert str(e.value) == "attention kernel 'flash9' is unknown; use one of xla, cudnn, blocked"


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in `jaxpr`, sub-jaxprs (pjit, remat, loops) included."""
    from jax.extend import core as jex_core

    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    found += _dot_precisions(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    found += _dot_precisions(sub)
    return found


def test_kills_model_every_matmul_takes_the_stages_precision():
    from h2jax.config import ModelConfig
    from h2jax.model import StageModel

    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    model = StageModel(cfg, 0, 1, seed=0, precision=jax.lax.Precision.HIGHEST)
    tokens = np.zeros((1, 8), np.int32)
    precisions = _dot_precisions(jax.make_jaxpr(lambda t: model(t, t))(tokens).jaxpr)
    # q, k, v, scores, weighted values, out projection; gate, up, down; the head
    assert len(precisions) == 10
    highest = jax.lax.Precision.HIGHEST
    assert all(p == (highest, highest) for p in precisions), precisions


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_kills_model_each_block_keeps_exactly_what_the_memory_model_counts(mode):
    """A block run by block_runner(mode) keeps for its backward exactly A(n) of the memory
    model (the named values, or only its input under "full"), and no copy of its parameters."""
    from flax import nnx

    from h2jax.config import ModelConfig
    from h2jax.model import Block, block_runner
    from h2jax.planner import memory_model as mm
    from h2jax.residuals import split_off

    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    block = Block(cfg, jax.random.key(0))
    graphdef, state = nnx.split(block)
    x = jnp.ones((2, 8, 16))
    kept_bytes = []

    def forward(s, h):
        out, vjp = jax.vjp(lambda s, h: block_runner(mode)(nnx.merge(graphdef, s), h), s, h)
        kept, _ = split_off(vjp, s)
        kept_bytes.append(sum(k.size * k.dtype.itemsize for k in kept))
        return out

    jax.eval_shape(forward, state, x)
    assert kept_bytes == [mm.layer_activation_bytes(cfg, 8, 16, 1, mode, 4, "xla")]


def test_kills_model_every_parameter_has_the_stage_dtype_and_its_logical_axes():
    """The sharding rules split parameters by these names (a misspelt axis would leave a weight
    replicated, still correct, silently slower); the stage's dtype reaches every parameter."""
    from flax import nnx

    from h2jax.config import ModelConfig
    from h2jax.model import StageModel

    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    model = StageModel(cfg, 0, 1, seed=0, dtype=jnp.bfloat16)
    got = {".".join(map(str, path)): (v[...].dtype, v.logical_axes)
           for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    heads = ("embed", "heads", "head_dim")
    kv = ("embed", "kv_heads", "head_dim")
    expected = {
        "embed.table_VD": ("vocab", "embed"), "head.norm.scale": ("embed",), "head.w_DV": ("embed", "vocab"),
        "layer_000.attn.wq_DHE": heads, "layer_000.attn.wk_DKE": kv, "layer_000.attn.wv_DKE": kv,
        "layer_000.attn.wo_HED": ("heads", "head_dim", "embed"), "layer_000.attn_norm.scale": ("embed",),
        "layer_000.mlp.w_gate_DF": ("embed", "mlp"), "layer_000.mlp.w_up_DF": ("embed", "mlp"),
        "layer_000.mlp.w_down_FD": ("mlp", "embed"), "layer_000.mlp_norm.scale": ("embed",),
    }
    assert got == {name: (jnp.dtype(jnp.bfloat16), axes) for name, axes in expected.items()}


def test_kills_model_layer_names_and_initial_scale():
    from flax import nnx

    from h2jax.config import ModelConfig
    from h2jax.model import StageModel, layer_name

    assert [layer_name(i) for i in (0, 7, 123)] == ["layer_000", "layer_007", "layer_123"]
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, init_std=0.05)
    model = StageModel(cfg, 0, 2, seed=3)
    assert np.all(np.asarray(model.layer_000.attn_norm.scale[...]) == 1.0)
    assert np.all(np.asarray(model.head.norm.scale[...]) == 1.0)
    w = np.asarray(model.layer_001.mlp.w_up_DF[...])
    assert abs(w.std() - 0.05) < 0.005 and abs(w.mean()) < 0.005  # N(0, init_std)
    table = np.asarray(model.embed.table_VD[...])
    assert abs(table.std() - 1.0) < 0.05  # the embedding is N(0, 1)
    assert model.is_first and model.is_last and model.layer_names == ["layer_000", "layer_001"]
    middle = nnx.eval_shape(lambda: StageModel(cfg, 1, 2, seed=3))
    assert not middle.is_first and middle.is_last and not hasattr(middle, "embed")
    assert not hasattr(middle, "layer_000")


def test_kills_model_blocked_kernel_takes_a_precision_given_as_jax_lax_precision():
    """The stage's precision reaches the blocked kernel as a default-precision name: a
    jax.lax.Precision is translated (jax.default_matmul_precision refuses the enum)."""
    from h2jax.model import causal_attention

    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    kv = jax.random.normal(jax.random.key(1), (1, 8, 1, 4))
    highest = jax.lax.Precision.HIGHEST
    np.testing.assert_allclose(np.asarray(causal_attention(q, kv, kv, kernel="blocked", precision=highest)),
                               np.asarray(causal_attention(q, kv, kv, kernel="xla", precision=highest)),
                               rtol=1e-5, atol=1e-6)


def test_kills_model_tied_embeddings_are_refused_naming_the_field():
    import dataclasses

    from h2jax.config import PRESETS, ConfigError
    from h2jax.model import StageModel

    tied = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    with pytest.raises(ConfigError) as e:
        StageModel(tied, 0, tied.n_layers, 0)
    assert str(e.value).startswith("model.tie_embeddings: the planner prices tied embeddings")


def test_kills_model_initialization_keys_are_the_documented_ones():
    """model.py's contract: layer i from fold_in(seed, i), the embedding from
    fold_in(seed, n_layers), the final norm and head from fold_in(seed, n_layers + 1), so a
    seed gives the same parameters under every stage split and every version."""
    from h2jax.config import ModelConfig
    from h2jax.model import Block, Embed, Head, StageModel

    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32)
    root = jax.random.key(5)
    model = StageModel(cfg, 0, 2, seed=5)
    expected = {
        "embed": Embed(cfg, jax.random.fold_in(root, 2)).table_VD[...],
        "layer_001": Block(cfg, jax.random.fold_in(root, 1)).mlp.w_up_DF[...],
        "head": Head(cfg, jax.random.fold_in(root, 3)).w_DV[...],
    }
    got = {"embed": model.embed.table_VD[...], "layer_001": model.layer_001.mlp.w_up_DF[...],
           "head": model.head.w_DV[...]}
    for name in expected:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]), err_msg=name)


# ------------------------------------------------------------------------------ planner/memory_model.py
# Every figure below is the module docstring's formula evaluated by hand for one small model:
# d=16, h=4 heads, g=2 kv heads, e=4, F=24, V=64; s=8, micro-batch 4 over data=2 -> n=16 tokens
# per device, tensor T=2; parameters f32, activations bf16 (a=2); one layer has
# P = d*h*e + 2*d*g*e + h*e*d + 3*d*F + 2*d = 1,952 parameters.

from h2jax.cluster import ChipType, Kernels, Precision  # noqa: E402
from h2jax.config import ModelConfig  # noqa: E402
from h2jax.planner import memory_model as mm  # noqa: E402
from h2jax.planner.stage_shape import StageShape  # noqa: E402

_MM_CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=24)
_GIB = 2**30


def _mm_chip(platform="cpu", attention="xla", compute="bfloat16"):
    return ChipType("c", platform, 1.0, 1.0, 2, 10.0, 1.0, "t", precision=Precision("float32", compute),
                    kernels=Kernels(attention))


def _terms(recompute="none", first=True, last=True, in_flight=3, chip=None, **kw):
    shape = StageShape(_MM_CFG, 8, 4, chip or _mm_chip(), 2, 2, recompute)
    return mm.stage_memory_terms(shape, first, last, in_flight, **kw)


def test_kills_planner_memory_terms_of_a_first_and_last_stage_by_hand():
    t = _terms()
    per_param = 4 + 4 + 8 / 2  # f32 params, f32 grads, AdamW's 8 bytes split over data=2
    assert t.layer_static == 1952 / 2 * per_param == 11712
    assert t.params_end == (64 * 16 + 64 * 16 + 16) / 2 * per_param == 12384
    # A(n), none, explicit attention: n*a*(4d + ((h+2g)e + d + 3F + h*s)/T) = 32 * (64 + 152/2)
    assert t.layer_activation == 16 * 2 * (4 * 16 + ((4 + 4) * 4 + 16 + 72 + 4 * 8) / 2) == 4480
    # one layer's backward: its activations' gradients (f32 on XLA:CPU, twice the bf16 A(n))
    # and its weight gradient (f32 too), + f32 logits and their gradient
    assert t.working == 2 * 4480 + 1952 / 2 * 4 + 16 * 64 / 2 * 4 * 2 == 16960
    # each micro-batch in flight keeps the f32 logits, log-probabilities and final norm output
    assert t.end_activation == 16 * 64 / 2 * 4 * 2 + 16 * 16 * 2 == 4608
    assert t.reserve == pytest.approx(0.1 * _GIB) and t.capacity == _GIB
    assert t.in_flight == 3 and t.deferred == 0 and t.layer_deferred == 16 * 16 * 2
    assert t.per_layer == 11712 + 3 * 4480
    assert t.total_bytes(2) == pytest.approx(2 * (11712 + 3 * 4480) + 12384 + 3 * 4608 + 16960 + 0.1 * _GIB)
    assert t.static_bytes(2) == int(2 * 11712 + 12384 + 16960 + 0.1 * _GIB)
    assert t.activation_bytes(2) == 2 * 4480 + 4608
    room = _GIB - 12384 - 3 * 4608 - 16960 - 0.1 * _GIB
    assert t.max_layers() == math.floor(room / (11712 + 3 * 4480))
    b = t.breakdown(2)
    assert b["params_grads_optimizer"] == pytest.approx((2 * 11712 + 12384) / _GIB)
    assert b["activations"] == pytest.approx(3 * (4480 * 2 + 4608) / _GIB)
    assert b["deferred_weight_gradients"] == 0
    assert b["working"] == pytest.approx(16960 / _GIB) and b["reserve"] == pytest.approx(0.1)
    assert b["total"] == pytest.approx(t.total_bytes(2) / _GIB) and b["capacity"] == 1.0


def test_kills_planner_memory_middle_stage_selective_sgd_by_hand():
    t = _terms("selective", first=False, last=False, in_flight=1, optimizer="sgd")
    assert t.layer_static == 1952 / 2 * (4 + 4 + 0) and t.params_end == 0
    assert t.layer_activation == 16 * 2 * (64 + (32 + 16 + 72) / 2) == 3968  # the attention core recomputed
    assert t.working == 8960 + 3904 + 8960  # the backward, + the recomputed layer's activations (f32 here)
    first_only = _terms("full", first=True, last=False, in_flight=1)
    assert first_only.params_end == 64 * 16 / 2 * 12 and first_only.layer_activation == 16 * 2 * 16
    last_only = _terms("full", first=False, last=True, in_flight=1, shard_optimizer=False)
    assert last_only.params_end == (64 * 16 + 16) / 2 * (4 + 4 + 8)
    assert last_only.working == 8960 + 3904 + 8960 + 4096


def test_kills_planner_memory_attention_kernels_by_hand():
    blocked = _terms(chip=_mm_chip("cpu", "fused"))  # fused on a CPU: the blocked XLA kernel
    assert blocked.layer_activation == 3968  # no scores kept
    # one block's f32 scores + probs, the layer's backward (f32 on a CPU), + logits
    assert blocked.working == 16 * min(512, 8) * 4 * 8 / 2 + 2 * 3968 + 3904 + 4096
    blocked_full = _terms("full", chip=_mm_chip("cpu", "fused"), last=False)
    assert blocked_full.working == 2048 + 2 * 3968 + 3904 + 2 * 3968
    cudnn = _terms(chip=_mm_chip("cuda", "fused"))
    assert cudnn.layer_activation == 3968 + 16 * 4 * 4 / 2  # one f32 log-sum-exp per head and token
    assert cudnn.working == 4096 + 1952 / 2 * 2 + 4096  # bf16 on a GPU: the layer's backward + logits
    assert mm.attention_working_bytes(_MM_CFG, 8, 16, 2, "cudnn") == 0.0
    assert mm.layer_activation_bytes(_MM_CFG, 8, 16, 2, "full", 2, "cudnn") == 512


def test_kills_planner_memory_measured_activation_and_deferred_gradients():
    t = _terms(measured_activation=777, deferred=2)
    assert t.layer_activation == 777.0
    assert t.per_layer == 11712 + 3 * 777 + 2 * 512
    assert t.breakdown(1)["deferred_weight_gradients"] == pytest.approx(2 * 512 / _GIB)


def test_kills_planner_memory_nothing_fits_below_the_end_parameters():
    tiny = ChipType("c", "cpu", 1e-5, 1.0, 2, 10.0, 1.0, "t", precision=Precision("float32", "bfloat16"))
    t = _terms(chip=tiny)
    assert t.max_layers() == -1
    assert mm.end_params(_MM_CFG, False, False) == 0
    assert mm.end_params(_MM_CFG, True, True) == 64 * 16 * 2 + 16


# ------------------------------------------------------------------------------ planner/cost_model.py
# The module docstring's equations by hand, same small model: P_mm = 3*256 + 3*16*24 = 1,920
# matmul parameters per layer, n = 16 tokens per device, T = 2, a = 2 bytes; a chip of 1 TFLOP/s
# with 2 chips per node, 10 GB/s inside a node and 1 GB/s between nodes.

from h2jax.planner import cost_model as cm  # noqa: E402
from h2jax.planner.stage_cost import StageCost  # noqa: E402


def _cm_chip(attention="xla", platform="cpu"):
    return ChipType("c", platform, 1.0, 1.0, 2, 10.0, 1.0, "t", precision=Precision("float32", "bfloat16"),
                    kernels=Kernels(attention))


def test_kills_planner_cost_helpers_by_hand():
    assert cm.matmul_params(_MM_CFG) == 1920
    assert cm.efficiency(256, 256) == pytest.approx(0.75 / 4)
    assert cm.efficiency(16, 8) == pytest.approx(0.75 * 16 / 272 * 8 / 264)
    assert cm.allreduce_s(1e9, 1, 10.0) == 0.0
    assert cm.allreduce_s(1e9, 4, 10.0) == pytest.approx(2 * 3 / 4 * 0.1 + 2 * 3 * 5e-6)
    assert cm.dtype_bytes("bfloat16") == 2 and cm.dtype_bytes("float64") == 8
    with pytest.raises(mem.ConfigError) as e:
        cm.dtype_bytes("int4")
    assert str(e.value) == "unknown dtype 'int4' in a chip's [precision]; use one of float32, bfloat16, float16, float64"
    assert cm.attention_flops_per_token(_MM_CFG, 8) == 4 * 8 * 4 * 4
    keys = (128 * 128 + 72 * 200) / 200  # causal tiles of 128 over 200 positions
    assert cm.attention_flops_per_token(_MM_CFG, 200, "cudnn") == pytest.approx(4 * keys * 16)
    assert cm.attention_score_bytes_per_token(_MM_CFG, 8, "xla", 2) == 4 * 8 * 12
    assert cm.attention_score_bytes_per_token(_MM_CFG, 8, "cudnn", 2) == 0.0
    assert cm.model_flops_per_token(_MM_CFG, 8) == 3 * (4 * (2 * 1920 + 512) + 2 * 16 * 64)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_kills_planner_cost_stage_terms_by_hand(recompute, platform):
    t = cm.stage_terms(StageShape(_MM_CFG, 8, 4, _cm_chip(platform=platform), 2, 2, recompute), True, True, 3)
    rate = 1e12 * 0.75 * 16 / 272 * 8 / 264
    mm_s = 16 * 2 * 1920 / 2 / rate
    attn_s = 16 * 512 / 2 / rate + 16 * 384 / 2 / 5e9  # FLOPs, and the scores through HBM at peak/200
    tp_ar = 512 / 1e10 + 2 * 5e-6  # n*d*a bytes over 2 chips, intra-node
    mem_s = 16 * cm.memory_bound_bytes_per_token(_MM_CFG, 2, 2) / 5e9  # element-wise work at peak/200
    down_s = 16 * 2 * 16 * 24 / 2 / rate  # the MLP's down projection, not recomputed
    # selective (XLA attention): the scores' matmul (half the core's FLOPs) and the scores again
    recompute_s = {"none": 0.0, "selective": 16 * 256 / 2 / rate + 16 * 384 / 2 / 5e9,
                   "full": mm_s - down_s + attn_s + mem_s}[recompute]
    assert t.fwd_layer == pytest.approx(mm_s + attn_s + mem_s + 2 * tp_ar, rel=1e-12)
    # backward all-reduces: Megatron's two (+1 under full); XLA:CPU reduces each of the five
    # column-parallel input gradients on its own (+1 under full)
    backward_ars = {"cpu": 5, "cuda": 2}[platform] + (recompute == "full")
    assert t.bwd_layer == pytest.approx(2 * mm_s + 2 * attn_s + 2 * mem_s + recompute_s
                                        + backward_ars * tp_ar, rel=1e-12)
    assert t.bwd_weight_layer == pytest.approx(mm_s, rel=1e-12)
    logit_s = 16 * 2 * 16 * 64 / 2 / rate
    loss_s = 16 * 64 / 2 * 12 / 5e9  # the softmax cross-entropy: 12 bytes per f32 logit at HBM
    dispatch = 50e-6  # the default fixed cost of one stage compute
    assert t.fwd_end == pytest.approx(tp_ar + logit_s + loss_s + dispatch, rel=1e-12)
    assert t.bwd_end == pytest.approx(2 * logit_s + loss_s + tp_ar + dispatch, rel=1e-12)
    assert t.bwd_weight_end == pytest.approx(logit_s, rel=1e-12)
    # data x tensor = 4 chips > 2 per node: the gradient all-reduce crosses nodes (1 GB/s)
    assert t.dp_layer == pytest.approx(4 * 1952 / 2 / 1e9, rel=1e-9)
    assert t.dp_end == pytest.approx(4 * 2064 / 2 / 1e9 + 2 * 5e-6, rel=1e-9)
    opt = 28 / 5e9 / 4  # AdamW's bytes per owned parameter, sharded over data x tensor
    assert t.tail_layer == pytest.approx(t.dp_layer + opt * 1952, rel=1e-12)
    assert t.tail_end == pytest.approx(t.dp_end + opt * 2064 + dispatch, rel=1e-12)
    assert t.fwd(3) == pytest.approx(3 * t.fwd_layer + t.fwd_end) and t.bwd(2) == pytest.approx(2 * t.bwd_layer + t.bwd_end)
    assert t.tail(2) == pytest.approx(2 * t.tail_layer + t.tail_end)
    assert t.mem.in_flight == 3


def test_kills_planner_cost_middle_stage_sgd_unsharded_cudnn_by_hand():
    chip = _cm_chip("fused", "cuda")  # cuDNN: causal keys, no scores through HBM, 2.5x backward
    t = cm.stage_terms(StageShape(_MM_CFG, 8, 2, chip, 1, 1, "none"), False, False, 1,
                       options=cm.CostOptions(shard_optimizer=False, optimizer="sgd"))
    n = 16
    rate = 1e12 * 0.75 * n / (n + 256) * 16 / (16 + 256)
    attn_s = n * 4 * 8 * 16 / rate  # 8 positions: one tile, every key
    mem_s = n * cm.memory_bound_bytes_per_token(_MM_CFG, 1, 2) / 5e9
    assert t.fwd_layer == pytest.approx(n * 2 * 1920 / rate + attn_s + mem_s, rel=1e-12)  # no tensor all-reduce
    assert t.bwd_layer == pytest.approx(2 * n * 2 * 1920 / rate + 2.5 * attn_s + 2 * mem_s, rel=1e-12)
    assert t.fwd_end == t.bwd_end == pytest.approx(50e-6)  # only the dispatch on a middle stage
    assert t.bwd_weight_end == 0.0 and t.dp_layer == 0.0 and t.dp_end == 0.0
    assert t.tail_layer == pytest.approx(12 / 5e9 * 1952, rel=1e-12)


def test_kills_planner_cost_send_and_options_by_hand():
    fast, slow = _cm_chip(), ChipType("s", "cpu", 1.0, 1.0, 2, 10.0, 0.25, "t")
    seconds, nbytes = cm.send_terms(_MM_CFG, 8, 4, fast, 2, 1, slow, 1, 2)
    assert nbytes == 4 * 8 * 16 * 2  # the sender's compute dtype
    assert seconds == pytest.approx(max(nbytes / (2 * 1e9), nbytes / (2 * 0.25e9)))
    plan = plan_from_dict({"format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 4, "micro_batch": 2,
                           "optimizer": {"name": "sgd", "shard_over_data": False},
                           "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 4]}]})
    assert cm.CostOptions.of(plan) == cm.CostOptions(shard_optimizer=False, optimizer="sgd")


def _cost(f, b, send=0.0, latency=0.0, dp=0.0, opt=0.0):
    return StageCost(forward_s=f, backward_s=b, backward_weight_s=b / 2, send_s=send, send_bytes=0,
                     dp_reduce_s=dp, optimizer_s=opt, activation_bytes=0, static_bytes=0, link_latency_s=latency)


def test_kills_planner_cost_iteration_time_by_hand():
    """1F1B: sum t + 2 sum c + (m-1) max(max t, max send) + max tail;
    GPipe: sum t + 2 sum c + (m-1) (max(max f, max send) + max(max b, max send)) + max tail."""
    costs = [_cost(1.0, 2.0, send=2.5, latency=0.1, dp=0.2, opt=0.1), _cost(2.0, 3.0, dp=0.1, opt=0.1)]
    assert cm.iteration_time(costs, 4, "1f1b") == pytest.approx(8 + 2 * 2.6 + 3 * 5 + 0.3)
    assert cm.iteration_time(costs, 4, "gpipe") == pytest.approx(8 + 2 * 2.6 + 3 * (2.5 + 3) + 0.3)
    assert cm.pipeline_time(costs, 1, "1f1b") == pytest.approx(8 + 2 * 2.6)
    with pytest.raises(mem.ConfigError, match="at least one stage"):
        cm.iteration_time([], 4)
    with pytest.raises(mem.ConfigError, match=r"n_micro must be >= 1, got 0"):
        cm.pipeline_time(costs, 0)


# ------------------------------------------------------------------------------ transport/reshard.py

from h2jax.transport import reshard as rs  # noqa: E402


def test_kills_reshard_layout_errors_name_the_problem():
    with pytest.raises(ValueError) as e:
        rs.Layout(0, 2)
    assert str(e.value) == "mesh sizes must be >= 1, got data=0, tensor=2"
    with pytest.raises(ValueError) as e:
        rs.Layout(2, 1, owners=("a",))
    assert str(e.value) == "owners lists 1 devices but the mesh has 2"
    with pytest.raises(ValueError) as e:
        rs.Layout(1, 1, spec=("data", "pipe"))
    assert str(e.value) == "spec ('data', 'pipe') names mesh axis 'pipe'; known axes: ('data', 'tensor')"
    with pytest.raises(ValueError) as e:
        rs.Layout(1, 2).block(0, (4, 2, 3))
    assert str(e.value) == ("dimension 2 of shape (4, 2, 3) (3) is not divisible by the 2 devices of mesh axis "
                            "'tensor'; pick sizes that divide it")


def test_kills_reshard_blocks_of_a_two_axis_dimension_major_first():
    layout = rs.Layout(2, 2, spec=(("data", "tensor"), None), owners=("a", "b", "c", "d"))
    blocks = [layout.block(p, (8, 3)) for p in range(4)]
    assert blocks == [(slice(2 * p, 2 * p + 2), slice(0, 3)) for p in range(4)]
    assert [layout.owner(p) for p in range(4)] == ["a", "b", "c", "d"] and rs.Layout(1, 3).owner(2) == 2
    assert layout.coords(3) == {"data": 1, "tensor": 1} and layout.size == 4
    assert rs.Layout(2, 3).coords(4) == {"data": 1, "tensor": 1}


def test_kills_reshard_replicated_sender_by_hand():
    """A sender replicated on 2 devices, a receiver split over data=2: each receiver block is
    cut in two along its longest (first) dimension, the halves taken from the least-loaded
    replica first."""
    src, dst = rs.Layout(1, 2, spec=(None, None, None)), rs.Layout(2, 1)
    plan = rs.reshard_plan(src, dst, (4, 2, 2), 4)
    got = [(t.src_pos, t.dst_pos, t.index, t.nbytes) for t in plan]
    whole = (slice(0, 2), slice(0, 2))
    assert got == [(0, 0, (slice(0, 1),) + whole, 16), (1, 0, (slice(1, 2),) + whole, 16),
                   (0, 1, (slice(2, 3),) + whole, 16), (1, 1, (slice(3, 4),) + whole, 16)]
    assert rs.total_bytes(plan) == 64 and rs.bytes_per_dst_group(plan, dst) == {0: 32, 1: 32}


def test_kills_reshard_broadcast_moves_tensor_times_the_bytes_by_hand():
    src, dst = rs.Layout(1, 1), rs.Layout(1, 2)
    aware = rs.reshard_plan(src, dst, (2, 3, 4), 2)
    naive = rs.broadcast_plan(src, dst, (2, 3, 4), 2)
    assert [t.index for t in aware] == [(slice(0, 2), slice(0, 3), slice(0, 2)), (slice(0, 2), slice(0, 3), slice(2, 4))]
    assert [t.index for t in naive] == [(slice(0, 2), slice(0, 3), slice(0, 4))] * 2
    assert rs.total_bytes(aware) == 48 and rs.total_bytes(naive) == 96
    x = np.arange(24).reshape(2, 3, 4)
    for plan in (aware, naive):
        out = rs.apply_local(plan, src, dst, {0: x}, (2, 3, 4), x.dtype)
        np.testing.assert_array_equal(out[0], x[:, :, :2])
        np.testing.assert_array_equal(out[1], x[:, :, 2:])
        assert out[0].dtype == out[1].dtype == x.dtype  # the receiver's blocks keep the sender's dtype


def test_kills_reshard_split_and_index_helpers_by_hand():
    index = (slice(0, 2), slice(1, 8))
    assert rs._split(index, 3) == [(slice(0, 2), slice(1, 3)), (slice(0, 2), slice(3, 5)), (slice(0, 2), slice(5, 8))]
    assert rs._split((slice(0, 2), slice(0, 1)), 5) == [(slice(0, 1), slice(0, 1)), (slice(1, 2), slice(0, 1))]
    assert rs._intersect((slice(0, 4),), (slice(4, 6),)) is None
    assert rs._intersect((slice(0, 4), slice(2, 5)), (slice(3, 6), slice(0, 3))) == (slice(3, 4), slice(2, 3))
    assert rs.relative((slice(3, 5), slice(2, 4)), (slice(2, 6), slice(0, 4))) == (slice(1, 3), slice(2, 4))
    assert rs.shape_of((slice(3, 5), slice(2, 4))) == (2, 2) and rs._count((slice(3, 5), slice(2, 5))) == 6


def test_kills_reshard_layout_from_a_named_sharding():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    layout = rs.Layout.from_sharding(NamedSharding(mesh, P("data", None, "tensor")))
    assert (layout.data, layout.tensor, layout.spec) == (2, 2, ("data", None, "tensor"))
    assert layout.owners == tuple(d.id for d in jax.devices()[:4])
    named = rs.Layout.from_sharding(NamedSharding(mesh, P()), owner=lambda d: f"dev{d.id}")
    assert named.owners[0] == f"dev{jax.devices()[0].id}"
    other = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("x", "y"))
    with pytest.raises(ValueError) as e:
        rs.Layout.from_sharding(NamedSharding(other, P()))
    assert str(e.value) == "stage meshes have axes ('data', 'tensor'), got ('x', 'y')"


# ------------------------------------------------------------------------------ schedules (registry)

from h2jax import schedules as sch  # noqa: E402


def _names(actions):
    return [repr(a) for a in actions]


def test_kills_schedule_1f1b_and_gpipe_action_lists_by_hand():
    s = sch.get_schedule("1f1b")
    assert _names(s.stage_actions(0, 3, 4)) == [
        "F0", "SEND_ACT0", "F1", "SEND_ACT1",  # p - 1 = 2 warm-up forwards
        "F2", "SEND_ACT2", "RECV_GRAD0", "B0", "F3", "SEND_ACT3", "RECV_GRAD1", "B1",
        "RECV_GRAD2", "B2", "RECV_GRAD3", "B3"]
    assert _names(s.stage_actions(2, 3, 2)) == [
        "RECV_ACT0", "F0", "B0", "SEND_GRAD0", "RECV_ACT1", "F1", "B1", "SEND_GRAD1"]
    assert _names(s.stage_actions(1, 3, 1)) == ["RECV_ACT0", "F0", "SEND_ACT0", "RECV_GRAD0", "B0", "SEND_GRAD0"]
    g = sch.get_schedule("gpipe")
    assert _names(g.stage_actions(1, 3, 2)) == [
        "RECV_ACT0", "F0", "SEND_ACT0", "RECV_ACT1", "F1", "SEND_ACT1",
        "RECV_GRAD0", "B0", "SEND_GRAD0", "RECV_GRAD1", "B1", "SEND_GRAD1"]
    assert [s.in_flight(i, 3, 4) for i in range(3)] == [3, 2, 1] and s.in_flight(0, 3, 2) == 2
    assert [g.in_flight(i, 3, 4) for i in range(3)] == [4, 4, 4]
    assert [sch.max_in_flight(s.stage_actions(i, 3, 4)) for i in range(3)] == [3, 2, 1]
    assert sch.max_in_flight(g.stage_actions(0, 3, 4)) == 4
    assert s.memory_in_flight(1, 4, 8) == 3.0 and s.deferred(0, 3, 4) == 0
    assert len(s.build(3, 4)) == 3


def test_kills_schedule_helpers_by_hand():
    A = sch.Action
    plain = [A(sch.F, 0), A(sch.B, 0), A(sch.F, 1), A(sch.B, 1)]
    assert [sch.backward_follows(plain, i) for i in range(4)] == [True, False, True, False]
    assert not sch.backward_follows([A(sch.F, 0), A(sch.B, 1)], 0)
    assert not sch.backward_follows([A(sch.F, 0, 0), A(sch.B, 0, 1)], 0)
    assert not sch.backward_follows([A(sch.F, 0)], 0)
    split = [A(sch.F, 0), A(sch.F, 1), A(sch.B, 0), A(sch.B, 1), A(sch.W, 0), A(sch.W, 1)]
    assert not sch.backward_follows(split, 1)
    assert sch.max_in_flight(split) == 2 and sch.max_deferred(split) == 2 and sch.max_deferred(plain) == 0
    assert sch.max_in_flight([A(sch.F, 0), A(sch.B, 0), A(sch.W, 0), A(sch.F, 1)]) == 1
    assert repr(A(sch.F, 3, 1)) == "F3c1" and repr(A(sch.B, 2)) == "B2"
    # virtual stages: chunk c of stage i is c*p + i
    assert sch.sender(0, 1, 4, sch.RECV_ACT) == (3, 0) and sch.sender(3, 0, 4, sch.RECV_GRAD) == (0, 1)
    assert sch.receiver(3, 0, 4, sch.SEND_ACT) == (0, 1) and sch.receiver(0, 1, 4, sch.SEND_GRAD) == (3, 0)
    assert sch.receiver(1, 0, 4, sch.SEND_ACT) == (2, 0)
    with pytest.raises(ValueError) as e:
        sch.actions_from_order(0, 2, [("X", 0, 0)])
    assert str(e.value) == "unknown compute kind 'X' in stage 0's order; use F, B or W"
    assert _names(sch.actions_from_order(0, 2, [(sch.F, 0, 0), (sch.W, 0, 0)])) == ["F0", "SEND_ACT0", "W0"]


def test_kills_schedule_checks_name_the_fault():
    with pytest.raises(ValueError) as e:
        sch.get_schedule("2f2b")
    assert str(e.value) == "schedule '2f2b' is unknown; use one of gpipe, 1f1b, interleaved-1f1b, zb-h1"
    with pytest.raises(ValueError) as e:
        sch.get_schedule("1f1b").stage_actions(0, 2, 2, v=2)
    assert str(e.value) == ("schedule '1f1b' runs one chunk per stage; set virtual_stages to 1 or use "
                            "interleaved-1f1b")
    with pytest.raises(ValueError) as e:
        sch.get_schedule("interleaved-1f1b").check_v(1)
    assert str(e.value) == "schedule 'interleaved-1f1b' needs virtual_stages >= 2, got 1"
    with pytest.raises(ValueError) as e:
        sch.check_order([(sch.F, 0, 0), (sch.B, 0, 0)], 2, stage=3)
    assert str(e.value) == "stage 3: F runs [(0, 0)]..., expected every micro-batch 0..1 x chunk 0..0 once"
    with pytest.raises(ValueError) as e:
        sch.check_order([(sch.B, 0, 0), (sch.F, 0, 0)], 1)
    assert str(e.value) == "stage 0: B0 (chunk 0) comes before F0"
    sch.check_order([(sch.F, 0, 0), (sch.B, 0, 0), (sch.W, 0, 0)], 1)  # a valid split order
    with pytest.raises(ValueError, match="W0 \\(chunk 0\\) comes before B0"):
        sch.check_order([(sch.F, 0, 0), (sch.W, 0, 0), (sch.B, 0, 0)], 1)
    A = sch.Action
    deadlock = [[A(sch.RECV_GRAD, 0), A(sch.F, 0), A(sch.SEND_ACT, 0)], [A(sch.RECV_ACT, 0), A(sch.F, 0)]]
    with pytest.raises(RuntimeError) as e:
        sch.execution_order(deadlock)
    assert str(e.value) == "schedule deadlocks; stages wait at {0: RECV_GRAD0, 1: RECV_ACT0}"
    order = sch.execution_order(sch.get_schedule("1f1b").build(2, 2))
    assert [(i, repr(a)) for i, a in order][:4] == [(0, "F0"), (0, "SEND_ACT0"), (0, "F1"), (0, "SEND_ACT1")]


def test_kills_schedule_closed_forms_and_bubble_by_hand():
    f, b, w = [1.0, 2.0], [2.0, 3.0], [1.0, 1.5]
    one = sch.get_schedule("1f1b").closed_form
    assert one.pipeline_time(f, b, w, 0.6, 2.5, 4) == pytest.approx(8 + 1.2 + 3 * 5)
    assert one.pipeline_time(f, b, w, 0.6, 6.0, 4) == pytest.approx(8 + 1.2 + 3 * 6)  # send-bound
    gp = sch.get_schedule("gpipe").closed_form
    assert gp.pipeline_time(f, b, w, 0.6, 2.5, 4) == pytest.approx(8 + 1.2 + 3 * (2.5 + 3))
    chunked = sch.ClosedForm(fill=(1, 1, 0), fill_last=(2, 1, 0), steady=((1, 1, 0),), chunked=True)
    assert chunked.steady_weight(4, 2) == 3.5 and chunked.fill_scale(2) == 0.5 and chunked.send_factor(2) == 2.0
    assert chunked.fill_coefficients(2, 2).tolist() == [[0.5, 0.5, 0.0], [1.0, 0.5, 0.0]]
    # fill (1+2)/2 + (2*2+3)/2 = 5, links 2*0.1, steady (4 - 1/2) * max(5, 2 * 1.0)
    assert chunked.pipeline_time(f, b, w, 0.1, 1.0, 4, 2) == pytest.approx(5 + 0.2 + 3.5 * 5)
    assert one.steady_weight(4) == 3.0 and one.fill_scale(2) == 1.0 and one.send_factor(3) == 1.0
    assert sch.bubble_fraction([3.0, 1.0], 4.0) == 0.5 and sch.bubble_fraction([1.0], 0.0) == 0.0
    assert sch.bubble_fraction([5.0, 5.0], 4.0) == 0.0


def test_kills_schedule_variants_for_the_planner():
    assert sch.variants("1f1b") == [("1f1b", 1)]
    assert sch.variants("interleaved-1f1b") == [("interleaved-1f1b", 2), ("interleaved-1f1b", 4)]
    assert sch.variants() == [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
                              ("zb-h1", 1)]


def test_kills_schedule_closed_form_defaults_and_weight_terms_by_hand():
    chunked = sch.ClosedForm(fill=(1, 1, 0), fill_last=(0.5, 1, 0), steady=((1, 1, 0),), chunked=True)
    # one chunk unless told: v = 1
    assert chunked.steady_weight(4) == 3.0 and chunked.fill_scale() == 1.0 and chunked.send_factor() == 1.0
    assert chunked.fill_coefficients(3).tolist() == [[1, 1, 0], [1, 1, 0], [0.5, 1, 0]]  # the last row, as given
    assert chunked.pipeline_time([1.0], [2.0], [0.0], 0.0, 0.0, 4) == pytest.approx(0.5 + 2 + 3 * 3)
    assert sch.get_schedule("1f1b").closed_form.steady_weight(4, 2) == 3.0  # not chunked: m - 1 whatever v
    # a form with weight-gradient terms (split backward): fill and steady both count w
    split = sch.ClosedForm(fill=(1, 1, 1), fill_last=(1, 1, 1), steady=((1, 0, 2),))
    f, b, w = [1.0, 2.0], [3.0, 1.0], [0.5, 2.0]
    assert split.pipeline_time(f, b, w, 0.0, 0.0, 3) == pytest.approx((1 + 3 + 0.5 + 2 + 1 + 2) + 2 * max(2, 6))
    # send-bound chunked steady state: each micro-batch crosses each link v times
    plain = sch.ClosedForm(fill=(1, 1, 0), fill_last=(1, 1, 0), steady=((1, 1, 0),), chunked=True)
    assert plain.pipeline_time([1.0], [2.0], [0.0], 0.0, 4.0, 4, 2) == pytest.approx(1.5 + 3.5 * 8)
    # vectorised over layer splits: one row each, the max over stages per row
    rows = plain.pipeline_time([[1.0, 2.0], [3.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]],
                               0.0, 0.0, 2)
    assert rows.tolist() == pytest.approx([5 + 3, 6 + 4])
    assert sch.bubble_fraction([0.25, 0.25], 0.5) == 0.5


def test_kills_schedule_interleaved_in_flight_by_hand():
    """Megatron's warm-up: 2 (p - i - 1) + (v - 1) p forwards, then one more in flight, at most m v."""
    s = sch.get_schedule("interleaved-1f1b")
    assert [s.in_flight(i, 4, 8) for i in range(4)] == [2 * (4 - i - 1) + 4 + 1 for i in range(4)]  # v = 2
    assert s.in_flight(0, 4, 4, 2) == 8 and s.in_flight(1, 2, 4, 3) == 2 * 0 + 2 * 2 + 1


def test_kills_schedule_order_checks_for_split_backwards_and_long_lists():
    with pytest.raises(ValueError) as e:
        sch.check_order([(sch.F, 0, 0), (sch.F, 1, 0), (sch.B, 0, 0), (sch.B, 1, 0), (sch.W, 0, 0)], 2)
    assert str(e.value) == "stage 0: W runs [(0, 0)]..., expected every micro-batch 0..1 x chunk 0..0 once"
    order = [(sch.F, k, 0) for k in range(11)] + [(sch.B, k, 0) for k in range(12)]
    with pytest.raises(ValueError) as e:
        sch.check_order(order, 12)
    assert str(e.value).startswith("stage 0: F runs [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0)]...")


def test_kills_planner_cost_virtual_stages_of_a_plan():
    assert cm.virtual_stages(types.SimpleNamespace(virtual_stages=2)) == 2
    assert cm.virtual_stages(types.SimpleNamespace()) == 1


def test_kills_planner_memory_breakdown_of_deferred_gradients_scales_with_layers():
    t = _terms(deferred=2)
    assert t.breakdown(3)["deferred_weight_gradients"] == pytest.approx(2 * 512 * 3 / _GIB)


def test_kills_planner_cost_chips_from_the_plan_and_bubble_by_hand():
    from h2jax.cluster import load_chip

    plan = _plan()
    assert cm.chips_by_name(None, plan) == {"cpu": load_chip("cpu")}
    assert cm.chips_by_name(None) == {}
    (terms,) = cm.plan_stage_terms(plan, None)  # chip types read from backends/ by the plan's names
    assert terms.mem.capacity == load_chip("cpu").usable_memory_gib * 2**30
    # uniform stages, 1F1B by default: (p - 1) / (m + p - 1)
    costs = [_cost(1.0, 2.0), _cost(1.0, 2.0), _cost(1.0, 2.0)]
    assert cm.bubble_fraction(costs, 5) == pytest.approx(2 / 7)
    # interleaved: v reaches the closed form (1/v of the fill)
    form = sch.get_schedule("interleaved-1f1b").closed_form
    t_pipe = form.pipeline_time([1.0] * 3, [2.0] * 3, [1.0] * 3, 0.0, 0.0, 6, 2)
    assert cm.bubble_fraction(costs, 6, "interleaved-1f1b", 2) == pytest.approx(1 - 3 * 6 * 3 / (3 * t_pipe))
    assert cm.bubble_fraction(costs, 6, "interleaved-1f1b", 2) < cm.bubble_fraction(costs, 6, "1f1b")


def test_kills_schedule_interleaved_order_defaults_to_two_chunks():
    s = sch.get_schedule("interleaved-1f1b")
    assert s.order(0, 2, 2) == s.order(0, 2, 2, 2)
    assert sorted({c for _, _, c in s.order(1, 2, 4)}) == [0, 1]


def test_kills_planner_cost_plan_stage_terms_hold_the_schedules_micro_batches():
    raw = {"format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8, "micro_batch": 2,
           "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 1]},
                      {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [1, 2]},
                      {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]}]}
    one = plan_from_dict({**raw, "schedule": "1f1b"})
    assert [t.mem.in_flight for t in cm.plan_stage_terms(one, None)] == [3, 2, 1]  # p - i of m = 4
    gp = plan_from_dict({**raw, "schedule": "gpipe"})
    assert [t.mem.in_flight for t in cm.plan_stage_terms(gp, None)] == [4, 4, 4]
    other = ChipType("other", "cpu", 1.0, 1.0, 2, 10.0, 1.0, "t")
    with pytest.raises(mem.ConfigError) as e:
        cm.plan_stage_terms(one, {"other": other, "more": other})
    assert str(e.value) == "stages[0].chip 'cpu' is not in the cluster; it has other, more"
    with pytest.raises(mem.ConfigError) as e:
        cm.plan_stage_terms(one, {})
    assert str(e.value) == "stages[0].chip 'cpu' is not in the cluster; it has (none)"


def test_kills_last_survivors_by_hand():
    # max_layers is the fit test's: 0.3 / 0.1 = 2.9999999999999996, yet 3 layers take 0.1 * 3 =
    # 0.30000000000000004 bytes, over a capacity of 0.3 (2 fit) but within one of 0.1 * 3 (3 fit)
    t = mm.StageMemoryTerms(layer_static=0.1, layer_activation=0.0, in_flight=0.0, params_end=0.0, working=0.0,
                            reserve=0.0, capacity=0.3)
    assert t.max_layers() == 2 and t.fits(2) and not t.fits(3)
    t = mm.StageMemoryTerms(layer_static=0.1, layer_activation=0.0, in_flight=0.0, params_end=0.0, working=0.0,
                            reserve=0.0, capacity=0.1 * 3)
    assert t.max_layers() == 3 and t.fits(3) and not t.fits(4)
    # the numpy executor keeps the array's dtype
    src, dst = rs.Layout(1, 1), rs.Layout(1, 2)
    x = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    out = rs.apply_local(rs.reshard_plan(src, dst, x.shape, 2), src, dst, {0: x}, x.shape, x.dtype)
    assert out[0].dtype == np.int16 and out[1].dtype == np.int16
    # a one-chunk schedule checks one chunk unless told; interleaved memory is in whole-stage units
    sch.get_schedule("1f1b").check(2, 2)
    assert sch.get_schedule("interleaved-1f1b").memory_in_flight(0, 4, 8, 2) == 11 / 2
    # a deadlock after one stage has finished names only the waiting stage
    A = sch.Action
    with pytest.raises(RuntimeError) as e:
        sch.execution_order([[A(sch.F, 0)], [A(sch.RECV_ACT, 0), A(sch.F, 0)]])
    assert str(e.value) == "schedule deadlocks; stages wait at {1: RECV_ACT0}"


def test_kills_reshard_least_loaded_replica_first_and_owners():
    """Three replicas, three receiving blocks each cut in two: the pieces go to the least-loaded
    replicas (ties: lowest position), so the senders rotate 0,1 / 2,0 / 1,2."""
    src = rs.Layout(1, 3, spec=(None, None, None), owners=("r0", "r1", "r2"))
    dst = rs.Layout(3, 1, owners=("d0", "d1", "d2"))
    plan = rs.reshard_plan(src, dst, (3, 2, 1), 4)
    assert [t.src_pos for t in plan] == [0, 1, 2, 0, 1, 2]
    assert [(t.src, t.dst) for t in plan] == [("r0", "d0"), ("r1", "d0"), ("r2", "d1"), ("r0", "d1"),
                                              ("r1", "d2"), ("r2", "d2")]
    assert rs._split((slice(2, 3), slice(0, 1)), 5) == [(slice(2, 3), slice(0, 1))]  # one element: one piece


def _two_stage_plan(schedule="1f1b"):
    return plan_from_dict({"format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8, "micro_batch": 2,
                           "schedule": schedule,
                           "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2]},
                                      {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]}]})


def test_kills_planner_cost_plan_terms_take_the_profile_and_the_deferred_gradients():
    from h2jax.planner.profile import Profile, ProfileEntry, ProfileError

    plan = _two_stage_plan("zb-h1")
    held, deferred = cm.memory_holds("zb-h1", 0, 2, 4)
    assert deferred > 0
    assert [t.mem.deferred for t in cm.plan_stage_terms(plan, None)] == [deferred, cm.memory_holds("zb-h1", 1, 2, 4)[1]]
    tokens = plan.micro_batch * plan.seq_len
    entry = ProfileEntry(1, tokens, forward_s=0.5, backward_s=0.75)
    profile = Profile(plan.model, plan.seq_len, {"cpu": (entry,)})
    measured = cm.plan_stage_terms(plan, None, profile)
    dispatch = cm.chips_by_name(None, plan)["cpu"].dispatch_s
    assert measured[0].fwd_layer == pytest.approx(cm.per_layer_of_entry(0.5, dispatch))
    assert cm.plan_stage_terms(plan, None)[0].fwd_layer < 0.01  # the analytical figure is another
    other = Profile(plan.model, plan.seq_len + 1, {"cpu": (entry,)})
    with pytest.raises(ProfileError, match="seq_len 17, but the plan is for tiny at seq_len 16"):
        cm.plan_stage_terms(plan, None, other)


def test_kills_planner_cost_stage_costs_from_chip_files_carry_the_send_bytes():
    plan = _two_stage_plan()
    costs = cm.stage_costs(plan, None)  # chip types read by the plan's names
    cpu = cm.chips_by_name(None, plan)["cpu"]
    _, nbytes = cm.send_terms(plan.model, 16, 2, cpu, 1, 1, cpu, 1, 1)
    assert costs[0].send_bytes == nbytes > 0 and costs[1].send_bytes == 0
    # the default schedule is 1F1B's closed form
    assert cm.pipeline_time(costs, 4) == cm.pipeline_time(costs, 4, "1f1b")
    assert cm.iteration_time(costs, 4) == cm.iteration_time(costs, 4, "1f1b")


def test_kills_planner_cost_measured_backward_splits_its_weight_share_and_kernel_reaches_attention():
    from h2jax.planner.profile import Profile, ProfileEntry

    entry = ProfileEntry(1, 16, forward_s=0.5, backward_s=1.0)
    profile = Profile(_MM_CFG, 8, {"c": (entry,)})
    t = cm.stage_terms(StageShape(_MM_CFG, 8, 2, _cm_chip(), 1, 1, "none"), False, False, 1, profile)
    mm_flops = 16 * 2 * 1920
    fwd_flops = mm_flops + 16 * cm.attention_flops_per_token(_MM_CFG, 8)
    assert t.bwd_weight_layer == pytest.approx(t.bwd_layer * mm_flops / (2 * fwd_flops), rel=1e-12)
    # cuDNN's causal tiles at 200 positions: the fused kernel's FLOPs, not the full square
    n = 200
    t = cm.stage_terms(StageShape(_MM_CFG, n, 1, _cm_chip("fused", "cuda"), 1, 1, "none"), False, False, 1)
    rate = 1e12 * 0.75 * n / (n + 256) * 16 / (16 + 256)
    attn_s = n * cm.attention_flops_per_token(_MM_CFG, n, "cudnn") / rate
    mem_s = n * cm.memory_bound_bytes_per_token(_MM_CFG, 1, 2) / 5e9
    assert t.fwd_layer == pytest.approx(n * 2 * 1920 / rate + attn_s + mem_s, rel=1e-12)


def test_kills_planner_cost_a_sharded_optimizer_state_is_split_over_data():
    def static(shard):
        t = cm.stage_terms(StageShape(_MM_CFG, 8, 2, _cm_chip(), 2, 1, "none"), False, False, 1,
                           options=cm.CostOptions(shard_optimizer=shard))
        return t.mem.layer_static

    assert static(True) < static(False)
    assert static(False) - static(True) == pytest.approx(mm.OPTIMIZER_STATE_BYTES["adamw"] * 1952 / 2)


def test_kills_planner_cost_one_interleaved_stage_sends_nothing_to_itself():
    raw = {"format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8, "micro_batch": 2,
           "schedule": "interleaved-1f1b", "virtual_stages": 2,
           "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [[0, 2], [2, 4]]}]}
    (cost,) = cm.stage_costs(plan_from_dict(raw), None)
    assert cost.send_s == 0.0 and cost.send_bytes == 0 and cost.link_latency_s == 0.0
    two = dict(raw, stages=[{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [[0, 1], [2, 3]]},
                            {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [[1, 2], [3, 4]]}])
    assert cm.stage_costs(plan_from_dict(two), None)[1].send_bytes > 0  # the last stage's chunk wraps to stage 0
