"""h2jax.model against an independent numpy implementation (tests/reference_numpy.py).

The pipelined run is checked against the unpipelined one elsewhere, but both run this
model: only a reference that shares no code with it can catch a bug in its math (a rotary
frequency off by a factor, a mask off by one, a norm that ignores its scale). The weights are
redrawn at a scale where attention is far from uniform and every norm scale differs from 1,
so each part of a block moves the output well above f32 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from h2jax.config import ModelConfig
from h2jax.model import StageModel, cross_entropy, rotary
from h2jax.sharding import flatten_params
from tests import reference_numpy as ref

SHAPES = {
    # grouped-query attention, two query heads per kv head
    "gqa": ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48),
    # multi-head (one query head per kv head), another rope_theta, wider heads
    "mha": ModelConfig(vocab_size=48, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, d_ff=40,
                       rope_theta=500.0),
    # multi-query (one kv head), a larger norm epsilon that matters at this scale
    "mqa": ModelConfig(vocab_size=40, d_model=24, n_layers=3, n_heads=4, n_kv_heads=1, d_ff=32,
                       norm_eps=0.05),
}


def randomized(cfg: ModelConfig, start: int, end: int, seed: int) -> StageModel:
    """A stage whose every parameter is redrawn: matrices ~ N(0, 1/fan_in) x 2 (peaked
    attention), norm scales ~ U(0.5, 1.5)."""
    model = nnx.eval_shape(lambda: StageModel(cfg, start, end, seed=0))  # shapes only: no init compute
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)

    def redraw(x):
        if x.ndim == 1:
            return jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
        std = 1.0 if x.shape[0] == cfg.vocab_size else 2.0 / np.sqrt(x.shape[0])
        return jnp.asarray(rng.normal(0.0, std, x.shape), x.dtype)

    nnx.update(model, jax.tree.map(redraw, state))
    return model


@nnx.jit
def apply(model, *args):
    """One compiled program per shape (op-by-op dispatch compiles every primitive)."""
    return model(*args)


def numpy_params(model) -> dict:
    return {k: np.asarray(v) for k, v in flatten_params(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def assert_f32_close(got, want):
    """f32 computation against a float64 reference: relative 1e-5 of the output's scale."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_whole_model_loss_matches_numpy(name):
    cfg = SHAPES[name]
    model = randomized(cfg, 0, cfg.n_layers, seed=1)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9))
    loss = apply(model, jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
    want = ref.stage_forward(numpy_params(model), cfg, 0, cfg.n_layers, tokens[:, :-1], tokens[:, 1:])
    assert abs(want - np.log(cfg.vocab_size)) > 0.1  # far from the untrained loss: weights matter
    assert_f32_close(loss, want)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_stage_slices_match_numpy(name):
    """First stage: tokens -> hidden; a middle stage: hidden -> hidden (no embedding, no head)."""
    cfg = SHAPES[name]
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, 6))
    first = randomized(cfg, 0, 1, seed=4)
    hidden = apply(first, jnp.asarray(tokens))
    assert hidden.shape == (3, 6, cfg.d_model)
    assert_f32_close(hidden, ref.stage_forward(numpy_params(first), cfg, 0, 1, tokens))

    middle = randomized(cfg, 1, 2, seed=5)
    x = np.random.default_rng(6).normal(size=(3, 6, cfg.d_model)).astype(np.float32)
    assert_f32_close(apply(middle, jnp.asarray(x)), ref.stage_forward(numpy_params(middle), cfg, 1, 2, x))


@pytest.mark.parametrize("theta", [10_000.0, 500.0])
@pytest.mark.parametrize("head_dim", [8, 16])
def test_rotary_matches_numpy(theta, head_dim):
    x = np.random.default_rng(7).normal(size=(2, 11, 3, head_dim)).astype(np.float32)
    assert_f32_close(rotary(jnp.asarray(x), theta), ref.rope(x.astype(np.float64), theta))


def test_rotary_preserves_norms_and_sees_only_relative_positions():
    """Properties of rotations, whatever the frequencies: each head vector keeps its length,
    and q(p) . k(p') depends on p - p' only."""
    E, theta = 16, 10_000.0
    rng = np.random.default_rng(8)
    q, k = rng.normal(size=E).astype(np.float32), rng.normal(size=E).astype(np.float32)
    S = 12
    Q = rotary(jnp.asarray(np.tile(q, (1, S, 1, 1))), theta)[0, :, 0]
    K = rotary(jnp.asarray(np.tile(k, (1, S, 1, 1))), theta)[0, :, 0]
    np.testing.assert_allclose(np.linalg.norm(Q, axis=-1), np.linalg.norm(q), rtol=1e-5)
    dots = np.asarray(Q @ K.T)
    for shift in range(1, 4):
        np.testing.assert_allclose(np.diag(dots, -shift)[:-1], np.diag(dots, -shift)[1:], rtol=2e-4, atol=2e-5)


def test_cross_entropy_matches_numpy():
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 3, (2, 5, 17)).astype(np.float32)
    labels = rng.integers(0, 17, (2, 5))
    assert_f32_close(cross_entropy(jnp.asarray(logits), jnp.asarray(labels)),
                     ref.cross_entropy(logits.astype(np.float64), labels))


@pytest.mark.parametrize("block", [3, 16])
def test_blocked_attention_kernel_matches_numpy(monkeypatch, block):
    """The 'blocked' kernel computes the same function: here with blocks of 3 queries over 8
    positions (three blocks, the last one padded) and with one block larger than the sequence."""
    import h2jax.model as model_module

    monkeypatch.setattr(model_module, "ATTENTION_BLOCK", block)
    cfg = SHAPES["gqa"]
    shapes = randomized(cfg, 0, cfg.n_layers, seed=10)
    model = StageModel(cfg, 0, cfg.n_layers, seed=0, attention="blocked")
    nnx.update(model, nnx.state(shapes, nnx.Param))
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, (2, 9))
    fresh = nnx.jit(lambda m, x, y: m(x, y))  # traced here, under this block size
    loss = fresh(model, jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
    want = ref.stage_forward(numpy_params(shapes), cfg, 0, cfg.n_layers, tokens[:, :-1], tokens[:, 1:])
    assert_f32_close(loss, want)
