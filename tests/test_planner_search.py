"""The fast search is exact under its own cost model: it matches exhaustive enumeration."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2jax.cluster import ChipGroup, ChipType, Cluster, Precision
from h2jax.planner import PlannerError, top_k
from h2jax.planner import cost_model as cm
from h2jax.planner.search import make_context
from h2jax.planner.split import _breakpoints, list_bound, list_may_beat, list_sums, sums_bound
from h2jax.planner.stage_shape import StageShape


@st.composite
def small_clusters(draw, n_types, max_count):
    """Chip types whose memory is small enough that recomputation and memory caps matter."""
    groups = []
    for i in range(n_types):
        chip = ChipType(
            name=f"chip{i}",
            platform="cpu",
            memory_gib=draw(st.sampled_from([0.004, 0.008, 0.016, 0.05, 1.0])),
            peak_tflops=draw(st.sampled_from([0.1, 0.3, 1.0, 2.5])),
            chips_per_node=draw(st.sampled_from([1, 2, 4])),
            intra_node_gbps=draw(st.sampled_from([5.0, 50.0])),
            inter_node_gbps=draw(st.sampled_from([0.5, 2.0, 10.0])),
            source="hypothesis",
            precision=Precision("float32", draw(st.sampled_from(["float32", "bfloat16"]))),
        )
        groups.append(ChipGroup(chip, draw(st.integers(1, max_count))))
    return Cluster(tuple(groups), name="random")


# The exhaustive reference enumerates every stage list and split, so the clusters stay small
# enough for it: two types of up to 32 chips (tiny or small model), or three of up to 8 (tiny).
cases = st.one_of(
    st.tuples(small_clusters(2, 32), st.sampled_from(["tiny", "small"])),
    st.tuples(small_clusters(3, 8), st.just("tiny")),
)


def exhaustive_top(case, seq, batch, schedule, k=6):
    """(the exhaustive k best stage lists, each with its best split, and the search context)
    of a random case, or None where no plan fits."""
    cluster, model = case
    try:
        cands, _ = top_k(cluster, model, seq, batch, k=k, schedule=schedule, exhaustive=True)
    except PlannerError:
        return None
    return cands, make_context(cluster, model, seq, batch, schedule)


# The fast search against the exhaustive one on hundreds of random clusters (2-4 chip types,
# both schedules, infeasible ones included): tests/test_planner_properties.py.


def test_the_search_can_leave_a_useless_chip_type_unused():
    fast = ChipType("fast", "cpu", 1.0, 2.0, 4, 50.0, 10.0, "t")
    slow = ChipType("slow", "cpu", 2.0, 0.001, 4, 50.0, 0.01, "t")  # more memory: goes first, if used
    cluster = Cluster((ChipGroup(fast, 8), ChipGroup(slow, 8)))
    (best,), _ = top_k(cluster, "tiny", 32, 8)
    assert [o.chip for o in best.options] == ["fast"]
    (ref,), _ = top_k(cluster, "tiny", 32, 8, exhaustive=True)
    assert math.isclose(best.time_s, ref.time_s, rel_tol=1e-9)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases, seq=st.sampled_from([32, 128]), batch=st.sampled_from([4, 6]))
def test_fast_top_k_matches_the_exhaustive_top_k(case, seq, batch):
    """The k best stage lists (each with its best split) agree, not only the first."""
    cluster, model = case
    try:
        fast, stats = top_k(cluster, model, seq, batch, k=3)
    except PlannerError:
        with pytest.raises(PlannerError):
            top_k(cluster, model, seq, batch, k=3, exhaustive=True)
        return
    full, _ = top_k(cluster, model, seq, batch, k=3, exhaustive=True)
    assert [c.time_s for c in fast] == pytest.approx([c.time_s for c in full], rel=1e-9)
    assert stats.proved_optimal
    assert stats.lower_bound_s == pytest.approx(fast[0].time_s, rel=1e-12)


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=cases, seq=st.sampled_from([32, 128]), batch=st.sampled_from([4, 6]),
    schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1"]),
)
def test_a_stage_lists_cheap_bound_never_exceeds_its_best_split(case, seq, batch, schedule):
    """`list_bound` (memory caps, cheapest-first fill within them, sends, tail) is at most the
    time of the list's best split: here the exhaustive top 6, each a stage list with its
    best split; a list it prices too high would be skipped by the search."""
    found = exhaustive_top(case, seq, batch, schedule)
    if found is None:
        return
    cands, ctx = found
    shapes = {(b, o.chip, o.data, o.tensor, o.recompute): o  # a shape's terms are per micro-batch size
              for b in {c.micro_batch for c in cands} for opts in ctx.type_shapes(b, False) for o in opts}
    for c in cands:
        chosen = [dataclasses.replace(shapes[(c.micro_batch, o.chip, o.data, o.tensor, o.recompute)], stages=o.stages)
                  for o in c.options]
        bound = list_bound(ctx, c.micro_batch, chosen)
        assert 0 < bound <= c.time_s * (1 + 1e-12), (bound, c.time_s)
        # the cheapest bound, from sums over the stages (what solve and the local search's moves ask first)
        weight = ctx.sched.closed_form.steady_weight(ctx.global_batch // c.micro_batch, ctx.v)
        assert 0 < sums_bound(weight, ctx.model.n_layers, list_sums(chosen)) <= bound * (1 + 1e-12)
        # what solve asks instead: whether the bound is below a given one, either side of it
        for x in (bound * 0.999, bound * 1.001, c.time_s, math.inf):
            assert list_may_beat(ctx, c.micro_batch, chosen, x) == (bound < x), (x, bound)


@pytest.mark.parametrize("name, schedule", [("cluster-64.toml", "1f1b"), ("cluster-768.toml", "1f1b"),
                                            ("cluster-768.toml", "gpipe"), ("cluster-64.toml", "interleaved-1f1b")])
def test_the_per_block_first_test_rejects_only_lists_the_full_bound_rejects(monkeypatch, name, schedule):
    """`split._may_hold` (the per-block relaxation `list_may_beat` asks first) on every list
    the local search asks about: where it says no, `list_bound` says no too (else the search
    would skip a list that may beat the best), term by term (at each bottleneck, with each
    block's cap cut to what it holds there, its fill and tail no larger than the stages', the
    layers it holds no fewer; each block's largest cap is its stages' largest), and it says no
    to most. (The local search's moves then weigh a new block by its sums alone, not by its
    caps too, `split.Beside.cannot_beat`: else they leave out before building them nearly
    all the lists this rejects.)"""
    from pathlib import Path

    from h2jax.cluster import load_cluster
    from h2jax.planner import split

    real, asked = split._may_hold, []

    def checked(ctx, b, chosen, bound):
        quick = real(ctx, b, chosen, bound)
        parts = split._list_parts(ctx, b, chosen)
        full = parts is not None and split._least(ctx, b, chosen, parts, bound) < bound
        where = ([(o.chip, o.stages, o.shape) for o in chosen], b, bound)
        assert quick or not full, where
        if parts is not None and len(asked) % 3 == 0:  # the relaxation, term by term
            L = ctx.model.n_layers
            blocks, ends = split._Blocks(chosen), split._list_ends(ctx, b, chosen)
            caps = split._block_caps(ctx, b, chosen)
            loose = [min(o.cap1, L - blocks.p + 1) for o in chosen]  # its first test's caps: no lower
            assert all(x >= c for x, c in zip(loose, caps)), where
            assert (ends.floor, ends.fill_end) == (parts.floor, parts.fill_end), where  # the same end terms and sends
            tl, te = split._tail_terms(ctx, b, chosen, parts)
            groups = split._runs(parts.c, parts.e, tl, te)
            for x in sorted(set((parts.c * parts.caps + parts.e).tolist()))[::7]:
                U = np.minimum(parts.caps, np.floor((x - parts.e) / parts.c + 1e-9))[:, None]
                assert blocks.held(x, caps, ends.e_first, ends.e_last) >= split._held(parts, x)[0], where
                assert blocks.held(x, loose) >= blocks.held(x, caps, ends.e_first, ends.e_last), where
                if U.min() >= 1 and U.sum() >= L:  # a bottleneck whose splits hold the model
                    stages = split._fill_within(parts, U, L)[0] + split._least_tail(tl, te, parts.caps, groups, U, L)[0]
                    per_block = blocks.rest(blocks.holding(x, caps), L)
                    assert per_block is not None and per_block <= stages * (1 + 1e-12), where
                    assert blocks.rest(blocks.holding(x, loose), L) <= per_block * (1 + 1e-12), where
        if len(asked) % 10 == 0:  # a block's largest cap, taken at its fewest micro-batches in flight, is its stages' largest
            p, i, m = sum(o.stages for o in chosen), 0, ctx.global_batch // b
            for o, most in zip(chosen, ctx.block_cap_maxima(chosen, m)):
                assert most == max(int(o.max_layers(ctx.holds(j, p, m)[0])) for j in range(i, i + o.stages)), where
                i += o.stages
        asked.append(quick is not None)
        return quick

    monkeypatch.setattr(split, "_may_hold", checked)
    monkeypatch.setattr(split.Beside, "cannot_beat",
                        lambda self, weight, L, new, ks, bound: split.sums_bound(weight, L, self.sums.plus(new, ks)) >= bound)
    cluster = load_cluster(Path(__file__).resolve().parent.parent / "plans" / name)
    top_k(cluster, "llama-100b", 4096, 2048, schedule=schedule, mixed_shapes=True)
    assert len(asked) > 1000 and asked.count(False) > 0.7 * len(asked), (len(asked), asked.count(False))


def test_a_stage_lists_bound_weighs_fill_and_tail_at_each_bottleneck():
    """`list_bound` takes the fill and the tail of the splits at each bottleneck (not the
    cheapest fill and tail of any split beside the least bottleneck): on the 768-chip
    cluster its best three lists are priced within 0.2 % of their time (the bound without that
    coupling is 1-1.3 % below), and never above it."""
    from pathlib import Path

    from h2jax.cluster import load_cluster

    cluster = load_cluster(Path(__file__).resolve().parent.parent / "plans" / "cluster-768.toml")
    cands, _ = top_k(cluster, "llama-100b", 4096, 2048, k=3)
    ctx = make_context(cluster, "llama-100b", 4096, 2048)
    for c in cands:
        shapes = {o.shape + (o.chip,): o for opts in ctx.type_shapes(c.micro_batch, False) for o in opts}
        chosen = [dataclasses.replace(shapes[o.shape + (o.chip,)], stages=o.stages) for o in c.options]
        assert 0.998 * c.time_s <= list_bound(ctx, c.micro_batch, chosen) <= c.time_s


def test_time_limit_returns_the_best_found_with_a_valid_lower_bound(monkeypatch):
    """Stopped by its time limit, the search returns the best plan found, not proved, with a
    valid lower bound on the optimum. The clock is injected (a tick per reading), so where the
    search stops does not depend on the machine's speed: the whole search reads it ~230 times,
    and 100 ticks stop it after its dives found their incumbents."""
    import itertools
    import time
    from pathlib import Path

    from h2jax.cluster import load_cluster

    cluster = load_cluster(Path(__file__).resolve().parent.parent / "plans" / "cluster-1024.toml")
    (optimum,), full = top_k(cluster, "llama-100b", 4096, 2048, time_limit_s=600.0)
    assert full.proved_optimal and full.lower_bound_s == pytest.approx(optimum.time_s)
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    (best,), stats = top_k(cluster, "llama-100b", 4096, 2048, time_limit_s=0.1)
    assert not stats.proved_optimal
    assert 0.0 < stats.lower_bound_s < optimum.time_s <= best.time_s * (1 + 1e-12)
    assert best.time_s < 17.0  # the incumbents (dives of the enumeration) use the cluster well


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b"])
def test_models_of_one_to_three_layers(layers, schedule):
    """The position DP's edges: a one-stage pipeline (first and last at once), no middle stage."""
    model = {"vocab_size": 256, "d_model": 64, "n_layers": layers, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}
    a = ChipType("a", "cpu", 0.016, 1.0, 2, 50.0, 2.0, "t")
    b = ChipType("b", "cpu", 0.05, 0.3, 4, 5.0, 0.5, "t")
    cluster = Cluster((ChipGroup(a, 4), ChipGroup(b, 6)))
    (fast,), stats = top_k(cluster, model, 32, 4, schedule=schedule)
    (full,), _ = top_k(cluster, model, 32, 4, schedule=schedule, exhaustive=True)
    assert fast.time_s == pytest.approx(full.time_s, rel=1e-9)
    assert stats.proved_optimal


# ----------------------------------------------------------------------------- every schedule


def _best(exhaustive, cluster, model, seq, batch, schedule):
    try:
        (best,), stats = top_k(cluster, model, seq, batch, schedule=schedule, exhaustive=exhaustive)
    except PlannerError as e:
        assert "no plan fits" in str(e)
        return None, None
    return best, stats


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.tuples(small_clusters(2, 8), st.sampled_from(["tiny", "small"])),
    seq=st.sampled_from([32, 128]),
    batch=st.sampled_from([2, 4, 8]),
    schedule=st.sampled_from(["zb-h1", "interleaved-1f1b"]),
)
def test_the_exact_search_extends_to_every_schedule(case, seq, batch, schedule):
    """ZB-H1's and interleaved 1F1B's closed forms (v = 2 and 4) through the same exact search:
    it matches enumeration."""
    cluster, model = case
    fast, fast_stats = _best(False, cluster, model, seq, batch, schedule)
    full, _ = _best(True, cluster, model, seq, batch, schedule)
    assert (fast is None) == (full is None)
    if fast is None:
        return
    assert fast.time_s == pytest.approx(full.time_s, rel=1e-9)
    assert fast_stats.proved_optimal


def test_auto_computes_each_stage_term_once_for_all_its_schedules(monkeypatch):
    """A stage's terms depend on its micro-batches in flight and deferred gradients and
    whether its schedule splits the backward (ZB-H1's B and W as run), not on the schedule
    otherwise: under auto the schedules' searches share one cache (`Context.sharing_terms`),
    each term computed once, and the plan is the one its schedule alone gives."""
    from h2jax.planner import cost_model

    a = ChipType("a", "cpu", 0.05, 1.0, 2, 50.0, 2.0, "t")
    b = ChipType("b", "cpu", 0.2, 0.3, 4, 5.0, 0.5, "t")
    cluster = Cluster((ChipGroup(a, 4), ChipGroup(b, 4)))
    real, made = cost_model.stage_terms, []

    def counted(*args, **kwargs):
        shape = args[0]
        made.append((shape.micro_batch, shape.chip.name, shape.data, shape.tensor, shape.recompute, *args[1:4],
                     args[6:]))
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_model, "stage_terms", counted)
    (best,), stats = top_k(cluster, "tiny", 32, 8, schedule="auto")
    assert made and len(made) == len(set(made))
    assert len(stats.schedule_times) + len(stats.schedule_bounds) >= 4  # (every schedule searched)
    monkeypatch.setattr(cost_model, "stage_terms", real)
    v = best.virtual_stages if best.virtual_stages > 1 else None
    (alone,), _ = top_k(cluster, "tiny", 32, 8, schedule=best.schedule, virtual_stages=v)
    assert alone.time_s == pytest.approx(best.time_s, rel=1e-12)
    with pytest.raises(ValueError, match="share no stage terms"):
        make_context(cluster, "tiny", 32, 8).sharing_terms(make_context(cluster, "tiny", 64, 8))


def test_a_stages_times_do_not_depend_on_what_it_holds_in_flight():
    """`auto` leaves GPipe out as never faster than 1F1B (Schedule.no_faster_than, checked on
    the closed forms in tests/test_schedule.py): that holds only while a stage's times are the
    same whatever it holds in flight, which the cost model keeps; only its memory grows."""
    import itertools

    from h2jax.config import get_config

    chip = ChipType("a", "cpu", 0.05, 1.0, 8, 50.0, 2.0, "t")
    times = ("fwd_layer", "fwd_end", "bwd_layer", "bwd_end", "bwd_weight_layer", "bwd_weight_end",
             "tail_layer", "tail_end", "dp_layer", "dp_end")
    for (data, tensor), recompute, first, last in itertools.product(
            [(1, 1), (2, 2), (1, 4)], ["none", "selective", "full"], [False, True], [False, True]):
        shape = StageShape(get_config("tiny"), 32, 4, chip, data, tensor, recompute)
        terms = [cm.stage_terms(shape, first, last, held, None, cm.CostOptions(), deferred)
                 for held, deferred in [(1, 0), (4, 0), (16, 0), (4, 3)]]
        assert all([getattr(t, f) for f in times] == [getattr(terms[0], f) for f in times] for t in terms)
        assert terms[0].mem.per_layer < terms[2].mem.per_layer  # (what grows: the memory)


def test_auto_searches_every_schedule_and_reports_the_winner():
    from h2jax.planner import plan_cluster

    a = ChipType("a", "cpu", 0.05, 1.0, 2, 50.0, 2.0, "t")
    b = ChipType("b", "cpu", 0.2, 0.3, 4, 5.0, 0.5, "t")
    cluster = Cluster((ChipGroup(a, 4), ChipGroup(b, 4)))
    result = plan_cluster(cluster, "tiny", 32, 8, schedule="auto", baselines=False, mixed_shapes=False)
    times = result.plan.predicted["schedule_times_s"]
    # each schedule after 1F1B is searched only for plans faster than the best before it:
    # those with none are listed with a lower bound on their best, at least the winner's time
    beaten = dict(result.plan.predicted.get("schedule_bounds_s", {}))
    # GPipe is never faster than 1F1B (Schedule.no_faster_than): not searched, its bound 1F1B's
    left_out = result.plan.predicted["schedules_left_out"]
    assert left_out == {"gpipe": "1f1b"}
    assert set(times) | set(beaten) == {"1f1b", "zb-h1", "interleaved-1f1b (v=2)", "interleaved-1f1b (v=4)"}
    assert not set(times) & set(beaten)
    for label, other in left_out.items():
        beaten[label] = {**times, **beaten}[other]
    assert list(times.values()) == sorted(times.values())
    won = next(iter(times))
    assert result.plan.schedule == won.split(" ")[0]
    assert result.plan.predicted["step_time_s"] == pytest.approx(times[won])
    assert all(bound >= times[won] for bound in beaten.values())
    for label in [*times, *beaten]:  # each schedule alone: its best is the time, or above the bound
        name, _, v = label.partition(" (v=")
        try:
            (alone,), _ = top_k(cluster, "tiny", 32, 8, schedule=name, virtual_stages=int(v[:-1]) if v else None)
        except PlannerError:
            assert label in beaten  # nothing fits it at all
            continue
        if label in times:  # (a schedule's plan faster than the cutoff: its optimum)
            assert alone.time_s == pytest.approx(times[label], rel=1e-9)
        else:
            assert alone.time_s >= beaten[label] - 1e-9
    # auto is the best of each schedule's exact search: the exhaustive one agrees
    (full,), _ = top_k(cluster, "tiny", 32, 8, schedule="auto", exhaustive=True)
    assert full.time_s == pytest.approx(times[won], rel=1e-9)


def test_interleaved_tables_hold_no_stage_beyond_the_most_stages_m_allows():
    """Interleaved 1F1B runs p stages only where p divides m, so p <= m: its tables hold no
    stage at positions beyond the largest such p, and every bound and walk leaves out the
    lists the leaves would refuse (they used to be walked in every box: this cluster's
    two-shape proof ran past 15 s, now a tenth of a second); the optimum is the exhaustive
    one's, with one shape and with two."""
    from h2jax.planner import positions as pos

    a = ChipType("a", "cpu", 0.008, 1.0, 2, 5.0, 2.0, "t")
    b = ChipType("b", "cpu", 0.004, 1.0, 4, 50.0, 0.5, "t")
    cluster = Cluster((ChipGroup(a, 3), ChipGroup(b, 6)))
    kw = dict(schedule="interleaved-1f1b", virtual_stages=2, recompute=("none", "full"))
    ctx = make_context(cluster, "tiny", 32, 2, "interleaved-1f1b", None, cm.CostOptions(), ("none", "full"), 2)
    for table in pos.type_tables(ctx, 1):  # m = 2 of the model's 4 layers: positions 3 and 4 hold no stage
        assert not table.memcap[..., 2:].any() and table.memcap[..., :2].any()
    (fast,), _ = top_k(cluster, "tiny", 32, 2, **kw)
    (full,), _ = top_k(cluster, "tiny", 32, 2, exhaustive=True, **kw)
    assert fast.time_s == pytest.approx(full.time_s, rel=1e-9)
    (proved,), stats = top_k(cluster, "tiny", 32, 2, prove_two_shapes=True, **kw)
    (full_two,), _ = top_k(cluster, "tiny", 32, 2, exhaustive=True, mixed_shapes=True, **kw)
    assert stats.two_shapes_proved and proved.time_s == pytest.approx(full_two.time_s, rel=1e-9)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                          ("interleaved-1f1b", 4)])
def test_a_ranges_tables_hold_the_least_over_its_lengths(schedule, v):
    """`position_holds` of a range p_lo..p_hi of stage counts: at each position j from the end,
    the in-flight and deferred counts are at most those of every pipeline of the range that
    reaches j and that the schedule runs, and equal to one of them (the least); a list may end
    only at such a length. Without a range: the schedule's `position_in_flight`, no deferred
    gradients, every length it runs. `length_ranges` splits only where a position's counts
    depend on the length (ZB-H1, interleaved 1F1B), into ranges that cover the lengths the
    schedule runs once each, in order, each within LENGTH_RATIO."""
    from h2jax.planner import dual_search as ds
    from h2jax.planner import positions as pos

    model = {"vocab_size": 256, "d_model": 64, "n_layers": 24, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}
    a = ChipType("a", "cpu", 0.05, 1.0, 2, 50.0, 2.0, "t")
    for batch in (4, 12, 16, 48):
        ctx = make_context(Cluster((ChipGroup(a, 8),)), model, 32, batch, schedule, None, cm.CostOptions(),
                           ("none",), v)
        sched, L, m = ctx.sched, 24, batch
        runs = [p for p in range(1, L + 1) if sched.unsupported(p, m, v) is None]
        in_flight, deferred, ends = pos.position_holds(ctx, m, None)
        assert in_flight.tolist() == [sched.position_in_flight(j, m, v) for j in range(1, L + 1)]
        assert not deferred.any() and np.flatnonzero(ends).tolist() == runs
        ranges = ds.length_ranges(ctx, m)
        if schedule in ("1f1b", "gpipe"):
            assert ranges == [None]
            continue
        covered = [p for lo, hi in ranges for p in runs if lo <= p <= hi]
        assert covered == runs and all(hi <= ds.LENGTH_RATIO * lo for lo, hi in ranges)
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))
        for lo, hi in [*ranges, (1, L), (3, 9)]:
            in_flight, deferred, ends = pos.position_holds(ctx, m, (lo, hi))
            lengths = [p for p in runs if lo <= p <= hi]
            assert np.flatnonzero(ends).tolist() == lengths
            for j in range(1, max(lengths, default=0) + 1):
                held = [(sched.memory_in_flight(p - j, p, m, v), sched.deferred(p - j, p, m, v))
                        for p in lengths if p >= j]
                assert in_flight[j - 1] == min(h[0] for h in held) and deferred[j - 1] == min(h[1] for h in held)


def _chip(name, memory_gib, tflops, per_node, intra, inter, compute="float32"):
    return ChipType(name, "cpu", memory_gib, tflops, per_node, intra, inter, "t",
                    precision=Precision("float32", compute))


@pytest.mark.parametrize("cluster, model, seq, batch, schedule", [
    (Cluster((ChipGroup(_chip("c0", 0.008, 0.1, 2, 5.0, 2.0, "bfloat16"), 15), ChipGroup(_chip("c1", 1.0, 2.5, 1, 5.0, 0.5), 8))),
     "small", 32, 6, "zb-h1"),
    (Cluster((ChipGroup(_chip("c0", 0.016, 1.0, 2, 50.0, 2.0), 6), ChipGroup(_chip("c1", 1.0, 2.5, 2, 50.0, 0.5), 5),
              ChipGroup(_chip("c2", 0.016, 0.3, 2, 5.0, 0.5, "bfloat16"), 2))),
     "tiny", 128, 8, "interleaved-1f1b"),
])
def test_the_search_over_ranges_of_lengths_is_exact(cluster, model, seq, batch, schedule):
    """ZB-H1 and interleaved 1F1B are searched in ranges of stage counts, several per
    micro-batch size, each with its own tables (`length_ranges`): the optimum equals the
    exhaustive one's. (These cases failed when the boxes of a micro-batch size's ranges were
    bounded together with one range's tables.)"""
    (fast,), stats = top_k(cluster, model, seq, batch, schedule=schedule)
    (full,), _ = top_k(cluster, model, seq, batch, schedule=schedule, exhaustive=True)
    assert stats.proved_optimal and fast.time_s == pytest.approx(full.time_s, rel=1e-9)


def test_a_lists_candidate_bottlenecks_are_every_stages_values_taken_once():
    """best_split's bottleneck candidates come from one run per distinct (per-layer, end) pair,
    up to the largest cap among its stages: the same values as one run per stage."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = int(rng.integers(1, 14))
        pool = rng.uniform(0.1, 2.0, size=(3, 2))  # few distinct pairs: blocks of equal stages
        a, o = pool[rng.integers(0, 3, size=p)].T
        caps = rng.integers(-1, 10, size=p)
        runs = [a[i] * np.arange(1, caps[i] + 1) + o[i] for i in range(p)]
        assert np.array_equal(_breakpoints(a, o, caps), np.unique(np.concatenate(runs)))


def test_a_boxs_lambda_follows_the_dual_past_the_wider_steps(monkeypatch):
    """`_bounds` tries the parent's lambda, then 2 % steps, then wider steps, then farther
    ones while the dual still rises at the edge: on a concave dual whose peak lies at 5.2 times
    the parent's lambda it climbs there (the old schedule stopped at 1.4 times); at a peak near
    the parent's it stops after the steps; a box dropped at the center costs one row."""
    from h2jax.planner import dual_search as ds

    calls = []

    def dual(peak):
        def rows(batch, L, boxes, corners, box, lams):
            calls.append(len(lams))
            return -np.abs(np.log(np.asarray(lams) / peak))  # concave in log lambda, 0 at the peak
        return rows

    batch = ds._Batch(1, 2, [], 0.0, 1.0, np.array([0.5, 1.0, 2.0]), 1.0, np.array([1.0]), 1.0)
    corner = [np.array([1.0, 1.0])]

    monkeypatch.setattr(ds, "_lagrangian_rows", dual(5.2))
    (value, lam, _), = ds._bounds(batch, 8, corner, [1.0])
    # 1.02 -> 1.4 (wider) -> x2.5 = 3.57 -> x1.5 = 5.36: within 3 % of the peak
    assert lam == pytest.approx(1.02 * 1.4 * 2.5 * 1.5)
    assert value == pytest.approx(-math.log(lam / 5.2))
    assert calls == [1, 2, 3, 2, 2] and len(calls) == ds.LAMBDA_ROUNDS

    calls.clear()
    monkeypatch.setattr(ds, "_lagrangian_rows", dual(1.005))
    (value, lam, _), = ds._bounds(batch, 8, corner, [1.0])
    assert lam == 1.0 and calls == [1, 2]  # neither step beats the center: no wider round

    calls.clear()
    (value, lam, _), = ds._bounds(batch, 8, corner, [1.0], enough=[-0.5])
    assert calls == [1]  # the center already drops the box


def test_a_box_far_below_what_drops_it_keeps_its_lambda_untuned(monkeypatch):
    """A corner whose bound after the center round is below its `far_below` times a positive
    `enough` gets no further round and says its lambda is not tuned; one nearer `enough`, or
    with `far_below` -inf (the default), or with no `enough`, climbs the dual as before."""
    from h2jax.planner import dual_search as ds

    calls = []

    def rows(batch, L, boxes, corners, box, lams):
        calls.append(len(lams))
        return 10.0 - np.abs(np.log(np.asarray(lams) / 5.2))  # concave in log lambda, 10 at 5.2

    monkeypatch.setattr(ds, "_lagrangian_rows", rows)
    batch = ds._Batch(1, 2, [], 0.0, 1.0, np.array([0.5, 1.0, 2.0]), 1.0, np.array([1.0]), 1.0)
    corner = [np.array([1.0, 1.0])]
    center = 10.0 - math.log(5.2)  # ~8.35

    (value, lam, tuned), = ds._bounds(batch, 8, corner, [1.0], enough=[100.0], far_below=[0.3])
    assert calls == [1] and lam == 1.0 and value == pytest.approx(center) and not tuned  # 8.35 < 30
    for enough, far_below in (([20.0], [0.3]), ([100.0], [-math.inf]), (None, [0.3])):
        calls.clear()
        (value, lam, tuned), = ds._bounds(batch, 8, corner, [1.0], enough=enough, far_below=far_below)
        assert calls == [1, 2, 3, 2, 2] and value > center + 1.0 and tuned  # climbed toward the peak


def _search_cluster_64(max_work=None):
    """ZB-H1 on the shipped 64-chip cluster, llama-100b."""
    from pathlib import Path

    from h2jax.cluster import load_cluster

    cluster = load_cluster(Path(__file__).resolve().parent.parent / "plans" / "cluster-64.toml")
    return _dual_search(cluster, "llama-100b", 2048, "zb-h1", max_work)


def _dual_search(cluster, model: str, batch: int, schedule: str, max_work=None):
    from h2jax.planner import dual_search as ds
    from h2jax.planner.space import SearchStats, divisors
    from h2jax.planner.split import TopK

    ctx = make_context(cluster, model, 4096, batch, schedule=schedule)
    top = TopK(1)
    ds.search(ctx, divisors(batch), top, SearchStats(), max_work=max_work)
    return top.sorted()[0]


def test_a_box_is_walked_and_split_only_from_a_tuned_lambda(monkeypatch):
    """`search` leaves far-below boxes' lambdas untuned (LAMBDA_FAR_BELOW), but walks a box
    only at a tuned lambda (a walk under a poor one reaches far more lists), and bounds the
    children of an untuned box with every round (far_below -inf), so looseness does not pile
    up down the splits; the optimum is the one every round finds. The cluster: 4 chip types
    under llama-7b, where walking at untuned lambdas took the search from 0.8 s past 60 s (the
    random clusters of benchmarks/planner.py --random-shipped)."""
    from h2jax.cluster import ChipGroup, Cluster, load_chip
    from h2jax.planner import dual_search as ds

    cluster = Cluster(tuple(ChipGroup(load_chip(name), n) for name, n in (
        ("google-tpu-v5e", 224), ("amd-mi300x", 256), ("huawei-ascend-910b", 184), ("nvidia-a100", 32))))

    class Untuned(float):
        """An untuned lambda as `_bounds` returned it (arithmetic on it gives plain floats)."""

    real_bounds, real_run = ds._bounds, ds._Enumerator.run
    untuned, walked = [], []

    def bounds(batch, L, corners, centers, enough=None, far_below=None):
        for c, f in zip(centers, far_below or [-math.inf] * len(corners)):
            assert not isinstance(c, Untuned) or f == -math.inf
        out = real_bounds(batch, L, corners, centers, enough, far_below)
        untuned.extend(lam for _, lam, ok in out if not ok)
        return [(fill, lam if ok else Untuned(lam), ok) for fill, lam, ok in out]

    def run(self, lo, hi, lam, max_leaves=None):
        walked.append(type(lam))
        return real_run(self, lo, hi, lam, max_leaves)

    monkeypatch.setattr(ds, "_bounds", bounds)
    monkeypatch.setattr(ds._Enumerator, "run", run)
    best = _dual_search(cluster, "llama-7b", 512, "1f1b")
    assert untuned and walked and Untuned not in walked
    monkeypatch.setattr(ds, "LAMBDA_FAR_BELOW", -math.inf)
    untuned.clear()
    every_round = _dual_search(cluster, "llama-7b", 512, "1f1b")
    assert not untuned and best.time_s == pytest.approx(every_round.time_s, rel=1e-12)


def test_only_a_search_without_a_work_limit_leaves_boxes_far_below_untuned(monkeypatch):
    """`search` bounds with LAMBDA_FAR_BELOW where it runs to its end, with -inf (every round)
    where a work limit may stop it: such a search reports its open boxes' bounds (a proof node's)."""
    from h2jax.planner import dual_search as ds

    seen = set()
    real = ds._bounds

    def spy(batch, L, corners, centers, enough=None, far_below=None):
        seen.update(far_below or [-math.inf])
        return real(batch, L, corners, centers, enough, far_below)

    monkeypatch.setattr(ds, "_bounds", spy)
    _search_cluster_64()
    assert ds.LAMBDA_FAR_BELOW in seen and ds.LAMBDA_FAR_BELOW > 0
    seen.clear()
    _search_cluster_64(max_work=1e9)
    assert seen == {-math.inf}


def test_under_auto_the_first_proof_gets_the_time_left_less_a_reserve_per_later_proof(monkeypatch):
    """`_prove_all`'s deadlines (a clock injected): the fastest plan's proof, which proves that
    plan's own optimum and is the longest, may run until the time limit's end less
    PROOF_RESERVE of the proofs' time for each proof after it; each later one until the end
    less the reserves of those after it (so a slow proof leaves the later ones their time)."""
    from h2jax.planner import search as S

    clock = [100.0]
    monkeypatch.setattr(S.time, "perf_counter", lambda: clock[0])
    deadlines = []

    def fake_prove(one, k, deadline, workers, progress, cutoff=math.inf):
        deadlines.append(deadline)
        clock[0] += 10.0  # each proof takes 10 s of the clock

    monkeypatch.setattr(S, "_prove", fake_prove)
    ctx = make_context(Cluster((ChipGroup(ChipType("a", "cpu", 0.05, 1.0, 2, 50.0, 2.0, "t"), 2),)), "tiny", 32, 2)
    cand = lambda t: S.Candidate(t, 1, (), (), "1f1b")  # noqa: E731
    searched = [S._Searched([cand(t)], [], S.SearchStats(), ctx, [1], math.inf) for t in (3.0, 1.0, 2.0)]
    S._prove_all(searched, 1, 100.0 + 200.0, 1, None)
    reserve = S.PROOF_RESERVE * 200.0
    assert deadlines == pytest.approx([300.0 - 2 * reserve, 300.0 - reserve, 300.0])
    deadlines.clear()
    S._prove_all(searched, 1, None, 1, None)  # no time limit: none
    assert deadlines == [math.inf] * 3


def test_a_search_under_a_cutoff_finds_what_beats_it_without_dives():
    """A search under a cutoff (`auto`'s schedules after 1F1B) makes no incumbent dives
    (dual_search.search: the cutoff is its incumbent), so what beats the cutoff only its boxes
    find. ZB-H1 on the 64-chip cluster (a space far beyond one resolved at its root): under a
    cutoff just above its optimum it still returns that optimum, proved; under the optimum
    itself, nothing, proved (no plan beats it)."""
    from pathlib import Path

    from h2jax.cluster import load_cluster
    from h2jax.planner.search import _search_dual
    from h2jax.planner.space import SearchStats, micro_batches_of

    cluster = load_cluster(Path(__file__).resolve().parent.parent / "plans" / "cluster-64.toml")
    ctx = make_context(cluster, "llama-100b", 4096, 2048, "zb-h1")
    mbs = micro_batches_of(2048, None)
    (best,) = _search_dual(ctx, mbs, 1, SearchStats())
    stats = SearchStats()
    (under,) = _search_dual(ctx, mbs, 1, stats, cutoff=best.time_s * (1 + 1e-6))
    assert under.time_s == best.time_s and stats.proved_optimal
    stats = SearchStats()
    assert _search_dual(ctx, mbs, 1, stats, cutoff=best.time_s) == [] and stats.proved_optimal
