"""The real pipeline under `mpiexec` equals the single-process run with the local transport:
same losses, grad norms and final parameters (f32, rtol 1e-5), under GPipe, 1F1B, ZB-H1 and
interleaved 1F1B (two layer chunks per stage, 2 and 4 stages), with
stage meshes that differ and a stage that spans two processes.

SGD with active clipping, as in test_pipeline.py: each MPI rank's CPU backend has fewer
devices than the single process, so reductions may round differently in the last bit, and
AdamW would turn a last-bit difference in a near-zero gradient into a visible one. The
transport itself moves bits exactly (test_mpi_transport.py checks that bit for bit)."""

import json
import os

if "jax" not in os.sys.modules:  # a fresh process: give the local reference 8 CPU devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import pytest

from h2jax.plan import plan_from_dict, save_plan
from tests.test_mpi_transport import mpiexec

MODEL = {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64}
STEPS = 2
CLIP = 0.3  # below the gradient norm, so the cross-stage norm reduction matters


def _plan(stages, schedule):
    """stages: ((data, tensor), layers, processes[, recompute]); layers a list of [start, end)
    chunks makes an interleaved plan (virtual_stages = their number)."""
    chunked = isinstance(stages[0][1][0], (list, tuple))
    n_layers = max(r[-1] for _, layers, *_ in stages for r in (layers if chunked else [layers]))
    return plan_from_dict({
        "format_version": 1, "model": {**MODEL, "n_layers": n_layers}, "seq_len": 16, "global_batch": 8,
        "micro_batch": 2, "schedule": schedule,
        "optimizer": {"name": "sgd", "learning_rate": 0.5, "clip_norm": CLIP},
        **({"virtual_stages": len(stages[0][1])} if chunked else {}),
        "stages": [
            {"chip": "cpu", "mesh": {"data": d, "tensor": t}, "processes": p, "recompute": (rest or ["none"])[0],
             "layers": [list(c) for c in layers] if chunked else list(layers)}
            for (d, t), layers, p, *rest in stages
        ],
    })


_local_cache: dict = {}


def _local(plan):
    """The single-process run with the local transport (cached per plan)."""
    from h2jax.runtime.train import run

    key = json.dumps(plan.to_dict(), sort_keys=True)
    if key not in _local_cache:
        if plan.n_devices > len(jax.devices()):
            pytest.skip(f"the local reference needs {plan.n_devices} devices")
        result = run(plan, STEPS, return_params=True)
        _local_cache[key] = (result.losses, result.grad_norms, result.params)
    return _local_cache[key]


def _check_mpi_equals_local(tmp_path, stages, schedules, reference_schedule=None):
    plans = [_plan(stages, s) for s in schedules]
    files = []
    for plan, name in zip(plans, schedules):
        save_plan(plan, tmp_path / f"{name}.json")
        files.append(str(tmp_path / f"{name}.json"))
    n = sum(s[2] for s in stages)
    proc, _ = mpiexec(n, "train_plans.py", str(tmp_path / "out"), str(STEPS), "auto", *files, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i, plan in enumerate(plans):
        ref = plan if reference_schedule is None else _plan(stages, reference_schedule)
        losses, grad_norms, params = _local(ref)
        got = json.loads((tmp_path / f"out.{i}.json").read_text())
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(got["grad_norms"], grad_norms, rtol=1e-5)
        assert min(got["grad_norms"]) > CLIP and got["losses"][0] != got["losses"][-1]
        mpi_params = np.load(tmp_path / f"out.{i}.npz")
        assert sorted(mpi_params.files) == sorted(params)
        for name in params:
            np.testing.assert_allclose(mpi_params[name], params[name], rtol=1e-5, atol=1e-7, err_msg=name)
        for report in got["transport"]:
            assert report["path"] == "direct" and report["recv_buffers_copied"] == 0


@pytest.mark.mpi
@pytest.mark.slow
def test_two_processes_uneven_stages_every_schedule(tmp_path):
    stages = [((2, 1), (0, 1), 1), ((1, 2), (1, 4), 1)]
    _check_mpi_equals_local(tmp_path, stages, ["gpipe", "1f1b", "zb-h1"])


@pytest.mark.mpi
@pytest.mark.slow
def test_three_processes_with_a_two_process_data2_tensor2_stage(tmp_path):
    # Stage 0 spans two processes (two CPU devices each) as one jax.distributed group. One
    # schedule keeps the job short; the toy test in test_mpi_transport.py runs this stage
    # layout under both.
    stages = [((2, 2), (0, 2), 2), ((1, 2), (2, 4), 1)]
    _check_mpi_equals_local(tmp_path, stages, ["1f1b"])


@pytest.mark.mpi
@pytest.mark.slow
def test_four_processes_four_stages(tmp_path):
    # Recompute on (full, selective) and off in one plan, under every schedule.
    stages = [((1, 1), (0, 1), 1), ((2, 1), (1, 2), 1, "full"), ((1, 2), (2, 3), 1, "selective"), ((1, 1), (3, 4), 1)]
    # Both schedules against the local 1F1B run: the runtime accumulates micro-batches in
    # the same order under both (the two-process test checks each against its own run).
    _check_mpi_equals_local(tmp_path, stages, ["1f1b", "gpipe", "zb-h1"], reference_schedule="1f1b")


@pytest.mark.mpi
@pytest.mark.slow
def test_interleaved_two_processes_two_stages(tmp_path):
    # Interleaved 1F1B, two chunks per stage: messages cross virtual boundaries, the last
    # stage's first chunk sends back to stage 0's second chunk. Meshes data 2 / tensor 2,
    # recompute full on one stage.
    stages = [((2, 1), ((0, 1), (2, 3)), 1, "full"), ((1, 2), ((1, 2), (3, 4)), 1)]
    _check_mpi_equals_local(tmp_path, stages, ["interleaved-1f1b"])


@pytest.mark.mpi
@pytest.mark.slow
def test_interleaved_four_processes_four_stages(tmp_path):
    stages = [((1, 1), ((0, 1), (4, 5)), 1), ((2, 1), ((1, 2), (5, 6)), 1, "selective"),
              ((1, 2), ((2, 3), (6, 7)), 1), ((1, 1), ((3, 4), (7, 8)), 1)]
    _check_mpi_equals_local(tmp_path, stages, ["interleaved-1f1b"])
