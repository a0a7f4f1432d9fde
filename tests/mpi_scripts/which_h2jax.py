"""Launched by tests/test_checkout_under_test.py under mpiexec: each rank reports the file of
the h2jax it imported. Rank 0 prints one line: WHICH [file of rank 0, file of rank 1, ...]."""

import json

import h2jax
from mpi4py import MPI

files = MPI.COMM_WORLD.gather(h2jax.__file__, root=0)
if MPI.COMM_WORLD.rank == 0:
    print("WHICH " + json.dumps(files), flush=True)
