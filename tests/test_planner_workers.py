"""The planner's searches in worker processes (planner/workers.py): `--schedule auto`'s
schedules after the first at once (search._Rest) and the baselines at once
(baselines.homogeneous_baselines(at_once=...)) give what one process gives, and a worker
that dies fails the search with one clear error."""

from __future__ import annotations

import math
import os
import random
import signal

import pytest

from h2jax.cluster import ChipGroup, ChipType, Cluster
from h2jax.planner import PlannerError, homogeneous_baselines
from h2jax.planner import search
from h2jax.planner.workers import Pool


def random_cluster(rng: random.Random) -> Cluster:
    """2-3 types of 2-4 chips: under `auto` the interleaved 1F1B and ZB-H1 plans often beat or
    tie 1F1B's on the tiny model (most of these clusters have a schedule after 1F1B with
    plans under its cutoff)."""
    groups = []
    for i in range(rng.choice([2, 3])):
        chip = ChipType(f"chip{i}", "cpu", rng.choice([0.05, 0.1, 0.2]), rng.choice([0.3, 1.0, 2.5]),
                        rng.choice([1, 2, 4]), rng.choice([5.0, 50.0]), rng.choice([0.5, 2.0]), "t")
        groups.append(ChipGroup(chip, rng.randint(2, 4)))
    return Cluster(tuple(groups), name="random")


def outcome(found, stats) -> tuple:
    """What a search returns that must not depend on where it ran (not its counters or times)."""
    plans = [(c.time_s, c.label, c.micro_batch, c.options, c.layers) for c in found]
    return (plans, stats.schedule_times, stats.schedule_bounds, stats.proved_optimal, stats.one_shape_time_s,
            stats.lower_bound_s)


def test_auto_with_workers_returns_what_one_process_returns(monkeypatch):
    """8 random clusters, the 3 best plans over two shapes: `auto` with 3 processes (ZB-H1
    and one interleaved 1F1B each in a worker, the other here, all for plans under 1F1B's
    cutoff) returns the same plans, schedule times and bounds as one process searching one
    schedule after another under every cutoff before it. The test counts the cases where a
    schedule searched at once found plans that its cutoff one after the other leaves out
    (the replay in `_search_one` must drop them: it fails without that)."""
    monkeypatch.setattr(search, "PARALLEL_AFTER_S", 0.0)  # (small clusters: at once all the same)
    cutoffs: dict = {}
    real_one, real_outcome = search._search_one, search._Rest.outcome

    def one(*args, **kwargs):  # the cutoff each schedule gets one after the other
        cutoffs[(args[5], args[6])] = args[14] if len(args) > 14 else kwargs.get("cutoff", math.inf)
        return real_one(*args, **kwargs)

    at_once: list = []

    def outcome_of(self, i):
        out = real_outcome(self, i)
        at_once.append((self.runs[i], out))
        return out

    monkeypatch.setattr(search, "_search_one", one)
    monkeypatch.setattr(search._Rest, "outcome", outcome_of)
    rng = random.Random(1)
    compared = dropped = 0
    while compared < 8:
        cluster, seq, batch = random_cluster(rng), rng.choice([32, 64]), rng.choice([8, 16])
        kw = dict(k=3, schedule="auto", mixed_shapes=True)
        try:
            alone = outcome(*search.top_k(cluster, "tiny", seq, batch, **kw))
        except PlannerError:
            continue
        at_once.clear()
        assert outcome(*search.top_k(cluster, "tiny", seq, batch, workers=3, **kw)) == alone
        assert {run for run, _ in at_once} == {("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 1)}
        dropped += any(isinstance(out, tuple) and any(c.time_s >= cutoffs[run] for c in out[0])
                       for run, out in at_once)
        compared += 1
    assert dropped >= 4, dropped


def test_a_small_auto_search_stays_in_one_process(monkeypatch):
    """Where the first schedule's search took less than PARALLEL_AFTER_S the rest run here,
    one after the other (starting processes would cost more than they save)."""
    started = []
    monkeypatch.setattr(search._Rest, "start", lambda self, *a: started.append(a))
    monkeypatch.setattr(search, "PARALLEL_AFTER_S", 1e9)
    cluster = random_cluster(random.Random(3))
    (best,), stats = search.top_k(cluster, "tiny", 32, 8, schedule="auto", workers=4)
    assert not started and len(stats.schedule_times) + len(stats.schedule_bounds) >= 4


def test_baselines_at_once_are_the_baselines_one_after_another():
    """Each chip type alone, searched at once in 2 processes: the same baselines (the unfit
    type's reason too) as one after the other."""
    rng = random.Random(5)
    cluster = random_cluster(rng)
    small = ChipType("small", "cpu", 0.0001, 1.0, 1, 5.0, 0.5, "t")  # holds no plan of its own
    cluster = Cluster(cluster.groups + (ChipGroup(small, 2),), name="random")
    kw = dict(schedule="auto", mixed_shapes=True)
    one = homogeneous_baselines(cluster, "tiny", 32, 8, **kw)
    both = homogeneous_baselines(cluster, "tiny", 32, 8, at_once=2, **kw)
    assert list(one) == list(both) == list(cluster.counts)
    assert one["small"].reason and one["small"].tokens_per_s == 0
    for name in one:
        a, b = one[name], both[name]
        assert (a.tokens_per_s, a.iteration_time_s, a.reason) == (b.tokens_per_s, b.iteration_time_s, b.reason)
        assert (a.plan.to_dict() if a.plan else None) == (b.plan.to_dict() if b.plan else None)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_that_dies_fails_the_search_with_one_clear_error():
    """A worker killed (kill -9, the OOM killer) under its work: the caller gets a
    PlannerError naming the work and the fix, not a wait or a bare BrokenProcessPool."""
    with Pool(1, "the search of a schedule") as pool:
        with pytest.raises(PlannerError, match="a process of the search of a schedule died.*--jobs"):
            pool.result(pool.submit(_die))


def test_ctrl_c_while_the_schedules_are_searched_at_once_ends_the_workers(monkeypatch):
    """KeyboardInterrupt in the planner while a worker searches ZB-H1 (here: in this process's
    own share of the schedules): it reaches the caller, and no worker is left running."""
    import multiprocessing

    monkeypatch.setattr(search, "PARALLEL_AFTER_S", 0.0)
    real = search._search_dual  # (a worker imports its own: only this process's searches see this one)

    def interrupted(ctx, *args):
        if ctx.schedule != "1f1b":  # this process's share of the schedules after the first
            assert multiprocessing.active_children()  # the worker is under way
            raise KeyboardInterrupt
        return real(ctx, *args)

    monkeypatch.setattr(search, "_search_dual", interrupted)
    cluster = random_cluster(random.Random(1))
    with pytest.raises(KeyboardInterrupt):
        search.top_k(cluster, "tiny", 32, 8, schedule="auto", workers=2)
    assert not multiprocessing.active_children()
