"""Simulator speed and simulator-vs-cost-model agreement at paper scale; prints one JSON object.

1. Time to simulate the 2,432-chip plan with 1,000 micro-batches (goal: < 2 s on one core).
   The plan is the planner's best for plans/cluster-2432.toml (llama-100b, 4,096-token
   sequences, 4M-token batch), then re-batched to 1,000 micro-batches of the same size.
2. For the paper-scale clusters (768, 1,024, 2,432 chips) the closed-form step time of the
   planner's cost model, the simulated one, and their difference, for 1F1B, plus what GPipe
   and ZB-H1 would do with the same stages.

The planner's search runs under --search-timeout seconds; a plan it could not prove optimal in
that time says so in the output ("plan_source"). The simulator's speed depends on the stage and
micro-batch counts, not on how good the plan is.

Usage: python benchmarks/simulator.py [--model llama-100b] [--seq-len 4096] [--tokens 4M]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from h2jax.cluster import Cluster, load_cluster
from h2jax.plan import Plan
from h2jax.planner import cost_model, plan_cluster
from h2jax.sim_plans import simulate_plan
from h2jax.speedup import parse_tokens, sequences

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = (768, 1024, 2432)


def timed(fn, repeat: int = 3) -> tuple[float, object]:
    """Median wall and CPU seconds of `repeat` calls (the simulator is single-threaded)."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), out


def planned(cluster: Cluster, model: str, seq_len: int, batch: int, timeout_s: int) -> tuple[Plan, str]:
    """The planner's best plan within `timeout_s` (the search's own time limit), labelled with
    whether the search proved it optimal."""
    plan = plan_cluster(cluster, model, seq_len, batch, baselines=False, time_limit_s=timeout_s).plan
    proved = (plan.predicted or {}).get("proved_optimal")
    return plan, "planner" if proved else f"planner (best found in {timeout_s} s, not proved optimal)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-100b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--tokens", default="4M", help="global batch of the planned runs")
    ap.add_argument("--micro-batches", type=int, default=1000)
    ap.add_argument("--search-timeout", type=int, default=20,
                    help="the planner's time limit per cluster; unproved plans are labelled (default 20)")
    args = ap.parse_args()
    batch = sequences(parse_tokens(args.tokens), args.seq_len)

    plans = {}
    out: dict = {"model": args.model, "seq_len": args.seq_len, "global_batch_tokens": batch * args.seq_len,
                 "plans": {}}
    for n in CLUSTERS:
        cluster = load_cluster(ROOT / "plans" / f"cluster-{n}.toml")
        t0 = time.perf_counter()
        plan, source = planned(cluster, args.model, args.seq_len, batch, args.search_timeout)
        plan_s = time.perf_counter() - t0
        costs = cost_model.stage_costs(plan, cluster)
        plans[n] = (plan, cluster, costs)
        row = {"plan_source": source, "chips": cluster.n_chips, "chips_used": plan.n_devices, "stages": plan.n_stages,
               "n_micro": plan.n_micro, "plan_search_s": plan_s}
        for name in ("1f1b", "gpipe", "zb-h1"):
            sim = simulate_plan(plan, costs, schedule=name)
            entry = {"step_time_s": sim.iteration_s, "bubble_fraction": sim.bubble_fraction}  # simulated
            if name in ("1f1b", "gpipe"):
                closed = cost_model.iteration_time(costs, plan.n_micro, name)
                entry.update(predicted={"step_time_s": closed}, sim_minus_closed_s=sim.iteration_s - closed,
                             relative_difference=(sim.iteration_s - closed) / closed)
            row[name] = entry
        row["zb_h1_bubble_recovered"] = 1 - row["zb-h1"]["bubble_fraction"] / row["1f1b"]["bubble_fraction"]
        out["plans"][str(n)] = row

    plan, cluster, costs = plans[2432]
    big = dataclasses.replace(plan, global_batch=args.micro_batches * plan.micro_batch, predicted=None)
    big_costs = cost_model.stage_costs(big, cluster)
    wall, cpu, sim = timed(lambda: simulate_plan(big, big_costs))
    closed = cost_model.iteration_time(big_costs, big.n_micro, "1f1b")
    zb_wall, zb_cpu, zb = timed(lambda: simulate_plan(big, big_costs, schedule="zb-h1"), repeat=1)
    out["simulate_2432_chips"] = {
        "plan_source": out["plans"]["2432"]["plan_source"],
        "stages": big.n_stages,
        "n_micro": big.n_micro,
        # F and B per micro-batch, plus a send and a receive each way across inner links
        "actions": sum(big.n_micro * (2 + 2 * (i > 0) + 2 * (i < big.n_stages - 1))
                       for i in range(big.n_stages)),
        "wall_s": wall,
        "cpu_s": cpu,
        "goal_s": 2.0,
        "meets_goal": cpu < 2.0,
        "step_time_s": sim.iteration_s,  # simulated
        "predicted": {"step_time_s": closed},
        "relative_difference": (sim.iteration_s - closed) / closed,
        "zb_h1_build_and_simulate_wall_s": zb_wall,
        "zb_h1": {"step_time_s": zb.iteration_s},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
