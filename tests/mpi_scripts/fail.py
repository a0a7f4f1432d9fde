"""Launched by tests/test_mpi_transport.py: one rank fails, the others wait on a message that
will never come. The job must end non-zero within seconds, the error printed once.

usage: mpiexec -n 2 python fail.py MODE BAD_RANK
  raise  BAD_RANK raises an exception (through sys.excepthook)
  exit   BAD_RANK leaves with sys.exit(3) inside abort_on_failure()
  late   BAD_RANK starts MPI, then reaches the start-up barrier 600 s late (as if stuck
         initializing its backend; set H2JAX_MPI_STARTUP_TIMEOUT low)
  early  BAD_RANK is stuck 600 s before it even starts MPI
  early_slow_load  as early, and loading the MPI library takes the other ranks 15 s (as on a
         loaded machine; set H2JAX_MPI_STARTUP_TIMEOUT below that)
  early_alone  as early, and the launcher does not end BAD_RANK when the others leave: launched
         with `mpiexec -disable-auto-cleanup`, hydra sends SIGUSR1 instead of SIGKILL, which
         BAD_RANK ignores

Every rank first sets its start-up deadline, as `h2jax run` does (ranks.watch_startup).
"""

import signal
import sys
import time

import numpy as np

from h2jax.plan import plan_from_dict
from h2jax.runtime import ranks
from h2jax.transport import mpi

mode, bad = sys.argv[1], int(sys.argv[2])
rank = ranks.mpi_rank()
ranks.watch_startup()
plan = plan_from_dict({
    "format_version": 1, "model": "tiny", "seq_len": 4, "global_batch": 2, "micro_batch": 2,
    "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2]},
               {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]}],
})
if mode == "early_alone" and rank == bad:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
if mode.startswith("early") and rank == bad:
    time.sleep(600)
if mode == "early_slow_load":
    load = ranks._load_mpi_library

    def slow_load():
        time.sleep(15)
        return load()

    ranks._load_mpi_library = slow_load
if mode == "late" and rank == bad:
    ranks.init_mpi()
    time.sleep(600)
role = ranks.configure_process_for_plan(plan)

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from h2jax.transport.base import ACT, GRAD, Tag  # noqa: E402

mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
transport = mpi.MPITransport(ranks.plan_processes(plan))
transport.connect((2, 4, 64), np.float32, {role.stage: NamedSharding(mesh, P("data", None, "tensor"))})
with ranks.abort_on_failure():
    if rank == bad:
        time.sleep(0.5)  # let the others block first
        if mode == "exit":
            sys.exit(3)
        raise RuntimeError(f"injected failure on rank {rank}")
    # Never sent: without the abort this rank would wait forever.
    transport.recv(Tag(ACT, 0, 0) if role.stage == 1 else Tag(GRAD, 0, 0))
