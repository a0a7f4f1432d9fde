"""The Lagrangian DP over pipeline positions (planner/positions.py) bounds every plan's fill."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2jax.cluster import load_cluster
from h2jax.planner import top_k
from h2jax.planner import cost_model as cm
from h2jax.planner import positions as pos
from h2jax.planner.search import candidate_plan, make_context
from tests.test_planner_search import cases, exhaustive_top

REPO = Path(__file__).resolve().parent.parent


def test_window_min_matches_brute_force():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17, 88):
        H = rng.normal(size=(3, 9, n))
        H[0, 0, n // 2] = np.inf
        k = rng.integers(1, n + 3, size=9)
        M = pos._window_min(H, k)
        for s in range(9):
            for i in range(n):
                lo = max(0, i + 1 - k[s])
                np.testing.assert_array_equal(M[:, s, i], H[:, s, lo:i + 1].min(axis=-1))


def plan_figures(cand, ctx, cluster):
    """(steady components, tail, fill) of a candidate as the cost model computes them:
    1F1B one steady component (forward + backward), GPipe two (forward, backward)."""
    plan = candidate_plan(cand, ctx.model, ctx.seq_len, ctx.global_batch, ctx.schedule)
    costs = cm.stage_costs(plan, cluster)
    send = max(c.send_s for c in costs)
    if ctx.schedule == "gpipe":
        steady = [max(max(c.forward_s for c in costs), send), max(max(c.backward_s for c in costs), send)]
    else:
        steady = [max(max(c.forward_s + c.backward_s for c in costs), send)]
    tail = max(c.dp_reduce_s + c.optimizer_s for c in costs)
    fill = sum(c.forward_s + c.backward_s for c in costs) + 2 * sum(c.send_s + c.link_latency_s for c in costs)
    expected = (plan.n_micro - 1) * sum(steady) + tail + fill
    assert cm.iteration_time(costs, plan.n_micro, ctx.schedule) == pytest.approx(expected)
    return np.array(steady), tail, fill


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=cases, seq=st.sampled_from([32, 128]), batch=st.sampled_from([4, 6, 8]),
    schedule=st.sampled_from(["1f1b", "gpipe"]),
)
def test_the_lagrangian_bound_never_exceeds_a_plans_fill(case, seq, batch, schedule):
    """For every plan (here: the exhaustive top 6) and every lambda, the DP's value at the
    plan's own steady components and tail is at most its fill, and the model fits under them."""
    found = exhaustive_top(case, seq, batch, schedule)
    if found is None:
        return
    (cands, ctx), cluster = found, case[0]
    for cand in cands:
        steady, tail, fill = plan_figures(cand, ctx, cluster)
        tables = pos.type_tables(ctx, cand.micro_batch)
        a = np.concatenate([t.a for t in tables if t.size])
        lams = np.concatenate([[0.0], np.linspace(0.5, 2.0, 7) * a.mean(), a])
        V, tau = steady[None] * (1 + 1e-12), np.array([tail * (1 + 1e-12)])
        bound = pos.lagrangian(pos.Boxes.of(tables, V, tau), ctx.model.n_layers, np.zeros(len(lams), dtype=int), lams)
        assert np.isfinite(bound).all()
        assert bound.max() <= fill * (1 + 1e-9)


def test_below_the_smallest_steady_nothing_fits():
    cluster = load_cluster(REPO / "plans" / "cluster-64.toml")
    (best,), stats = top_k(cluster, "llama-7b", 4096, 512)
    ctx = make_context(cluster, "llama-7b", 4096, 512)
    (steady,), tail, fill = plan_figures(best, ctx, cluster)
    tables = pos.type_tables(ctx, best.micro_batch)
    L = ctx.model.n_layers
    held = pos.max_layers(pos.live_tables(tables, np.array([[steady], [steady / 4]]), np.full(2, np.inf)), L)
    assert held[0] >= L > held[1]
    boxes = pos.Boxes.of(tables, np.array([[steady / 4]]), np.array([np.inf]))
    bound = pos.lagrangian(boxes, L, np.zeros(1, dtype=int), np.ones(1))
    assert bound[0] == np.inf


@pytest.mark.parametrize("name", ["cluster-64.toml", "cluster-768.toml"])
def test_shipped_clusters_are_proved_optimal(name):
    cluster = load_cluster(REPO / "plans" / name)
    (best,), stats = top_k(cluster, "llama-100b", 4096, 2048, time_limit_s=120)
    assert stats.proved_optimal
    assert stats.lower_bound_s == pytest.approx(best.time_s, rel=1e-12)
    ctx = make_context(cluster, "llama-100b", 4096, 2048)
    steady, tail, fill = plan_figures(best, ctx, cluster)
    assert best.time_s == pytest.approx((2048 // best.micro_batch - 1) * steady.sum() + tail + fill)


def test_dropping_dominated_shapes_keeps_the_dp_minimum():
    """The bound DP runs over the shapes no other shape of the type dominates (positions.undominated):
    its least cost, per lambda and as a capacity row, is the same over all shapes, and each
    dropped shape has a kept one that dominates it."""
    cluster = load_cluster(REPO / "plans" / "cluster-768.toml")
    ctx = make_context(cluster, "llama-100b", 4096, 2048)
    L, tables = ctx.model.n_layers, pos.type_tables(ctx, 16)
    K = tables[0].steady_a.shape[0]
    single = np.concatenate([t.steady_a[0] * L / 8 + t.steady_end[0, pos.MID] for t in tables if t.size])
    V = np.quantile(single, [0.2, 0.6, 1.0])[:, None].repeat(K, 1)
    live = pos.live_tables(tables, V, np.full(len(V), np.inf))
    kept = pos.undominated(live)
    assert sum(t.size for t, _ in kept) < 0.8 * sum(t.size for t, _ in live)  # the test prunes something
    for (t, u), (k, uk) in zip(live, kept):
        assert set(map(id, k.options)) <= set(map(id, t.options))
        const, i_of = pos._stage_constants(t), {id(o): i for i, o in enumerate(t.options)}
        idx = [i_of[id(o)] for o in k.options]
        held = np.maximum(u, 0)  # a cap below 1 (no stage there) counts as 0
        for s in set(range(t.size)) - set(idx):  # a kept shape dominates each dropped one
            assert any(t.k_max[j] >= t.k_max[s] and t.a[j] <= t.a[s] and (const[:, j] <= const[:, s]).all()
                       and (held[:, :, j] >= held[:, :, s]).all() for j in idx)
    box = np.repeat(np.arange(len(V)), 4)
    lams = np.tile([0.0, 1e-3, 1e-2, 0.1], len(V)) * single.mean()
    cap = np.zeros(len(box), dtype=bool)
    cap[::4] = True  # one capacity row per box
    for rows in (live, kept):
        ws = [pos.weights(t, u, lams, box, cap) for t, u in rows]
        got = pos.back_dp([t for t, _ in rows], ws, L, len(box))
        if rows is live:
            full = got
    np.testing.assert_allclose(got, full, rtol=1e-12)
    assert np.isfinite(full).any()


@pytest.mark.parametrize("schedule, v", [("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_one_dp_over_a_micro_batch_sizes_ranges_of_lengths_bounds_each_as_alone(schedule, v):
    """`Boxes.of_groups`: rows of several ranges of pipeline lengths (their own memory caps and
    the lengths their lists may end at) bounded in one DP give each row the bound its range's
    boxes alone give, every lambda and corner; the capacity rows too (a row whose corner holds
    the model in one range and not in another)."""
    from h2jax.planner import dual_search

    cluster = load_cluster(REPO / "plans" / "cluster-64.toml")
    ctx = make_context(cluster, "llama-100b", 4096, 2048, schedule, v=v)
    L, b = ctx.model.n_layers, 2
    ranges = dual_search.length_ranges(ctx, ctx.global_batch // b)
    assert len(ranges) >= 3
    groups, alone = [], []
    for i, lengths in enumerate(ranges):
        tables = pos.type_tables(ctx, b, lengths)
        K = tables[0].steady_a.shape[0]
        single = np.concatenate([t.steady_a[0] * L / 8 + t.steady_end[0, pos.MID] for t in tables if t.size])
        V = np.quantile(single, [0.1 + 0.05 * i, 0.7, 1.0])[:, None].repeat(K, 1)
        tau = np.full(len(V), np.inf)
        groups.append((tables, V, tau))
        a = np.concatenate([t.a for t in tables if t.size])
        lams = np.array([0.0, 0.5 * a.mean(), 2.0 * a.mean()])
        box = np.repeat(np.arange(len(V)), len(lams))
        alone.append((box, np.tile(lams, len(V)), pos.lagrangian(pos.Boxes.of(tables, V, tau), L, box, np.tile(lams, len(V)))))
    merged = pos.Boxes.of_groups(groups)
    offsets = np.cumsum([0] + [len(g[2]) for g in groups])
    box = np.concatenate([off + bx for off, (bx, _, _) in zip(offsets, alone)])
    lams = np.concatenate([lm for _, lm, _ in alone])
    together = pos.lagrangian(merged, L, box, lams)
    expected = np.concatenate([value for _, _, value in alone])
    assert np.isfinite(expected).any() and not np.isfinite(expected).all()  # some corners hold the model, some not
    np.testing.assert_allclose(together, expected, rtol=1e-12)
    # the ranges differ where a list may end: with the first range's ends for every row, the bounds differ
    assert not all((g[0][0].ends == groups[0][0][0].ends).all() for g in groups[1:])
