"""A tensor-parallel stage's compiled programs communicate what the cost model prices, and a
backward runs again only what its recompute policy gives up.

Per layer and micro-batch: `cost_model.tensor_all_reduces(recompute, "cpu")` all-reduces of the
n x d activation forward and backward (XLA:CPU's backward reduces each of the five
column-parallel input gradients on its own, three more than Megatron's two), and nothing else
of that size but the stage's one gather of
its boundary input (forward) or output gradient (backward), which crosses the stage boundary
split over `tensor`. Before the residual stream was held replicated inside a stage, XLA kept
it split over `tensor` (as the boundary is), and paid in addition an all-gather before each
column-parallel matmul (two per layer forward, four backward) and a sum for each RMSNorm."""

import math
import re

import jax
import pytest

from h2jax.config import ModelConfig
from h2jax.plan import Mesh, Plan, Stage
from h2jax.planner.cost_model import tensor_all_reduces

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128)
SEQ, MICRO, LAYERS = 16, 4, 2
_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)(?:-start)?\(")


def _middle_stage(data: int, tensor: int, recompute: str):
    """Stage 1 of three: layers [1, 3) on a data x tensor mesh, no embedding or head."""
    from h2jax.runtime.stage import StageExecutor

    stages = (Stage("cpu", Mesh(1, 1), (0, 1), "none"), Stage("cpu", Mesh(data, tensor), (1, 1 + LAYERS), recompute),
              Stage("cpu", Mesh(1, 1), (1 + LAYERS, 4), "none"))
    plan = Plan(MODEL, SEQ, 2 * MICRO, MICRO, stages)
    return StageExecutor(plan, 1, jax.devices()[:data * tensor])


def _programs(ex):
    """(forward, backward) of one micro-batch: the forward compiled (its outputs give the
    backward's residuals), the backward lowered."""
    params, _, acc = ex._abstract_state
    x = jax.ShapeDtypeStruct((MICRO, SEQ, MODEL.d_model), ex.boundary_dtype, sharding=ex.input_sharding)
    forward = ex._forward.lower(params, x, None).compile()
    _, held = forward.out_info
    dy = jax.ShapeDtypeStruct((MICRO, SEQ, MODEL.d_model), ex.boundary_dtype, sharding=ex.boundary_sharding)
    return forward, ex._backward.lower(acc, params, held, dy)


def _activation_collectives(compiled_text: str, elements: int) -> dict[str, int]:
    """Per collective kind, how many operands of `elements` elements (a device's share of one
    micro-batch's n x d activation) the compiled program moves (tuple collectives counted per
    operand)."""
    out: dict[str, int] = {}
    for line in compiled_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1)):
            if math.prod(int(x) for x in dims.split(",") if x) == elements:
                out[m.group(2)] = out.get(m.group(2), 0) + 1
    return out


@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_tensor_parallel_stage_all_reduces_what_the_cost_model_prices(recompute, data):
    ex = _middle_stage(data, 2, recompute)
    forward, backward = _programs(ex)
    forward, backward = forward.as_text(), backward.compile().as_text()
    elements = MICRO // data * SEQ * MODEL.d_model
    fwd, bwd = tensor_all_reduces(recompute, "cpu")
    assert _activation_collectives(forward, elements) == {"all-reduce": fwd * LAYERS, "all-gather": 1}
    # the backward: XLA:CPU all-reduces the five column-parallel input gradients one by one
    # (+1 under full: the recomputed attention projection), where a GPU's compiler would sum
    # them first (Megatron's two, priced there); no all-gather but the output gradient's
    assert bwd == (6 if recompute == "full" else 5)
    assert _activation_collectives(backward, elements) == {"all-reduce": bwd * LAYERS, "all-gather": 1}


@pytest.mark.parametrize("recompute, per_layer", [("none", 18), ("selective", 19), ("full", 26)])
def test_a_backward_runs_again_only_what_its_policy_gives_up(recompute, per_layer):
    """The backward's matmuls per layer, XLA attention: nine forward matmuls (q, k, v, scores,
    weighted values, output projection, gate, up, down), two each backward (18); `selective`
    keeps no probabilities, so their scores' matmul runs again (19: the core's output is kept);
    `full` runs the forward again but its last matmul, whose output the backward never needs
    (26). Under `none` nothing runs again: jax.nn.softmax's own rule recomputed its output
    from the logits, so a backward that kept the probabilities still ran the scores' matmul."""
    _, backward = _programs(_middle_stage(1, 1, recompute))
    assert backward.as_text().count("stablehlo.dot_general") == per_layer * LAYERS


def test_the_residual_stream_does_not_change_the_stage_function():
    """The same stage on one device and on a tensor-parallel mesh computes the same output and
    input gradient (the layout is XLA's business, the values are not)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((MICRO, SEQ, MODEL.d_model)).astype(np.float32)
    dy = rng.standard_normal((MICRO, SEQ, MODEL.d_model)).astype(np.float32)
    results = []
    for tensor in (1, 2):
        ex = _middle_stage(1, tensor, "none")
        y, saved = ex.forward(jax.device_put(x, ex.input_sharding))
        dx = ex.backward(saved, jax.device_put(dy, ex.boundary_sharding))
        results.append((np.asarray(y), np.asarray(dx)))
    (y1, dx1), (y2, dx2) = results
    np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx2, dx1, rtol=1e-5, atol=1e-6)
