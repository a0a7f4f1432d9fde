"""The pipeline order of the chip types is searched, exactly: any order of the types present
(the first stage holds the embedding, the last the head and the loss), not fixed by memory.

- the fast search equals `--exhaustive` (which enumerates every order) on 200 random small
  clusters, infeasible ones included, and on 25 of them with the box search forced;
- a case where the faster chip with more memory goes last, where the head runs, beats the
  memory order by more than 10%;
- the Lagrangian DP over positions (positions.back_dp / front_dp) is the least over every
  order of the types, checked against brute-force enumeration of the stage lists.
"""

import itertools
import math
import random

import numpy as np
import pytest

from h2jax.cluster import ChipGroup, ChipType, Cluster, Precision
from h2jax.planner import PlannerError, top_k
from h2jax.planner import positions as pos
from h2jax.planner.space import make_context


def random_case(rng: random.Random) -> tuple[Cluster, dict]:
    """2-4 chip types of 1-3 chips (tiny model, one micro-batch size and recompute policy: the
    exhaustive reference, every order of every stage list, stays at a few ms)."""
    n = rng.choice([2, 3, 3, 4])
    scale = rng.choice([0.1, 1.0, 1.0])  # 0.1: about a third of the clusters hold no plan
    groups = []
    for i in range(n):
        chip = ChipType(
            f"chip{i}", "cpu", scale * rng.choice([0.004, 0.008, 0.016, 0.05]), rng.choice([0.1, 0.3, 1.0, 2.5]),
            rng.choice([1, 2]), rng.choice([5.0, 50.0]), rng.choice([0.5, 2.0, 10.0]), "t",
            precision=Precision("float32", rng.choice(["float32", "bfloat16"])),
        )
        groups.append(ChipGroup(chip, rng.randint(1, 3 if n < 4 else 2)))
    kwargs = dict(seq_len=rng.choice([32, 128]), global_batch=rng.choice([2, 4]),
                  schedule=rng.choice(["1f1b", "gpipe"]), recompute=(rng.choice(["none", "full"]),),
                  micro_batches=(rng.choice([1, 2]),))
    return Cluster(tuple(groups), name="random"), kwargs


def best(cluster, exhaustive=False, **kwargs):
    try:
        (cand,), stats = top_k(cluster, "tiny", exhaustive=exhaustive, **kwargs)
    except PlannerError as e:
        assert "no plan fits" in str(e)
        return None, None
    return cand, stats


def memory_order(cluster, names):
    return sorted(names, key=lambda n: (-cluster.chips[n].usable_memory_gib, n))


def test_fast_search_equals_exhaustive_over_every_order_on_200_random_clusters():
    rng = random.Random(20261201)
    none = other_order = 0
    for _ in range(200):
        cluster, kwargs = random_case(rng)
        fast, stats = best(cluster, **kwargs)
        full, _ = best(cluster, exhaustive=True, **kwargs)
        assert (fast is None) == (full is None), kwargs
        if fast is None:
            none += 1
            continue
        assert fast.time_s == pytest.approx(full.time_s, rel=1e-9), (cluster, kwargs)
        assert stats.proved_optimal
        names = [o.chip for o in fast.options]
        assert len(set(names)) == len(names)  # one block per chip type
        other_order += names != memory_order(cluster, names)
    # the sample covers both answers and plans outside the memory order
    assert 20 <= none <= 150 and other_order >= 10, (none, other_order)


def test_the_box_search_alone_equals_exhaustive(monkeypatch):
    """The same check with no space small enough to be enumerated at its root box
    (dual_search.RESOLVE_LISTS, 4096 stage lists, covers most clusters above): every micro-batch
    size goes through the dives and the box halving, on the first 25 clusters."""
    from h2jax.planner import dual_search

    monkeypatch.setattr(dual_search, "RESOLVE_LISTS", 0)
    rng = random.Random(20261201)
    for _ in range(25):
        cluster, kwargs = random_case(rng)
        fast, stats = best(cluster, **kwargs)
        full, _ = best(cluster, exhaustive=True, **kwargs)
        assert (fast is None) == (full is None), kwargs
        if fast is not None:
            assert fast.time_s == pytest.approx(full.time_s, rel=1e-9), (cluster, kwargs)
            assert stats.proved_optimal


def test_the_faster_chip_goes_last_where_the_head_runs():
    slow = ChipType("chip0", "cpu", 0.004, 0.3, 2, 5.0, 0.5, "t")  # less memory, slower
    fast = ChipType("chip1", "cpu", 0.016, 1.0, 1, 5.0, 10.0, "t")
    cluster = Cluster((ChipGroup(slow, 3), ChipGroup(fast, 1)))
    kwargs = dict(seq_len=32, global_batch=4, recompute=("none",), micro_batches=(1,))
    (found,), stats = top_k(cluster, "tiny", **kwargs)
    assert [o.chip for o in found.options] == ["chip0", "chip1"]  # not the memory order
    assert stats.proved_optimal
    every, _ = top_k(cluster, "tiny", k=200, exhaustive=True, **kwargs)
    assert every[0].time_s == pytest.approx(found.time_s, rel=1e-12)
    by_memory = [c for c in every if [o.chip for o in c.options] == ["chip1", "chip0"]]
    assert by_memory and by_memory[0].time_s > 1.1 * found.time_s


def _brute(tables, ws, L, back_q=0, allowed=None):
    """min over stage lists (distinct types, any order, one shape and k <= k_max per block) of
    the sum of the per-position terms; back_q > 0: front parts in front of back_q stages."""
    best_cost = math.inf
    types = [t for t in range(len(tables)) if tables[t].size and (allowed is None or allowed >> t & 1)]
    blocks = {t: [(s, k) for s in range(tables[t].size) for k in range(1, int(tables[t].k_max[s]) + 1)] for t in types}
    for n in range(1, len(types) + 1):
        for order in itertools.permutations(types, n):
            for combo in itertools.product(*[blocks[t] for t in order]):
                p = back_q + sum(k for _, k in combo)
                if p > L:
                    continue
                stages = [(t, s) for t, (s, k) in zip(order, combo) for _ in range(k)]
                cost = 0.0
                for idx, (t, s) in enumerate(stages):
                    j, w = p - idx, ws[t]  # position from the end
                    if p == 1:
                        cost += w.only1[0, s]
                    elif j == 1:
                        cost += w.last1[0, s]
                    elif j == p:
                        cost += w.first[0, s, j]
                    else:
                        cost += w.Wm[0, s, j] - w.Wm[0, s, j - 1] if w.mid_ok[0, s, j] else math.inf
                best_cost = min(best_cost, cost)
    return best_cost


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_position_dp_is_the_least_over_every_order(seed):
    rng = random.Random(seed)
    while True:
        cluster, kwargs = random_case(rng)
        if len(cluster.groups) >= 3:
            break
    ctx = make_context(cluster, "tiny", kwargs["seq_len"], kwargs["global_batch"], kwargs["schedule"], None,
                       recompute=("none", "full"))
    L, tables = ctx.model.n_layers, pos.type_tables(ctx, 1)
    for scale in (1e-3, 1e-2, 1.0):
        live = [t for t, _ in pos.live_tables(tables, np.array([[scale] * tables[0].steady_a.shape[0]]),
                                              np.array([scale]))]
        u = [c for _, c in pos.live_tables(tables, np.array([[scale] * tables[0].steady_a.shape[0]]),
                                           np.array([scale]))]
        for lam in (0.0, 1e-5, 1e-3):
            ws = [pos.weights(t, c, np.array([lam])) for t, c in zip(live, u)]
            assert pos.back_dp(live, ws, L, 1)[0] == pytest.approx(_brute(live, ws, L), rel=1e-12, abs=1e-15)
            G = pos.front_dp(live, ws, L)
            for A in range(1, 1 << len(live)):
                for q in range(1, L):
                    want = _brute(live, ws, L, back_q=q, allowed=A)
                    assert G[A][0, q] == pytest.approx(want, rel=1e-12, abs=1e-15), (A, q)


def test_the_enumeration_counts_the_layers_each_block_holds_in_its_box():
    """A stage list that cannot hold the L layers within a box's upper corner has no plan in
    that box, so the box's enumeration leaves it to the box its plans are in: the layers each
    next block holds (its stages' caps at their positions and roles) are the caps' own sum,
    and a block with types left in front of it counts the most their front part holds (a
    brute force over front parts), so the enumeration stops where no front part can help."""
    from h2jax.planner import dual_search
    from h2jax.planner.space import SearchStats
    from h2jax.planner.split import TopK

    rng = random.Random(7)
    checked = 0
    while checked < 3:
        cluster, kwargs = random_case(rng)
        ctx = make_context(cluster, "tiny", kwargs["seq_len"], kwargs["global_batch"], kwargs["schedule"], None)
        batch = dual_search._make_batch(ctx, 1, 0.0, bracket=False)
        if batch is None or len([t for t in batch.tables if t.size]) < 2:
            continue
        enum = dual_search._Enumerator(ctx, batch, TopK(1), SearchStats(), set(), math.inf)
        hi = np.append(batch.steady_max, batch.tail_max)
        enum.run(batch.corner(batch.v_feasible, 0.0), hi, 0.0, max_leaves=0)
        L, full = ctx.model.n_layers, (1 << len(enum.tables)) - 1

        def ahead(left: int, q: int) -> float:
            """The most layers a front part of the types `left` holds at positions q+1, ...
            (brute force; -inf: none fits)."""
            best = -math.inf
            for t in range(len(enum.tables)):
                if not left >> t & 1:
                    continue
                u = enum.u[t]
                for s in range(enum.tables[t].size):
                    for k in range(1, min(int(enum.tables[t].k_max[s]), L - q) + 1):
                        mids = [u[pos.MID, s, q + i] for i in range(k)]
                        front = mids[:-1] + [u[pos.FIRST, s, q + k - 1]]
                        if min(front) >= 1:
                            best = max(best, sum(front))
                        if min(mids) >= 1 and left & ~(1 << t):
                            best = max(best, sum(mids) + ahead(left & ~(1 << t), q + k))
            return best

        for q in (0, 1, 2):
            rel, t2s, ss, ks, fronts, _, most, reach = enum._children(full, q)
            assert len(rel)
            for t2, s, k, front, held, most_with_front in zip(
                t2s.tolist(), ss.tolist(), ks.tolist(), fronts.tolist(), most.tolist(), reach.tolist()
            ):
                u = enum.u[t2]
                roles = [pos.MID] * k  # positions q+1 .. q+k from the end
                if q == 0:
                    roles[0] = pos.LAST
                if front:
                    roles[-1] = pos.ONLY if q == 0 and k == 1 else pos.FIRST
                assert held == sum(u[r, s, q + i] for i, r in enumerate(roles))
                # with the most any front part of the other types holds in front of it
                assert most_with_front == held + (0 if front else ahead(full & ~(1 << t2), q + k))
        checked += 1
