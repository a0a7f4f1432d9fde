"""Launched by tests/test_checkpoint.py, in one process or under mpiexec: train a plan 3 steps
and commit a checkpoint, train 2 more, start an asynchronous save of step 5, and die by
SIGKILL (the process with rank KILL_RANK; the others wait for the save) while it is in flight.
The job's first process records each step's loss in OUT (JSON), before the kill.

usage: [mpiexec -n K] python checkpoint_crash.py PLAN DIR OUT KILL_RANK
"""

import json
import os
import signal
import sys

from h2jax.data import TokenDataset
from h2jax.plan import load_plan
from h2jax.runtime import ranks

plan_file, directory, out, kill_rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
plan = load_plan(plan_file)
if ranks.in_mpi_job():
    ranks.configure_process_for_plan(plan)  # before JAX starts
else:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from h2jax.runtime.checkpoint import RunCheckpoints  # noqa: E402
from h2jax.runtime.train import Trainer  # noqa: E402

rank = ranks.mpi_rank() if ranks.in_mpi_job() else 0
dataset = TokenDataset(os.environ["H2JAX_TEST_TOKENS"], plan.seq_len, plan.seed)
trainer = Trainer(plan, emulate_time=False)
checkpoints = RunCheckpoints(trainer, directory)
losses = []


def step(n):
    losses.append(trainer.step(dataset.batch(n, plan.global_batch) if trainer.needs_tokens else None).loss)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


for n in range(3):
    step(n)
checkpoints.finish(3)  # committed on every process
for n in range(3, 5):
    step(n)
checkpoints.save(5)  # asynchronous: the writes run in the background
if ranks.in_mpi_job():
    # Rank 0 has written every loss before any rank dies: the kill takes the whole job down,
    # and rank 0 cut off mid-write left OUT empty (seen with the suite run twice at once).
    ranks.comm_world().Barrier()
if rank == kill_rank:
    os.kill(os.getpid(), signal.SIGKILL)
checkpoints.finish(5)  # never completes: the killed process never reports its item
sys.exit("unreachable: the checkpoint of step 5 was committed without every process")
