"""`h2jax demo`: the whole story in one command, on one machine. A shipped cluster of three
EMULATED chip types (fast with little memory, in between, slow with much memory; all on this
machine's CPU backend) is profiled, planned with HeteroAuto, trained with a progress bar, and
reported: predicted against measured step time, and the HeteroSpeedupRatio measured against
the same chips run homogeneously (each type alone, planned alone) at the same global batch.
It ends by resuming the mixed run's checkpoint on another plan (a chip type alone)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from rich.table import Table

from h2jax.runtime.jaxsetup import force_cpu_devices
from h2jax.cli.console import count, make_console
from h2jax.cli.options import positive_int
from h2jax.cli.progress import training_progress
from h2jax.cli.show import plan_table
from h2jax.cluster import REPO_ROOT, load_cluster

DEMO_CLUSTER = REPO_ROOT / "plans" / "cluster-emu-3type.toml"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "h2jax" / "jax"


MAX_REPLANS = 3
PROFILE_REPEATS, PROFILE_WARMUP = 21, 3  # timed runs per shape (the median is kept), untimed first
# Traced steps of each plan's calibration run (the first compiles; each is followed by an
# untraced one, whose median is the step the plan is calibrated to): per stage a median of
# four traced steps and a step time of five untraced, where three gave two and three. With
# `--baseline-steps` (5: a median of four measured steps, where 3 gave two) it is what a
# loaded 2-core host needs: three demo runs in a row measured the emu-slow baseline at 1.65,
# 1.42 and 1.36 s from two steps each, against predictions of 1.59-1.64 s.
CALIBRATE_STEPS = 5


def calibrated_step_time(plan, cluster, profile) -> float:
    """`plan`'s step time under the cost model on a profile calibrated from a short traced run
    of it (h2jax calibrate), a run separate from the one measured afterwards. The one-layer
    profile alone predicts low: it times a layer over and over in a hot loop, while inside the
    pipeline every stage's compute runs on caches the other stages (all on this host's cores)
    have just used -- about a fifth more CPU time per call, measured on a 2-core host."""
    from h2jax.calibrate import calibrate
    from h2jax.planner import iteration_time, stage_costs

    _, calibrated = calibrate(plan, CALIBRATE_STEPS, cluster=cluster, profile=profile)
    return iteration_time(stage_costs(plan, cluster, calibrated), plan.n_micro, plan.schedule, plan.virtual_stages)


def with_memory_scaled(cluster, chip_name: str, factor: float):
    """`cluster` with one chip type's usable memory (as the planner sees it) times `factor`."""
    import dataclasses

    from h2jax.cluster import ChipGroup, Cluster, Emulation

    groups = []
    for g in cluster.groups:
        chip = g.chip
        if chip.name == chip_name:
            if chip.emulate is not None:
                chip = dataclasses.replace(chip, emulate=Emulation(chip.emulate.slowdown, chip.emulate.memory_gib * factor))
            else:
                chip = dataclasses.replace(chip, memory_gib=chip.memory_gib * factor)
        groups.append(ChipGroup(chip, g.count))
    return Cluster(tuple(groups), cluster.name)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="profile, plan, train and report a heterogeneous (emulated) cluster",
                       description=__doc__)
    p.add_argument("--cluster", default=str(DEMO_CLUSTER), help="cluster file (default: the emulated 3-type one)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--seq-len", type=positive_int, default=32, help="sequence length (default %(default)s)")
    p.add_argument("--global-batch", type=positive_int, default=8, help="sequences per step (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=20,
                   help="training steps of the planned run (default %(default)s)")
    p.add_argument("--baseline-steps", type=positive_int, default=5,
                   help="steps of each homogeneous run; its step time is the median after the first "
                        "(default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with every figure on stdout (the narrative goes to stderr)")
    p.set_defaults(func=main)


def resume_elsewhere(console, plan, measured: dict, checkpoints, bars: bool, start: int) -> dict | None:
    """5. The mixed run's checkpoint resumed on another plan (a chip type alone): each stage
    reads its own layers from the checkpoint, re-sharded onto its mesh."""
    from h2jax.runtime.train import run

    other = next((b.plan for b in measured.values() if b.plan is not None and b.plan.stages != plan.stages), None)
    if other is None:
        return None
    t0 = time.perf_counter()
    console.print(f"5. Resuming the checkpoint on another plan: {other.stages[0].chip} alone, "
                  f"{count(other.n_stages, 'stage')} (h2jax run --checkpoint-dir ... --resume)...")
    with training_progress(2, other.tokens_per_step, other.n_devices, enabled=bars, label="resumed") as on_step:
        resumed = run(other, 2, on_step=on_step, checkpoint_dir=str(checkpoints), resume=True)
    console.print(f"   steps {start + 1}-{start + 2} after the mixed plan's step {start}: loss "
                  f"{resumed.losses[0]:.3f} -> {resumed.losses[-1]:.3f} ({time.perf_counter() - t0:.1f} s)")
    return {"plan": other.to_dict(), "losses": resumed.losses, "seconds": time.perf_counter() - t0}


def chips_used(plan) -> dict[str, int]:
    """Chip type -> chips the plan's stages run on."""
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.chip] = used.get(s.chip, 0) + s.mesh.size
    return used


def main(args: argparse.Namespace) -> int:
    console = make_console(stderr=args.json)
    bars = not args.json
    t_start = time.perf_counter()
    import tempfile

    checkpoints = Path(tempfile.mkdtemp(prefix="h2jax-demo-checkpoints-"))
    cluster = load_cluster(args.cluster)
    force_cpu_devices(cluster.n_chips)
    # XLA's CPU compile dominates a short run; compile fast and keep what was compiled.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    import jax

    jax.config.update("jax_compilation_cache_dir", str(CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    from h2jax.planner import Baseline, hetero_speedup_ratio, plan_cluster
    from h2jax.profiler import profile_chips
    from h2jax.runtime.memory import StageMemoryError
    from h2jax.runtime.train import run

    emulated = [c for c in cluster.chips.values() if c.is_emulated]
    console.print(f"[bold]h2jax demo[/]: model {args.model} on cluster {cluster.name} ({cluster.n_chips} chips)")
    if emulated:
        console.print("[yellow]EMULATED chips[/]: " + ", ".join(
            f"{c.name} x{count} ({c.emulate.slowdown:g}x slower than this CPU, {c.emulate.memory_gib * 1024:.0f} MiB)"
            for c, count in ((c, cluster.counts[c.name]) for c in emulated)
        ) + ". Every time below is host CPU compute (CPU seconds per device) stretched by waiting.")

    console.print("1. Profiling one layer per chip type on its backend (h2jax profile)...")
    # One sequence per micro-batch and per device: every stage is one chip, (data, tensor) =
    # (1, 1), the shape profiled (a data-parallel stage also all-reduces its gradients in each
    # backward, which a (1, 1) profile does not hold). Emulated chips are timed in CPU seconds
    # (h2jax.runtime.emulation), which another process's load barely moves; the median of
    # PROFILE_REPEATS runs after PROFILE_WARMUP is stable to a few percent and costs ~1 s.
    profile, raw = profile_chips(list(cluster.chips), args.model, args.seq_len, (1,), (1,),
                                 repeats=PROFILE_REPEATS, warmup=PROFILE_WARMUP)
    for name, ms in raw.items():
        m = ms[0]
        chip = cluster.chips[name]
        s = chip.emulate.slowdown if chip.is_emulated else 1.0
        console.print(f"   {name}: one layer, {m.tokens} tokens: forward {m.forward_s * s * 1e3:.1f} ms, "
                      f"backward {m.backward_s * s * 1e3:.1f} ms"
                      + (f" (host {m.forward_s * 1e3:.1f} + {m.backward_s * 1e3:.1f} ms x {s:g})" if s != 1 else ""))

    console.print(f"   ({time.perf_counter() - t_start:.0f} s)")
    console.print("2. Planning with HeteroAuto on the measured profile (h2jax plan)...")
    # The profile measured recompute "none" with one sequence per micro-batch: plan for
    # exactly that, so the plan's costs are the measured ones.
    planning = cluster
    for attempt in range(MAX_REPLANS + 1):
        result = plan_cluster(planning, args.model, args.seq_len, args.global_batch, profile=profile,
                              recompute=("none",), micro_batches=(1,))
        plan = result.plan
        console.print(plan_table(plan, title=f"HeteroAuto plan: {count(plan.n_stages, 'stage')}, "
                                 f"{count(plan.n_micro, 'micro-batch')} of {plan.micro_batch} x {plan.seq_len} tokens, {plan.schedule}, "
                                 f"bubble {plan.predicted['bubble_fraction']:.1%}"))
        try:
            console.print(f"   calibrating the cost model on a {2 * CALIBRATE_STEPS}-step run of the plan, every other step traced "
                          "(h2jax calibrate)...")
            predicted_s = calibrated_step_time(plan, planning, profile)
            if attempt == 0:
                console.print(f"3. Training {args.steps} steps on the Python standard library's source (byte tokens)...")
            with training_progress(args.steps, plan.tokens_per_step, plan.n_devices, enabled=bars,
                                   label="mixed") as on_step:
                mixed = run(plan, args.steps, on_step=on_step, checkpoint_dir=str(checkpoints))
            break
        except StageMemoryError as e:
            if attempt == MAX_REPLANS:
                raise
            # The compiled stage needs more than the planner's memory model said: re-plan with
            # that chip type's memory scaled down by the measured shortfall (the run is unchanged).
            planning = with_memory_scaled(planning, e.chip, e.capacity_bytes / e.needed_bytes)
            console.print(f"   [yellow]refused before running[/]: stages[{e.stage}] needs {e.needed_bytes:,} B on "
                          f"{e.chip} ({e.capacity_bytes:,} B); re-planning with {e.chip}'s memory x "
                          f"{e.capacity_bytes / e.needed_bytes:.3f}")
    console.print(f"   loss {mixed.losses[0]:.3f} -> {mixed.losses[-1]:.3f}; checkpoint of step {args.steps} in "
                  f"{mixed.checkpoint} ({time.perf_counter() - t_start:.0f} s)")
    used = chips_used(plan)
    idle = {c: n - used.get(c, 0) for c, n in cluster.counts.items() if n > used.get(c, 0)}
    if idle:
        console.print("   chips left idle by the plan (the step is faster without them): "
                      + ", ".join(f"{c} x{n}" for c, n in idle.items()))

    console.print("4. Each chip type alone, planned alone, at the same global batch "
                  f"({args.global_batch} x {args.seq_len} tokens)...")
    measured: dict[str, Baseline] = {}
    baseline_predicted: dict[str, float] = {}  # calibrated, as the mixed plan's
    for name, base in result.baselines.items():
        if base.plan is None:
            console.print(f"   {name}: cannot train the model alone ({base.reason})")
            measured[name] = base
            continue
        baseline_predicted[name] = calibrated_step_time(base.plan, cluster.only(name), profile)
        with training_progress(args.baseline_steps, base.plan.tokens_per_step, base.plan.n_devices,
                               enabled=bars, label=name) as on_step:
            alone = run(base.plan, args.baseline_steps, on_step=on_step)
        measured[name] = Baseline(name, base.chips, base.global_batch, alone.tokens_per_s,
                                  alone.step_time_s, base.plan)

    ratio = hetero_speedup_ratio(mixed.tokens_per_s, measured)
    table = Table(title="predicted (HeteroAuto, calibrated) vs measured" + (" — EMULATED chips" if emulated else ""))
    # tokens/chip/s counts every chip of the cluster (idle ones too: the honest TGS); tokens/used
    # chip/s only the chips the plan runs on. "pred. (profile)": the one-layer profile alone.
    for col in ("run", "chips", "used", "stages", "step s (pred.)", "step s (measured)", "pred. (profile)",
                "tokens/s", "tokens/chip/s", "tokens/used chip/s"):
        table.add_column(col)
    table.add_row("mixed", str(cluster.n_chips), str(plan.n_devices), str(plan.n_stages),
                  f"{predicted_s:.3f}", f"{mixed.step_time_s:.3f}", f"{plan.predicted['step_time_s']:.3f}",
                  f"{mixed.tokens_per_s:,.0f}",
                  f"{mixed.tokens_per_s / cluster.n_chips:,.1f}", f"{mixed.tokens_per_s / plan.n_devices:,.1f}")
    for name, b in measured.items():
        pred = baseline_predicted.get(name)
        profiled = result.baselines[name].iteration_time_s
        n_used = b.plan.n_devices if b.plan else 0
        table.add_row(f"{name} alone", str(b.chips), str(n_used), str(b.plan.n_stages) if b.plan else "-",
                      "-" if pred is None else f"{pred:.3f}",
                      "-" if b.iteration_time_s is None else f"{b.iteration_time_s:.3f}",
                      "-" if profiled is None else f"{profiled:.3f}",
                      f"{b.tokens_per_s:,.0f}", f"{b.tgs:,.1f}",
                      f"{b.tokens_per_s / n_used:,.1f}" if n_used else "-")
    console.print(table)
    load = os.getloadavg()[0]
    if emulated:
        # The emulated chips wait out their stretched compute; the host must still compute every
        # stage in turn. Loaded by other processes, it falls behind and measured times grow.
        console.print(f"host load average {load:.1f} on {os.cpu_count()} cores"
                      + (" [yellow](busy: the host may not keep up with the emulated chips; measured times "
                         "then run above predicted)[/]" if load > (os.cpu_count() or 1) else ""))
    predicted_ratio = plan.predicted.get("hetero_speedup_ratio")
    console.print(
        f"HeteroSpeedupRatio (measured, same global batch) = mixed tokens/s / sum of each type alone = "
        + ("n/a (no chip type trains the model alone)" if ratio is None else f"[bold]{ratio:.3f}[/]")
        + ("" if predicted_ratio is None else f"  (predicted {predicted_ratio:.3f})")
    )
    resumed = resume_elsewhere(console, plan, measured, checkpoints, bars, args.steps)
    import shutil

    shutil.rmtree(checkpoints, ignore_errors=True)  # a temporary directory: the demo leaves nothing behind
    if emulated:
        console.print("[yellow]All figures are from EMULATED chips on this machine's CPU.[/]")
    console.print(f"demo finished in {time.perf_counter() - t_start:.0f} s")
    if args.json:
        print(json.dumps({
            "cluster": cluster.name, "model": args.model, "chips": cluster.counts, "load_average": load,
            "chips_used": used, "chips_idle": idle, "emulated": bool(emulated),
            "plan": plan.to_dict(), "losses": mixed.losses,
            "predicted": {"step_time_s": predicted_s, "step_time_s_profile_only": plan.predicted["step_time_s"]},
            "measured": {"step_time_s": mixed.step_time_s},
            "bubble_fraction": plan.predicted["bubble_fraction"],
            "tokens_per_s": mixed.tokens_per_s, "tokens_per_chip_per_s": mixed.tokens_per_s / cluster.n_chips,
            "tokens_per_used_chip_per_s": mixed.tokens_per_s / plan.n_devices,
            "baselines": {n: {"chips": b.chips, "chips_used": b.plan.n_devices if b.plan else 0,
                              "predicted": {"step_time_s": baseline_predicted.get(n),
                                            "step_time_s_profile_only": result.baselines[n].iteration_time_s},
                              "measured": {"step_time_s": b.iteration_time_s}, "tokens_per_s": b.tokens_per_s,
                              "tokens_per_chip_per_s": b.tgs, "reason": b.reason}
                          for n, b in measured.items()},
            "hetero_speedup_ratio": ratio, "hetero_speedup_ratio_predicted": predicted_ratio,
            "resumed_on_another_plan": resumed,
        }))
    if not mixed.losses[-1] < mixed.losses[0]:
        console.print("[red]the loss did not fall[/]")
        return 1
    return 0
