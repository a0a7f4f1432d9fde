"""The MPI transport: pure helpers in-process; real transfers and failures under `mpiexec`.

The mpiexec jobs use a toy stage function (tests/mpi_scripts/toy_pipeline.py) so they compile
in milliseconds: every received shard is checked bit for bit against a numpy oracle, under
GPipe and 1F1B action lists, across stages whose meshes differ.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from h2jax.config import ConfigError
from h2jax.plan import PlanError
from h2jax.runtime.ranks import mpi_world_size, role_for_rank
from h2jax.transport.mpi import _flat_offset, _is_contiguous, aligned_empty, choose_path
from tests.conftest import TEST_XLA_FLAGS, checkout_env

SCRIPTS = Path(__file__).parent / "mpi_scripts"
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")


def mpiexec(n: int, script: str, *args: str, timeout: float = 90, env: dict | None = None):
    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    full_env = checkout_env({**os.environ, **(env or {})})  # every rank imports this checkout
    # Each rank sets its own device count; the ranks compile with the tests' fast flags.
    full_env["XLA_FLAGS"] = TEST_XLA_FLAGS
    t0 = time.monotonic()
    proc = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, str(SCRIPTS / script), *args],
        capture_output=True, text=True, timeout=timeout, env=full_env,
    )
    return proc, time.monotonic() - t0


# ----------------------------------------------------------------------------- pure helpers


def test_aligned_buffers_start_on_64_bytes():
    for shape in [(1,), (3, 5), (2, 7, 9)]:
        for dtype in (np.float32, np.float16, np.int8):
            buf = aligned_empty(shape, dtype)
            assert buf.shape == shape and buf.dtype == dtype and buf.ctypes.data % 64 == 0


@pytest.mark.parametrize(
    "index,contiguous",
    [
        ((slice(0, 2), slice(0, 4), slice(0, 8)), True),  # everything
        ((slice(1, 2), slice(0, 4), slice(0, 8)), True),  # whole rows of the leading dim
        ((slice(1, 2), slice(2, 3), slice(0, 8)), True),
        ((slice(1, 2), slice(2, 3), slice(3, 5)), True),  # one run in the last dim
        ((slice(0, 2), slice(0, 4), slice(0, 4)), False),  # a tensor-parallel column block
        ((slice(0, 1), slice(1, 3), slice(2, 4)), False),
    ],
)
def test_contiguity_decides_between_a_byte_run_and_a_subarray_datatype(index, contiguous):
    shape = (2, 4, 8)
    assert _is_contiguous(index, shape) is contiguous
    if contiguous:
        flat = np.arange(64).reshape(shape)
        start = _flat_offset(index, shape)
        n = flat[index].size
        np.testing.assert_array_equal(flat.reshape(-1)[start : start + n], flat[index].reshape(-1))


def test_path_choice_and_reasons():
    assert choose_path("auto", "cpu", {"mpi", "system"})[0] == "direct"
    assert choose_path("staged", "cpu", set())[0] == "staged"
    assert choose_path("auto", "cuda", {"mpi", "system"})[0] == "staged"
    assert choose_path("auto", "cuda", {"mpi", "system", "cuda"})[0] == "direct"
    with pytest.raises(ConfigError, match="needs an MPI library that accepts cuda"):
        choose_path("direct", "cuda", {"mpi", "system"})
    with pytest.raises(ConfigError, match="unknown"):
        choose_path("fast", "cpu", set())


def test_ranks_are_given_to_stages_in_order_and_a_wrong_count_is_refused():
    role = role_for_rank([1, 2, 1], 2, 4)
    assert (role.stage, role.stage_rank, role.stage_size, role.first_rank) == (1, 1, 2, (0, 1, 3))
    assert list(role.ranks_of(1)) == [1, 2]
    with pytest.raises(PlanError, match=r"mpiexec started 3 process\(es\) but the plan's stages need 4.*mpiexec -n 4"):
        role_for_rank([1, 2, 1], 0, 3)


def test_world_size_comes_from_the_launcher_environment(monkeypatch):
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS_WORLD"):
        monkeypatch.delenv(key, raising=False)
    assert mpi_world_size() == 1
    monkeypatch.setenv("PMI_SIZE", "3")
    assert mpi_world_size() == 3


# ----------------------------------------------------------------------------- under mpiexec


def _toy(meshes, processes, schedules, path, dtype="float32"):
    n = sum(int(p) for p in processes.split(","))
    proc, _ = mpiexec(n, "toy_pipeline.py", meshes, processes, schedules, path, dtype)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TOY-OK "))
    return json.loads(line[len("TOY-OK "):])


def _expected_checks(stage, n_stages, schedules=2, steps=2, micro=3):
    receives = (stage > 0) + (stage < n_stages - 1)
    return receives * schedules * steps * micro


@pytest.mark.mpi
def test_two_stages_differing_meshes_zero_copy_both_ways():
    reports = _toy("2x1,1x4", "1,1", "gpipe,1f1b", "auto")
    shape_bytes = 8 * 4 * 16 * 4
    receiving_devices = {0: 2 * 1, 1: 1 * 4}  # each device of the receiving mesh adopts its own block
    for r in reports:
        assert r["path"] == "direct"
        assert r["checked"] == _expected_checks(r["stage"], 2)
        # Every message moved the activation exactly once, and nothing was copied.
        assert r["bytes_received"] == r["recvs"] * shape_bytes
        assert r["send_buffers_copied"] == 0 and r["recv_buffers_copied"] == 0
        assert r["recv_buffers_adopted"] == r["recvs"] * receiving_devices[r["stage"]]


@pytest.mark.mpi
def test_bfloat16_activations_cross_without_copies():
    # DLPack carries no bfloat16: sends go out through the buffer's address instead, and
    # receives are adopted by an aliasing device_put.
    reports = _toy("1x2,2x1", "1,1", "gpipe", "auto", "bfloat16")
    for r in reports:
        assert r["checked"] == _expected_checks(r["stage"], 2, schedules=1)
        assert r["bytes_received"] == r["recvs"] * 8 * 4 * 16 * 2
        assert r["send_buffers_copied"] == 0 and r["recv_buffers_copied"] == 0


@pytest.mark.mpi
def test_four_ranks_with_a_two_process_data2_tensor2_stage():
    # Stage 1 is one (data=2, tensor=2) mesh over two processes with two CPU devices each
    # (their own jax.distributed group, gloo collectives): its jitted max() spans both.
    reports = _toy("1x1,2x2,1x4", "1,2,1", "gpipe,1f1b", "auto")
    by_rank = {r["rank"]: r for r in reports}
    assert [by_rank[r]["stage"] for r in range(4)] == [0, 1, 1, 2]
    for r in reports:
        assert r["checked"] == _expected_checks(r["stage"], 3)
        assert r["recv_buffers_copied"] == 0
    # Each process of the split stage receives only its own half of every activation.
    per_message = {r: by_rank[r]["bytes_received"] / by_rank[r]["recvs"] for r in range(4)}
    assert per_message == {0: 8 * 4 * 16 * 4, 1: 8 * 4 * 16 * 2, 2: 8 * 4 * 16 * 2, 3: 8 * 4 * 16 * 4}


@pytest.mark.mpi
def test_three_stages_host_staged_path_copies_every_buffer():
    reports = _toy("1x1,4x1,1x8", "1,1,1", "1f1b,gpipe", "staged")
    for r in reports:
        assert r["path"] == "staged"
        assert r["checked"] == _expected_checks(r["stage"], 3)
        assert r["send_buffers_zero_copy"] == 0 and r["recv_buffers_adopted"] == 0
        assert r["recv_buffers_copied"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_an_exception_in_one_rank_ends_the_job_within_10_s(bad_rank):
    proc, elapsed = mpiexec(2, "fail.py", "raise", str(bad_rank), timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert out.count(f"RuntimeError: injected failure on rank {bad_rank}") == 1, out


@pytest.mark.mpi
def test_a_nonzero_exit_in_one_rank_ends_the_job():
    proc, elapsed = mpiexec(2, "fail.py", "exit", "1", timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert elapsed < 10


@pytest.mark.mpi
def test_startup_barrier_names_the_missing_rank():
    proc, elapsed = mpiexec(2, "fail.py", "late", "1", timeout=60, env={"H2JAX_MPI_STARTUP_TIMEOUT": "2"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < 10, f"exit {proc.returncode} after {elapsed:.1f} s:\n{out}"
    assert out.count("start-up barrier: rank 1 (stage 1) did not arrive within 2 s") == 1, out


@pytest.mark.mpi
def test_a_rank_that_never_starts_mpi_does_not_hang_the_others():
    proc, elapsed = mpiexec(2, "fail.py", "early", "1", timeout=60, env={"H2JAX_MPI_STARTUP_TIMEOUT": "2"})
    assert proc.returncode != 0 and elapsed < 10
    assert "_mpi_init_waits_for_every_rank_of_the_job" in proc.stderr


def test_receive_buffers_are_reused_only_once_jax_has_let_go():
    import gc

    import jax

    from h2jax.transport.mpi import _BufferPool

    pool = _BufferPool()
    buf = pool.take((256,), np.float32)
    ptr = buf.ctypes.data
    assert pool.take((256,), np.float32).ctypes.data != ptr  # still held by its taker
    for device in jax.devices()[:2]:  # adopted by DLPack on the first device, aliased after
        try:
            array = jax.dlpack.from_dlpack(buf, device=device, copy=False)
        except ValueError:
            array = jax.device_put(buf, device, may_alias=True)
        assert array.unsafe_buffer_pointer() == ptr
        del buf
        other = pool.take((256,), np.float32)
        assert other.ctypes.data != ptr  # the jax.Array still uses that memory
        del array, other
        gc.collect()
        buf = pool.take((256,), np.float32)
        assert buf.ctypes.data == ptr  # free again: reused, warm


@pytest.mark.mpi
def test_h2jax_run_refuses_a_process_count_the_plan_does_not_expect(tmp_path):
    from h2jax.plan import plan_from_dict, save_plan

    plan = plan_from_dict({
        "format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 4, "micro_batch": 2,
        "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2]},
                   {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4], "processes": 2}],
    })
    save_plan(plan, tmp_path / "plan.json")
    # `python -m h2jax` is the `h2jax` script's entry point, and runs from a checkout too
    # (PYTHONPATH=., no install), where no script exists beside the interpreter.
    env = checkout_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "h2jax", "run", "--plan", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert out.count("mpiexec started 2 process(es) but the plan's stages need 3 (stages[i].processes: 1 + 2); "
                     "launch with `mpiexec -n 3`") == 1, out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_views_of_jax_buffers_are_zero_copy_for_every_dtype(dtype):
    import jax
    import jax.numpy as jnp

    from h2jax.transport.mpi import _host_view

    x = jax.device_put(jnp.arange(24, dtype=dtype).reshape(2, 3, 4), jax.devices()[1])
    view = _host_view(x)
    assert view.ctypes.data == x.unsafe_buffer_pointer() and view.shape == x.shape
    assert view.dtype.itemsize == x.dtype.itemsize
    np.testing.assert_array_equal(view.view(x.dtype).astype(np.float32), np.arange(24).reshape(2, 3, 4))
