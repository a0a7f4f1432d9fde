"""`h2jax simulate --plan PLAN`: replay a plan's schedule event by event and compare the
simulated step with the planner's closed form; optionally write a Perfetto trace and a PNG."""

from __future__ import annotations

import argparse
import json

from h2jax import schedules as sched
from h2jax.cli.options import nonnegative_float, output_path, positive_int
from h2jax.cluster import load_cluster
from h2jax.names import format_layers, format_mesh
from h2jax.plan import check_schedule_size, load_plan
from h2jax.sim_plans import chips_for, plan_report, simulate_plan, under_schedule


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a plan's pipeline schedule", description=__doc__)
    p.add_argument("--plan", required=True, help="plan file (JSON)")
    p.add_argument("--cluster", help="cluster file whose per-group overrides (e.g. a slower NIC) "
                   "apply; default: the chip files in backends/")
    p.add_argument("--profile", help="measured profile (from `h2jax profile`) instead of the model")
    p.add_argument("--schedule", choices=sched.NAMES,
                   help="simulate the plan's stages under this schedule instead of the plan's")
    p.add_argument("--virtual-stages", type=positive_int, default=None, metavar="V",
                   help="chunks per stage with --schedule interleaved-1f1b (default 2)")
    p.add_argument("--all-schedules", action="store_true",
                   help="also simulate every schedule (interleaved with v = 2 and 4) and show the bubble each leaves")
    p.add_argument("--micro-batches", type=positive_int,
                   help="override the plan's micro-batch count (global batch = count x micro_batch)")
    p.add_argument("--jitter", type=nonnegative_float, default=0.0,
                   help="lognormal log-sd of per-operation noise (default 0: deterministic)")
    p.add_argument("--seed", type=int, default=0, help="jitter seed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    p.add_argument("--plot", help="write a PNG timeline")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from h2jax.planner import cost_model

    plan = load_plan(args.plan)
    if args.micro_batches is not None:
        if args.micro_batches < 1:
            raise SystemExit("h2jax simulate: error: --micro-batches must be >= 1")
        plan = dataclasses.replace(plan, global_batch=args.micro_batches * plan.micro_batch)
    check_schedule_size(plan, "--micro-batches" if args.micro_batches else str(args.plan))
    chips = chips_for(plan, load_cluster(args.cluster) if args.cluster else None)
    profile = None
    if args.profile:
        from h2jax.planner.profile import load_profile

        profile = load_profile(args.profile)
    name = args.schedule or plan.schedule
    if name != plan.schedule or args.virtual_stages:
        v = args.virtual_stages or (2 if sched.get_schedule(name).virtual else 1)
        plan = under_schedule(plan, name, v)
    costs = cost_model.stage_costs(plan, chips, profile)
    record = bool(args.trace or args.plot)
    result = simulate_plan(plan, costs, jitter=args.jitter, seed=args.seed, record=record)
    report = plan_report(plan, costs, result)
    if args.all_schedules:
        report["schedules"] = {}
        for s, v in sched.variants():
            if sched.get_schedule(s).unsupported(plan.n_stages, plan.n_micro, v):
                continue
            other = under_schedule(plan, s, v)
            c = cost_model.stage_costs(other, chips, profile)
            r = plan_report(other, c, simulate_plan(other, c, jitter=args.jitter, seed=args.seed))
            label = s if v == 1 else f"{s} v={v}"
            report["schedules"][label] = {k: x for k, x in r.items() if k != "stages"}
    labels = [f"stage {i} ({s.chip}, {s.mesh.data}x{s.mesh.tensor})" for i, s in enumerate(plan.stages)]
    if args.trace:
        from h2jax.trace import write_trace

        write_trace(result.events, output_path(args.trace), stage_names=labels,
                    metadata={"source": "h2jax simulate", "plan": str(args.plan), "schedule": name})
        report["trace"] = args.trace
    if args.plot:
        from h2jax.trace import plot_timeline

        plot_timeline(result.events, output_path(args.plot), labels,
                      title=f"{args.plan}: {name}, {plan.n_micro} micro-batches, "
                      f"{result.iteration_s:.3f} s/step (simulated)")
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report, str(args.plan))
    return 0


def _print_report(r: dict, plan_path: str) -> None:
    from rich.table import Table

    from h2jax.cli.console import count, make_console

    table = Table(title=f"{plan_path}: {r['schedule']}, {count(r['n_stages'], 'stage')}, "
                  f"{r['n_micro']} micro-batches, {r['n_chips']} chips (simulated)")
    for col in ("stage", "chip", "DxT", "layers", "F ms", "B ms", "send ms", "busy %", "in flight",
                "peak GiB"):
        table.add_column(col, justify="right")
    pipe = r["pipeline_s"]
    for i, s in enumerate(r["stages"]):
        table.add_row(
            str(i), s["chip"], format_mesh(s["data"], s["tensor"]),
            format_layers(s["layers"] if isinstance(s["layers"][0], list) else [s["layers"]]),
            f"{s['forward_s'] * 1e3:.2f}", f"{s['backward_s'] * 1e3:.2f}", f"{s['send_s'] * 1e3:.2f}",
            f"{100 * s['busy_s'] / pipe:.1f}", str(s["peak_in_flight"]), f"{s['peak_memory_gib']:.1f}",
        )
    console = make_console()
    console.print(table)
    line = (f"step {r['step_time_s']:.4f} s simulated, bubble {100 * r['bubble_fraction']:.1f}% "
            f"(simulated timeline: {100 * r['simulated_bubble_fraction']:.1f}%), "
            f"{r['tokens_per_s']:,.0f} tokens/s, {r['tokens_per_chip_per_s']:,.1f} tokens/chip/s")
    if r["predicted"]["step_time_s"] is not None:
        line += (f"; cost model {r['predicted']['step_time_s']:.4f} s "
                 f"(sim - model = {r['sim_minus_closed_s'] * 1e3:+.2f} ms, "
                 f"{100 * r['relative_difference']:+.2f}%)")
    console.print(line)
    for name, s in r.get("schedules", {}).items():
        console.print(f"  {name:22s} {s['step_time_s']:.4f} s/step simulated, bubble {100 * s['bubble_fraction']:.1f}% "
                      f"(simulated timeline: {100 * s['simulated_bubble_fraction']:.1f}%)")
    for key in ("trace", "plot"):
        if key in r:
            console.print(f"wrote {r[key]}")
