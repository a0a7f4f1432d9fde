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
from typing import Sequence

import numpy as np
import pytest

from h2jax.config import ConfigError
from h2jax.plan import PlanError
from h2jax.runtime.ranks import mpi_world_size, role_for_rank
from h2jax.transport import reshard
from h2jax.transport.mpi import _flat_offset, _is_contiguous, _runs, aligned_empty, choose_path
from tests.conftest import TEST_XLA_FLAGS, checkout_env

SCRIPTS = Path(__file__).parent / "mpi_scripts"
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")


def mpiexec(n: int, script: str, *args: str, timeout: float = 90, env: dict | None = None,
            launcher_flags: Sequence[str] = ()):
    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    full_env = checkout_env({**os.environ, **(env or {})})  # every rank imports this checkout
    # Each rank sets its own device count; the ranks compile with the tests' fast flags.
    full_env["XLA_FLAGS"] = TEST_XLA_FLAGS
    t0 = time.monotonic()
    argv = [MPIEXEC, *launcher_flags, "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hang: say all it printed and which processes were left, then end it
            # (-ww: every command whole; cut at 80 columns, the ranks' lines lost the script's name)
            # (the launcher's proxies' children too, whatever their command: a dead rank not yet
            # reaped has none)
            listing = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,pgid,stat,wchan:24,etime,args"],
                                     capture_output=True, text=True).stdout.splitlines()
            proxies = {line.split()[0] for line in listing[1:] if "hydra" in line}
            processes = "\n".join(listing[:1] + [line for line in listing[1:]
                                                  if any(w in line for w in ("mpiexec", "hydra", script))
                                                  or line.split()[1] in proxies])
            job.kill()
            out, err = job.communicate()
            pytest.fail(f"{' '.join(argv[1:])} did not end within {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}"
                        f"\n--- processes at the timeout\n{processes}", pytrace=False)
    return subprocess.CompletedProcess(argv, job.returncode, out, err), time.monotonic() - t0


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


def _selected_bytes(index, shape, itemsize):
    """Byte offsets `index` selects in a C-ordered buffer, in order (the numpy oracle)."""
    elements = np.arange(int(np.prod(shape))).reshape(shape)[index].reshape(-1)
    return (elements[:, None] * itemsize + np.arange(itemsize)).reshape(-1)


def _bytes_of_runs(offset, run, repeats):
    """The byte offsets a datatype of `run`-byte runs repeated by `repeats` (inner first) reads."""
    starts = np.array([offset])
    for count, stride in repeats:
        starts = (np.arange(count)[:, None] * stride + starts[None, :]).reshape(-1)
    return (starts[:, None] + np.arange(run)).reshape(-1)


def test_pieces_become_runs_that_read_exactly_the_selected_bytes():
    # Every sub-box of small 1-4-d arrays: the runs an MPI datatype is built from read the
    # bytes numpy's slicing selects, in the same order, as few and as long as possible.
    rng = np.random.default_rng(0)
    for _ in range(400):
        shape = tuple(int(n) for n in rng.integers(1, 5, size=rng.integers(1, 5)))
        index = tuple(slice(int(a), int(b) + 1) for a, b in (sorted(rng.integers(0, n, size=2)) for n in shape))
        itemsize = int(rng.choice([1, 2, 4]))
        offset, run, repeats = _runs(index, shape, itemsize)
        np.testing.assert_array_equal(_bytes_of_runs(offset, run, repeats), _selected_bytes(index, shape, itemsize))
        assert all(count > 1 for count, _ in repeats)
        assert all(stride > run for count, stride in repeats[:1])  # a run never continues into the next
        assert _is_contiguous(index, shape) is (not repeats)
    # A tensor-parallel column block of a [batch, seq, d_model] shard: one vector of row runs.
    assert _runs((slice(0, 2), slice(0, 4), slice(4, 8)), (2, 4, 16), 4) == (16, 16, [(8, 64)])


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


def test_a_startup_timeout_too_short_to_start_mpi_is_refused(monkeypatch):
    from h2jax.config import ConfigError
    from h2jax.runtime.ranks import MIN_STARTUP_TIMEOUT_S, default_startup_timeout

    monkeypatch.delenv("H2JAX_MPI_STARTUP_TIMEOUT", raising=False)
    assert default_startup_timeout() == 120.0
    monkeypatch.setenv("H2JAX_MPI_STARTUP_TIMEOUT", str(MIN_STARTUP_TIMEOUT_S))
    assert default_startup_timeout() == MIN_STARTUP_TIMEOUT_S
    for bad, why in (("1", "is below 5 s"), ("nan", "is below 5 s"), ("2m", "is not a number of seconds")):
        monkeypatch.setenv("H2JAX_MPI_STARTUP_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"H2JAX_MPI_STARTUP_TIMEOUT=.*{why}"):
            default_startup_timeout()


def test_h2jax_run_sets_each_ranks_start_up_deadline_before_anything_else(monkeypatch, tmp_path):
    import argparse

    from h2jax.cli import run as run_cli
    from h2jax.runtime import ranks

    calls = []

    def load_plan(path):
        calls.append("plan")
        raise SystemExit(2)

    monkeypatch.setattr(ranks, "watch_startup", lambda: calls.append("deadline"))
    monkeypatch.setattr(run_cli, "load_plan", load_plan)
    args = argparse.Namespace(plan=str(tmp_path / "plan.json"))
    for in_job, expected in ((True, ["deadline", "plan"]), (False, ["plan"])):
        calls.clear()
        monkeypatch.setattr(ranks, "in_mpi_job", lambda: in_job)
        with pytest.raises(SystemExit):
            run_cli.main(args)
        assert calls == expected


def test_init_mpi_ends_the_start_up_deadline_also_when_mpi_was_started_already(monkeypatch):
    import faulthandler

    from h2jax.runtime import ranks

    class Started:
        COMM_WORLD = "world"

        @staticmethod
        def Is_initialized():
            return True

    events = []
    monkeypatch.setattr(ranks, "_load_mpi_library", lambda: Started)
    monkeypatch.setattr(ranks, "die_with_parent", lambda: None)
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda timeout, exit: events.append(("arm", timeout)))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: events.append("cancel"))
    ranks.watch_startup(30.0)
    assert ranks.init_mpi(30.0) == "world"
    assert events == [("arm", 30.0), "cancel"]  # no deadline left to end the run later


# ----------------------------------------------------------------------------- under mpiexec


def _toy(meshes, processes, schedules, path, dtype="float32", assembly="fast"):
    n = sum(int(p) for p in processes.split(","))
    proc, _ = mpiexec(n, "toy_pipeline.py", meshes, processes, schedules, path, dtype, assembly)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TOY-OK "))
    return json.loads(line[len("TOY-OK "):])


TOY_SHAPE = (8, 4, 16)


def _is_strided(index, block):
    """Whether the piece `index` of `block` is more than one run of the block's memory."""
    flat = np.arange(int(np.prod(reshard.shape_of(block)))).reshape(reshard.shape_of(block))
    return bool(np.any(np.diff(flat[reshard.relative(index, block)].reshape(-1)) != 1))


def _planned(reports, itemsize=4):
    """Per rank, from the stages' layouts and `reshard_plan` alone: bytes and strided pieces it
    sends and receives per message, summed over its routes (each route carries the same
    number of messages), and how many routes it sends and receives on."""
    layouts = {r["stage"]: reshard.Layout(r["layout"][0], r["layout"][1], owners=tuple(r["layout"][2])) for r in reports}
    out = {r["rank"]: dict(bytes_sent=0, bytes_received=0, strided_sent=0, strided_received=0,
                           send_routes=0, recv_routes=0) for r in reports}
    for b in range(len(layouts) - 1):
        for s, d in ((b, b + 1), (b + 1, b)):  # ACT, GRAD
            src, dst = layouts[s], layouts[d]
            for rank in {*src.owners}:
                out[rank]["send_routes"] += 1
            for rank in {*dst.owners}:
                out[rank]["recv_routes"] += 1
            for t in reshard.reshard_plan(src, dst, TOY_SHAPE, itemsize):
                sender, receiver = out[src.owner(t.src_pos)], out[dst.owner(t.dst_pos)]
                sender["bytes_sent"] += t.nbytes
                receiver["bytes_received"] += t.nbytes
                sender["strided_sent"] += _is_strided(t.index, src.block(t.src_pos, TOY_SHAPE))
                receiver["strided_received"] += _is_strided(t.index, dst.block(t.dst_pos, TOY_SHAPE))
    return out


def _assert_counters_follow_the_plan(reports, itemsize=4):
    planned = _planned(reports, itemsize)
    for r in reports:
        p = planned[r["rank"]]
        sends, recvs = r["sends"] / p["send_routes"], r["recvs"] / p["recv_routes"]
        assert r["bytes_sent"] == sends * p["bytes_sent"], (r, p)
        assert r["bytes_received"] == recvs * p["bytes_received"], (r, p)  # as MPI reported it
        assert r["send_pieces_strided"] == sends * p["strided_sent"], (r, p)
        assert r["recv_pieces_strided"] == recvs * p["strided_received"], (r, p)
    return planned


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
        assert r["send_copy_bytes"] == 0 and r["recv_copy_bytes"] == 0
        assert r["recv_buffers_adopted"] == r["recvs"] * receiving_devices[r["stage"]]
        assert r["assembly"] == "xla_client.batched_device_put"
    planned = _assert_counters_follow_the_plan(reports)
    # Stage 0's (data=2) shards go to a (tensor=4) mesh as column blocks: strided pieces, all
    # read by MPI straight out of the JAX buffers (zero copies above), none packed.
    by_stage = {r["stage"]: r for r in reports}
    assert planned[by_stage[0]["rank"]]["strided_sent"] == 8 and by_stage[0]["send_pieces_strided"] > 0


@pytest.mark.mpi
def test_public_jax_assembly_adopts_the_same_buffers():
    reports = _toy("2x1,1x2", "1,1", "gpipe", "auto", "float32", "public")
    for r in reports:
        assert r["assembly"] == "make_array_from_callback"
        assert r["checked"] == _expected_checks(r["stage"], 2, schedules=1)
        assert r["recv_buffers_copied"] == 0 and r["recv_buffers_adopted"] == r["recvs"] * 2
    _assert_counters_follow_the_plan(reports)


@pytest.mark.mpi
def test_a_receive_never_waits_on_the_compute_behind_queued_sends():
    proc, _ = mpiexec(2, "recv_order.py", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("ORDER-OK "))
    reports = json.loads(line[len("ORDER-OK "):])
    receiver = next(r for r in reports if r["stage"] == 1)
    assert next(r for r in reports if r["stage"] == 0)["refused"]  # a value off the connected layout
    # 1. an arrived message is handed over with no wait at all
    assert receiver["arrived_waited"] == 0 and receiver["arrived_naps"] == 0
    # 2. and 3. the receives that did wait polled; the third opened its gate by polling
    assert receiver["recvs_waited"] == 2
    assert receiver["deadlock_gate_polls"] >= 5
    assert receiver["recvs"] == 3 and receiver["sends"] == 3


@pytest.mark.mpi
def test_bfloat16_activations_cross_without_copies():
    # Sends go out of the JAX buffer by its address and receives are adopted by PJRT as host
    # buffers: bytes either way, so bfloat16 (which DLPack and numpy lack) crosses as is.
    reports = _toy("1x2,2x1", "1,1", "gpipe", "auto", "bfloat16")
    for r in reports:
        assert r["checked"] == _expected_checks(r["stage"], 2, schedules=1)
        assert r["bytes_received"] == r["recvs"] * 8 * 4 * 16 * 2
        assert r["send_buffers_copied"] == 0 and r["recv_buffers_copied"] == 0
    _assert_counters_follow_the_plan(reports, itemsize=2)


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
    _assert_counters_follow_the_plan(reports)
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
        # One copy per end: every byte sent was copied out of JAX once, every byte received
        # copied into JAX once (no replicas here: each shard is sent whole).
        devices = {0: 1, 1: 4, 2: 8}[r["stage"]]
        assert r["send_buffers_copied"] == r["sends"] * devices
        assert r["recv_buffers_copied"] == r["recvs"] * devices
        assert r["send_copy_bytes"] == r["bytes_sent"] > 0
        assert r["recv_copy_bytes"] == r["bytes_received"] > 0
    _assert_counters_follow_the_plan(reports)


# Without the abort these jobs never end (the good rank waits forever; in late/early the bad
# rank sleeps 600 s), so the subprocess timeout tells a hang from an abort: no test here
# measures how long the job took (that depends on the machine's load).
@pytest.mark.mpi
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_an_exception_in_one_rank_ends_the_job(bad_rank):
    proc, _ = mpiexec(2, "fail.py", "raise", str(bad_rank), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(f"RuntimeError: injected failure on rank {bad_rank}") == 1, out


@pytest.mark.mpi
def test_a_nonzero_exit_in_one_rank_ends_the_job():
    proc, _ = mpiexec(2, "fail.py", "exit", "1", timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr


@pytest.mark.mpi
def test_startup_barrier_names_the_missing_rank():
    # The timeout also bounds each rank's MPI_Init (which waits for every rank): generous
    # enough for a loaded machine to start both.
    proc, _ = mpiexec(2, "fail.py", "late", "1", timeout=300, env={"H2JAX_MPI_STARTUP_TIMEOUT": "10"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"exit {proc.returncode}:\n{out}"
    assert out.count("start-up barrier: rank 1 (stage 1) did not arrive within 10 s") == 1, out


@pytest.mark.mpi
def test_a_too_short_startup_timeout_ends_the_job_before_mpi_starts_with_one_error():
    proc, _ = mpiexec(2, "fail.py", "raise", "1", timeout=120, env={"H2JAX_MPI_STARTUP_TIMEOUT": "1"})
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("H2JAX_MPI_STARTUP_TIMEOUT=1 is below 5 s") == 1, proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("mode,stuck_in", [
    ("early", "_mpi_init_waits_for_every_rank_of_the_job"),  # rank 0 waits in MPI_Init
    ("early_slow_load", "in slow_load"),  # rank 0 misses its own deadline loading the library
    # The launcher leaves the stuck rank running, as MPICH's hydra once did on a loaded CI
    # machine (2026-12-06, rank 0 having left MPI_Init after 10 s): before every rank had a
    # start-up deadline of its own (ranks.watch_startup), the job then hung until it woke.
    ("early_alone", "_mpi_init_waits_for_every_rank_of_the_job"),
])
def test_a_rank_that_never_starts_mpi_does_not_hang_the_others(mode, stuck_in):
    flags = ["-disable-auto-cleanup"] if mode == "early_alone" else []
    proc, _ = mpiexec(2, "fail.py", mode, "1", timeout=120, env={"H2JAX_MPI_STARTUP_TIMEOUT": "10"},
                         launcher_flags=flags)
    assert proc.returncode != 0
    assert stuck_in in proc.stderr, proc.stderr


def test_receive_buffers_are_adopted_and_reused_only_once_jax_has_let_go():
    import gc

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from h2jax.transport.mpi import _batched_put, _BufferPool

    pool = _BufferPool()
    buf = pool.take((1, 4, 8), np.float32)
    ptr = buf.ctypes.data
    assert pool.take((1, 4, 8), np.float32).ctypes.data != ptr  # still held by its taker
    for device in jax.devices()[:2]:
        sharding = NamedSharding(Mesh(np.array([[device]]), ("data", "tensor")), P("data", None, "tensor"))
        put = _batched_put((1, 4, 8), np.float32, sharding, [device], copy=False)
        buf[:] = np.arange(32).reshape(1, 4, 8)
        array = put([buf])
        assert array.sharding == sharding and array.addressable_data(0).unsafe_buffer_pointer() == ptr  # adopted
        np.testing.assert_array_equal(np.asarray(array), np.arange(32).reshape(1, 4, 8))
        copied = _batched_put((1, 4, 8), np.float32, sharding, [device], copy=True)([buf])
        assert copied.addressable_data(0).unsafe_buffer_pointer() != ptr  # the staged path's one copy
        del buf, copied
        other = pool.take((1, 4, 8), np.float32)
        assert other.ctypes.data != ptr  # the jax.Array still uses that memory
        del array, other
        gc.collect()
        buf = pool.take((1, 4, 8), np.float32)
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

    # The view reads the buffer by its address: only of a computed array, as the transport
    # (which sends a value once it is_ready()) does.
    x = jax.device_put(jnp.arange(24, dtype=dtype).reshape(2, 3, 4), jax.devices()[1]).block_until_ready()
    view = _host_view(x)
    assert view.ctypes.data == x.unsafe_buffer_pointer() and view.shape == x.shape
    assert view.dtype.itemsize == x.dtype.itemsize
    np.testing.assert_array_equal(view.view(x.dtype).astype(np.float32), np.arange(24).reshape(2, 3, 4))
