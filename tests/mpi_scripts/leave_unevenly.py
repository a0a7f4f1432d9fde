"""Launched by tests/test_hardening_runtime.py under `mpiexec -n 2`: both ranks finalize MPI
(MPI_Finalize waits for every rank); rank 1 then leaves at once through ranks.leave_process,
while rank 0 goes on for two seconds more, says so, and leaves the same way with the exit
status given as the argument. Had rank 1 left without the MPI library's exit hook
(os._exit), the launcher's proxy would have SIGKILLed rank 0 meanwhile -- what happens, in a
moment's window, to a rank descheduled between its MPI_Finalize and its exit."""

import sys
import time

from h2jax.runtime import ranks

comm = ranks.init_mpi()
rank = comm.rank
sys.modules["mpi4py.MPI"].Finalize()
if rank == 1:
    ranks.leave_process(0)
time.sleep(2.0)  # the proxy acts on a closed connection at once: long enough to be killed
print("rank 0 outlived rank 1", flush=True)
ranks.leave_process(int(sys.argv[1]))
