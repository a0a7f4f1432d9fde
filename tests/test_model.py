import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from h2jax.config import PRESETS, ConfigError, ModelConfig, get_config
from h2jax.model import StageModel, cross_entropy
from h2jax.sharding import flatten_params

CFG = PRESETS["tiny"]


def params_of(model) -> dict:
    return flatten_params(nnx.to_pure_dict(nnx.state(model)))


def test_stage_slices_initialize_the_whole_models_parameters():
    whole = params_of(StageModel(CFG, 0, CFG.n_layers, seed=7))
    parts = {}
    for start, end in [(0, 1), (1, 3), (3, 4)]:
        parts.update(params_of(StageModel(CFG, start, end, seed=7)))
    assert parts.keys() == whole.keys()
    for name in whole:
        assert np.array_equal(parts[name], whole[name]), name
    other_seed = params_of(StageModel(CFG, 0, 1, seed=8))
    assert not np.array_equal(other_seed["layer_000/attn/wq_DHE"], whole["layer_000/attn/wq_DHE"])


def test_parameter_count_matches_config():
    n = sum(v.size for v in params_of(StageModel(CFG, 0, CFG.n_layers, seed=0)).values())
    assert n == CFG.param_count()


def test_causality_later_tokens_never_influence_earlier_losses():
    model = StageModel(CFG, 0, CFG.n_layers, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)
    x_BSD = model.embed(tokens)
    t = 5

    def loss_at_t(x_BSD):
        for name in model.layer_names:
            x_BSD = getattr(model, name)(x_BSD)
        logits = model.head(x_BSD)
        return cross_entropy(logits[:, t : t + 1], tokens[:, t + 1 : t + 2])

    g_BSD = jax.grad(loss_at_t)(x_BSD)
    assert np.all(np.asarray(g_BSD[:, t + 1 :]) == 0.0)  # exactly zero after t
    assert np.all(np.abs(np.asarray(g_BSD[:, : t + 1])).sum(axis=-1) > 0)  # and alive up to t


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_recompute_gives_the_same_gradients(mode):
    """Every recompute mode (a checkpoint keeping the named values, or only the block input)
    gives the plain model's loss and gradients."""
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, CFG.vocab_size)
    plain = StageModel(CFG, 0, CFG.n_layers, seed=0)
    graph, params = nnx.split(plain)
    recomputing = nnx.graphdef(StageModel(CFG, 0, CFG.n_layers, seed=0, recompute=mode))

    def loss(p, g):
        return nnx.merge(g, p)(tokens[:, :-1], tokens[:, 1:])

    def unchecked(p, g):  # the blocks called directly: no checkpoint at all
        model = nnx.merge(g, p)
        x = model.embed(tokens[:, :-1])
        for name in model.layer_names:
            x = getattr(model, name)(x)
        return cross_entropy(model.head(x), tokens[:, 1:])

    reference = jax.jit(jax.value_and_grad(unchecked))(params, graph)
    recomputed = jax.jit(jax.value_and_grad(loss))(params, recomputing)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(recomputed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_initial_loss_is_near_uniform():
    model = StageModel(CFG, 0, CFG.n_layers, seed=0)
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, CFG.vocab_size)
    loss = float(model(tokens[:, :-1], tokens[:, 1:]))
    assert abs(loss - np.log(CFG.vocab_size)) < 0.5


def test_config_validation():
    with pytest.raises(ConfigError, match=r"model\.d_model \(65\) must be divisible by model\.n_heads \(4\)"):
        ModelConfig(vocab_size=256, d_model=65, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8)
    with pytest.raises(ConfigError, match=r"model\.n_heads \(4\) must be a multiple of model\.n_kv_heads \(3\)"):
        ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=3, d_ff=8)
    with pytest.raises(ConfigError, match=r"unknown model field\(s\) \['layers'\]"):
        get_config({"layers": 3})


def test_llama_100b_preset_is_about_100b_parameters():
    assert 95e9 < PRESETS["llama-100b"].param_count() < 110e9
    assert 6.5e9 < PRESETS["llama-7b"].param_count() < 7.0e9
    assert 68e9 < PRESETS["llama-70b"].param_count() < 71e9


def test_gqa_matches_repeated_kv_heads():
    """Grouped-query attention equals full multi-head attention with K/V heads repeated."""
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=16)
    mha = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=16)
    gqa_model = StageModel(cfg, 0, 1, seed=0)
    mha_model = StageModel(mha, 0, 1, seed=0)
    attn_g, attn_m = gqa_model.layer_000.attn, mha_model.layer_000.attn
    attn_m.wq_DHE[...] = attn_g.wq_DHE[...]
    attn_m.wo_HED[...] = attn_g.wo_HED[...]
    attn_m.wk_DKE[...] = jnp.repeat(attn_g.wk_DKE[...], 2, axis=1)
    attn_m.wv_DKE[...] = jnp.repeat(attn_g.wv_DKE[...], 2, axis=1)
    x = jax.random.normal(jax.random.key(0), (2, 6, 32))
    np.testing.assert_allclose(np.asarray(attn_g(x)), np.asarray(attn_m(x)), rtol=1e-5, atol=1e-6)
