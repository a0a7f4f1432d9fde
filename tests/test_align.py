"""Precision alignment: policies that should agree pass the 1.5% criterion; a coarse one fails."""

import numpy as np
import pytest

from h2jax.align import TOLERANCE, align, curve_error
from h2jax.cluster import backends_dir

# float16 parameters and compute with no loss scaling: AdamW's second moment (kept in the
# parameters' dtype) underflows to zero and the first update divides by ~0. Deliberately coarse.
COARSE = """name = "cpu-fp16"
platform = "cpu"
memory_gib = 16.0
peak_tflops = 0.5
chips_per_node = 8
intra_node_gbps = 20.0
inter_node_gbps = 10.0
source = "test: a deliberately coarse precision policy"
[plugin]
kind = "builtin"
[precision]
param_dtype = "float16"
compute_dtype = "float16"
matmul_precision = "default"
"""

# Two narrow layers: the fastest model to compile three times (once per precision policy).
TWO_LAYERS = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64}
KW = dict(model=TWO_LAYERS, seq_len=16, batch=4, learning_rate=3e-3)


@pytest.fixture(scope="module")
def chips_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("backends")
    for f in backends_dir().glob("*.toml"):
        (d / f.name).write_text(f.read_text())
    (d / "cpu-fp16.toml").write_text(COARSE)
    return d


@pytest.fixture(scope="module")
def result(chips_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("H2JAX_BACKENDS_DIR", str(chips_dir))
        return align(["cpu", "cpu-bf16", "cpu-fp16"], steps=10, **KW)


def test_bf16_compute_aligns_with_f32(result):
    bf16 = next(e for e in result.errors if e.chip == "cpu-bf16")
    assert bf16.passed and bf16.mean_relative_error < TOLERANCE
    # a different numerics really ran: the curves are close, not identical
    assert bf16.mean_relative_error > 0
    assert not np.array_equal(result.losses["cpu-bf16"], result.losses["cpu"])
    assert result.losses["cpu"][-1] < result.losses["cpu"][0]


def test_coarse_policy_fails_loudly_naming_the_worst_step(result):
    fp16 = next(e for e in result.errors if e.chip == "cpu-fp16")
    assert not fp16.passed and not result.passed
    assert fp16.mean_relative_error > TOLERANCE
    msg = result.failure_message()
    assert "cpu-fp16: mean relative error" in msg and f"worst at step {fp16.worst_step}" in msg
    assert "cpu-bf16" not in msg


def test_curve_error_is_the_mean_relative_error():
    e = curve_error("x", [1.1, 2.0, 2.7], [1.0, 2.0, 3.0])
    assert e.mean_relative_error == pytest.approx((0.1 + 0.0 + 0.1) / 3)
    assert (e.worst_step, e.worst_relative_error) == (0, pytest.approx(0.1))

