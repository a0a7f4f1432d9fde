"""Launched by tests/test_mpi_pipeline.py under mpiexec: train each plan file with the MPI
transport (the plans share stage layouts and process counts) and let rank 0 write, per plan,
`<out>.<i>.npz` (all stages' final parameters) and `<out>.<i>.json` (losses, transport reports).

usage: mpiexec -n K python train_plans.py OUT STEPS PATH PLAN [PLAN ...]
"""

import json
import os
import sys

import numpy as np

import h2jax
from h2jax.plan import load_plan
from h2jax.runtime import ranks

out, steps, path, plan_files = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
plans = [load_plan(p) for p in plan_files]
role = ranks.configure_process_for_plan(plans[0])  # before JAX starts
if os.environ.get("H2JAX_TEST_JAX_CACHE"):  # the test session's persistent compilation cache
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["H2JAX_TEST_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
for i, plan in enumerate(plans):
    result = h2jax.run(plan, steps, return_params=True, mpi_path=path)
    params = comm.gather(result.params if role.stage_rank == 0 else {}, root=0)
    reports = comm.gather(result.transport, root=0)
    if comm.rank == 0:
        merged = {k: v for p in params for k, v in p.items()}
        np.savez(f"{out}.{i}.npz", **merged)
        with open(f"{out}.{i}.json", "w") as f:
            json.dump({"losses": result.losses, "grad_norms": result.grad_norms, "transport": reports}, f)
