"""Checkpoint speed: save and restore throughput against plain numpy writing and reading the
same arrays to and from the same disk, and the step-time overhead of saving asynchronously
after every step against not saving, measured side by side in one run.

Prints one JSON object. Goals: save and restore >= 0.7 of plain numpy; overhead <= 5% for the
`small` model (the demo plan's three stages and meshes).
    python benchmarks/checkpoint.py [--dir /tmp/h2jax-ckpt-bench] [--rounds 7] [--blocks 8] [--steps 6]

The overhead is measured in `--blocks` alternating blocks of `--steps` steps without and with
saving after every step, so a change of the machine's load falls on both sides alike; the
first step of each saving block is not counted (no earlier write is in flight during it,
which would flatter saving), and each side's figure is the median step; the overhead of
each pair of blocks alone is reported too (median, min, max), to show how much the load
moved it. Save and restore
throughput are medians of `--rounds` rounds, each side by side with plain numpy.

Where a saving step's extra time goes is reported too: the training thread's own part of a
save (handing the state to the writer, starting it) and its wait for the previous checkpoint's
write (one checkpoint in flight at a time), the background write's own time, and the CPU
time the write takes from the cores training runs on (the writer thread's), with the
process's CPU per step with and without saving. /proc/loadavg before and after is recorded,
and the share of the CPU time the virtual machine's host took for others during the run
(/proc/stat's steal): on a shared machine the figures move with both.

Both sides pay the same costs: the arrays start on the stages' devices and end there, every
file is fsynced, the disk is the same directory, and the plain numpy save runs in a thread at
the checkpoint writer's priority (checkpoint.lower_thread_priority, as the writer of a
one-process run). The checkpoint's figures include what numpy's do not: the metadata, the
CRC-32C of every file (computed as it is written, checked before the read) and the atomic
commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _plain_save(arrays: dict, directory: Path) -> None:
    directory.mkdir(parents=True)
    for name, array in arrays.items():
        with open(directory / f"{name}.npy", "wb") as f:
            np.save(f, np.asarray(array))  # device -> host
            f.flush()
            os.fsync(f.fileno())


def _plain_save_background(arrays: dict, directory: Path) -> None:
    """_plain_save in a thread at the checkpoint writer's priority (one process: idle class),
    waited for."""
    import threading

    from h2jax.runtime import checkpoint as ckpt

    def run():
        ckpt.lower_thread_priority(threading.get_native_id(), idle_class=True)
        _plain_save(arrays, directory)

    t = threading.Thread(target=run)
    t.start()
    t.join()


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _cpu_ticks() -> tuple[int, int] | None:
    """(all, stolen) CPU ticks of the machine so far (/proc/stat, Linux): on a virtual machine,
    "steal" is the time the host gave this machine's CPUs to others."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def _stolen(before, after) -> float | None:
    """The fraction of the machine's CPU time the host took for others between two readings."""
    if before is None or after is None or after[0] == before[0]:
        return None
    return round((after[1] - before[1]) / (after[0] - before[0]), 4)


def _plain_load(arrays: dict, directory: Path) -> dict:
    import jax

    return {name: jax.device_put(np.load(directory / f"{name}.npy"), a.sharding) for name, a in arrays.items()}


def _state_arrays(trainer) -> dict:
    import jax

    out = {}
    for i, ex in trainer.executors.items():
        for k, leaf in enumerate(jax.tree.leaves((ex.params, ex.opt_state))):
            out[f"s{i}_{k}"] = leaf
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default=str(ROOT / "plans" / "demo.json"), help="default: the small model, 3 stages")
    ap.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    ap.add_argument("--rounds", type=int, default=7, help="save and restore rounds (medians reported)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks of steps with and without saving, alternating")
    ap.add_argument("--steps", type=int, default=6, help="steps per block")
    args = ap.parse_args()
    load_before, ticks_before = _loadavg(), _cpu_ticks()

    import jax

    from h2jax.data import TokenDataset, stdlib_corpus
    from h2jax.plan import load_plan
    from h2jax.runtime import checkpoint as ckpt
    from h2jax.runtime.train import Trainer

    plan = load_plan(args.plan)
    base = Path(args.dir or tempfile.mkdtemp(prefix="h2jax-ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    data = TokenDataset(stdlib_corpus(), plan.seq_len, seed=plan.seed)
    trainer = Trainer(plan, emulate_time=False)
    batch = lambda n: data.batch(n, plan.global_batch)  # noqa: E731
    trainer.step(batch(0))  # compile
    arrays = _state_arrays(trainer)
    nbytes = sum(a.nbytes for a in arrays.values())

    # --- save / restore throughput (after one warm-up save and restore)
    warm = ckpt.CheckpointWriter(base / "warm-up")
    warm.save(1, trainer.executors, ckpt.checkpoint_meta(plan, 1))
    warm.wait()
    ckpt.open_checkpoint(base / "warm-up", plan).restore_all(trainer.executors.values())
    shutil.rmtree(base / "warm-up")
    save_s, plain_save_s, restore_s, plain_load_s = [], [], [], []
    for r in range(args.rounds):
        d = base / f"ckpt-{r}"
        t0 = time.perf_counter()
        writer = ckpt.CheckpointWriter(d)
        writer.save(1, trainer.executors, ckpt.checkpoint_meta(plan, 1))
        writer.wait()
        save_s.append(time.perf_counter() - t0)

        p = base / f"plain-{r}"
        t0 = time.perf_counter()
        _plain_save_background(arrays, p)
        plain_save_s.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        checkpoint = ckpt.open_checkpoint(d, plan)  # checks every file's size and CRC-32C
        checkpoint.restore_all(trainer.executors.values())  # as h2jax run --resume does
        jax.block_until_ready([(ex.params, ex.opt_state) for ex in trainer.executors.values()])
        restore_s.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        jax.block_until_ready(_plain_load(arrays, p))
        plain_load_s.append(time.perf_counter() - t0)
        shutil.rmtree(d)
        shutil.rmtree(p)

    # --- step-time overhead: blocks alternate no saving and saving after every step
    plain_steps, saving_steps, waits, starts, writes = [], [], [], [], []
    by_block = []  # each block pair's median saving step over its median plain step, minus 1
    cpu_plain, cpu_saving = [], []
    writer = ckpt.CheckpointWriter(base / "every-step", keep=2)
    n = 1
    for _ in range(args.blocks):
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.step(batch(n))
            plain_steps.append(time.perf_counter() - t0)
            cpu_plain.append(time.process_time() - c0)
            n += 1
        for k in range(args.steps + 1):  # step 0 of a block: no write in flight, not counted
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.step(batch(n))
            t1 = time.perf_counter()
            writer.settle()  # what save() waits for: the previous checkpoint's write (commit in background)
            t2 = time.perf_counter()
            writer.save(n, trainer.executors, ckpt.checkpoint_meta(plan, n))
            t3 = time.perf_counter()
            if k > 0:
                saving_steps.append(t3 - t0)
                cpu_saving.append(time.process_time() - c0)
                waits.append(t2 - t1)
                starts.append(t3 - t2)
            writes.append(writer._pending[2][0])
            n += 1
        by_block.append(float(np.median(saving_steps[-args.steps:]) / np.median(plain_steps[-args.steps:]) - 1))
        writer.wait()  # the next block's plain steps do not pay for this block's last write
    saved = ckpt.complete_steps(base / "every-step")
    shutil.rmtree(base / "every-step")
    if args.dir is None:
        shutil.rmtree(base)

    write_s = [w.seconds for w in writes]
    mb = nbytes / 2**20
    med = lambda xs: float(np.median(xs))  # noqa: E731
    step_plain, step_saving = med(plain_steps), med(saving_steps)
    out = {
        "model": plan.model_name, "stages": plan.n_stages, "checkpoint_mib": round(mb, 2),
        "arrays": len(arrays), "disk": str(base),
        "save_mib_per_s": mb / med(save_s), "plain_numpy_save_mib_per_s": mb / med(plain_save_s),
        "save_vs_plain": med(plain_save_s) / med(save_s),
        "restore_mib_per_s": mb / med(restore_s), "plain_numpy_load_mib_per_s": mb / med(plain_load_s),
        "restore_vs_plain": med(plain_load_s) / med(restore_s),
        "step_s_no_saving": step_plain, "step_s_async_save_every_step": step_saving,
        "save_every_step_overhead": step_saving / step_plain - 1.0,
        # The same, block pair by block pair: how much the figure above moves with the load.
        "save_every_step_overhead_by_block": {"median": med(by_block), "min": min(by_block), "max": max(by_block)},
        "saving_step_training_thread_s": med(starts), "saving_step_wait_for_previous_write_s": med(waits),
        "background_write_s": med(write_s),
        "background_write_cpu_s": med([w.cpu_seconds for w in writes]),
        "process_cpu_s_per_step": {"no_saving": med(cpu_plain), "saving": med(cpu_saving)},
        # Saving every step can hide only if a checkpoint is written within a step: the plain
        # numpy write of the same bytes, over the step time, is the floor of what any writer needs.
        "plain_numpy_save_s_per_step_s": med(plain_save_s) / step_plain,
        "checkpoints_committed_in_overhead_run": len(saved) and saved[-1],
        "rounds": args.rounds, "blocks": args.blocks, "steps_per_block": args.steps,
        "steps_timed": {"no_saving": len(plain_steps), "saving": len(saving_steps)},
        "loadavg_before_after": [load_before, _loadavg()],
        "cpu_stolen_by_the_host": _stolen(ticks_before, _cpu_ticks()),
        "cpu_cores": os.cpu_count(),
        "goals": {"save_vs_plain": ">= 0.7", "restore_vs_plain": ">= 0.7", "save_every_step_overhead": "<= 0.05"},
    }
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
