"""The one training loop: asynchronous hand-off between local meshes, the measured trace, the
Python API's device set-up, and a rank's platform selection under mpiexec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from h2jax.plan import plan_from_dict
from h2jax.runtime.tracing import StepTracer, busy_fractions, overlapping_stages
from h2jax.runtime.train import run
from h2jax.trace import TraceEvent, read_trace
from h2jax.transport.base import ACT, Tag
from h2jax.transport.local import LocalTransport
from tests.conftest import checkout_env, skip_if_fewer_devices

REPO = Path(__file__).resolve().parent.parent
SHAPE = (4, 8, 16)  # [micro_batch, seq, d_model]


def boundary(devices, data, tensor):
    mesh = Mesh(np.array(devices).reshape(data, tensor), ("data", "tensor"))
    return NamedSharding(mesh, P("data", None, "tensor"))


def blocked_producer(x, release: threading.Event):
    """x * 2 on x's devices, computed only once `release` is set (a host callback waits)."""

    def wait(v):
        release.wait()
        return v

    body = lambda v: jax.pure_callback(wait, jax.ShapeDtypeStruct(v.shape, v.dtype), v) * 2  # noqa: E731
    return jax.jit(body, out_shardings=x.sharding)(x)


# The producer spans two or more devices: XLA's CPU client runs a one-device program inline on
# the dispatching thread, which would block the test itself, whatever the transport does.
MESH_PAIRS = [((2, 1), (1, 4)), ((1, 2), (2, 2)), ((2, 2), (1, 1)), ((1, 2), (2, 1))]


@skip_if_fewer_devices(8)
@pytest.mark.parametrize("src_mesh, dst_mesh", MESH_PAIRS)
def test_local_handoff_returns_before_the_producer_finishes(src_mesh, dst_mesh):
    devices = jax.devices()
    src = boundary(devices[: src_mesh[0] * src_mesh[1]], *src_mesh)
    dst = boundary(devices[4: 4 + dst_mesh[0] * dst_mesh[1]], *dst_mesh)
    transport = LocalTransport()
    transport.connect(SHAPE, np.float32, {0: src, 1: dst})
    x = jax.device_put(np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE), src)
    release = threading.Event()
    y = blocked_producer(x, release)
    sent = threading.Event()
    sender = threading.Thread(target=lambda: (transport.send(Tag(ACT, 0, 0), y), sent.set()), daemon=True)
    sender.start()
    # The producer cannot finish before `release`: a send that waited for it would never return.
    assert sent.wait(60), "send blocked until the producer finished"
    assert not y.is_ready()
    received = transport.recv(Tag(ACT, 0, 0))
    release.set()
    assert received.sharding == dst
    np.testing.assert_array_equal(np.asarray(received), np.asarray(x) * 2)
    assert transport.bytes_moved == int(np.prod(SHAPE)) * 4  # each element crosses once


@skip_if_fewer_devices(8)
def test_the_sync_handoff_kept_for_comparison_waits_for_the_producer():
    devices = jax.devices()
    src, dst = boundary(devices[:2], 2, 1), boundary(devices[4:8], 1, 4)
    transport = LocalTransport(handoff="sync")
    transport.connect(SHAPE, np.float32, {0: src, 1: dst})
    release = threading.Event()
    y = blocked_producer(jax.device_put(np.ones(SHAPE, np.float32), src), release)
    sent = threading.Event()
    threading.Thread(target=lambda: (transport.send(Tag(ACT, 0, 0), y), sent.set()), daemon=True).start()
    assert not sent.wait(1.0)  # still waiting on the producer (would be True at once if async)
    release.set()
    assert sent.wait(60)
    np.testing.assert_array_equal(np.asarray(transport.recv(Tag(ACT, 0, 0))), 2.0)


def test_the_handoff_mode_is_checked():
    with pytest.raises(ValueError, match="handoff must be one of"):
        LocalTransport(handoff="fast")


# ------------------------------------------------------------------ the measured trace


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_tracer_starts_a_compute_no_earlier_than_the_stages_previous_one_ended():
    clock = FakeClock()
    tracer = StepTracer(clock=clock, wall=lambda: 100.0)
    a, b = jax.numpy.ones(3), jax.numpy.ones(3)
    clock.t = 1.0
    tracer.compute(0, "F0", 1.0, a)  # dispatched at 1
    tracer.drain()  # its outputs are ready: stamped at the clock's time then
    clock.t = 3.0
    tracer.compute(0, "F1", 2.0, b)  # dispatched at 2, before... F0 ended at 1: starts at 2
    tracer.drain()
    tracer.compute(1, "F0", 0.5, None, interval=(5.0, 9.0))  # an emulated chip's own interval
    tracer.comm(1, "RECV_ACT0", 4.0, 5.0)
    events = tracer.relative_events(100.0)
    tracer.close()
    assert events == [
        TraceEvent(0, "F0", 1.0, 0.0, None),
        TraceEvent(0, "F1", 2.0, 1.0, None),
        TraceEvent(1, "RECV_ACT0", 4.0, 1.0, None, "comm"),
        TraceEvent(1, "F0", 5.0, 4.0, None),
    ]


def test_the_watcher_waits_on_a_marker_that_the_next_program_cannot_donate(monkeypatch):
    """The gradient accumulator a backward produces is donated by the next backward, which the
    host may dispatch before the watcher reaches it: a donated array cannot be waited on, so the
    watcher waits on a one-element copy taken at dispatch (ready once the compute finished)."""
    from h2jax.runtime import tracing

    waited_on = []
    real_wait = tracing._wait_for
    monkeypatch.setattr(tracing, "_wait_for", lambda arrays: (waited_on.append(list(arrays)), real_wait(arrays)))
    consume = jax.jit(lambda acc: jax.tree.map(lambda a: a * 2, acc), donate_argnums=(0,))
    tracer = StepTracer(clock=FakeClock(), wall=lambda: 0.0)
    acc = {"w": jax.numpy.arange(6.0).reshape(2, 3), "b": jax.numpy.full(2, 7.0)}
    tracer.compute(0, "B0", 0.0, acc)
    out = consume(acc)  # donates both leaves
    assert acc["b"].is_deleted() and acc["w"].is_deleted()
    tracer.drain()
    assert len(tracer.relative_events(0.0)) == 1
    tracer.close()
    assert np.asarray(out["b"]).tolist() == [14.0, 14.0]
    (marker,), = waited_on  # one array, the marker: never a leaf the next program donated
    assert not marker.is_deleted() and np.asarray(marker).tolist() == [7.0]


def test_the_ready_marker_is_the_smallest_outputs_first_element_and_outlives_donation():
    from h2jax.runtime.tracing import _ready_marker

    consume = jax.jit(lambda acc: jax.tree.map(lambda a: a * 2, acc), donate_argnums=(0,))
    acc = {"w": jax.numpy.arange(6.0).reshape(2, 3), "b": jax.numpy.full(2, 7.0)}
    marker = _ready_marker(acc)
    consume(acc)
    assert acc["b"].is_deleted() and not marker.is_deleted()
    assert np.asarray(marker).tolist() == [7.0]
    assert _ready_marker({"gone": acc["b"]}) is None and _ready_marker(None) is None


def test_overlap_and_busy_fractions_from_events():
    events = [TraceEvent(0, "F0", 0.0, 2.0), TraceEvent(0, "F1", 3.0, 1.0), TraceEvent(1, "F0", 1.0, 1.5),
              TraceEvent(1, "RECV_ACT1", 2.5, 2.0, None, "comm")]
    assert overlapping_stages(events) == 2
    assert overlapping_stages([TraceEvent(0, "F0", 0.0, 1.0), TraceEvent(1, "F0", 1.0, 1.0)]) == 1
    assert busy_fractions(events) == {0: 0.75, 1: 1.0}


TWO_STAGES = {
    "format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8, "micro_batch": 2,
    "schedule": "1f1b", "seed": 0,
    "stages": [
        {"chip": "cpu", "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
        {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4]},
    ],
}


@skip_if_fewer_devices(4)
def test_a_measured_trace_holds_every_action_on_the_simulators_tracks(tmp_path, token_file):
    from h2jax.data import TokenDataset

    plan = plan_from_dict(TWO_STAGES)
    path = tmp_path / "run.json"
    # three steps, every other one traced: steps 0 and 2 (step 1 runs untraced)
    result = run(plan, 3, dataset=TokenDataset(token_file, 16), trace=str(path), trace_every=2)
    events = read_trace(path)
    names = {(e.stage, e.name, e.lane) for e in events}
    for k in range(plan.n_micro):
        assert (0, f"F{k}", "compute") in names and (0, f"B{k}", "compute") in names
        assert (1, f"F{k}+B{k}", "compute") in names  # the last stage's fused program
        assert (0, f"SEND_ACT{k}", "comm") in names and (1, f"RECV_ACT{k}", "comm") in names
        assert (1, f"SEND_GRAD{k}", "comm") in names and (0, f"RECV_GRAD{k}", "comm") in names
    optimizer = [e for e in events if e.name == "optimizer"]
    assert sorted(e.stage for e in optimizer) == [0, 0, 1, 1]  # one per stage per traced step
    reduces = [e for e in events if e.name == "dp reduce"]
    assert sorted(e.stage for e in reduces) == [0, 0]  # the data-parallel stage's one reduction per step
    computes = [e for e in events if e.lane == "compute"]
    assert len(computes) == 2 * (2 * plan.n_micro + plan.n_micro + 1 + 1 + 1)
    assert all(e.start_s >= 0 for e in events)
    assert np.isfinite(result.losses).all()
    trace = json.loads(path.read_text())
    assert trace["metadata"]["source"] == "measured"
    labels = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert labels == {"stage 0 (cpu)", "stage 1 (cpu)"}


@pytest.mark.parametrize("kwargs, says", [
    ({"trace_every": 0, "trace": "t.json"}, "trace_every must be an integer >= 1"),
    ({"trace_every": 2.0, "trace": "t.json"}, "trace_every must be an integer >= 1"),
    ({"trace_every": 2}, "trace_every > 1 needs a trace file"),
    ({"trace_every": 2, "trace": "t.json", "log_dir": "logs"}, "trace_every > 1 needs a trace file and no log_dir"),
])
def test_trace_every_is_checked_before_anything_compiles(kwargs, says):
    from h2jax.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        run(plan_from_dict(TWO_STAGES), 2, **kwargs)


# ------------------------------------------------------------------ processes


def _python(code: str, env: dict | None = None, timeout: float = 300):
    full = checkout_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                          timeout=timeout, cwd=REPO)


def test_the_python_api_sets_up_the_host_devices_a_plan_needs():
    plan = json.dumps(TWO_STAGES)
    proc = _python(
        "import json, h2jax, jax\n"
        f"r = h2jax.run(h2jax.plan.plan_from_dict(json.loads({plan!r})), steps=1)\n"
        "print(len(jax.devices('cpu')), r.losses)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "4"


def test_the_python_api_says_what_to_do_when_jax_started_with_too_few_devices():
    plan = json.dumps(TWO_STAGES)
    proc = _python(
        "import json, jax, h2jax\n"
        "jax.devices()\n"
        f"h2jax.run(h2jax.plan.plan_from_dict(json.loads({plan!r})), steps=1)\n"
    )
    assert proc.returncode != 0
    assert "need 4 host devices but JAX already started with 1" in proc.stderr
    assert "--xla_force_host_platform_device_count=4" in proc.stderr


def _library_chip(directory: Path, path: str) -> None:
    for name in ("cpu",):
        (directory / f"{name}.toml").write_text((REPO / "backends" / f"{name}.toml").read_text())
    (directory / "vendor-x.toml").write_text(
        'name = "vendor-x"\nplatform = "vendorx"\nmemory_gib = 16.0\npeak_tflops = 100.0\n'
        'chips_per_node = 8\nintra_node_gbps = 100.0\ninter_node_gbps = 25.0\nsource = "test"\n\n'
        f'[plugin]\nkind = "library"\npath = "{path}"\n'
    )


@pytest.mark.mpi
@pytest.mark.parametrize("exists", [False, True])
def test_a_rank_registers_its_stages_library_plugin_under_mpiexec(tmp_path, exists):
    from tests.test_mpi_transport import MPIEXEC

    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    backends = tmp_path / "backends"
    backends.mkdir()
    library = tmp_path / "libvendorx_pjrt.so"
    if exists:
        library.write_bytes(b"not a shared library")
    _library_chip(backends, str(library))
    plan = dict(TWO_STAGES, stages=[
        {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2]},
        {"chip": "vendor-x", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]},
    ])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    env = checkout_env({**os.environ, "H2JAX_BACKENDS_DIR": str(backends), "H2JAX_MPI_STARTUP_TIMEOUT": "30"})
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "h2jax", "run", "--plan", str(plan_file), "--steps", "1"],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 1 (stage 1" in out and str(library) in out, out
    assert "Traceback" not in out, out  # one clear line, not a stack
