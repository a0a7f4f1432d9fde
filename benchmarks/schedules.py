"""Every registered schedule on one emulated 4-stage plan: measured and simulated step time and
bubble per schedule, measured side by side in one run.

The plan: four stages of one emulated chip type (default emu-mid: host CPU compute stretched
8x by waiting, see backends/), the model's layers split evenly, 8 micro-batches. GPipe, 1F1B,
ZB-H1 and interleaved 1F1B (v = 2: each stage holds two chunks of the same number of layers)
are trained for real (the runtime executes the registry's action lists); each runs
its warm-up step, then the schedules take turns step by step (so machine noise hits them
alike) and the median step is reported. One traced step per schedule gives the measured
bubble (the one definition, h2jax.schedules.bubble_fraction, on the measured timeline: the
stages' compute seconds against four times the span from the first compute to the last) and
the per-action times the simulator replays: forward and whole backward per stage from GPipe's
step, ZB-H1's own B and W (its W re-runs each block's backward, so B + W exceeds the whole
backward: the cost model's `split_backward_as_run`), the optimizer from each (interleaved
1F1B is simulated on the whole-stage costs, each chunk costing half). `zb_h1_over_1f1b`:
ZB-H1's step time over 1F1B's, measured, simulated and `predicted` (the cost model's, from
the chip file alone: a ratio, whose absolute times need a calibrated profile, as in
benchmarks/cost_model.py).

Prints one JSON object; every figure is from EMULATED chips.
    python benchmarks/schedules.py [--steps 6] [--chip emu-mid]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

RUN = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
V = 2  # interleaved 1F1B's chunks per stage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chip", default="emu-mid")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per schedule (after one warm-up)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    args = ap.parse_args()

    from h2jax import schedules
    from h2jax.data import TokenDataset, stdlib_corpus
    from h2jax.plan import plan_from_dict
    from h2jax.planner import cost_model
    from h2jax.planner.stage_cost import StageCost
    from h2jax.runtime.tracing import StepTracer
    from h2jax.runtime.train import Trainer
    from h2jax.sim import simulate

    model = {"vocab_size": 256, "d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
             "n_kv_heads": 2, "d_ff": 4 * args.d_model}
    p, L = 4, args.layers
    bounds = [round(i * L / p) for i in range(p + 1)]

    chunk_bounds = [round(j * L / (p * V)) for j in range(p * V + 1)]  # virtual stage j = c * p + i

    def plan(schedule: str):
        v = V if schedules.get_schedule(schedule).virtual else 1
        layers = ([chunk_bounds[c * p + i:c * p + i + 2] for c in range(v)] if v > 1 else bounds[i:i + 2]
                  for i in range(p))
        return plan_from_dict({
            "format_version": 1, "model": model, "seq_len": args.seq_len, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch, "schedule": schedule, "virtual_stages": v,
            "stages": [{"chip": args.chip, "mesh": {"data": 1, "tensor": 1}, "layers": ranges} for ranges in layers],
        })

    data = TokenDataset(stdlib_corpus(), args.seq_len, seed=0)
    tracers = {s: StepTracer() for s in RUN}
    trainers = {s: Trainer(plan(s), tracer=tracers[s], steps=args.steps + 2) for s in RUN}
    m = trainers["1f1b"].plan.n_micro
    for s, t in trainers.items():  # warm-up: compile
        t.step(data.batch(0, args.global_batch))
    times: dict[str, list[float]] = {s: [] for s in RUN}
    for k in range(args.steps):
        for s, t in trainers.items():
            times[s].append(t.step(data.batch(1 + k, args.global_batch)).step_time_s)
    traced = {}
    for s, t in trainers.items():  # one more step each, its actions kept
        start = time.time()
        t.step(data.batch(1 + args.steps, args.global_batch))
        traced[s] = [e for e in tracers[s].relative_events(start) if e.start_s >= 0]
        t.close()

    def per_stage(events, name):
        return [statistics.median([e.duration_s for e in events if e.stage == i and e.name[:1] == name
                                   and "+" not in e.name and e.lane == "compute"] or [0.0]) for i in range(p)]

    def optimizer(events):
        return [statistics.median([e.duration_s for e in events if e.stage == i and e.name == "optimizer"] or [0.0])
                for i in range(p)]

    def measured_bubble(events):
        comp = [e for e in events if e.lane == "compute" and e.name != "optimizer"]
        span = max(e.start_s + e.duration_s for e in comp) - min(e.start_s for e in comp)
        busy = [sum(e.duration_s for e in comp if e.stage == i) for i in range(p)]
        return schedules.bubble_fraction(busy, span)

    f, b = per_stage(traced["gpipe"], "F"), per_stage(traced["gpipe"], "B")
    b_in, w = per_stage(traced["zb-h1"], "B"), per_stage(traced["zb-h1"], "W")
    opt = optimizer(traced["1f1b"])
    def stage_costs(backward, weight):
        return [StageCost(forward_s=f[i], backward_s=backward[i], backward_weight_s=weight[i], send_s=0.0,
                          send_bytes=0, dp_reduce_s=0.0, optimizer_s=opt[i], activation_bytes=0, static_bytes=0)
                for i in range(p)]

    # ZB-H1 replays its own B and W (W re-runs each block's backward: B + W > the whole
    # backward, as the cost model prices it); the others GPipe's whole backward
    costs = stage_costs(b, [0.0] * p)
    split_costs = stage_costs([x + y for x, y in zip(b_in, w)], w)

    out: dict = {
        "emulated": True, "chip": args.chip, "stages": p, "micro_batches": m, "layers": L,
        "d_model": args.d_model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "timed_steps": args.steps,
        "stage_costs_s": {"forward": f, "backward": b, "backward_input_zb": b_in, "weight_zb": w, "optimizer": opt},
        "schedules": {},
    }
    for name, v in schedules.variants():
        if v not in (1, 2):
            continue
        run = split_costs if schedules.get_schedule(name).splits_backward else costs
        sim = simulate(run, m, name, virtual_stages=v)
        row = {
            "virtual_stages": v,
            "simulated": {"step_time_s": sim.iteration_s, "bubble_fraction": sim.bubble_fraction},
            "closed_form": {"step_time_s": cost_model.iteration_time(run, m, name, v),
                            "bubble_fraction": cost_model.bubble_fraction(run, m, name, v)},
        }
        if name in trainers and trainers[name].plan.virtual_stages == v:
            row["measured"] = {"step_time_s": statistics.median(times[name]), "step_times_s": times[name],
                               "bubble_fraction": measured_bubble(traced[name])}
        else:
            row["measured"] = None
            row["not_measured_because"] = f"this benchmark trains interleaved 1F1B with v = {V} only"
        out["schedules"][name] = row
    rows = out["schedules"]

    def predicted(name: str) -> float:  # the cost model's step time of a trained plan, from the chip file
        planned = trainers[name].plan
        return cost_model.iteration_time(cost_model.stage_costs(planned, None), planned.n_micro, name,
                                         planned.virtual_stages)

    out["zb_h1_over_1f1b"] = {
        "measured": rows["zb-h1"]["measured"]["step_time_s"] / rows["1f1b"]["measured"]["step_time_s"],
        "simulated": rows["zb-h1"]["simulated"]["step_time_s"] / rows["1f1b"]["simulated"]["step_time_s"],
        "predicted": predicted("zb-h1") / predicted("1f1b"),
    }
    out["interleaved_over_1f1b"] = {
        "measured": rows["interleaved-1f1b"]["measured"]["step_time_s"] / rows["1f1b"]["measured"]["step_time_s"],
        "simulated": rows["interleaved-1f1b"]["simulated"]["step_time_s"] / rows["1f1b"]["simulated"]["step_time_s"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
