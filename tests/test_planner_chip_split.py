"""The exact two-shape search (chip_split.prove): branch and bound over how each chip type's
chips split between its two blocks, against the exhaustive two-shape enumeration."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
from pathlib import Path

import pytest

from h2jax.cluster import ChipGroup, Cluster, load_cluster
from h2jax.planner import chip_split, dual_search, plan_cluster, search
from h2jax.planner import positions as pos
from h2jax.planner.search import top_k
from h2jax.planner.space import Candidate, PlannerError, SearchStats, divisors, make_context
from h2jax.planner.split import TopK
from test_planner_mixed_shapes import CASES, chip, layout

REPO = Path(__file__).resolve().parent.parent


def random_cluster(rng: random.Random) -> Cluster:
    groups = []
    for i in range(rng.choice([1, 2, 2])):
        groups.append(ChipGroup(chip(f"chip{i}", rng.choice([0.004, 0.008, 0.016]), rng.choice([0.1, 0.3, 1.0, 2.5]),
                                     rng.choice([2, 4]), rng.choice([0.5, 2.0, 10.0]), rng.choice([5.0, 50.0]),
                                     rng.choice(["float32", "bfloat16"])), rng.randint(2, 6)))
    return Cluster(tuple(groups), name="random")


@pytest.mark.slow
def test_the_proof_equals_the_exhaustive_two_shape_optimum_on_200_random_clusters():
    """200 seeded clusters of 1-2 types, 2-6 chips each, 1F1B and GPipe: the proved plan's
    time is the exhaustive two-shape optimum's, and it is proved. (Recompute none or full:
    the exhaustive space of two blocks grows with the square of a type's shapes.)"""
    rng = random.Random(2)
    checked, won, apart = 0, 0, 0
    while checked < 200:
        cluster = random_cluster(rng)
        seq, batch, schedule = rng.choice([32, 128]), rng.choice([2, 4]), rng.choice(["1f1b", "gpipe"])
        kw = dict(schedule=schedule, recompute=("none", "full"))
        try:
            (proved,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, **kw)
        except PlannerError:
            continue
        (full,), _ = top_k(cluster, "tiny", seq, batch, mixed_shapes=True, exhaustive=True, **kw)
        assert stats.two_shapes_proved and stats.two_shape_nodes >= 1
        assert math.isclose(proved.time_s, full.time_s, rel_tol=1e-9), (layout(proved), layout(full))
        assert stats.two_shape_lower_bound_s == proved.time_s
        won += proved.time_s < stats.one_shape_time_s * (1 - 1e-9)
        chips = [o.chip for o in proved.options]
        apart += any(chips.count(c) == 2 and chips.index(c) + 1 < len(chips) - 1 - chips[::-1].index(c)
                     for c in chips)
        checked += 1
    assert won >= 10 and apart >= 1  # cases where two shapes beat one, a type's blocks apart, among them


APART = Cluster((ChipGroup(chip("chip0", 0.004, 0.1, 4, 10.0, 50.0), 6), ChipGroup(chip("chip1", 0.008, 0.1, 4, 10.0, 5.0), 8)))


def test_a_types_two_blocks_may_sit_apart():
    """A case whose two-shape optimum runs chip1 at both ends of the pipeline, chip0 between:
    the proof finds it (the local search too, by moving some of chip1's stages: test_planner_mixed_shapes)."""
    kw = dict(schedule="gpipe")
    (proved,), stats = top_k(APART, "tiny", 32, 2, prove_two_shapes=True, **kw)
    (full,), _ = top_k(APART, "tiny", 32, 2, mixed_shapes=True, exhaustive=True, **kw)
    (local,), _ = top_k(APART, "tiny", 32, 2, mixed_shapes=True, **kw)
    assert math.isclose(proved.time_s, full.time_s, rel_tol=1e-9)
    chips = [o.chip for o in proved.options]
    assert chips[0] == chips[-1] != chips[1], layout(proved)  # one type at both ends
    assert math.isclose(local.time_s, proved.time_s, rel_tol=1e-9)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_proof_keeps_the_local_searchs_optimum_where_it_is_one(case):
    cluster, seq, batch, schedule = CASES[case]
    (local,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
    (proved,), stats = top_k(cluster, "tiny", seq, batch, schedule=schedule, prove_two_shapes=True)
    (full,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True, exhaustive=True)
    assert stats.two_shapes_proved
    assert math.isclose(proved.time_s, full.time_s, rel_tol=1e-9) and proved.time_s <= local.time_s


def test_a_node_is_a_virtual_cluster_of_two_types_per_chip():
    ctx = make_context(Cluster((ChipGroup(chip("a", 0.008, 1.0), 8), ChipGroup(chip("b", 0.008, 1.0), 5))),
                       "tiny", 32, 4)
    v = chip_split.virtual_context(ctx, {"a": (2, 4), "b": (0, 0)})
    assert v.counts == {"a#1": 4, "a#2": 6, "b#2": 5}  # t#1: hi chips (none at 0); t#2: C - lo
    assert all(v.chips[n] is ctx.chips[chip_split.real_name(n)] for n in v.order)
    assert v._terms is ctx._terms and v._options is not ctx._options  # terms shared, shapes per node
    a1 = next(o for o in v.type_options(4, prune_unfit=False)[0] if o.chip == "a#1" and o.chips == 2)
    a2 = next(o for o in v.type_options(4, prune_unfit=False)[1] if o.chip == "a#2" and o.chips == 2)
    b2 = next(o for o in v.type_options(4, prune_unfit=False)[2] if o.chip == "b#2")
    cand = Candidate(1.0, 4, (a1, b2, a2), (1, 1, 1))
    assert chip_split.usage(cand) == {"a": (2, 2), "b": (0, b2.chips)}
    real = chip_split.as_real(cand)
    assert [o.chip for o in real.options] == ["a", "b", "a"] and real.layers == cand.layers
    both = chip_split.as_real(dataclasses.replace(cand, options=(a1, a2, b2)))
    assert [o.chip for o in both.options] == (["a", "b"] if a1.shape == a2.shape else ["a", "a", "b"])
    # another node whose a#2 and b#2 have the same counts shares their shapes and tables (a
    # type's are made once per chip count); its a#1 has another count: its own
    w = chip_split.virtual_context(ctx, {"a": (2, 3), "b": (0, 0)})
    assert w.type_shapes(4, True)[1:] == v.type_shapes(4, True)[1:]
    assert all(x is y for x, y in zip(pos.type_tables(w, 4)[1:], pos.type_tables(v, 4)[1:]))
    (a1_w, *_), (a1_v, *_) = pos.type_tables(w, 4), pos.type_tables(v, 4)
    assert a1_w is not a1_v and a1_w.k_max.max() < a1_v.k_max.max()  # 3 chips, not 4


def test_out_of_time_the_proof_returns_the_best_found_and_a_valid_bound():
    kw = dict(schedule="gpipe")
    (full,), _ = top_k(APART, "tiny", 32, 2, mixed_shapes=True, exhaustive=True, **kw)
    ctx = make_context(APART, "tiny", 32, 2, "gpipe")
    (local,), stats = top_k(APART, "tiny", 32, 2, mixed_shapes=True, **kw)
    st = SearchStats()
    best = chip_split.prove(ctx, divisors(2), local, st, deadline=0.0)  # already past
    assert best is local and st.two_shapes_proved is False
    assert st.two_shape_lower_bound_s <= full.time_s


def test_a_one_shape_search_out_of_time_leaves_the_proofs_valid_bound(monkeypatch, capsys):
    """When the time runs out in the one-shape search, the proof still reports (not proved,
    the root's bound) and `h2jax plan` prints it (it used to meet no bound and fail)."""
    from h2jax.cli.plan import print_table
    from h2jax.planner.split import OutOfTime

    real = dual_search.search

    def out_of_time(ctx, mbs, top, stats, deadline=math.inf, **kw):  # finds its plans, then the time is up
        real(ctx, mbs, top, stats, math.inf, **kw)
        raise OutOfTime

    monkeypatch.setattr(dual_search, "search", out_of_time)
    result = plan_cluster(APART, "tiny", 32, 2, schedule="gpipe", baselines=False, prove_two_shapes=True,
                          time_limit_s=1e-9)
    pred = result.plan.predicted
    assert pred["proved_optimal"] is False and pred["two_shapes_proved"] is False
    assert 0.0 <= pred["two_shape_lower_bound_s"] <= pred["step_time_s"]
    print_table(result, APART, None)
    assert "two shapes per type NOT proved within the time limit" in capsys.readouterr().out


def test_plan_reports_the_two_shape_proof(capsys):
    from h2jax.cli.plan import print_table

    result = plan_cluster(APART, "tiny", 32, 2, schedule="gpipe", baselines=False, prove_two_shapes=True)
    pred = result.plan.predicted
    assert pred["two_shapes_proved"] is True and pred["two_shape_nodes"] >= 1
    assert pred["two_shape_lower_bound_s"] == pytest.approx(pred["step_time_s"], rel=1e-9)
    print_table(result, APART, None)
    out = capsys.readouterr().out
    assert "among plans with up to two shapes per chip type" in out and "faster than the best with one shape" in out
    # out of time: the plan as found, the two-shape optimum's bound
    pred.update(two_shapes_proved=False, two_shape_lower_bound_s=0.0123, two_shapes_faster_by=0.05)
    print_table(result, APART, None)
    out = " ".join(capsys.readouterr().out.split())
    assert "two shapes per type NOT proved within the time limit" in out and "at least 0.0123 s" in out
    assert "the best found (not proved optimal), are 5.00% faster" in out and "local search" not in out


def test_plan_prints_each_schedules_time_or_that_it_is_slower(capsys):
    """--schedule auto: the winner, the others' times, those with no plan under the cutoff as
    slower (proved) or not proved (the time limit stopped their search), and those left out
    as never faster than one searched."""
    from h2jax.cli.plan import print_table

    result = plan_cluster(APART, "tiny", 32, 2, schedule="auto", baselines=False, mixed_shapes=False)
    pred = result.plan.predicted
    won, t_won = next(iter(pred["schedule_times_s"].items()))
    assert pred["schedule_bounds_s"]  # (this cluster: a schedule with no plan under 1F1B's)
    pred["schedule_bounds_s"] = {"interleaved-1f1b (v=2)": t_won * 1.5, "zb-h1": t_won * 0.5}
    print_table(result, APART, None)
    out = " ".join(capsys.readouterr().out.split())
    assert f"schedule: {won} won;" in out
    assert f"interleaved-1f1b (v=2) slower (no plan under {t_won * 1.5:.4g} s)" in out
    assert "gpipe not searched (never faster than 1f1b)" in out
    assert f"zb-h1 no plan found under {t_won:.4g} s, not proved (time limit; at least {t_won * 0.5:.4g} s)" in out


class _Stop(Exception):
    pass


class _StopAt(TopK):
    """A top 1 that ends the search at its n-th push (before taking the plan in)."""

    def __init__(self, n: int) -> None:
        super().__init__(1)
        self.n = n

    def push(self, cand: Candidate) -> None:
        self.n -= 1
        if self.n == 0:
            raise _Stop
        super().push(cand)


@pytest.mark.parametrize("h100s", [32, 20])
def test_a_search_started_from_the_boxes_another_left_finds_the_same_optimum(h100s):
    """A search of the 64-chip cluster stopped at its n-th push (n = 1, 2, ...: every stop it
    has) leaves its open boxes; a search of the same space, or of one inside it (fewer
    chips of a type: what the proof's children have), started from them with the plans found
    so far reaches the optimum a fresh search reaches, and its bound never exceeds it."""
    cluster = load_cluster(REPO / "plans" / "cluster-64.toml")
    parent = make_context(cluster, "llama-100b", 4096, 2048)
    child = make_context(Cluster(tuple(ChipGroup(g.chip, h100s if g.chip.name == "nvidia-h100" else g.count)
                                       for g in cluster.groups)), "llama-100b", 4096, 2048)
    mbs = divisors(2048)
    stops = 0
    for n in itertools.count(1):
        stopped, left = _StopAt(n), []
        try:
            dual_search.search(parent, mbs, stopped, SearchStats(), dives=0, left=left)
        except _Stop:
            pass
        else:
            break  # the whole search took fewer pushes
        stops += 1
        assert left  # (the box being resolved, at least)
        fresh, resumed = TopK(1), TopK(1)
        for c in stopped.sorted():  # the plans found before the stop seed both
            fresh.push(c)
            resumed.push(c)
        dual_search.search(child, mbs, fresh, SearchStats(), dives=0)
        st = SearchStats()
        dual_search.search(child, mbs, resumed, st, dives=0, start=left)
        assert resumed.sorted()[0].time_s == pytest.approx(fresh.sorted()[0].time_s, rel=1e-12)
        assert st.lower_bound_s <= fresh.sorted()[0].time_s * (1 + 1e-12)
    assert stops >= 3


@pytest.mark.parametrize("space", ["real", "virtual"])
def test_a_search_out_of_work_leaves_the_boxes_a_resumed_search_finishes_from(space):
    """A search given `max_work` stops with OverBudget -- on the 64-chip cluster from scratch
    inside a box's walk (its lists), on the proof's root node seeded with the one-shape optimum
    between two generations (its bound rows) -- and leaves its open boxes; the search of a
    space a few chips narrower started from them (and the plans found so far) reaches the
    optimum a fresh search reaches."""
    import sys
    import traceback

    cluster = load_cluster(REPO / "plans" / "cluster-64.toml")
    ctx = make_context(cluster, "llama-100b", 4096, 2048)
    mbs = divisors(2048)
    stopped, left = TopK(1), []
    if space == "real":
        parent = ctx
        child = make_context(Cluster(tuple(ChipGroup(g.chip, 24 if g.chip.name == "nvidia-h100" else g.count)
                                           for g in cluster.groups)), "llama-100b", 4096, 2048)
    else:
        one = TopK(1)
        dual_search.search(ctx, mbs, one, SearchStats(), dives=0)
        stopped.push(one.sorted()[0])
        root = {name: (0, ctx.counts[name] // 2) for name in ctx.order}
        parent = chip_split.virtual_context(ctx, root)
        child = chip_split.virtual_context(ctx, {**root, "nvidia-h100": (0, 8)})
    with pytest.raises(dual_search.OverBudget):
        try:
            # (from scratch, the micro-batch sizes' roots take the first generation's rows: 80 then reach a walk)
            dual_search.search(parent, mbs, stopped, SearchStats(), dives=0, left=left,
                               max_work=80.0 if space == "real" else 5.0)
        except dual_search.OverBudget:
            where = traceback.extract_tb(sys.exc_info()[2])[-2].name
            raise
    assert where == ("_leaf" if space == "real" else "search") and left
    fresh, resumed = TopK(1), TopK(1)
    for c in stopped.sorted():
        fresh.push(c)
        resumed.push(c)
    dual_search.search(child, mbs, fresh, SearchStats(), dives=0)
    dual_search.search(child, mbs, resumed, SearchStats(), dives=0, start=left)
    assert resumed.sorted()[0].time_s == pytest.approx(fresh.sorted()[0].time_s, rel=1e-12)


def test_a_node_splits_a_range_from_zero_at_one_else_at_the_over_plan_or_the_middle():
    """`_split`: after a plan over a type's chips, on the type most over them, at min(u1,
    middle + 1); after the node's work ran out, on the widest range, at its middle + 1; a
    range from 0 at 1 (x = 0: the type in one block)."""
    ctx = make_context(Cluster((ChipGroup(chip("a", 0.008, 1.0), 5), ChipGroup(chip("b", 0.008, 1.0), 6))),
                       "tiny", 32, 4)
    out = chip_split._Outcome("budget", None, None, 0.0, [])
    assert chip_split._split(ctx, chip_split._Node(0.0, 0, {"a": (1, 3), "b": (1, 2)}), out) == ("a", 3)  # widest
    node = chip_split._Node(0.0, 0, {"a": (1, 3), "b": (0, 3)})
    assert chip_split._split(ctx, node, out) == ("b", 1)  # the widest, from 0: at 1
    v = chip_split.virtual_context(ctx, node.bounds)
    opts = dict(zip(v.order, v.type_options(4, prune_unfit=False)))
    a1, a2, b2 = (next(o for o in opts[name] if o.chips == n) for name, n in (("a#1", 2), ("a#2", 4), ("b#2", 1)))
    over = Candidate(1.0, 4, (a1, b2, a2), (1, 1, 1))  # a: 2 + 4 > 5 chips
    assert chip_split._split(ctx, node, dataclasses.replace(out, kind="over", over=over)) == ("a", 2)  # u1 < 3


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_a_schedule_whose_lists_go_by_length_gives_a_node_more_work(schedule):
    """ZB-H1's search takes its lists apart by pipeline length (tables per range): a node's
    start costs more, so it may do RANGED_NODE_WORK before it splits; 1F1B and GPipe NODE_WORK."""
    ctx = make_context(APART, "tiny", 32, 2, schedule)
    ranged = dual_search.length_ranges(ctx, ctx.global_batch) != [None]
    assert ranged == (schedule == "zb-h1")
    assert chip_split.node_work(ctx) == (chip_split.RANGED_NODE_WORK if ranged else chip_split.NODE_WORK)
    assert chip_split.RANGED_NODE_WORK > chip_split.NODE_WORK


def test_the_proof_stays_exact_when_nodes_split_for_running_out_of_work(monkeypatch):
    """With almost no work per node, nearly every node splits before it is done (on its
    widest range, from the boxes it left): on the clusters whose proof beats the local
    search's plan, it still reaches the exhaustive two-shape optimum, proved."""
    monkeypatch.setattr(chip_split, "NODE_WORK", 0.5)
    monkeypatch.setattr(search, "WIDE_SPACE", 0)  # (the narrow local search: it misses these optima)
    kinds = []
    real = chip_split._search_node

    def counted(*args, **kw):
        out = real(*args, **kw)
        kinds.append(out.kind)
        return out

    monkeypatch.setattr(chip_split, "_search_node", counted)
    for cluster, seq, batch, kw in multi_node_cases():
        (proved,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, **kw)
        (full,), _ = top_k(cluster, "tiny", seq, batch, mixed_shapes=True, exhaustive=True, **kw)
        (local,), _ = top_k(cluster, "tiny", seq, batch, mixed_shapes=True, **kw)
        assert stats.two_shapes_proved and stats.two_shape_lower_bound_s == proved.time_s
        assert math.isclose(proved.time_s, full.time_s, rel_tol=1e-9), (layout(proved), layout(full))
        assert proved.time_s < local.time_s * (1 - 1e-9)  # (so a proof that drops a node cannot pass)
    assert kinds.count("budget") >= 10


# ----------------------------------------------------------------------------- worker processes


# (chip groups, seq, batch, schedule): seeded random clusters whose proof takes three nodes or
# more (the root's halves run at once: three or seven since a range from 0 splits at 1 first)
# and, but the last, beats the narrow local search's plan (search.WIDE_SPACE 0; it reaches the last one's optimum)
MULTI_NODE = [
    ([(("chip0", 0.004, 2.5, 4, 0.5, 5.0, "bfloat16"), 3)], 128, 4, "gpipe"),
    ([(("chip0", 0.004, 0.3, 2, 10.0, 50.0, "float32"), 3)], 128, 2, "gpipe"),
    ([(("chip0", 0.004, 2.5, 4, 0.5, 5.0, "float32"), 6), (("chip1", 0.008, 1.0, 4, 0.5, 50.0, "bfloat16"), 3)],
     128, 4, "1f1b"),
    ([(("chip0", 0.016, 0.3, 2, 10.0, 50.0, "bfloat16"), 2), (("chip1", 0.004, 1.0, 4, 10.0, 5.0, "bfloat16"), 3)],
     128, 4, "gpipe"),
    ([(("chip0", 0.004, 2.5, 2, 2.0, 5.0, "float32"), 3)], 128, 2, "1f1b"),
    ([(("chip0", 0.004, 0.3, 2, 0.5, 5.0, "float32"), 3)], 128, 2, "gpipe"),
    ([(("chip0", 0.004, 2.5, 4, 10.0, 5.0, "float32"), 6)], 128, 4, "1f1b"),
]


def multi_node_cases():
    """MULTI_NODE but the last, as (cluster, seq, batch, top_k keywords): the proofs that beat
    the local search's plan."""
    for groups, seq, batch, schedule in MULTI_NODE[:-1]:
        cluster = Cluster(tuple(ChipGroup(chip(*args), count) for args, count in groups))
        yield cluster, seq, batch, dict(schedule=schedule, recompute=("none", "full"))


def test_nodes_searched_by_worker_processes_reach_the_same_proved_optimum(monkeypatch):
    """Two worker processes from the first node on (POOL_AFTER_S 0): on clusters whose proof
    takes several nodes and beats the local search's plan, the proof reaches the optimum the
    proof in one process reaches, proved."""
    monkeypatch.setattr(search, "WIDE_SPACE", 0)  # (the narrow local search: it misses these optima)
    for cluster, seq, batch, kw in multi_node_cases():
        (alone,), one = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, **kw)
        (local,), _ = top_k(cluster, "tiny", seq, batch, mixed_shapes=True, **kw)
        assert one.two_shape_nodes >= 3  # (what the case is for)
        assert alone.time_s < local.time_s * (1 - 1e-9)  # (so a proof that drops a node cannot pass)
        with monkeypatch.context() as m:
            m.setattr(chip_split, "POOL_AFTER_S", 0.0)
            (proved,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, workers=2, **kw)
        assert stats.two_shapes_proved and stats.two_shape_lower_bound_s == proved.time_s
        assert proved.time_s == pytest.approx(alone.time_s, rel=1e-9), (layout(proved), layout(alone))


def test_a_proof_worker_that_dies_fails_the_proof_with_one_clear_error():
    """A worker killed (kill -9, the OOM killer) under a node: the proof raises a PlannerError
    that says so, instead of waiting for the node forever."""
    import os
    import signal

    ctx = make_context(APART, "tiny", 32, 2, "gpipe")
    (local,), _ = top_k(APART, "tiny", 32, 2, schedule="gpipe", mixed_shapes=True)
    pool = chip_split._NodePool(ctx, divisors(2), 1)
    try:
        node = chip_split._Node(0.0, 0, {name: (0, ctx.counts[name] // 2) for name in ctx.order})
        running = {0: (node, pool.submit(node, local, math.inf))}
        for process in pool._pool._pool._processes.values():  # still starting: it has not taken the node
            os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(PlannerError, match="a process of the two-shape proof died"):
            pool.next_done(running)
    finally:
        pool.close()


_KILLED_PLANNER = """
import sys, threading, time, multiprocessing
from pathlib import Path
from h2jax.cluster import load_cluster
from h2jax.planner import chip_split, top_k
chip_split.POOL_AFTER_S = 0.0
def say_workers():
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.05)
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
if __name__ == "__main__":
    threading.Thread(target=say_workers, daemon=True).start()
    top_k(load_cluster(Path(sys.argv[1])), "llama-100b", 4096, 2048, prove_two_shapes=True, workers=2)
"""


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="watches the workers through /proc")
def test_proof_workers_end_when_the_planner_is_killed(tmp_path):
    """kill -9 of a planner in the middle of a proof (its workers each under a node of the
    768-chip cluster's, minutes of work): the workers end too, instead of searching on."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import checkout_env

    script = tmp_path / "planner.py"
    script.write_text(_KILLED_PLANNER)
    proc = subprocess.Popen([sys.executable, str(script), str(REPO / "plans" / "cluster-768.toml")],
                            stdout=subprocess.PIPE, text=True, env=checkout_env(dict(os.environ)))
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(workers) == 2
    deadline = time.monotonic() + 120  # a guard against a worker that never ends, not a measurement
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in workers), workers


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (not a zombie waiting for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_workers_below_one_are_refused_by_name():
    with pytest.raises(PlannerError, match="workers must be a whole number >= 1"):
        top_k(APART, "tiny", 32, 2, prove_two_shapes=True, workers=0)


# ----------------------------------------------------------------------------- progress and Ctrl-C


def _multi_node(i: int):
    groups, seq, batch, schedule = MULTI_NODE[i]
    cluster = Cluster(tuple(ChipGroup(chip(*args), count) for args, count in groups))
    return cluster, seq, batch, dict(schedule=schedule, recompute=("none", "full"))


def test_a_proof_reports_where_it_stands_after_each_node():
    """`proof_progress` hears when the proof begins and after each node: the nodes searched,
    the best plan (never slower), the least open bound (never above the best); the last
    report of a finished proof has no node open and the bound at the optimum."""
    cluster, seq, batch, kw = _multi_node(2)
    seen = []
    (best,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, proof_progress=seen.append, **kw)
    assert stats.two_shapes_proved and stats.two_shape_nodes >= 3
    assert [p.nodes for p in seen] == list(range(stats.two_shape_nodes + 1))
    assert seen[0].open == 1 and seen[0].bound_s == 0.0 and seen[0].schedule == kw["schedule"]
    assert all(b.best_s <= a.best_s for a, b in zip(seen, seen[1:]))
    assert all(p.bound_s <= p.best_s for p in seen)
    assert seen[-1].open == 0 and seen[-1].best_s == best.time_s == seen[-1].bound_s and seen[-1].gap == 0.0


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_the_proof_with_the_best_plan_and_a_valid_bound(signum):
    """Ctrl-C (KeyboardInterrupt; SIGTERM arrives as one with its `signum`) after a few nodes
    stops the proof as the time limit does: the best plan found, not proved, the signal
    named, and a bound at most the optimum the whole proof proves."""
    import signal

    cluster, seq, batch, kw = _multi_node(2)
    (optimum,), _ = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, **kw)
    interrupt = KeyboardInterrupt()
    interrupt.signum = signal.Signals[signum]
    seen = []

    def stop_at_two(p):
        seen.append(p)
        if p.nodes == 2:
            raise interrupt

    (best,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, proof_progress=stop_at_two, **kw)
    assert stats.two_shapes_proved is False and stats.two_shapes_stopped == signum
    assert stats.two_shape_nodes == 2
    assert stats.two_shape_lower_bound_s == seen[-1].bound_s <= optimum.time_s <= best.time_s


def test_ctrl_c_in_the_middle_of_a_node_leaves_that_node_open(monkeypatch):
    """Ctrl-C while a node is searched: that node stays open at its bound (best bound first:
    the least of all), so the proof's bound is the one reported before it began."""
    cluster, seq, batch, kw = _multi_node(2)
    (optimum,), _ = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, **kw)
    real, calls, seen = chip_split._search_node, [], []

    def search_node(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(chip_split, "_search_node", search_node)
    (best,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, proof_progress=seen.append, **kw)
    assert stats.two_shapes_stopped == "SIGINT" and stats.two_shape_nodes == 3
    assert seen[-1].nodes == 2 and 0 < seen[-1].bound_s < optimum.time_s  # (the node it stopped in holds it)
    assert stats.two_shape_lower_bound_s == seen[-1].bound_s


def test_ctrl_c_ends_the_proofs_worker_processes(monkeypatch):
    """Ctrl-C with the root's halves handed to two workers, one of them reported done: the
    other stays open, and the workers end."""
    import multiprocessing

    cluster, seq, batch, kw = _multi_node(2)
    monkeypatch.setattr(chip_split, "POOL_AFTER_S", 0.0)
    seen = []

    def stop_after_a_half(p):
        seen.append(p)
        if p.nodes == 3:  # (the root, then both halves handed out: reported as the first ends)
            assert len(multiprocessing.active_children()) == 2 and p.open >= 1
            raise KeyboardInterrupt

    (best,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, workers=2,
                           proof_progress=stop_after_a_half, **kw)
    assert [p.nodes for p in seen] == [0, 1, 3]
    assert stats.two_shapes_stopped == "SIGINT" and stats.two_shapes_proved is False
    assert stats.two_shape_lower_bound_s == seen[-1].bound_s
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("case", [0, 1, 2, 4, 5, 6])
def test_auto_proves_each_schedule_against_the_best_before_it(case):
    """--schedule auto with the proof: every schedule's proof runs, each after the first only
    to show that no plan of its schedule beats the best before it (its last report: no node
    open, the bound at that target); the proved plan's time is the exhaustive two-shape
    optimum over every schedule, and schedules with no plan under the cutoff are listed with a
    bound no lower than the plan's time. (Cases whose interleaved proofs take seconds left out.)"""
    cluster, seq, batch, kw = _multi_node(case)
    kw["schedule"] = "auto"
    proofs = []
    (proved,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, proof_progress=proofs.append, **kw)
    (full,), _ = top_k(cluster, "tiny", seq, batch, mixed_shapes=True, exhaustive=True, **kw)
    assert stats.two_shapes_proved
    assert math.isclose(proved.time_s, full.time_s, rel_tol=1e-9), (layout(proved), layout(full))
    last = {p.schedule: p for p in proofs}
    assert set(last) == set(stats.schedule_times) | set(stats.schedule_bounds)  # each proved
    assert all(p.open == 0 and p.bound_s == p.best_s for p in last.values())
    # each proof's target (the time a plan must beat) is no slower than the one before it ends
    # with: the best plan so far is its cutoff (but ZB-H1's: its plan may yet lose)
    before = math.inf
    for label, p in last.items():  # (in the order the proofs ran)
        assert p.best_s <= before * (1 + 1e-12), (label, p.best_s, before)
        before = p.best_s if label != "zb-h1" else before
    assert all(b >= proved.time_s * (1 - 1e-9) for b in stats.schedule_bounds.values())
    assert stats.schedules_left_out == {"gpipe": "1f1b"}  # (never faster: not searched, not proved)


def test_ctrl_c_in_one_schedules_proof_leaves_the_other_schedules_unproved():
    """--schedule auto runs a proof per schedule: after Ctrl-C stops one, the schedules after it
    are searched without one, and the two-shape optimum's bound is then 0 (nothing proved)."""
    cluster, seq, batch, kw = _multi_node(2)
    kw["schedule"] = "auto"
    proofs = []

    def stop_first(p):
        proofs.append(p.schedule)
        if len(set(proofs)) == 1 and p.nodes == 1:
            raise KeyboardInterrupt

    (best,), stats = top_k(cluster, "tiny", seq, batch, prove_two_shapes=True, proof_progress=stop_first, **kw)
    assert len(set(proofs)) == 1  # no other schedule's proof ran
    assert len(stats.schedule_times) + len(stats.schedule_bounds) > 1  # the others were searched
    assert stats.proved_optimal  # (their one-shape searches, exactly)
    assert stats.two_shapes_proved is False and stats.two_shapes_stopped == "SIGINT"
    assert stats.two_shape_lower_bound_s == 0.0


def test_ctrl_c_on_h2jax_plan_writes_the_best_plan_found(tmp_path):
    """`h2jax plan --prove-two-shapes` on 768 chips (a proof of minutes), Ctrl-C once the
    proof says it began (a line on stderr: not a terminal): the plan found so far is written
    and valid, the summary says the proof was stopped by Ctrl-C, and the command succeeds."""
    import signal
    import subprocess
    import sys

    from h2jax.plan import load_plan
    from tests.conftest import checkout_env

    out = tmp_path / "plan.json"
    args = ["plan", "--cluster", str(REPO / "plans" / "cluster-768.toml"), "--model", "llama-100b",
            "--seq-len", "4096", "--global-batch-tokens", "8M", "--schedule", "1f1b", "--prove-two-shapes",
            "--jobs", "1", "--no-baselines", "--out", str(out)]
    # `python -m h2jax ...`, with Ctrl-C's KeyboardInterrupt even where the test runner ignores SIGINT
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv = ['h2jax'] + sys.argv[1:]; runpy.run_module('h2jax', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=checkout_env(dict(os.environ)))
    try:
        first = proc.stderr.readline()
        assert first.startswith("two-shape proof (1f1b): 0 nodes, 1 open") and "Ctrl-C stops it" in first, first
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)  # a guard, not a measurement
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "two shapes per type NOT proved (stopped by Ctrl-C after" in stdout
    assert f"plan written to {out}" in stdout
    plan = load_plan(out)
    assert plan.predicted["two_shapes_proved"] is False and plan.predicted["two_shapes_stopped_by"] == "SIGINT"
    assert 0.0 <= plan.predicted["two_shape_lower_bound_s"] <= plan.predicted["step_time_s"]


def test_a_node_does_not_solve_again_a_list_an_earlier_search_showed_cannot_beat_its_time(monkeypatch):
    """A list the walk solved and found no faster than the time to beat is not solved again by
    a later search of a context that shares the record (a proof's nodes: virtual contexts of
    one cluster) whose time to beat is no higher: the same plan, no list solved. Where the time
    to beat is higher (a slower best so far), those lists are solved again; a context with its
    own record solves them all."""
    cluster = load_cluster(REPO / "plans" / "cluster-64.toml")
    ctx = make_context(cluster, "llama-100b", 4096, 2048)
    mbs = divisors(2048)
    one = TopK(1)
    dual_search.search(ctx, mbs, one, SearchStats(), dives=0)
    slower = one.sorted()[0]  # the one-shape optimum: the H100s split 16 + 16 hold a faster plan
    node = {"nvidia-h100": (16, 16), "nvidia-a100": (0, 0)}  # every plan within the chips
    solved = []
    real = dual_search.solve

    def spy(ctx, b, chosen, top, stats):
        solved.append(1)
        return real(ctx, b, chosen, top, stats)

    monkeypatch.setattr(dual_search, "solve", spy)

    def walk(context, seed):
        solved.clear()
        top = TopK(1)
        top.push(seed)
        dual_search.search(chip_split.virtual_context(context, node), mbs, top, SearchStats(), dives=0)
        return top.sorted()[0], len(solved)

    best, first = walk(ctx, slower)
    assert first > 0 and best.time_s < slower.time_s
    again, none = walk(ctx, best)
    assert none == 0 and again.time_s == best.time_s
    _, from_slower = walk(ctx, slower)
    assert from_slower > 0
    own, all_again = walk(ctx.with_fresh_caches(), best)
    assert all_again > 0 and own.time_s == best.time_s
