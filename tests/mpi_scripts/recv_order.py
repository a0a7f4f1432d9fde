"""Launched by tests/test_mpi_transport.py under `mpiexec -n 2`: a receive never waits on the
compute behind this rank's own queued sends, and still starts them in time to avoid deadlock.

Stage 1 queues a GRAD send whose value is a gate: a real array whose `is_ready()` says what
the script decides and whose `block_until_ready()` fails while the gate is shut. So the proof
needs no clock: a receive that waited on that compute would raise, and one that never started
the send once it was ready would hang (the test's timeout). The transport's sleep between
polls is replaced by a counter.

1. arrived:  stage 1 polls `ready(ACT 0)` until the message is there, then `recv`s it with the
   gated send queued: handed over at once (no wait at all), the send still queued.
2. waiting:  stage 1 `recv`s ACT 1 before it arrives, the gate still shut: it polls, takes the
   message when it comes, and never blocks on the gate.
3. deadlock: stage 0 sends ACT 2 only after it has received GRAD 2, which stage 1 queued
   behind a gate that opens after a few polls; stage 1 `recv`s ACT 2 first. Only a receive
   that starts queued sends as their values become ready (without blocking on them) ends.

Rank 0 prints one line: ORDER-OK {json}; any failure raises (and aborts the job).
"""

import json

import numpy as np

from h2jax.plan import plan_from_dict
from h2jax.runtime import ranks
from h2jax.transport import mpi

SHAPE = (2, 4, 8)
plan = plan_from_dict({
    "format_version": 1,
    "model": {"vocab_size": 64, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "d_ff": 16},
    "seq_len": SHAPE[1], "global_batch": SHAPE[0], "micro_batch": SHAPE[0],
    "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 1]},
               {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [1, 2]}],
})
role = ranks.configure_process_for_plan(plan)  # before JAX starts

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

from h2jax.runtime.jaxsetup import stage_mesh_devices  # noqa: E402
from h2jax.transport.base import ACT, GRAD, Tag  # noqa: E402

s = role.stage
mesh = Mesh(stage_mesh_devices(1, 1 + s), ("data", "tensor"))
layout = NamedSharding(mesh, P("data", None, "tensor"))
transport = mpi.MPITransport(ranks.plan_processes(plan), path="direct")
transport.connect(SHAPE, np.float32, {s: layout})
naps = []
transport._sleep = naps.append  # no clock: count the polls that would have slept


def value(k: int, kind: str) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.float32) * (k + 1) + (kind == GRAD) * 1000).reshape(SHAPE)


def put(k: int, kind: str):
    return jax.device_put(value(k, kind), layout).block_until_ready()


class Gate:
    """A computed array that claims to be still computing until opened (or until it has been
    polled `opens_after` times)."""

    def __init__(self, array, opens_after: int | None = None):
        self.array, self.opens_after, self.polls, self.open = array, opens_after, 0, False

    def is_ready(self) -> bool:
        self.polls += 1
        if self.opens_after is not None and self.polls >= self.opens_after:
            self.open = True
        return self.open

    def block_until_ready(self):
        if not self.open:
            raise AssertionError("the transport waited on the compute behind a queued send")
        return self

    def __getattr__(self, name):
        return getattr(self.array, name)


def check(array, k, kind):
    assert array.sharding == layout, array.sharding
    np.testing.assert_array_equal(np.asarray(array), value(k, kind))


report = {"rank": role.rank, "stage": s}
if s == 0:
    try:  # MPI reads shards by address: a value off the connected layout is refused
        transport.send(Tag(ACT, 0, 9), jax.device_put(np.zeros((2, 4, 4), np.float32), layout))
        raise AssertionError("a value of another shape was sent")
    except ValueError as e:
        report["refused"] = "transport was connected for float32[2, 4, 8]" in str(e)
    transport.send(Tag(ACT, 0, 0), put(0, ACT))
    # An equivalent layout (unsplit on this 1-device mesh) is accepted.
    transport.send(Tag(ACT, 0, 1), jax.device_put(value(1, ACT), NamedSharding(mesh, P())).block_until_ready())
    transport.flush()
    for k in (0, 1):
        check(transport.recv(Tag(GRAD, 0, k)), k, GRAD)
    check(transport.recv(Tag(GRAD, 0, 2)), 2, GRAD)  # case 3: only then does ACT 2 go
    transport.send(Tag(ACT, 0, 2), put(2, ACT))
    transport.flush()
else:
    # 1. arrived
    gate = Gate(put(0, GRAD))
    transport.send(Tag(GRAD, 0, 0), gate)
    while not transport.ready(Tag(ACT, 0, 0)):
        pass
    check(transport.recv(Tag(ACT, 0, 0)), 0, ACT)
    assert len(transport._pending_sends) == 1, "the gated send must still be queued"
    report["arrived_waited"] = transport.stats["recvs_waited"]
    report["arrived_naps"] = len(naps)
    # 2. waiting (the gate of case 1 still shut, a second one behind it)
    gate2 = Gate(put(1, GRAD))
    transport.send(Tag(GRAD, 0, 1), gate2)
    check(transport.recv(Tag(ACT, 0, 1)), 1, ACT)
    assert len(transport._pending_sends) == 2, "both gated sends must still be queued"
    gate.open = gate2.open = True
    transport.flush()
    # 3. deadlock: ACT 2 comes only after GRAD 2 has gone
    gate3 = Gate(put(2, GRAD), opens_after=5)
    transport.send(Tag(GRAD, 0, 2), gate3)
    check(transport.recv(Tag(ACT, 0, 2)), 2, ACT)
    report["deadlock_gate_polls"] = gate3.polls
    report["naps"] = len(naps)
    transport.flush()
report.update(transport.describe())
transport.close()
reports = MPI.COMM_WORLD.gather(report, root=0)
if role.rank == 0:
    print("ORDER-OK " + json.dumps(reports), flush=True)
