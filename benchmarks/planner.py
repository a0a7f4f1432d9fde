"""HeteroAuto search speed on the shipped clusters, and fast-vs-exhaustive on small ones.

Prints one JSON object. Planning target: llama-100b, seq 4096, 8M-token global batch
(2,048 sequences), 1F1B. The search is exact: `proved_optimal` says it finished within the
time limit (else `lower_bound_s` is a valid lower bound on the optimum and
`within_of_optimum` = time / bound - 1). Each shipped cluster is searched `--repeat` times
(min and median wall time: the search is deterministic, the spread is the machine's).
`shipped_clusters_auto`: the same clusters under `--schedule auto` (every schedule, the
time limit shared); `shipped_clusters_by_schedule`: ZB-H1 and interleaved 1F1B (v = 2, 4)
each alone. Two shapes per chip type: the shipped clusters' plans with the local search after the exact
one (how much faster than the proved one-shape optimum; the whole search's time, min and median
of `--repeat` runs), the local search and the exact
two-shape search against the exhaustive two-shape enumeration on `--two-shape-cases` random
tiny clusters, and the exact two-shape search on the 64- and 768-chip clusters (within
`--proof-time-limit`), in one process and then with `--proof-workers` processes, under
`--schedule auto` (every schedule proved, one process), and of ZB-H1
alone on the 64- and 768-chip clusters (one process).
`shipped_plan_by_workers`: `h2jax plan`'s default run (auto, two shapes, baselines) in one
process and in `--plan-workers`, in turn. `--random-shipped N` adds N random clusters of 2-4
shipped accelerator types (one search each: how many are proved optimal, the total and
slowest time, how many take over 1 s). `--random-two-shapes N`: N random small clusters of
2-3 shipped accelerator types on which the default two-shape plan (the local search) meets
the exact two-shape search (in how many it is the proved optimum, its misses).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from h2jax.cli.plan import usable_cpus
from h2jax.cluster import ChipGroup, ChipType, Cluster, Precision, known_chips, load_chip, load_cluster
from h2jax.planner import PlannerError, plan_cluster, top_k
from h2jax.planner.space import schedule_label

REPO = Path(__file__).resolve().parent.parent
CLUSTERS = ["cluster-64.toml", "cluster-768.toml", "cluster-1024.toml", "cluster-2432.toml"]


def timed_search(cluster: Cluster, time_limit: float, repeat: int, **options) -> tuple:
    """(best plan, stats, {search_time_s_min, search_time_s_median}) of `repeat` runs of the
    same deterministic search (llama-100b, 4,096 tokens, 2,048 sequences): the spread is the
    machine's."""
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        (best,), stats = top_k(cluster, "llama-100b", 4096, 8 * 2**20 // 4096, time_limit_s=time_limit, **options)
        walls.append(time.perf_counter() - t0)
    return best, stats, {"search_time_s_min": round(min(walls), 3),
                         "search_time_s_median": round(statistics.median(walls), 3)}


def shipped(time_limit: float, repeat: int) -> dict:
    out = {}
    for name in CLUSTERS:
        cluster = load_cluster(REPO / "plans" / name)
        best, stats, walls = timed_search(cluster, time_limit, repeat)
        chips = sum(o.chips for o in best.options)
        out[cluster.name] = {
            "chips": cluster.n_chips,
            "chip_types": len(cluster.groups),
            **walls,
            "proved_optimal": stats.proved_optimal,
            "lower_bound_s": round(stats.lower_bound_s, 4),
            "within_of_optimum": round(best.time_s / stats.lower_bound_s - 1, 4) if stats.lower_bound_s else None,
            "bound_rows": stats.bound_rows,
            "stage_lists_solved": stats.configs_visited,
            "plans_evaluated": stats.plans_evaluated,
            "space_size": stats.space_size,
            "step_time_s": round(best.time_s, 4),
            "tokens_per_s": round(8 * 2**20 / best.time_s, 1),
            "tokens_per_chip_per_s": round(8 * 2**20 / best.time_s / cluster.n_chips, 2),
            "stages": sum(o.stages for o in best.options),
            "chips_used": chips,
            "micro_batch": best.micro_batch,
        }
    return out


def shipped_gpipe(time_limit: float) -> dict:
    """The same searches under GPipe (one run each)."""
    out = {}
    for name in CLUSTERS:
        cluster = load_cluster(REPO / "plans" / name)
        t0 = time.perf_counter()
        try:
            (best,), stats = top_k(
                cluster, "llama-100b", 4096, 8 * 2**20 // 4096, schedule="gpipe", time_limit_s=time_limit
            )
        except PlannerError as e:
            out[cluster.name] = {"plan": None, "why": str(e).split(";")[0]}
            continue
        out[cluster.name] = {
            "search_time_s": round(time.perf_counter() - t0, 3),
            "proved_optimal": stats.proved_optimal,
            "step_time_s": round(best.time_s, 4),
            "bound_rows": stats.bound_rows,
            "stage_lists_solved": stats.configs_visited,
        }
    return out


def shipped_by_schedule(time_limit: float) -> dict:
    """ZB-H1 and interleaved 1F1B (v = 2, 4) each searched alone on the shipped clusters, one
    shape per type, one run each: proved or not, the time, the plan's step time."""
    out = {}
    for name in CLUSTERS:
        cluster = load_cluster(REPO / "plans" / name)
        row = {}
        for schedule, v in (("zb-h1", None), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)):
            t0 = time.perf_counter()
            try:
                (best,), stats = top_k(cluster, "llama-100b", 4096, 8 * 2**20 // 4096, schedule=schedule,
                                       virtual_stages=v, time_limit_s=time_limit)
            except PlannerError as e:
                row[schedule_label(schedule, v or 1)] = {"plan": None, "why": str(e).split(";")[0]}
                continue
            row[best.label] = {
                "search_time_s": round(time.perf_counter() - t0, 3),
                "proved_optimal": stats.proved_optimal,
                "step_time_s": round(best.time_s, 4),
                "lower_bound_s": round(stats.lower_bound_s, 4),
                "bound_rows": stats.bound_rows,
            }
        out[cluster.name] = row
    return out


def shipped_auto(time_limit: float) -> dict:
    """`--schedule auto` (what `h2jax plan` runs by default), one shape per type, one run each:
    every schedule searched (but GPipe, never faster than 1F1B: `schedules_left_out`), each
    after 1F1B only for plans faster than the best before it, within one time limit shared
    among them."""
    out = {}
    for name in CLUSTERS:
        cluster = load_cluster(REPO / "plans" / name)
        t0 = time.perf_counter()
        (best,), stats = top_k(cluster, "llama-100b", 4096, 8 * 2**20 // 4096, schedule="auto",
                               time_limit_s=time_limit)
        out[cluster.name] = {
            "search_time_s": round(time.perf_counter() - t0, 3),
            "proved_optimal": stats.proved_optimal,
            "bound_rows": stats.bound_rows,
            "schedule": best.label,
            "step_time_s": round(best.time_s, 4),
            "schedule_times_s": {k: round(v, 4) for k, v in stats.schedule_times.items()},
            "schedule_lower_bounds_s": {k: round(v, 4) for k, v in stats.schedule_bounds.items()},
            "schedules_left_out": dict(stats.schedules_left_out),
        }
    return out


def shipped_plan_by_workers(time_limit: float, workers: int, repeat: int) -> dict:
    """`h2jax plan`'s default (`plan_cluster`: `--schedule auto`, the local search over two
    shapes, the baselines) in one process and with `workers` (`--jobs`), `repeat` times each,
    in turn (one process, then workers): the wall time of each, the ratio of the medians,
    and whether the plan files are the same (but the search time they record)."""
    out = {}
    for name in CLUSTERS:
        cluster = load_cluster(REPO / "plans" / name)
        walls: dict[int, list[float]] = {1: [], workers: []}
        plans: dict[int, dict] = {}
        for _ in range(repeat):
            for n in walls:
                t0 = time.perf_counter()
                result = plan_cluster(cluster, "llama-100b", 4096, 8 * 2**20 // 4096, schedule="auto",
                                      time_limit_s=time_limit, workers=n)
                walls[n].append(time.perf_counter() - t0)
                plan = result.plan.to_dict()
                plan["predicted"].pop("search_time_s")
                plans[n] = plan
        median = {n: statistics.median(w) for n, w in walls.items()}
        out[cluster.name] = {
            "wall_s_one_process": [round(w, 2) for w in walls[1]],
            f"wall_s_{workers}_processes": [round(w, 2) for w in walls[workers]],
            "ratio_of_medians": round(median[workers] / median[1], 3),
            "same_plan": plans[1] == plans[workers],
        }
    return out


def random_chip(rng: random.Random, name: str, memories_gib: list[float], per_node: list[int]) -> ChipType:
    return ChipType(
        name, "cpu", rng.choice(memories_gib), rng.choice([0.1, 0.3, 1.0, 2.5]),
        rng.choice(per_node), rng.choice([5.0, 50.0]), rng.choice([0.5, 2.0, 10.0]), "benchmark",
        precision=Precision("float32", rng.choice(["float32", "bfloat16"])),
    )


def random_cluster(rng: random.Random) -> tuple[Cluster, str]:
    n_types = rng.choice([2, 3])
    max_count, model = (32, rng.choice(["tiny", "small"])) if n_types == 2 else (8, "tiny")
    groups = []
    for i in range(n_types):
        chip = random_chip(rng, f"chip{i}", [0.004, 0.008, 0.016, 0.05, 1.0], [1, 2, 4])
        groups.append(ChipGroup(chip, rng.randint(1, max_count)))
    return Cluster(tuple(groups), name="random"), model


def fast_vs_exhaustive(cases: int, seed: int) -> dict:
    rng = random.Random(seed)
    agree = fits = 0
    fast_s = full_s = 0.0
    worst = 0.0
    for _ in range(cases):
        cluster, model = random_cluster(rng)
        seq, batch, schedule = rng.choice([32, 128]), rng.choice([2, 4, 6]), rng.choice(["1f1b", "gpipe"])
        res = []
        for exhaustive in (False, True):
            t0 = time.perf_counter()
            try:
                (best,), _ = top_k(cluster, model, seq, batch, schedule=schedule, exhaustive=exhaustive)
                res.append(best.time_s)
            except PlannerError:
                res.append(None)
            if exhaustive:
                full_s += time.perf_counter() - t0
            else:
                fast_s += time.perf_counter() - t0
        if res[0] is None or res[1] is None:
            agree += res[0] is None and res[1] is None
            continue
        fits += 1
        gap = abs(res[0] - res[1]) / res[1]
        worst = max(worst, gap)
        agree += gap <= 1e-9
    return {
        "cases": cases, "cases_with_a_plan": fits, "fast_equals_exhaustive": agree,
        "worst_relative_gap": worst, "fast_total_s": round(fast_s, 3), "exhaustive_total_s": round(full_s, 3),
    }


def shipped_two_shapes(time_limit: float, repeat: int, one_shape: dict) -> dict:
    """Two shapes per chip type (`mixed_shapes=True`, what `h2jax plan` does by default): the
    local search's plan, how much faster than the proved one-shape optimum (`one_shape`:
    `shipped`'s rows), and the whole search's time (min and median of `repeat` runs, as
    `shipped`). On a large space the local search climbs first and the exact search then
    proves only that no one-shape plan beats its plan (`one_shape_proved` false:
    search._EarlyClimb), so the optimum is taken from `shipped`'s search."""
    out = {}
    for name in CLUSTERS:
        cluster = load_cluster(REPO / "plans" / name)
        best, stats, walls = timed_search(cluster, time_limit, repeat, mixed_shapes=True)
        optimum = one_shape[cluster.name]["step_time_s"]
        per_type = {}
        for o in best.options:
            per_type.setdefault(o.chip, []).append(f"{o.stages}x(data={o.data},tensor={o.tensor},{o.recompute})")
        out[cluster.name] = {
            **walls,
            "proved_no_one_shape_plan_faster": stats.proved_optimal,
            "one_shape_proved_in_this_search": stats.one_shape_proved,
            "one_shape_step_time_s": optimum,
            "step_time_s": round(best.time_s, 4),
            "faster_by": round(1 - best.time_s / optimum, 4),
            "types_on_two_shapes": {c: v for c, v in per_type.items() if len(v) > 1},
        }
    return out


def tiny_cluster(rng: random.Random) -> Cluster:
    """1-2 chip types of 2-12 chips each (small enough for the exhaustive two-shape space)."""
    groups = []
    for i in range(rng.choice([1, 2, 2])):
        groups.append(ChipGroup(random_chip(rng, f"chip{i}", [0.004, 0.008, 0.016], [2, 4]), rng.randint(2, 12)))
    return Cluster(tuple(groups), name="random")


def two_shapes_vs_exhaustive(cases: int, seed: int) -> dict:
    """The local search and the exact two-shape search (`prove_two_shapes`) against the
    exhaustive enumeration of every two-shape stage list on small random clusters (tiny
    model): in how many cases two shapes beat one, in how many of those the local search
    reaches the two-shape optimum (and by how much it misses), and whether the exact search
    equals the exhaustive optimum in every case (its total and slowest time, its nodes)."""
    rng = random.Random(seed)
    fits = two_better = reached = proved_equal = nodes = 0
    worst, gains, proof_walls = 0.0, [], []
    for _ in range(cases):
        cluster = tiny_cluster(rng)
        seq, batch, schedule = rng.choice([32, 128]), rng.choice([2, 4, 8]), rng.choice(["1f1b", "1f1b", "gpipe"])
        try:
            (one,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule)
        except PlannerError:
            continue
        (local,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
        t0 = time.perf_counter()
        (exact,), stats = top_k(cluster, "tiny", seq, batch, schedule=schedule, prove_two_shapes=True)
        proof_walls.append(time.perf_counter() - t0)
        (full,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True, exhaustive=True)
        fits += 1
        nodes += stats.two_shape_nodes
        proved_equal += bool(stats.two_shapes_proved) and abs(exact.time_s / full.time_s - 1) <= 1e-9
        if full.time_s < one.time_s * (1 - 1e-9):
            two_better += 1
            gains.append(1 - full.time_s / one.time_s)
            miss = local.time_s / full.time_s - 1
            reached += miss <= 1e-9
            worst = max(worst, miss)
    return {
        "cases": cases, "cases_with_a_plan": fits, "two_shapes_faster": two_better,
        "local_search_reached_the_two_shape_optimum": reached, "worst_miss": round(worst, 4),
        "largest_two_shape_gain": round(max(gains, default=0.0), 4),
        "exact_search_proved_the_exhaustive_optimum": proved_equal,
        "exact_search_total_s": round(sum(proof_walls), 2), "exact_search_slowest_s": round(max(proof_walls, default=0.0), 3),
        "exact_search_nodes": nodes,
    }


def shipped_two_shape_proof(time_limit: float, workers: int) -> dict:
    """The exact two-shape search (`prove_two_shapes`) on the shipped 64- and 768-chip
    clusters, one run each within `time_limit`: proved or not, its nodes and time, the plan
    against the local search's and the one-shape optimum, and the lower bound it leaves; then
    the same search with `workers` processes (`top_k(workers=...)`), right after it: its time, its
    nodes and whether it reached the same plan time."""
    out = {}
    for name in CLUSTERS[:2]:
        cluster = load_cluster(REPO / "plans" / name)
        args = (cluster, "llama-100b", 4096, 8 * 2**20 // 4096)
        (local,), _ = top_k(*args, time_limit_s=time_limit, mixed_shapes=True)
        t0 = time.perf_counter()
        (best,), stats = top_k(*args, time_limit_s=time_limit, prove_two_shapes=True)
        wall = time.perf_counter() - t0
        parallel = {}
        if workers > 1:
            t0 = time.perf_counter()
            (pbest,), pstats = top_k(*args, time_limit_s=time_limit, prove_two_shapes=True, workers=workers)
            pwall = time.perf_counter() - t0
            parallel = {"workers": workers, "search_time_s": round(pwall, 2), "proved": pstats.two_shapes_proved,
                        "nodes": pstats.two_shape_nodes, "same_step_time": abs(pbest.time_s / best.time_s - 1) <= 1e-9,
                        "time_ratio_to_one_process": round(pwall / wall, 3)}
        out[cluster.name] = {
            "search_time_s": round(wall, 2), "proved": stats.two_shapes_proved, "nodes": stats.two_shape_nodes,
            "step_time_s": round(best.time_s, 4), "local_search_step_time_s": round(local.time_s, 4),
            "one_shape_step_time_s": round(stats.one_shape_time_s, 4),
            "one_shape_proved": stats.one_shape_proved,  # (false: the best one-shape plan found)
            "lower_bound_s": round(stats.two_shape_lower_bound_s, 4),
            "layout": [f"{o.chip} {o.stages}x(data={o.data},tensor={o.tensor},{o.recompute})" for o in best.options],
            "micro_batch": best.micro_batch,
            **({"with_workers": parallel} if parallel else {}),
        }
    return out


def shipped_two_shape_proof_auto(time_limit: float) -> dict:
    """The exact two-shape search under `--schedule auto` on the 64- and 768-chip clusters,
    one process, one run each: every schedule searched, then proved, each against the best
    before it."""
    out = {}
    for name in CLUSTERS[:2]:
        cluster = load_cluster(REPO / "plans" / name)
        t0 = time.perf_counter()
        (best,), stats = top_k(cluster, "llama-100b", 4096, 8 * 2**20 // 4096, schedule="auto",
                               time_limit_s=time_limit, prove_two_shapes=True)
        out[cluster.name] = {
            "search_time_s": round(time.perf_counter() - t0, 2), "proved": stats.two_shapes_proved,
            "nodes": stats.two_shape_nodes, "schedule": best.label, "step_time_s": round(best.time_s, 4),
            "lower_bound_s": round(stats.two_shape_lower_bound_s, 4),
        }
    return out


def shipped_two_shape_proof_zb_h1(time_limit: float) -> dict:
    """The exact two-shape search of ZB-H1 alone on the 64- and 768-chip clusters, one process,
    one run each: the schedule whose tables depend on the pipeline's length (its boxes halved
    by length before they are resolved, `dual_search.range_halves`)."""
    out = {}
    for name in CLUSTERS[:2]:
        cluster = load_cluster(REPO / "plans" / name)
        t0 = time.perf_counter()
        (best,), stats = top_k(cluster, "llama-100b", 4096, 8 * 2**20 // 4096, schedule="zb-h1",
                               time_limit_s=time_limit, prove_two_shapes=True, workers=1)
        out[cluster.name] = {
            "search_time_s": round(time.perf_counter() - t0, 2), "proved": stats.two_shapes_proved,
            "nodes": stats.two_shape_nodes, "step_time_s": round(best.time_s, 4),
            "one_shape_step_time_s": round(stats.one_shape_time_s, 4),
            "one_shape_proved": stats.one_shape_proved,  # (false: the best one-shape plan found)
            "lower_bound_s": round(stats.two_shape_lower_bound_s, 4),
        }
    return out


def shipped_accelerators() -> list[ChipType]:
    """The chip files in backends/ but the host CPU and the emulated chips."""
    chips = [load_chip(n) for n in known_chips()]
    return [c for c in chips if c.platform != "cpu" and c.emulate is None]


def random_shipped(cases: int, seed: int, time_limit: float) -> dict:
    """The search on random clusters of 2-4 shipped accelerator types (backends/ less the
    host CPU and emulated ones; 16-256 chips each, in multiples of 8), llama-7b, 70b or 100b,
    seq 4096, 2M-8M-token batches, 1F1B: how many it proves optimal, its total and slowest
    time and how many take over 1 s (one run each)."""
    accelerators = shipped_accelerators()
    rng = random.Random(seed)
    walls, proved, with_plan = [], 0, 0
    for _ in range(cases):
        picked = rng.sample(accelerators, rng.randint(2, 4))
        cluster = Cluster(tuple(ChipGroup(c, 8 * rng.randint(2, 32)) for c in picked), name="random")
        model = rng.choice(["llama-7b", "llama-70b", "llama-100b"])
        batch = rng.choice([2, 4, 8]) * 2**20 // 4096
        t0 = time.perf_counter()
        try:
            _, stats = top_k(cluster, model, 4096, batch, time_limit_s=time_limit)
        except PlannerError:
            stats = None
        walls.append(time.perf_counter() - t0)
        if stats is not None:
            with_plan += 1
            proved += stats.proved_optimal
    return {
        "cases": cases, "cases_with_a_plan": with_plan, "proved_optimal": proved,
        "total_s": round(sum(walls), 2), "slowest_s": round(max(walls, default=0.0), 3),
        "over_1s": sum(w > 1.0 for w in walls),
    }


def random_two_shapes(cases: int, seed: int, proof_time_limit: float) -> dict:
    """The default two-shape plan (the local search after the exact one-shape search) against
    the exact two-shape search (`prove_two_shapes`, within `proof_time_limit` each) on random
    small clusters of 2-3 shipped accelerator types (8-48 chips each, in multiples of 8),
    llama-7b or 70b, seq 4096, 1M-4M-token batches, 1F1B: where the proof ends, whether the
    local search's plan is its optimum and by how much it misses; where it does not, whether
    the proof found a faster plan (one run each)."""
    accelerators = shipped_accelerators()
    rng = random.Random(seed)
    rows, local_s, proof_s = [], [], []
    for _ in range(cases):
        picked = rng.sample(accelerators, rng.randint(2, 3))
        cluster = Cluster(tuple(ChipGroup(c, 8 * rng.randint(1, 6)) for c in picked), name="random")
        model = rng.choice(["llama-7b", "llama-70b"])
        batch = rng.choice([1, 2, 4]) * 2**20 // 4096
        try:
            t0 = time.perf_counter()
            (local,), _ = top_k(cluster, model, 4096, batch, mixed_shapes=True)
            t1 = time.perf_counter()
            (best,), stats = top_k(cluster, model, 4096, batch, prove_two_shapes=True, time_limit_s=proof_time_limit)
        except PlannerError:
            continue
        local_s.append(t1 - t0)
        proof_s.append(time.perf_counter() - t1)
        rows.append((bool(stats.two_shapes_proved), local.time_s / best.time_s - 1))
    proved = [miss for done, miss in rows if done]
    return {
        "cases": cases, "cases_with_a_plan": len(rows), "proofs_ended": len(proved),
        "local_search_reached_the_proved_optimum": sum(miss <= 1e-9 for miss in proved),
        "misses": sorted((round(miss, 4) for miss in proved if miss > 1e-9), reverse=True),
        "proof_found_faster_where_not_ended": sum(miss > 1e-9 for done, miss in rows if not done),
        "local_search_total_s": round(sum(local_s), 2), "local_search_slowest_s": round(max(local_s, default=0.0), 3),
        "proof_total_s": round(sum(proof_s), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-limit", type=float, default=60.0, help="per shipped cluster search (s)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="searches per shipped cluster, one shape and two (min and median)")
    parser.add_argument("--cases", type=int, default=30, help="random small clusters")
    parser.add_argument("--two-shape-cases", type=int, default=150,
                        help="random tiny clusters on which the two-shape local search meets the exhaustive")
    parser.add_argument("--proof-time-limit", type=float, default=420.0,
                        help="the exact two-shape search on the 64- and 768-chip clusters, each within this (s; 0: skip)")
    parser.add_argument("--proof-workers", type=int, default=usable_cpus(),
                        help="processes for the exact two-shape search's second run (default: the usable CPUs; 1: none)")
    parser.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                        help="also search the shipped clusters under --schedule auto, and each of ZB-H1 and "
                             "interleaved 1F1B (v = 2, 4) alone (within --time-limit each)")
    parser.add_argument("--plan-workers", type=int, default=max(2, usable_cpus()),
                        help="processes for `h2jax plan`'s default run on the shipped clusters, against one "
                             "(with --auto; 1: skip)")
    parser.add_argument("--plan-repeat", type=int, default=2, help="runs of each (in turn)")
    parser.add_argument("--random-shipped", type=int, default=0,
                        help="random clusters of 2-4 shipped accelerator types to search (one run each)")
    parser.add_argument("--random-two-shapes", type=int, default=0,
                        help="random small clusters of 2-3 shipped accelerator types on which the default "
                             "two-shape plan meets the exact two-shape search (minutes: the proofs)")
    parser.add_argument("--random-two-shapes-limit", type=float, default=40.0,
                        help="each of those proofs within this (s)")
    args = parser.parse_args()
    one_shape = shipped(args.time_limit, args.repeat)
    print(json.dumps({
        "model": "llama-100b", "seq_len": 4096, "global_batch_tokens": 8 * 2**20, "schedule": "1f1b",
        "time_limit_s": args.time_limit,
        "shipped_clusters": one_shape,
        "shipped_clusters_gpipe": shipped_gpipe(args.time_limit),
        **({"shipped_clusters_auto": shipped_auto(args.time_limit)} if args.auto else {}),
        **({"shipped_clusters_by_schedule": shipped_by_schedule(args.time_limit)} if args.auto else {}),
        **({"shipped_plan_by_workers": shipped_plan_by_workers(args.time_limit, args.plan_workers, args.plan_repeat)}
           if args.auto and args.plan_workers > 1 else {}),
        "small_clusters": fast_vs_exhaustive(args.cases, seed=0),
        "shipped_clusters_two_shapes": shipped_two_shapes(args.time_limit, args.repeat, one_shape),
        "small_clusters_two_shapes": two_shapes_vs_exhaustive(args.two_shape_cases, seed=1),
        **({"shipped_two_shape_proof": shipped_two_shape_proof(args.proof_time_limit, args.proof_workers)} if args.proof_time_limit else {}),
        **({"shipped_two_shape_proof_auto": shipped_two_shape_proof_auto(args.proof_time_limit)}
           if args.proof_time_limit else {}),
        **({"shipped_two_shape_proof_zb_h1": shipped_two_shape_proof_zb_h1(args.proof_time_limit)}
           if args.proof_time_limit else {}),
        **({"random_shipped": random_shipped(args.random_shipped, 1, args.time_limit)} if args.random_shipped else {}),
        **({"random_two_shapes": random_two_shapes(args.random_two_shapes, 7, args.random_two_shapes_limit)}
           if args.random_two_shapes else {}),
    }))


if __name__ == "__main__":
    main()
