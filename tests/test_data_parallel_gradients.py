"""A data-parallel stage keeps each rank's gradients to itself until the step's one reduction:
its per-micro-batch programs communicate nothing over `data`, and the sum of its ranks'
accumulators is the micro-batch's gradient."""

import jax
import jax.numpy as jnp
import numpy as np

from h2jax.config import ModelConfig
from h2jax.plan import Mesh, Plan, Stage

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
SEQ, MICRO = 16, 4


def _first_stage(data: int):
    """Stage 0 of a two-stage plan (embedding and the first layer), on `data` devices."""
    from h2jax.runtime.stage import StageExecutor

    stages = (Stage("cpu", Mesh(data, 1), (0, 1), "none"), Stage("cpu", Mesh(1, 1), (1, 2), "none"))
    plan = Plan(MODEL, SEQ, 2 * MICRO, MICRO, stages)
    return StageExecutor(plan, 0, jax.devices()[:data])


def _backward(ex, tokens, dy):
    _, saved = ex.forward(ex.put_input(tokens))
    ex.backward(saved, jax.device_put(dy, ex.boundary_sharding))


def test_a_data_parallel_backward_communicates_nothing():
    """On one tensor rank the only collective a backward could hold is a reduction over data:
    a gradient all-reduced inside every micro-batch's backward (m times the bytes of the
    once-per-step reduction the cost model prices). The step's reduction holds it."""
    ex = _first_stage(2)
    params, _, acc = ex._abstract_state
    x = jax.ShapeDtypeStruct((MICRO, SEQ), jnp.int32, sharding=ex.input_sharding)
    _, held = ex._forward.lower(params, x, None).compile().out_info
    dy = jax.ShapeDtypeStruct((MICRO, SEQ, MODEL.d_model), ex.boundary_dtype, sharding=ex.boundary_sharding)
    backward = ex._backward.lower(acc, params, held, dy).compile().as_text()
    assert "all-reduce" not in backward and "reduce-scatter" not in backward
    reduce = ex._reduce.lower(acc).compile().as_text()
    assert "all-reduce" in reduce or "reduce-scatter" in reduce


def test_the_ranks_accumulators_sum_to_the_micro_batch_gradient():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (MICRO, SEQ), dtype=np.int32)
    dy = rng.standard_normal((MICRO, SEQ, MODEL.d_model)).astype(np.float32)
    two, one = _first_stage(2), _first_stage(1)
    for ex in (two, one):
        _backward(ex, tokens, dy)
    per_rank = jax.tree.map(np.asarray, two.grad_acc)
    whole = jax.tree.map(np.asarray, one.grad_acc)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(per_rank), jax.tree.leaves(whole)):
        assert a.shape == (2,) + b.shape, path
        assert not np.allclose(a[0], a[1]), path  # each rank's own share, not a replicated sum
        np.testing.assert_allclose(a.sum(axis=0), b, rtol=1e-5, atol=1e-6, err_msg=str(path))
    # the step's reduction: the same gradient and its squared norm; the accumulators are
    # dropped until the update has run, then zero
    norm = two.grad_squared_norm()
    reduced = jax.tree.map(np.asarray, two._grads)
    for a, b in zip(jax.tree.leaves(reduced), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm, one.grad_squared_norm(), rtol=1e-5)
    assert two.grad_acc is None
    two.update(float(np.sqrt(norm)))
    assert [a.shape for a in jax.tree.leaves(two.grad_acc)] == [a.shape for a in jax.tree.leaves(per_rank)]
    assert all(not np.asarray(a).any() for a in jax.tree.leaves(two.grad_acc))
