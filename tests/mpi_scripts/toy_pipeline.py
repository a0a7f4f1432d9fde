"""Launched by tests/test_mpi_transport.py under mpiexec: the MPI transport under real schedule
action lists, with a toy stage function instead of a transformer (compiles in milliseconds).

Stage s computes y = x * (s + 1) + max(x) and, backward, dx = dy * (s + 1) + max(dy), both
jitted on the stage's own mesh (the max is a collective over the whole mesh, across processes
in a multi-process stage). Inputs are small integers, so every value is exact in f32 and each
received shard must equal the numpy oracle bit for bit.

usage: mpiexec -n K python toy_pipeline.py MESHES PROCESSES SCHEDULES PATH [DTYPE [ASSEMBLY]]
       e.g. "2x1,1x2,2x2" "1,1,2" "gpipe,1f1b" auto
ASSEMBLY `public` makes the transport assemble received arrays through public JAX only (as on
a JAX without the PJRT call it prefers). Each rank's report carries its stage's layout.
Rank 0 prints one line: TOY-OK {json}; any mismatch raises (and aborts the job).
"""

import json
import sys

import numpy as np

from h2jax.plan import plan_from_dict
from h2jax.runtime import ranks
from h2jax.transport import mpi

meshes = [tuple(int(v) for v in m.split("x")) for m in sys.argv[1].split(",")]
processes = [int(p) for p in sys.argv[2].split(",")]
schedules, path = sys.argv[3].split(","), sys.argv[4]
DTYPE = sys.argv[5] if len(sys.argv) > 5 else "float32"  # bfloat16: keep to 2 stages (exact < 256)
if len(sys.argv) > 6 and sys.argv[6] == "public":
    mpi._batched_put = lambda *args: None
N_MICRO, STEPS = 3, 2
SHAPE = (8, 4, 16)  # [micro_batch, seq, d_model]
n = len(meshes)

plan = plan_from_dict({
    "format_version": 1,
    "model": {"vocab_size": 256, "d_model": 16, "n_layers": n, "n_heads": 8, "n_kv_heads": 8, "d_ff": 32},
    "seq_len": SHAPE[1], "global_batch": SHAPE[0] * N_MICRO, "micro_batch": SHAPE[0],
    "stages": [
        {"chip": "cpu", "mesh": {"data": d, "tensor": t}, "layers": [i, i + 1], "processes": p}
        for i, ((d, t), p) in enumerate(zip(meshes, processes))
    ],
})
role = ranks.configure_process_for_plan(plan)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

from h2jax import schedules as sched  # noqa: E402
from h2jax.transport.base import ACT, GRAD, Tag  # noqa: E402
from h2jax.runtime.jaxsetup import stage_mesh_devices  # noqa: E402

s = role.stage
data, tensor = meshes[s]
mesh = Mesh(stage_mesh_devices(data, tensor), ("data", "tensor"))
layout = NamedSharding(mesh, P("data", None, "tensor"))
toy = jax.jit(lambda x: x * (s + 1) + jnp.max(x), in_shardings=layout, out_shardings=layout)


def oracle_input(step, k):
    return ((np.arange(np.prod(SHAPE)) * (k + 1) + step) % 5).reshape(SHAPE).astype(np.float32)


def oracle_act(step, k, upto):  # output of stage `upto`
    x = oracle_input(step, k)
    for i in range(upto + 1):
        x = x * (i + 1) + x.max()
    return x


def oracle_grad(step, k, stage):  # gradient stage `stage` sends back (dx of that stage)
    g = oracle_act(step, k, n - 1)  # the last stage's "loss gradient" is its own output
    for i in range(n - 1, stage - 1, -1):
        g = g * (i + 1) + g.max()
    return g


def check(array, want, what):
    assert array.sharding == layout, f"{what}: arrived as {array.sharding}, want {layout}"
    assert array.dtype == DTYPE, f"{what}: arrived as {array.dtype}"
    for shard in array.addressable_shards:
        got = np.asarray(shard.data).astype(np.float32)
        np.testing.assert_array_equal(got, want[shard.index], err_msg=what)


transport = mpi.MPITransport(ranks.plan_processes(plan), path=path)
transport.connect(SHAPE, jnp.dtype(DTYPE), {s: layout})
checked = 0
for name in schedules:
    actions = sched.get_schedule(name).stage_actions(s, n, N_MICRO)
    for step in range(STEPS):
        transport.prepost([Tag(ACT, s - 1, a.micro) for a in actions if a.kind == sched.RECV_ACT]
                          + [Tag(GRAD, s, a.micro) for a in actions if a.kind == sched.RECV_GRAD])
        inbox, outbox = {}, {}
        for a in actions:
            k = a.micro
            if a.kind == sched.RECV_ACT:
                inbox[ACT, k] = transport.recv(Tag(ACT, s - 1, k))
                check(inbox[ACT, k], oracle_act(step, k, s - 1), f"{name} step {step} act {k} into stage {s}")
                checked += 1
            elif a.kind == sched.RECV_GRAD:
                inbox[GRAD, k] = transport.recv(Tag(GRAD, s, k))
                check(inbox[GRAD, k], oracle_grad(step, k, s + 1), f"{name} step {step} grad {k} into stage {s}")
                checked += 1
            elif a.kind == sched.F:
                x = inbox.pop((ACT, k)) if s else jax.make_array_from_callback(
                    SHAPE, layout, lambda idx, k=k: oracle_input(step, k)[idx].astype(DTYPE))
                outbox[ACT, k] = toy(x)
            elif a.kind == sched.B:
                outbox[GRAD, k] = toy(outbox[ACT, k] if s == n - 1 else inbox.pop((GRAD, k)))
            elif a.kind == sched.SEND_ACT:
                transport.send(Tag(ACT, s, k), outbox[ACT, k])
            elif a.kind == sched.SEND_GRAD:
                transport.send(Tag(GRAD, s - 1, k), outbox.pop((GRAD, k)))
        transport.flush()

leaders = {s: float(s + 1)} if role.stage_rank == 0 else {}
assert transport.sum_across_stages(leaders) == n * (n + 1) / 2
shared = transport.share_from_stage(n - 1, [1.5, float(n)] if s == n - 1 else None)
assert shared == [1.5, float(n)], shared
mine = mpi.reshard.Layout.from_sharding(layout, owner=lambda d: role.first_rank[s] + d.process_index)
report = dict(transport.describe(), checked=checked, layout=[mine.data, mine.tensor, list(mine.owners)])
transport.close()
reports = MPI.COMM_WORLD.gather(report, root=0)
if role.rank == 0:
    print("TOY-OK " + json.dumps(reports), flush=True)
