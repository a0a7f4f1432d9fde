"""Launched by tests/test_hardening_runtime.py under mpiexec: train PLAN with the MPI transport
and, before step 3, do to rank RANK what MODE says: `sigstop` (the rank freezes: the step
watchdog must abort the job naming it), `sigterm` (every rank must stop after the same step
with one line), `sigkill` (the rank dies without a word: `h2jax launch` must name it), `nan` (rank RANK feeds out-of-vocabulary tokens: the run stops naming the step
and stage).

usage: mpiexec -n K python stop_rank.py PLAN TOKENS MODE RANK
"""

import os
import signal
import sys

from h2jax.data import TokenDataset
from h2jax.plan import load_plan
from h2jax.runtime import ranks

plan_file, tokens, mode, target = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
plan = load_plan(plan_file)
role = ranks.configure_process_for_plan(plan)  # before JAX starts

from h2jax.runtime.guard import RunGuard  # noqa: E402
from h2jax.runtime.signals import RunInterrupted  # noqa: E402
from h2jax.runtime.train import Trainer  # noqa: E402

dataset = TokenDataset(tokens, plan.seq_len)
try:
    with ranks.abort_on_failure(label=role.label):
        trainer = Trainer(plan)
        guard = RunGuard(plan, trainer, label=role.label)
        try:
            for n in range(50):
                batch = dataset.batch(n, plan.global_batch) if trainer.needs_tokens else None
                if n == 2 and role.rank == target:
                    if mode == "sigstop":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    elif mode == "sigkill":  # dies without a word; the launcher must name it
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif mode == "sigterm":
                        os.kill(os.getpid(), signal.SIGTERM)
                    elif mode == "nan" and batch is not None:
                        batch = batch.copy()
                        batch[:, 0] = plan.model.vocab_size + 7  # an input id past the embedding
                m = trainer.step(batch)
                guard.after_step(n + 1, m)
        finally:
            guard.close()
except RunInterrupted as e:  # every rank stops after the same step, each with one line
    print(f"{role.label}: {e}", flush=True)
    sys.exit(e.exit_code)
print(f"{role.label}: finished 50 steps", flush=True)
