"""Does the cost model predict what runs? Predicted against measured step time of a set of plans
on this machine: real `cpu` chips and EMULATED chips (backends/emu-*.toml), 1 to 4 stages,
data- and tensor-parallel stages, 1 to 16 micro-batches.

1. Profile: `h2jax profile` (h2jax.profiler.profile_chips) measures one layer of the model
   on every (chip, tensor size, sequences per device) the plans use (stable medians) and fits
   each chip type's dispatch, efficiency and memory-bound terms. Emulated chip types share
   one measurement (the host's CPU seconds per device, h2jax.runtime.emulation), stretched
   by each one's slowdown. `predicted_profiled_s`: the cost model on this profile alone.
2. Calibrate: `h2jax calibrate` (h2jax.calibrate.calibrate) runs the plan `--calibrate-steps`
   steps with a trace and writes a profile under which the model reproduces each stage's
   measured forward, backward, optimizer and sends. `predicted_s`: the cost model
   (h2jax.planner.predict) on that calibrated profile -- the headline ratio.
3. Measure: train the plan again, a separate run of `--steps` steps in this process
   (h2jax.runtime.train.Trainer, what h2jax.run drives); its step time is the median after
   the first (compile) step: `measured_s`. So the calibration and the measurement are two
   runs of the plan; `calibration_step_s` (the calibration run's own step time) shows how
   much two runs of one plan differ on this machine. `--rounds R` (default 1) repeats steps 2
   and 3 R times per plan, each calibration followed by its measurement: `ratio` is then the
   median of the R rounds' predicted / measured (`round_ratios`), so one slow stretch of a
   shared host moves one round, not the row. For
   emulated chips each stage's busy seconds per step and its host lag (seconds its chip sat
   ready until the host dispatched: where the host, not the emulated chip, set the pace) are
   reported too, so an emulated row that the host could not keep up with is told apart.

The plans are fixed here (not searched) so that the set spans the space above on every run.
The load average is recorded before and after each measurement: this machine's 2 cores are
shared, and a real `cpu` chip's wall time grows with the load (an emulated chip's does not,
as long as the host keeps up with the emulated pipeline).

Prints one JSON object: per plan predicted, measured, ratio predicted/measured, load.
    python benchmarks/cost_model.py [--steps 8] [--calibrate-steps 6] [--repeats 9] [--rounds 1] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HOST_DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={HOST_DEVICES}"
    # XLA's CPU compile dominates runs this short; profile and runs compile alike (as the demo).
    + " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODEL, SEQ_LEN = "small", 32
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "h2jax" / "jax"


def stage(chip: str, layers: tuple[int, int], data: int = 1, tensor: int = 1) -> dict:
    return {"chip": chip, "mesh": {"data": data, "tensor": tensor}, "layers": list(layers)}


# name (chips, shape, mN: N micro-batches) -> (global batch, micro-batch, stages). `small` has 8 layers; emu-fast holds 24 MiB,
# emu-mid 64 MiB, emu-slow 1 GiB (their memory caps are checked before anything runs).
PLANS: dict[str, tuple[int, int, list[dict]]] = {
    "cpu-1stage-m1": (4, 4, [stage("cpu", (0, 8))]),
    "cpu-2stage-m4": (8, 2, [stage("cpu", (0, 4)), stage("cpu", (4, 8))]),
    "cpu-tensor2-m2": (8, 4, [stage("cpu", (0, 8), tensor=2)]),
    "cpu-data2-m2": (8, 4, [stage("cpu", (0, 8), data=2)]),
    "cpu-4stage-m8": (8, 1, [stage("cpu", (2 * i, 2 * i + 2)) for i in range(4)]),
    "emu-mid-2stage-m8": (8, 1, [stage("emu-mid", (0, 4)), stage("emu-mid", (4, 8))]),
    "emu-slow-data2+emu-mid-tensor2-m4": (
        8, 2, [stage("emu-slow", (0, 3), data=2), stage("emu-mid", (3, 8), tensor=2)]),
    "emu-slow-data2xtensor2-m2": (8, 4, [stage("emu-slow", (0, 8), data=2, tensor=2)]),
    "emu-slow/mid/fast/fast-4stage-m16": (16, 1, [
        stage("emu-slow", (0, 1)), stage("emu-mid", (1, 3)), stage("emu-fast", (3, 6)), stage("emu-fast", (6, 8))]),
    "cpu+emu-mid-data2+emu-slow-3stage-m4": (8, 2, [
        stage("cpu", (0, 3)), stage("emu-mid", (3, 6), data=2), stage("emu-slow", (6, 8))]),
}


def make_plan(name: str):
    from h2jax.plan import plan_from_dict

    global_batch, micro_batch, stages = PLANS[name]
    return plan_from_dict({
        "format_version": 1, "model": MODEL, "seq_len": SEQ_LEN, "global_batch": global_batch,
        "micro_batch": micro_batch, "schedule": "1f1b", "stages": stages,
    })


def plan_cluster_of(plan):
    """The cluster a plan runs on: exactly the chips its stages use."""
    from h2jax.cluster import cluster_from_dict

    counts: dict[str, int] = {}
    for s in plan.stages:
        counts[s.chip] = counts.get(s.chip, 0) + s.mesh.size
    return cluster_from_dict({"name": "bench", "group": [{"chip": c, "count": n} for c, n in counts.items()]}, "bench")


def profile_all(plans, repeats: int, warmup: int):
    """`h2jax profile` of every chip type the plans use, on every (tensor size, sequences per
    device) they run: one-layer medians and each chip type's fits (h2jax.profiler)."""
    from h2jax.profiler import profile_chips

    chips, tensors, per_device = set(), set(), set()
    for plan in plans:
        for s in plan.stages:
            chips.add(s.chip)
            tensors.add(s.mesh.tensor)
            per_device.add(plan.micro_batch // s.mesh.data)
    t0 = time.perf_counter()
    profile, _ = profile_chips(sorted(chips), MODEL, SEQ_LEN, sorted(tensors), sorted(per_device),
                               repeats=repeats, warmup=warmup)
    return profile, time.perf_counter() - t0


def measure(plan, steps: int) -> tuple[float, dict]:
    """(median step time after the first, details) of `steps` steps of `plan`."""
    from h2jax.runtime.train import Trainer, default_dataset

    trainer = Trainer(plan, steps=steps)
    dataset = default_dataset(plan)
    times, busy, lag = [], [], []
    for n in range(steps):
        for clock in trainer.clocks.values():
            clock.busy_s = clock.host_lag_s = 0.0
        times.append(trainer.step(dataset.batch(n, plan.global_batch)).step_time_s)
        busy.append([c.busy_s for _, c in sorted(trainer.clocks.items())])
        lag.append([c.host_lag_s for _, c in sorted(trainer.clocks.items())])
    after_first = slice(1, None) if steps > 1 else slice(None)

    def per_stage(values):
        return [round(statistics.median(v), 4) for v in zip(*values[after_first])] if trainer.clocks else None

    return statistics.median(times[after_first]), {
        "step_times_s": [round(t, 4) for t in times],
        "emulated": trainer.emulated or None,
        "stage_busy_s": per_stage(busy), "stage_host_lag_s": per_stage(lag),
    }


def load() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8, help="steps per plan; the median after the first is measured")
    ap.add_argument("--calibrate-steps", type=int, default=6, help="steps of each plan's calibration run")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs per profiled shape (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="calibrations, each followed by a measurement, per plan; the ratio is the rounds' median")
    ap.add_argument("--only", default="", help="comma-separated plan names (default: all)")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_compilation_cache_dir", str(CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    from h2jax.calibrate import calibrate
    from h2jax.planner import iteration_time, predict, stage_costs

    if args.rounds < 1:
        sys.exit(f"--rounds must be at least 1 (a calibration and its measurement), got {args.rounds}")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(PLANS)
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        sys.exit(f"--only: unknown plan(s) {unknown}; known: {list(PLANS)}")
    plans = {n: make_plan(n) for n in names}
    t_start = time.perf_counter()
    load_before = load()
    profile, profile_s = profile_all(plans.values(), args.repeats, args.warmup)
    rows = []
    for name, plan in plans.items():
        cluster = plan_cluster_of(plan)
        profiled = predict(plan, cluster, profile)["step_time_s"]
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            calibration, calibrated = calibrate(plan, args.calibrate_steps, cluster=cluster, profile=profile)
            calibrate_s = time.perf_counter() - t0
            # the cost model's closed form on the calibrated stage costs (what predict's step time
            # is; predict would also re-check memory, which the plan passed above)
            predicted = iteration_time(stage_costs(plan, cluster, calibrated), plan.n_micro, plan.schedule,
                                       plan.virtual_stages)
            before = load()
            measured, row = measure(plan, args.steps)
            rounds.append((predicted / measured, predicted, measured, calibration, calibrated, calibrate_s, before, row))
        # the round of the median ratio (an odd count: that round; even: the upper middle one)
        _, predicted, measured, calibration, calibrated, calibrate_s, before, row = sorted(rounds, key=lambda r: r[0])[
            len(rounds) // 2]
        # what the cost model says each stage's chip is busy for in one step (compare stage_busy_s)
        predicted_busy = [round(plan.n_micro * (c.forward_s + c.backward_s) + c.optimizer_s + c.dp_reduce_s, 4)
                          for c in stage_costs(plan, cluster, calibrated)]
        rows.append({
            "plan": name,
            "stages": [f"{s.chip} {s.mesh.data}x{s.mesh.tensor} layers {list(s.layers)}" for s in plan.stages],
            "micro_batches": plan.n_micro, "micro_batch": plan.micro_batch,
            "predicted_s": round(predicted, 5), "measured_s": round(measured, 5),
            "ratio": round(predicted / measured, 3), "round_ratios": [round(r[0], 3) for r in rounds],
            "predicted_profiled_s": round(profiled, 5), "ratio_profiled": round(profiled / measured, 3),
            "calibration_step_s": round(next(r.measured_s for r in calibration if r.term == "step"), 5),
            "calibrate_seconds": round(calibrate_s, 1),
            "stage_busy_s_predicted": predicted_busy, **row,
            "load_before": before, "load_after": load(),
        })
        print(f"{name}: predicted {predicted:.4f} s (profile only {profiled:.4f}), measured {measured:.4f} s, "
              f"ratio {predicted / measured:.3f} (profile only {profiled / measured:.3f}) "
              f"(load {before} -> {rows[-1]['load_after']})", file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in rows]
    profiled_ratios = [r["ratio_profiled"] for r in rows]
    print(json.dumps({
        "model": MODEL, "seq_len": SEQ_LEN, "host_cores": os.cpu_count(), "steps": args.steps,
        "profile": {"repeats": args.repeats, "warmup": args.warmup, "seconds": round(profile_s, 1),
                    "source": profile.source, "entries": profile.to_dict()["chips"]},
        "plans": rows,
        "ratio_min": min(ratios), "ratio_max": max(ratios), "ratio_median": statistics.median(ratios),
        "within_10_percent": sum(0.9 <= r <= 1.1 for r in ratios), "n_plans": len(rows),
        "profile_only": {"ratio_min": min(profiled_ratios), "ratio_max": max(profiled_ratios),
                         "within_10_percent": sum(0.9 <= r <= 1.1 for r in profiled_ratios)},
        "load_before": load_before, "load_after": load(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
