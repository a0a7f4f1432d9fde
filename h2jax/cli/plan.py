"""`h2jax plan --cluster FILE --model NAME --seq-len S --global-batch-tokens T`: HeteroAuto.

Searches the cluster for the fastest plan under the cost model (exactly), writes it with
--out, and reports it next to each chip type planned alone at the same global batch."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from typing import Any

from h2jax import names as N
from h2jax.config import ConfigError
from h2jax.names import format_layers, format_mesh


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan a model on a (mixed) cluster", description=__doc__)
    p.add_argument("--cluster", required=True, help="cluster file (TOML), e.g. plans/cluster-1024.toml")
    p.add_argument("--model", required=True, help="model preset, e.g. tiny, small, llama-7b, llama-100b")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    batch = p.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch-tokens",
                       help="tokens per optimizer step, a multiple of --seq-len, e.g. 2097152 or 2M (binary suffixes)")
    batch.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    from h2jax.schedules import AUTO, NAMES

    p.add_argument("--schedule", default=AUTO, choices=[AUTO, *NAMES],
                   help="pipeline schedule (default auto: search every schedule and keep the fastest)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="layer chunks per stage for interleaved-1f1b (default: search 2 and 4)")
    p.add_argument("--exhaustive", action="store_true",
                   help="enumerate every stage list and layer split (small clusters only): checks the search")
    p.add_argument("--one-shape-per-type", action="store_true",
                   help="give every stage of a chip type one shape (mesh and recompute), the space the search "
                        "proves optimal; by default a local search then tries two shapes per type")
    p.add_argument("--prove-two-shapes", action="store_true",
                   help="prove the plan optimal among plans with up to two shapes per chip type (branch and bound "
                        "over how each type's chips split between its blocks; tens of seconds on hundreds of chips, more on "
                        "thousands: raise --time-limit; "
                        "it shows where it stands, and Ctrl-C stops it and keeps the best plan found)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes for the search of a large cluster: --schedule auto's schedules after the "
                        "first and the baselines, each in one of its own, and --prove-two-shapes' nodes once the "
                        "proof has run a second; the same plan with any N (default: the CPUs this process may use)")
    p.add_argument("--profile", help="measured profile (from `h2jax profile`) to use instead of the analytical model")
    p.add_argument("--top-k", type=int, default=1, help="keep the K best stage lists (listed with --json)")
    p.add_argument("--refine-with-sim", type=int, default=None, metavar="K",
                   help="re-rank the search's best K plans by event-level simulation and keep the fastest")
    p.add_argument("--time-limit", type=float, default=60.0,
                   help="stop the search after this many seconds with the best plan so far, marked not proved "
                        "optimal (default 60; small clusters finish in well under a second)")
    p.add_argument("--baseline-global-batch-tokens", default=None,
                   help="also report baselines at this (different) batch, labelled batch-mismatched, as the H2 paper did")
    p.add_argument("--no-baselines", action="store_true", help="skip the homogeneous baselines")
    p.add_argument("--out", help="write the plan (JSON) here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=main)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system says, else all)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def sequences(tokens: str | int | None, seqs: int | None, seq_len: int, flag: str) -> int | None:
    from h2jax.speedup import parse_tokens

    if seqs is not None:
        if seqs < 1:
            raise ConfigError(f"--global-batch must be a positive number of sequences, got {seqs}")
        return seqs
    if tokens is None:
        return None
    tokens = parse_tokens(tokens, flag)
    if tokens < seq_len or tokens % seq_len:
        raise ConfigError(
            f"{flag} ({tokens}) must be a positive multiple of --seq-len ({seq_len}); e.g. "
            f"{max(1, round(tokens / seq_len)) * seq_len}"
        )
    return tokens // seq_len


def main(args: argparse.Namespace) -> int:
    from h2jax.cluster import load_cluster
    from h2jax.planner import load_profile, plan_cluster
    from h2jax.plan import save_plan
    from h2jax.cli.progress import proof_status

    if args.seq_len is None or args.seq_len < 1:
        raise ConfigError("--seq-len must be a positive integer")
    global_batch = sequences(args.global_batch_tokens, args.global_batch, args.seq_len, "--global-batch-tokens")
    baseline_batch = sequences(args.baseline_global_batch_tokens, None, args.seq_len, "--baseline-global-batch-tokens")
    jobs = usable_cpus() if args.jobs is None else args.jobs
    if jobs < 1:
        raise ConfigError(f"--jobs must be a positive number of processes, got {jobs}; e.g. --jobs {usable_cpus()}")
    cluster = load_cluster(args.cluster)
    profile = load_profile(args.profile) if args.profile else None
    # a proof of minutes shows where it stands (stderr); Ctrl-C stops it and keeps the best plan
    with proof_status() if args.prove_two_shapes else contextlib.nullcontext() as progress:
        result = plan_cluster(
            cluster, args.model, args.seq_len, global_batch, schedule=args.schedule, exhaustive=args.exhaustive,
            profile=profile, k=max(args.top_k, args.refine_with_sim or 1), baselines=not args.no_baselines,
            baseline_global_batch=baseline_batch, time_limit_s=args.time_limit, virtual_stages=args.virtual_stages,
            mixed_shapes=not args.one_shape_per_type, prove_two_shapes=args.prove_two_shapes, workers=jobs,
            proof_progress=progress,
        )
    if args.refine_with_sim:
        result = refined_by_simulation(result, cluster, profile)
    if args.out:
        save_plan(result.plan, args.out)
    if args.json:
        out: dict[str, Any] = {"cluster": cluster.name, "plan": result.plan.to_dict()}
        # the attention kernel each chip type's stages run (its chip file's [kernels] attention)
        out["attention"] = {s.chip: cluster.chips[s.chip].attention_kernel for s in result.plan.stages}
        if args.top_k > 1:
            out["top_k"] = [
                {"step_time_s": c.time_s, "micro_batch": c.micro_batch,
                 "stages": [{"chip": s.chip, "mesh": {"data": s.mesh.data, "tensor": s.mesh.tensor},
                             "layers": list(s.layers), "recompute": s.recompute} for s in c.stages()]}
                for c in result.candidates
            ]
        if args.out:
            out["written_to"] = args.out
        print(json.dumps(out))
    else:
        print_table(result, cluster, args.out)
    return 0


def refined_by_simulation(result: Any, cluster: Any, profile: Any) -> Any:
    """The search's top-K plans re-ranked by the simulator; the winner's `predicted` keeps the
    closed-form figures of the cost model and adds its simulated step time and rank."""
    import dataclasses

    from h2jax.planner.cost_model import CostOptions
    from h2jax.planner.heteroauto import predict
    from h2jax.sim_plans import rerank_by_simulation

    candidates = result.candidate_plans()
    ranked = rerank_by_simulation(candidates, cluster, profile)
    best, sim = ranked[0]
    predicted = dict(result.plan.predicted)
    if best != candidates[0]:
        predicted.update(predict(best, cluster, profile, CostOptions.of(best)))
    predicted["simulated"] = {"step_time_s": sim.iteration_s}
    predicted["refined_with_sim"] = {
        "k": len(candidates),
        "rank_under_cost_model": candidates.index(best),
        "simulated": {"step_time_s": [r.iteration_s for _, r in ranked]},
    }
    return dataclasses.replace(result, plan=dataclasses.replace(best, predicted=predicted))


def print_table(result: Any, cluster: Any, out: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    plan, pred = result.plan, result.plan.predicted
    from h2jax.cli.console import count, gib, make_console

    console = make_console()
    from h2jax.planner.space import TIME_LIMIT, schedule_label

    table = Table(title=f"{plan.model_name or 'model'} on {cluster.name} ({count(cluster.n_chips, 'chip')}): "
                  f"{count(plan.n_stages, 'stage')}, micro-batch {plan.micro_batch} x {plan.n_micro}, "
                  f"{schedule_label(plan.schedule, plan.virtual_stages)}")
    for col in ("stage", "chip", "data x tensor", "layers", "recompute", "attention", "memory GiB"):
        table.add_column(col, justify="right" if col in ("stage", "memory GiB") else "left")
    for i, s in enumerate(plan.stages):
        table.add_row(
            str(i), s.chip, format_mesh(s.mesh.data, s.mesh.tensor),
            format_layers(r for r in s.layer_ranges if r[1] > r[0]) + f" ({s.n_layers})",
            s.recompute, cluster.chips[s.chip].attention_kernel,
            f"{gib(pred['memory_gib'][i])} / {gib(pred['memory_capacity_gib'][i])}",
        )
    console.print(table)
    console.print(
        f"step {pred['step_time_s']:.4g} s, {pred['tokens_per_s']:,.0f} tokens/s, "
        f"TGS {pred['tokens_per_chip_per_s']:,.1f} tokens/chip/s, MFU {pred['mfu']:.1%}, bubble {pred['bubble_fraction']:.1%}"
    )
    closed = pred.get(N.CLOSED_FORM_STEP_TIME_S)
    if closed is not None:  # ZB-H1: the step replays its order; the search ranked by its closed form
        console.print(f"  {plan.schedule}'s order replayed; its closed form, which the search ranks by, "
                      f"gives {closed:.4g} s ({closed / pred['step_time_s'] - 1:+.1%})")
    times = pred.get("schedule_times_s") or {}
    beaten = pred.get("schedule_bounds_s") or {}
    if len(times) + len(beaten) > 1:  # --schedule auto: which schedule won, and by how much
        (won, t_won), *rest = times.items()
        console.print(f"schedule: {won} won; " + ", ".join(
            [f"{name} {t:.4g} s ({t / t_won - 1:+.1%})" for name, t in rest]
            + [f"{name} slower (no plan under {t:.4g} s)" if t >= t_won
               else f"{name} no plan found under {t_won:.4g} s, not proved (time limit; at least {t:.4g} s)"
               for name, t in beaten.items()]
            + [f"{name} not searched (never faster than {other})"
               for name, other in (pred.get("schedules_left_out") or {}).items()]))
    simulated = pred.get("auto_simulated_s") or {}
    if len(simulated) > 1:  # ZB-H1 was fastest under the closed forms: the simulator decided
        console.print("  ZB-H1 checked by simulation (its closed form can fall short on uneven stages): "
                      + ", ".join(f"{name} {t:.4g} s" for name, t in simulated.items()) + " simulated")
    unused = pred.get("chips_unused") or {}
    if unused:
        console.print("chips left unused (faster without them): " + ", ".join(f"{n} x {c}" for c, n in unused.items()))
    under = "the schedule's closed form" if closed is not None else "the cost model"
    opt = f"proved optimal under {under}" if pred.get("proved_optimal", True) else "NOT proved optimal (time limit)"
    one_shape = pred.get("one_shape_step_time_s")
    proved_two = pred.get("two_shapes_proved")
    if proved_two:  # --prove-two-shapes finished: the plan is the two-shape optimum
        gain = pred["two_shapes_faster_by"]
        opt += (f" among plans with up to two shapes per chip type ({count(pred['two_shape_nodes'], 'branch-and-bound node')}; "
                + (f"{gain:.2%} faster than the best with one shape per type, {one_shape:.4g} s)" if gain > 1e-9
                   else "one shape per type is as fast)"))
    elif one_shape is not None and not pred.get("one_shape_proved", True):  # (search._EarlyClimb)
        # the local search's plan came first: the exact search proved no one-shape plan beats it
        opt = (f"proved faster than every plan with one shape per chip type under {under}"
               if pred.get("proved_optimal", True) else "NOT proved faster than every plan with one shape per "
               "chip type (time limit)")
        opt += (f": two shapes on a type, from a local search (not proved optimal), {pred['two_shapes_faster_by']:.2%} "
                f"faster than the best one-shape plan found, {one_shape:.4g} s (the one-shape optimum, between "
                "the two, was not searched for)")
    elif one_shape is not None:  # the fast search proves the one-shape space; two shapes come from a local search
        opt += " among plans with one shape per chip type"
        if pred["two_shapes_faster_by"] > 1e-9:
            found_by = "the best found" if proved_two is False else "from a local search"  # (the proof's, or not tried)
            opt += (f" ({one_shape:.4g} s); two shapes on a type, {found_by} (not proved optimal), "
                    f"are {pred['two_shapes_faster_by']:.2%} faster")
        elif proved_two is None:
            opt += "; a local search found no faster plan with two shapes on a type (not proved: --prove-two-shapes)"
    if one_shape is not None and proved_two is False:
        stopped = pred.get("two_shapes_stopped_by", TIME_LIMIT)
        nodes = count(pred["two_shape_nodes"], "branch-and-bound node")
        why = (f"within the time limit ({nodes})" if stopped == TIME_LIMIT
               else f"(stopped by {'Ctrl-C' if stopped == 'SIGINT' else stopped} after {nodes})")
        opt += (f"; two shapes per type NOT proved {why}: "
                f"their optimum is at least {pred['two_shape_lower_bound_s']:.4g} s")
    console.print(
        f"search: {pred['search_time_s']:.3f} s, {pred['plans_evaluated']:,} plans evaluated, "
        f"{pred['configs_visited']:,} of {pred['space_size']:,} stage lists visited; {opt}"
    )
    if result.baselines:
        base = Table(title="each chip type alone, same global batch")
        for col in ("chip", "chips", "tokens/s", "TGS", "note"):
            base.add_column(col)
        for name, b in result.baselines.items():
            note = "" if b.plan is not None else (b.reason or "")[:60]
            base.add_row(name, str(b.chips), f"{b.tokens_per_s:,.0f}", f"{b.tgs:,.1f}", note)
        console.print(base)
        ratio = result.hetero_speedup_ratio
        console.print(
            "HeteroSpeedupRatio N*TGS / sum N_i*TGS_i = "
            + (f"{ratio:.3f}" if ratio is not None else "n/a (no chip type fits the model alone)")
            + " (batch-matched)"
        )
        if "hetero_speedup_ratio_batch_mismatched" in pred:
            r2 = pred["hetero_speedup_ratio_batch_mismatched"]
            console.print(f"  vs baselines at a different batch (paper-style, NOT batch-matched): "
                          + (f"{r2:.3f}" if r2 is not None else "n/a"))
    if out:
        console.print(f"plan written to {out}")
