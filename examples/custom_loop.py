"""Your own training loop around `h2jax.Trainer`: your data iterator, your learning-rate
schedule, your evaluation and logging. The same script runs in one process and under MPI:

    python examples/custom_loop.py --steps 20
    mpiexec -n 2 python examples/custom_loop.py --steps 20      # one process per stage

Under `mpiexec` every rank runs this file. The Trainer builds only its rank's stage; ranks of
middle stages need no tokens (`trainer.needs_tokens` is false: they pass None); every rank
calls step/evaluate together and gets the same loss; only rank 0 (`trainer.reports`) logs.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Iterator

import numpy as np

import h2jax
from h2jax.plan import plan_from_dict

# A two-stage pipeline of the `tiny` model on 4 CPU devices: stage 0 on data=2, stage 1 on
# tensor=2 (a real cluster would name other chip types here). Train settings come from this
# script, not from the plan's `train` section.
PLAN = {
    "format_version": 1, "model": "tiny", "seq_len": 32, "global_batch": 8, "micro_batch": 4,
    "schedule": "1f1b", "seed": 0,
    "optimizer": {"name": "adamw", "learning_rate": 3e-3, "weight_decay": 0.01, "clip_norm": 1.0},
    "stages": [
        {"chip": "cpu", "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
        {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4], "recompute": "full"},
    ],
}


def inverse_sqrt_schedule(peak: float, warmup: int):
    """Linear warm-up, then peak * sqrt(warmup / step): a schedule h2jax does not ship. It is
    traced inside each stage's jitted update, so it uses jax.numpy on the update count."""
    import jax.numpy as jnp

    def lr(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return peak * jnp.minimum(step / warmup, jnp.sqrt(warmup / jnp.maximum(step, warmup)))

    return lr


def batches(dataset, start: int, batch_size: int, wanted: bool) -> Iterator[np.ndarray | None]:
    """Your own data iterator: batch n of the dataset for n = start, start + 1, ... (a pure
    function of (seed, n), so a resumed run continues the same stream). A rank whose stage
    needs no tokens yields None and reads nothing."""
    n = start
    while True:
        yield dataset.batch(n, batch_size) if wanted else None
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--data", help="a dataset from `h2jax data prepare --tokenizer bytes` (default: stdlib source bytes)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--checkpoint", help="save here at the end (and resume from here if it holds one)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the losses (rank 0)")
    args = ap.parse_args()

    plan = plan_from_dict(PLAN)
    trainer = h2jax.Trainer(plan, lr_schedule=inverse_sqrt_schedule(plan.optimizer.learning_rate, args.warmup))
    from h2jax.data import open_dataset, stdlib_corpus

    dataset = open_dataset(args.data or stdlib_corpus(), plan.seq_len, seed=plan.seed)
    if args.checkpoint:
        try:
            trainer.restore(args.checkpoint, dataset=dataset)
        except h2jax.ConfigError as e:  # nothing to resume yet
            if trainer.reports:
                print(f"starting fresh ({e})")
    log = print if trainer.reports else (lambda *a, **k: None)
    # A fixed held-out batch: the validation split of a prepared dataset, else a far-away batch.
    held_out = None
    if trainer.needs_tokens:
        held_out = (dataset.val_batch(0, plan.global_batch) if getattr(dataset, "has_val", False)
                    else dataset.batch(10**9, plan.global_batch))

    losses, evals = [], []
    data = batches(dataset, trainer.step_count, plan.global_batch, trainer.needs_tokens)
    t_start = time.perf_counter()
    while trainer.step_count < args.steps:
        m = trainer.step(next(data))
        losses.append(m.loss)
        log(f"step {m.step:4d}  loss {m.loss:.4f}  grad norm {m.grad_norm:.3f}  "
            f"lr {m.learning_rate:.2e}  {m.step_time_s * 1e3:.0f} ms")
        if m.step % args.eval_every == 0 or m.step == args.steps:
            evals.append((m.step, trainer.evaluate(held_out)))
            log(f"          eval loss {evals[-1][1]:.4f}")
    log(f"{len(losses)} steps in {time.perf_counter() - t_start:.1f} s")
    if args.checkpoint:
        trainer.save(args.checkpoint, dataset=dataset)
    head = trainer.parameters("head", all_stages=True)  # gathered onto rank 0
    if trainer.reports:
        log("head parameters:", {k: v.shape for k, v in head.items()})
        if args.json:
            print(json.dumps({"losses": losses, "eval": evals, "last_step": trainer.step_count}))
    trainer.close()


if __name__ == "__main__":
    main()
