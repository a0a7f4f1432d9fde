"""examples/custom_loop.py, a user's own loop around h2jax.Trainer, runs unchanged in one
process and under `mpiexec` (one rank per stage) and trains the same model: same losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TEST_XLA_FLAGS, checkout_env
from tests.test_mpi_transport import MPIEXEC

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_loop.py"
ARGS = ["--steps", "4", "--eval-every", "2", "--json"]


def _run(cmd: list[str], timeout: float) -> dict:
    env = checkout_env({**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS})
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # only rank 0 reports
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def one_process():
    return _run([sys.executable, str(EXAMPLE), *ARGS], timeout=600)


def test_custom_loop_in_one_process(one_process):
    out = one_process
    assert out["last_step"] == 4 and len(out["losses"]) == 4
    assert [s for s, _ in out["eval"]] == [2, 4]
    assert out["losses"][-1] < out["losses"][0]  # it trains: the warm-up reaches its peak by step 4


@pytest.mark.mpi
def test_custom_loop_under_mpiexec_trains_the_same_model(one_process):
    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    out = _run([MPIEXEC, "-n", "2", sys.executable, str(EXAMPLE), *ARGS], timeout=600)
    assert out["last_step"] == 4
    # Each rank's CPU backend has fewer devices than the one process, so reductions may round
    # differently in the last bit (see test_mpi_pipeline.py); AdamW keeps that tiny.
    np.testing.assert_allclose(out["losses"], one_process["losses"], rtol=1e-4)
    np.testing.assert_allclose([v for _, v in out["eval"]], [v for _, v in one_process["eval"]], rtol=1e-4)
