"""Two shapes per chip type: the local search (planner/mixed_shapes.py) against the exhaustive
enumeration of every two-shape stage list, and what `plan_cluster` and `h2jax plan` report."""

import dataclasses
import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest

from h2jax.cli import main as cli_main
from h2jax.cluster import ChipGroup, ChipType, Cluster, Precision, load_chip, load_cluster
from h2jax.planner import mixed_shapes, plan_cluster, search
from h2jax.planner.cost_model import CostOptions
from h2jax.planner.memory_model import StageMemoryTerms
from h2jax.planner.mixed_shapes import Shapes, climb, in_space, merged, moves, refine
from h2jax.planner.search import exhaustive_size, top_k
from h2jax.planner.space import Candidate, Option, PlannerError, SearchStats, divisors, make_context
from h2jax.planner.split import Beside, NewShapes, TopK, _may_hold, list_bound, list_sums, sums_bound

REPO = Path(__file__).resolve().parent.parent
C64 = REPO / "plans" / "cluster-64.toml"
EMU2 = REPO / "plans" / "cluster-emu-2type.toml"


def chip(name, memory_gib, tflops, per_node=2, inter=2.0, intra=50.0, compute="float32"):
    return ChipType(name, "cpu", memory_gib, tflops, per_node, intra, inter, "test",
                    precision=Precision("float32", compute))


def small_cluster(rng: random.Random) -> Cluster:
    groups = []
    for i in range(rng.choice([1, 2])):
        groups.append(ChipGroup(chip(f"chip{i}", rng.choice([0.004, 0.008, 0.016]), rng.choice([0.1, 0.3, 1.0, 2.5]),
                                     rng.choice([2, 4]), rng.choice([0.5, 2.0, 10.0]), rng.choice([5.0, 50.0]),
                                     rng.choice(["float32", "bfloat16"])), rng.randint(2, 8)))
    return Cluster(tuple(groups), name="random")


def layout(cand):
    return [(o.chip, o.stages, o.data, o.tensor, o.recompute) for o in cand.options]


# Cases where the two-shape optimum (exhaustive) beats the one-shape one, each reached by a
# different kind of move: a block split in two shapes; a neighbour's block replaced by a second
# shape of this type; the list moved to another micro-batch size, then split; the kept stages
# on another recompute policy beside a new block.
CASES = {
    "recompute": (Cluster((ChipGroup(chip("chip0", 0.004, 2.5, per_node=4, intra=5.0, compute="bfloat16"), 12),)),
                  128, 8, "1f1b"),
    "split": (Cluster((ChipGroup(chip("chip0", 0.004, 2.5), 7), ChipGroup(chip("chip1", 0.016, 1.0), 4))), 128, 4, "1f1b"),
    "neighbour": (Cluster((ChipGroup(chip("chip0", 0.004, 1.0, compute="bfloat16"), 12),
                           ChipGroup(chip("chip1", 0.008, 1.0, inter=0.5, intra=5.0), 7))), 128, 8, "gpipe"),
    "micro-batch": (Cluster((ChipGroup(chip("chip0", 0.004, 0.1, per_node=4, inter=0.5, compute="bfloat16"), 7),)),
                    128, 4, "1f1b"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_shapes_reach_the_exhaustive_two_shape_optimum(case):
    cluster, seq, batch, schedule = CASES[case]
    kw = dict(schedule=schedule)
    (one,), one_stats = top_k(cluster, "tiny", seq, batch, **kw)
    (one_full,), _ = top_k(cluster, "tiny", seq, batch, exhaustive=True, **kw)
    (two_full,), _ = top_k(cluster, "tiny", seq, batch, exhaustive=True, mixed_shapes=True, **kw)
    (two,), stats = top_k(cluster, "tiny", seq, batch, mixed_shapes=True, **kw)
    assert math.isclose(one.time_s, one_full.time_s, rel_tol=1e-9)
    assert two_full.time_s < one_full.time_s * (1 - 1e-3), "the case must need two shapes"
    assert math.isclose(two.time_s, two_full.time_s, rel_tol=1e-9), (layout(two), layout(two_full))
    # the case's kind of move is needed: climbing from the best one-shape list alone reaches it
    ctx = make_context(cluster, "tiny", seq, batch, schedule)
    alone = refine(ctx, [one], divisors(batch), SearchStats())
    assert math.isclose(alone.time_s, two_full.time_s, rel_tol=1e-9), (layout(alone), layout(two_full))
    assert stats.one_shape_time_s == pytest.approx(one.time_s, rel=1e-12)
    chips = [o.chip for o in two.options]
    assert any(chips.count(c) == 2 for c in chips), layout(two)  # one type on two shapes
    assert in_space(two.options, cluster.counts)


def test_the_local_search_stays_between_the_one_and_two_shape_optima():
    """Seeded random small clusters: one-shape optimum >= the local search's plan >= the
    exhaustive two-shape optimum, and the two-shape exhaustive never loses to one shape."""
    rng = random.Random(3)
    checked = 0
    for _ in range(20):
        cluster = small_cluster(rng)
        seq, batch, schedule = rng.choice([32, 128]), rng.choice([2, 4]), rng.choice(["1f1b", "gpipe"])
        try:
            (one,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, exhaustive=True)
        except PlannerError:
            continue
        (two,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
        (two_full,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True, exhaustive=True)
        assert two_full.time_s <= two.time_s * (1 + 1e-9) <= one.time_s * (1 + 2e-9), (layout(two), layout(two_full))
        assert in_space(two.options, cluster.counts)
        checked += 1
    assert checked >= 12


def test_the_space_keeps_a_types_blocks_few_and_within_its_chips():
    ctx = make_context(load_cluster(C64), "llama-100b", 4096, 2048)
    first, second = (sorted((o for o in opts if o.stages == 1), key=lambda o: o.chips)
                     for opts in ctx.type_options(32, prune_unfit=True))
    counts = ctx.counts
    x, y, z = first[:3]
    assert len({x.shape, y.shape, z.shape}) == 3
    assert in_space((x, second[0]), counts)
    assert in_space((x, y, second[0]), counts)
    assert in_space((x, second[0], y), counts)  # a type's two blocks need not be adjacent
    assert not in_space((x, y, z), counts)  # three blocks of one type
    big = max(ctx.type_options(32, prune_unfit=True)[0], key=lambda o: o.chips)
    assert big.chips <= counts[big.chip] and not in_space((big, x), counts)  # over its chips
    assert merged((x, x, second[0])) == (dataclasses.replace(x, stages=2), second[0])


def test_moves_are_one_step_and_reach_every_split_of_a_block():
    """From one block of k stages: every list keeping j of them (0..k) beside m stages of another
    shape of its chip is a move (chips permitting), and every move stays one block's change."""
    ctx = make_context(load_cluster(C64), "llama-100b", 4096, 2048)
    (best,), _ = top_k(load_cluster(C64), "llama-100b", 4096, 2048)
    shapes = {}
    for opts in ctx.type_shapes(best.micro_batch, prune_unfit=True):
        for o in opts:
            shapes.setdefault(o.chip, []).append(o)
    start = merged(best.options)
    found = {merged(x) for x in moves(start, shapes, ctx.counts, ctx.model.n_layers)}
    assert start not in found
    a = start[0]  # the first block
    other = next(s for s in shapes[a.chip] if s.shape != a.shape)
    room = ctx.counts[a.chip] - a.chips
    for keep in range(a.stages + 1):
        for k in range(1, (room + (a.stages - keep) * a.data * a.tensor) // (other.data * other.tensor) + 1):
            kept = (dataclasses.replace(a, stages=keep),) if keep else ()
            extra = (dataclasses.replace(other, stages=k),)
            assert merged(kept + extra + start[1:]) in found
            assert merged(extra + kept + start[1:]) in found
    def per_chip(options):
        out = {}
        for o in options:
            out.setdefault(o.chip, []).append((o.shape, o.stages))
        return out

    before = per_chip(start)
    for x in found:  # a move changes one block and at most one neighbouring type
        after = per_chip(x)
        assert sum(before.get(c) != after.get(c) for c in set(before) | set(after)) <= 2


def test_moves_skip_only_the_lists_that_cannot_beat_the_best():
    """`moves` weighs a new block's lists before it builds them (`split.Beside.cannot_beat`):
    every list it no longer yields once told a time to beat fails a test `split.solve` asks
    of it (its sums bound, `split.sums_bound`, reaches that time, or `split._may_hold` rejects
    it), and the memory caps skip lists the sums bound alone would build."""
    ctx = make_context(load_cluster(C64), "llama-100b", 4096, 2048)
    (best,), _ = top_k(load_cluster(C64), "llama-100b", 4096, 2048)
    b, L = best.micro_batch, ctx.model.n_layers
    weight = ctx.sched.closed_form.steady_weight(ctx.global_batch // b, ctx.v)
    shapes = {}
    for opts in ctx.type_shapes(b, prune_unfit=True):
        for o in opts:
            shapes.setdefault(o.chip, []).append(o)
    start = merged(best.options)
    for beat in (best.time_s, best.time_s * 1.05):
        every = set(moves(start, shapes, ctx.counts, L))
        by_sums = set(moves(start, shapes, ctx.counts, L,
                            lambda beside, s, ks: sums_bound(weight, L, beside.sums.plus(s, ks)) >= beat))
        kept = set(moves(start, shapes, ctx.counts, L,
                         lambda beside, s, ks: beside.cannot_beat(weight, L, s, ks, beat)))
        assert kept <= by_sums <= every and len(kept) < len(by_sums) < len(every)
        for x in every - kept:
            assert sums_bound(weight, L, list_sums(x)) >= beat * (1 - 1e-12) or not _may_hold(ctx, b, x, beat)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_a_new_blocks_cheap_test_rejects_only_what_may_hold_rejects(schedule, v):
    """`split.Beside.cannot_beat` over random lists of random small clusters, every number of
    new stages at once: where it says no list of the blocks and k new stages can beat a time,
    the list with the new block in any place fails `sums_bound` or `_may_hold` at that time
    (the memory caps, each stage's `cap1` and at most L - p + 1 layers, are a relaxation of
    `_may_hold`'s); and the caps reject some lists the sums bound alone does not."""
    rng = random.Random(7)
    by_caps = 0
    for _ in range(25):
        cluster = small_cluster(rng)
        ctx = make_context(cluster, "tiny", 128, 8, schedule, v=v)
        L = ctx.model.n_layers
        for b in divisors(8):
            shapes = [o for opts in ctx.type_shapes(b, prune_unfit=True) for o in opts]
            if not shapes:
                continue
            weight = ctx.sched.closed_form.steady_weight(ctx.global_batch // b, ctx.v)
            for _ in range(12):
                beside = [dataclasses.replace(o, stages=rng.randint(1, 2)) for o in rng.sample(shapes, rng.randint(0, 2))]
                new = rng.choice(shapes)
                ks = np.arange(1, L - sum(o.stages for o in beside) + 1)
                if not len(ks):
                    continue
                one = list_bound(ctx, b, beside + [dataclasses.replace(new, stages=int(ks[0]))])
                beat = (one if math.isfinite(one) else 1.0) * rng.choice([0.7, 1.0, 1.3])
                no = Beside(beside).cannot_beat(weight, L, new, ks, beat)
                for k, rejected in zip(ks.tolist(), no.tolist()):
                    lists = [beside[:j] + [dataclasses.replace(new, stages=k)] + beside[j:] for j in range(len(beside) + 1)]
                    by_sum = sums_bound(weight, L, list_sums(lists[0])) >= beat
                    if rejected:
                        by_caps += not by_sum
                        assert all(by_sum or not _may_hold(ctx, b, x, beat) for x in lists)
    assert by_caps > 0


def test_a_new_blocks_test_over_every_shape_at_once_answers_as_shape_by_shape():
    """`moves` asks `split.Beside.cannot_beat` once for every shape of a chip at every number
    of stages (`split.NewShapes`, a column each, the fill order of the blocks then differing
    per column): each column's answer is the one it gives that shape alone."""
    rng = random.Random(11)
    asked = 0
    for _ in range(20):
        ctx = make_context(small_cluster(rng), "tiny", 128, 8)
        L = ctx.model.n_layers
        for b in divisors(8):
            shapes = [o for opts in ctx.type_shapes(b, prune_unfit=True) for o in opts]
            if len(shapes) < 2:
                continue
            weight = ctx.sched.closed_form.steady_weight(ctx.global_batch // b, ctx.v)
            beside = [dataclasses.replace(o, stages=1) for o in rng.sample(shapes, rng.randint(0, 2))]
            most = L - len(beside)
            if most < 1:
                continue
            which = np.repeat(np.arange(len(shapes)), most)
            ks = np.tile(np.arange(1, most + 1), len(shapes))
            for beat in (list_bound(ctx, b, beside + [dataclasses.replace(shapes[0], stages=1)]) * 1.2, 1.0):
                beat = beat if math.isfinite(beat) else 1.0
                together = Beside(beside).cannot_beat(weight, L, NewShapes.of(shapes).take(which), ks, beat)
                alone = np.concatenate([Beside(beside).cannot_beat(weight, L, s, np.arange(1, most + 1), beat)
                                        for s in shapes])
                assert together.tolist() == alone.tolist()
                asked += int((~together).sum() > 0 and together.sum() > 0)
    assert asked > 0  # some columns said yes and some no


def test_a_move_puts_one_block_anywhere_else_in_the_pipeline():
    """Every list with one block taken out and put in another place of the pipeline is a move
    (a type may then run at both ends, another between), and such a move keeps every block."""
    ctx = make_context(load_cluster(C64), "llama-100b", 4096, 2048)
    a, b = (sorted((o for o in opts if o.stages == 2), key=lambda o: o.chips)[0]
            for opts in ctx.type_options(32, prune_unfit=True))
    a2 = next(o for o in ctx.type_options(32, prune_unfit=True)[0] if o.stages == 1 and o.shape != a.shape)
    start = (a, b, a2)
    found = set(moves(start, {}, ctx.counts, ctx.model.n_layers))
    for i, block in enumerate(start):
        rest = start[:i] + start[i + 1:]
        for j in range(len(rest) + 1):
            assert j == i or rest[:j] + (block,) + rest[j:] in found
    assert start not in found
    assert (b, a, a2) in found and (a, a2, b) in found and (a2, a, b) in found


def test_a_move_puts_some_of_a_blocks_stages_elsewhere_on_its_shape():
    """Every list with k of a block's stages (on its shape) taken out and put in another place
    of the pipeline, not beside the kept ones, is a move; not where the type has two blocks."""
    ctx = make_context(load_cluster(C64), "llama-100b", 4096, 2048)
    a, b = (sorted((o for o in opts if o.stages == 3), key=lambda o: o.chips)[0]
            for opts in ctx.type_options(32, prune_unfit=True))
    found = set(moves((a, b), {}, ctx.counts, ctx.model.n_layers))
    a1, a2 = (dataclasses.replace(a, stages=k) for k in (1, 2))
    b1, b2 = (dataclasses.replace(b, stages=k) for k in (1, 2))
    assert {(a2, b, a1), (a1, b, a2), (b1, a, b2), (b2, a, b1)} <= found
    assert (a1, a2, b) not in found and (a2, a1, b) not in found  # beside the kept stages: no change
    c = next(o for o in ctx.type_options(32, prune_unfit=True)[0] if o.stages == 1 and o.shape != a.shape)
    after = [merged(x) for x in moves((a, b, c), {}, ctx.counts, ctx.model.n_layers)]
    assert all(sum(o.chip == a.chip for o in x) <= 2 for x in after)  # no third block of a's type
    assert {(b1, a, b2, c), (a, b2, c, b1)} <= set(after)  # (b's type has one block: its stages may move)


# Seeded random tiny clusters (benchmarks/planner.py's) whose two-shape optima run chip0 at
# both ends of the pipeline and chip1 between: the local search reaches "block" by moving a
# block to the other side of its neighbour, "part" only by moving some of a block's stages
# there, on its shape
BOTH_ENDS = {
    "block": (Cluster((ChipGroup(chip("chip0", 0.004, 1.0, per_node=4, inter=10.0, intra=5.0), 7),
                       ChipGroup(chip("chip1", 0.008, 0.3, per_node=4, inter=2.0, intra=50.0, compute="bfloat16"),
                                 8))), 128, 8, "1f1b"),
    "part": (Cluster((ChipGroup(chip("chip0", 0.004, 0.1, per_node=4, inter=10.0, intra=5.0), 8),
                      ChipGroup(chip("chip1", 0.008, 0.1, per_node=4, inter=0.5, intra=50.0), 7))), 32, 2, "gpipe"),
}


@pytest.mark.parametrize("case", sorted(BOTH_ENDS))
def test_the_local_search_reaches_a_type_at_both_ends(case):
    cluster, seq, batch, schedule = BOTH_ENDS[case]
    (two,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
    (full,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True, exhaustive=True)
    (one,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule)
    assert full.time_s < one.time_s * (1 - 1e-4)
    assert math.isclose(two.time_s, full.time_s, rel_tol=1e-9), (layout(two), layout(full))
    chips = [o.chip for o in two.options]
    assert chips[0] == chips[-1] != chips[1], layout(two)
    assert case != "part" or two.options[0].shape == two.options[-1].shape, layout(two)


# A seeded random tiny cluster (benchmarks/planner.py's) whose two-shape optimum the local
# search reaches only by climbing from a start at another micro-batch size against its own
# time (mixed_shapes.refine)
OTHER_MICRO_BATCH = (Cluster((ChipGroup(chip("chip0", 0.008, 0.3, per_node=4, inter=0.5, intra=50.0), 7),
                              ChipGroup(chip("chip1", 0.004, 1.0, per_node=2, inter=2.0, intra=50.0), 7))),
                     128, 4, "gpipe")


def test_the_first_start_at_another_micro_batch_size_climbs_against_its_own_time():
    cluster, seq, batch, schedule = OTHER_MICRO_BATCH
    ones, _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, k=search.REFINE_STARTS)
    (two,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
    (full,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True, exhaustive=True)
    assert full.time_s < ones[0].time_s * (1 - 1e-3)
    assert math.isclose(two.time_s, full.time_s, rel_tol=1e-9), (layout(two), layout(full))
    # the optimum is at a micro-batch size of a later start, not the best one's
    assert two.micro_batch != ones[0].micro_batch and two.micro_batch in {c.micro_batch for c in ones[1:]}


def test_on_a_large_space_every_later_start_climbs_against_the_best_so_far(monkeypatch):
    """On a small space the first start at each micro-batch size climbs in a TopK of its own
    (against its own time, above); beyond WIDE_SPACE (here every space: it is set to 0) every
    start climbs in one, only through lists faster than the best plan so far."""
    import h2jax.planner.mixed_shapes as mixed

    cluster, seq, batch, schedule = OTHER_MICRO_BATCH
    climbs, real = [], mixed.climb

    def recording(ctx, start, micro_batches, shapes, top, *rest):
        climbs.append((start.micro_batch, top))
        return real(ctx, start, micro_batches, shapes, top, *rest)

    monkeypatch.setattr(mixed, "climb", recording)
    top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
    small, climbs[:] = list(climbs), []
    monkeypatch.setattr(search, "WIDE_SPACE", 0)
    monkeypatch.setattr(search, "START_GAP", math.inf)  # (every start climbs)
    top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
    firsts = [top for n, (b, top) in enumerate(small) if b not in {b2 for b2, _ in small[:n]}]
    assert len(firsts) > 1 and len({id(top) for top in firsts}) == len(firsts)  # one each
    assert len({b for b, _ in climbs}) > 1 and len({id(top) for _, top in climbs}) == 1


def test_the_local_search_solves_no_list_of_a_length_the_schedule_does_not_run(monkeypatch):
    """Interleaved 1F1B runs p stages only where p divides m: the local search neither builds
    a new block's split of another length nor solves a list of one (before, `solve` turned
    each away, 81 % of the lists of a climb on 2,432 chips)."""
    import h2jax.planner.mixed_shapes as mixed

    asked, real = [], mixed.solve

    def recording(ctx, b, chosen, top, stats):
        asked.append((ctx, b, sum(o.stages for o in chosen)))
        return real(ctx, b, chosen, top, stats)

    monkeypatch.setattr(mixed, "solve", recording)
    rng = random.Random(3)
    for _ in range(6):
        try:
            top_k(small_cluster(rng), "tiny", 128, 16, schedule="interleaved-1f1b", virtual_stages=2,
                  mixed_shapes=True)
        except PlannerError:
            continue
    assert len({p for _, _, p in asked}) > 1  # lists of several lengths were solved
    assert all(ctx.sched.unsupported(p, ctx.global_batch // b, ctx.v) is None for ctx, b, p in asked)


def test_a_types_two_blocks_reshare_their_chips_in_one_move():
    """One of a type's two blocks shorter and the other longer at once (`moves`' re-share):
    with every H100 in use, 4 stages of (4, 1) and 2 of (4, 2) apart, the move gives two of
    the first block's stages' chips to a third stage of the second, a list neither one block
    shorter nor one longer reaches. A random small cluster of `benchmarks/planner.py
    --random-two-shapes`' kind (seed 7) whose local search stopped 0.054 % above that list
    now reaches it."""
    cluster = Cluster((ChipGroup(load_chip("nvidia-h100"), 32), ChipGroup(load_chip("huawei-ascend-910b"), 24),
                       ChipGroup(load_chip("amd-mi300x"), 16)))
    ctx = make_context(cluster, "llama-7b", 4096, 512, "1f1b")
    shapes = {opts[0].chip: opts for opts in ctx.type_shapes(4, prune_unfit=True) if opts}

    def block(chip, stages, data, tensor):
        return dataclasses.replace(next(o for o in shapes[chip] if o.shape == (data, tensor, "none")), stages=stages)

    h100, ascend, mi300x = "nvidia-h100", "huawei-ascend-910b", "amd-mi300x"
    start = (block(h100, 4, 4, 1), block(ascend, 1, 4, 2), block(h100, 2, 4, 2), block(ascend, 1, 4, 4),
             block(mi300x, 2, 4, 2))
    reshared = (block(h100, 2, 4, 1),) + start[1:2] + (block(h100, 3, 4, 2),) + start[3:]
    assert in_space(start, ctx.counts) and in_space(reshared, ctx.counts)
    assert sum(o.chips for o in start if o.chip == h100) == ctx.counts[h100]  # (no chip to spare)
    assert reshared in set(moves(start, shapes, ctx.counts, ctx.model.n_layers))
    (two,), _ = top_k(cluster, "llama-7b", 4096, 512, mixed_shapes=True)
    assert two.micro_batch == 4 and merged(two.options) == reshared, layout(two)


def test_the_exhaustive_size_counts_two_shape_lists():
    ctx = make_context(load_cluster(EMU2), "tiny", 16, 8, "1f1b", None, CostOptions(), ("none", "selective", "full"), 1)
    mbs = divisors(8)
    brute = 0
    for b in mbs:
        for combo in itertools.product(*[[None, *blocks] for blocks in ctx.type_blocks(b, True)]):
            blocks = [o for blk in combo if blk is not None for o in blk]
            p = sum(o.stages for o in blocks)
            if 1 <= p <= ctx.model.n_layers:  # every order of the blocks
                brute += math.factorial(len(blocks)) * math.comb(ctx.model.n_layers - 1, p - 1)
    total, _, _ = exhaustive_size(ctx, mbs, two_shapes=True)
    assert total == brute > exhaustive_size(ctx, mbs)[0]


def test_plan_cluster_reports_the_one_shape_optimum_and_the_two_shape_gain(capsys):
    cluster = load_cluster(C64)
    args = (cluster, "llama-100b", 4096, 2048)
    one = plan_cluster(*args, baselines=False, mixed_shapes=False)
    two = plan_cluster(*args, baselines=False)
    assert "one_shape_step_time_s" not in one.plan.predicted
    pred = two.plan.predicted
    assert pred["one_shape_step_time_s"] == pytest.approx(one.plan.predicted["step_time_s"], rel=1e-9)
    assert pred["two_shapes_faster_by"] == pytest.approx(1 - pred["step_time_s"] / pred["one_shape_step_time_s"])
    assert pred["two_shapes_faster_by"] > 1e-3  # cluster-64: the A100s' front stages take tensor 8, the rest 4
    meshes = {}
    for s in two.plan.stages:
        meshes.setdefault(s.chip, set()).add((s.mesh.data, s.mesh.tensor, s.recompute))
    assert max(len(v) for v in meshes.values()) == 2
    for name, count in cluster.counts.items():
        assert sum(s.mesh.data * s.mesh.tensor for s in two.plan.stages if s.chip == name) <= count
    rc = cli_main(["plan", "--cluster", str(C64), "--model", "llama-100b", "--seq-len", "4096",
                   "--global-batch-tokens", str(8 * 2**20), "--schedule", "1f1b", "--no-baselines"])
    out = capsys.readouterr().out
    assert rc in (0, None) and "among plans with one shape per chip type" in out and "faster" in out
    rc = cli_main(["plan", "--cluster", str(C64), "--model", "llama-100b", "--seq-len", "4096",
                   "--global-batch-tokens", str(8 * 2**20), "--schedule", "1f1b", "--no-baselines",
                   "--one-shape-per-type"])
    out = capsys.readouterr().out
    assert rc in (0, None) and "one shape per chip type" not in out


def test_plan_says_when_the_local_search_found_no_faster_plan_with_two_shapes(capsys):
    """cluster-1024's best one-shape plan is the local search's best too: `h2jax plan` says
    it looked, and that this is not proved."""
    rc = cli_main(["plan", "--cluster", str(REPO / "plans" / "cluster-1024.toml"), "--model", "llama-100b",
                   "--seq-len", "4096", "--global-batch-tokens", str(8 * 2**20), "--schedule", "1f1b",
                   "--no-baselines"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc in (0, None) and "among plans with one shape per chip type; a local search found no faster plan" in out
    assert "(not proved: --prove-two-shapes)" in out and "faster" not in out.split("local search found no")[0]


def test_the_local_search_climbs_from_the_best_few_one_shape_lists():
    """A case whose two-shape optimum lies beyond the best one-shape list's local optimum but
    within reach of the next ones' (search.REFINE_STARTS)."""
    cluster = Cluster((ChipGroup(chip("chip0", 0.004, 1.0, intra=5.0, inter=10.0), 6),))
    (one,), _ = top_k(cluster, "tiny", 128, 4, schedule="gpipe")
    (two,), _ = top_k(cluster, "tiny", 128, 4, schedule="gpipe", mixed_shapes=True)
    (two_full,), _ = top_k(cluster, "tiny", 128, 4, schedule="gpipe", mixed_shapes=True, exhaustive=True)
    ctx = make_context(cluster, "tiny", 128, 4, "gpipe")
    alone = refine(ctx, [one], divisors(4), SearchStats())
    assert alone.time_s > two_full.time_s * 1.01  # stuck from the best one-shape list alone
    assert math.isclose(two.time_s, two_full.time_s, rel_tol=1e-9), (layout(two), layout(two_full))


# A seeded random tiny cluster (benchmarks/planner.py's two-shape cases, seed 1, case 289)
# whose two-shape optimum the local search reaches only from the third best one-shape list
THIRD_START = (Cluster((ChipGroup(chip("chip0", 0.004, 0.1, per_node=2, inter=10.0, intra=50.0, compute="bfloat16"), 5),)),
               128, 8, "1f1b")


def test_on_a_small_space_the_local_search_climbs_from_the_three_best_one_shape_lists():
    """A small space's starts are its REFINE_STARTS best one-shape lists, proved (the exact
    search prunes by the third best's time: `search._Starts`), not its incumbents: here the
    search meets only its best as an incumbent, and the optimum is reached only from the third."""
    cluster, seq, batch, schedule = THIRD_START
    ones, _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, k=search.REFINE_STARTS)
    (two,), stats = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True)
    (full,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule, mixed_shapes=True, exhaustive=True)
    assert stats.space_size <= search.WIDE_SPACE and full.time_s < ones[0].time_s * (1 - 1e-3)
    assert math.isclose(two.time_s, full.time_s, rel_tol=1e-9), (layout(two), layout(full))
    ctx = make_context(cluster, "tiny", seq, batch, schedule)
    alone = refine(ctx, ones[:2], divisors(batch), SearchStats(), wide=True)
    assert alone.time_s > full.time_s * (1 + 1e-3)  # (neither of the best two reaches it)


def plan_at(time_s: float, b: int) -> Candidate:
    return Candidate(time_s, b, (), ())


def test_the_local_search_starts_are_proved_on_a_small_space_and_incumbents_on_a_large_one():
    stats = SearchStats()
    top = search._Starts(1, 3, math.inf, stats)
    for t, b in ((5.0, 1), (4.0, 2), (6.0, 3), (3.0, 4), (5.5, 5)):
        top.push(plan_at(t, b))
    # a small space: the search prunes by the third best, the three best are kept
    assert top.bound == 5.0 and [c.time_s for c in top.sorted()] == [3.0, 4.0, 5.0]
    stats.space_size = search.WIDE_SPACE + 1  # the space met grows past it: the best's time
    assert top.bound == 3.0 and top.k == 1 and top.heap[0][2].time_s == 3.0
    top.push(plan_at(3.5, 6))  # no incumbent: not a start
    top.push(plan_at(2.0, 7))  # an incumbent: the first start
    assert top.bound == 2.0 and [c.time_s for c in top.sorted()] == [2.0, 3.0, 4.0]
    top.ceiling = 1.5  # a two-shape plan known (search._EarlyClimb): the search proves only what beats it
    assert top.bound == 1.5
    top.push(plan_at(1.8, 8))  # slower than it: not a start, not the best
    top.push(plan_at(1.2, 9))
    assert top.bound == 1.2 and [c.time_s for c in top.sorted()] == [1.2, 2.0, 3.0]


def _search_768(mixed_shapes: bool, climb_early: bool):
    """1F1B's search on the 768-chip cluster (llama-100b, 8M tokens), as `top_k` makes it
    (`climb_early`: as it does for one schedule)."""
    return search._search_one(load_cluster(REPO / "plans" / "cluster-768.toml"), "llama-100b", 4096, 2048, 1,
                              "1f1b", 1, False, None, None, search.RECOMPUTE_POLICIES, CostOptions(), None,
                              mixed_shapes, climb_early=climb_early)


def test_on_a_large_space_the_search_for_the_starts_prunes_as_the_search_for_the_best():
    """Beyond WIDE_SPACE the exact search under two shapes (the local search after it, as
    under `--schedule auto`) bounds the rows of the search for the best plan alone, not those
    of the search for the best three (which its starts are not then: `search._Starts`)."""
    args = (load_cluster(REPO / "plans" / "cluster-768.toml"), "llama-100b", 4096, 2048)
    (one,), one_stats = top_k(*args)
    _, three_stats = top_k(*args, k=3)
    two = _search_768(mixed_shapes=True, climb_early=False)
    assert two.stats.space_size > search.WIDE_SPACE and two.stats.one_shape_time_s == one.time_s
    assert two.stats.one_shape_proved
    assert two.stats.bound_rows == one_stats.bound_rows < three_stats.bound_rows
    assert two.found[0].time_s < one.time_s


def test_on_a_large_space_one_schedule_climbs_first_and_proves_only_that_no_one_shape_plan_beats_it(capsys):
    """One schedule, k = 1, beyond WIDE_SPACE: the local search climbs from the dives' plans
    before the exact search searches its boxes (`search._EarlyClimb`), which then proves only
    that no one-shape plan beats the plan reached: the same plan as climbing after the whole
    exact search, fewer rows bounded, the plan's time the bound, the one-shape optimum (here
    found by the dives, 2 % slower) not proved; `h2jax plan` says so."""
    from h2jax.cli.plan import print_table

    args = (load_cluster(REPO / "plans" / "cluster-768.toml"), "llama-100b", 4096, 2048)
    (one,), one_stats = top_k(*args)
    (two,), two_stats = top_k(*args, mixed_shapes=True)
    after = _search_768(mixed_shapes=True, climb_early=False).found[0]
    assert two_stats.space_size > search.WIDE_SPACE and two.time_s == after.time_s < one.time_s * 0.99
    assert two_stats.proved_optimal and not two_stats.one_shape_proved
    assert two_stats.lower_bound_s == two.time_s and two_stats.one_shape_time_s >= one.time_s
    assert two_stats.bound_rows < one_stats.bound_rows
    result = plan_cluster(*args, schedule="1f1b", baselines=False)
    assert result.plan.predicted["one_shape_proved"] is False
    print_table(result, args[0], None)
    out = " ".join(capsys.readouterr().out.split())
    assert "proved faster than every plan with one shape per chip type" in out
    assert "was not searched for" in out and "among plans with one shape" not in out


def test_a_ceiling_above_the_one_shape_optimum_loses_nothing(monkeypatch):
    """Where the early climb's plan is slower than the one-shape optimum (here made so: the
    slowest of the dives' plans, unclimbed), the exact search still finds the optimum under it,
    proves it, and climbs from it: the plan of the search without the early climb."""
    def slowest_start(self, top, stats):
        self.plan = top.sorted()[-1]
        top.ceiling = self.plan.time_s

    (one,), _ = top_k(load_cluster(REPO / "plans" / "cluster-768.toml"), "llama-100b", 4096, 2048)
    monkeypatch.setattr(search._EarlyClimb, "__call__", slowest_start)
    early = _search_768(mixed_shapes=True, climb_early=True)
    after = _search_768(mixed_shapes=True, climb_early=False)
    assert early.stats.one_shape_proved and early.stats.one_shape_time_s == one.time_s
    assert early.found[0].time_s == after.found[0].time_s < one.time_s


def test_an_early_climb_that_finds_nothing_faster_leaves_the_one_shape_optimum_proved(monkeypatch):
    """Where the early climb ends at its start (made so: the dives' best, here the one-shape
    optimum, unclimbed) no one-shape plan beats it: it is the one-shape optimum, proved."""
    def no_move(self, top, stats):
        self.plan = top.sorted()[0]
        top.ceiling = self.plan.time_s

    (one,), _ = top_k(load_cluster(REPO / "plans" / "cluster-768.toml"), "llama-100b", 4096, 2048)
    monkeypatch.setattr(search._EarlyClimb, "__call__", no_move)
    early = _search_768(mixed_shapes=True, climb_early=True)
    assert early.stats.one_shape_proved and early.stats.proved_optimal
    assert early.stats.one_shape_time_s == early.found[0].time_s == one.time_s


def test_on_a_large_space_the_local_search_climbs_only_from_starts_near_the_best(monkeypatch):
    """Beyond WIDE_SPACE (here every space: it is set to 0) the starts after the best are
    climbed from only within START_GAP of it: the 64-chip cluster's incumbents after the best
    are 2.8 % and 7.4 % slower (all three climb where the gap allows them)."""
    monkeypatch.setattr(search, "WIDE_SPACE", 0)
    monkeypatch.setattr(search._EarlyClimb, "__call__", lambda self, top, stats: None)  # (the climbs after)
    starts = []
    monkeypatch.setattr(search, "refine", lambda ctx, given, *rest: (starts.append(given), given[0])[1])
    args = (load_cluster(C64), "llama-100b", 4096, 2048)
    monkeypatch.setattr(search, "START_GAP", math.inf)
    top_k(*args, mixed_shapes=True)
    monkeypatch.setattr(search, "START_GAP", 0.01)
    top_k(*args, mixed_shapes=True)
    every, near = starts
    assert len(every) == search.REFINE_STARTS and every[1].time_s > every[0].time_s * 1.01
    assert near == [c for c in every if c.time_s <= every[0].time_s * 1.01] == every[:1]


@pytest.mark.parametrize("case", ["split", "neighbour"])
def test_a_proved_one_shape_optimum_spares_the_local_search_every_one_shape_list(case, monkeypatch):
    """No one-shape list beats a proved one-shape optimum, so `refine` does not solve any when
    the exact search proved its start; unproved, it solves them too, and finds the same plan."""
    import h2jax.planner.mixed_shapes as mixed

    cluster, seq, batch, schedule = CASES[case]
    (one,), _ = top_k(cluster, "tiny", seq, batch, schedule=schedule)
    ctx = make_context(cluster, "tiny", seq, batch, schedule)
    solved, real_solve = [], mixed.solve

    def recording(ctx_, b, chosen, top, stats):
        solved.append(tuple(chosen))
        return real_solve(ctx_, b, chosen, top, stats)

    monkeypatch.setattr(mixed, "solve", recording)
    found = {}
    for proved in (True, False):
        solved.clear()
        found[proved] = refine(ctx, [one], divisors(batch), SearchStats(proved_optimal=proved))
        one_shape_lists = [x for x in solved if mixed.one_shape(x)]
        assert bool(one_shape_lists) == (not proved), len(one_shape_lists)
    assert found[True].time_s == found[False].time_s < one.time_s


def _block(shapes, chip, stages, data, tensor, recompute):
    shape = next(o for o in shapes[chip] if (o.data, o.tensor, o.recompute) == (data, tensor, recompute))
    return dataclasses.replace(shape, stages=stages)


def test_a_block_put_on_a_smaller_shape_leaves_its_chips_to_its_types_other_block():
    """On the 64-chip cluster at micro-batch 2 the local search stopped at H100 8x(1,1,full),
    A100 8x(2,2), H100 3x(2,4) (238.58 s). The two-shape optimum there, H100 16x(1,1,full),
    A100 8x(2,2), H100 4x(2,2) (236.40 s), puts the back H100 block on a shape of half the
    chips and gives the chips it leaves to the front H100 block: one move now (neither half
    alone is faster), yielded even where the move's list without the grown block is hopeless."""
    ctx = make_context(load_cluster(C64), "llama-100b", 4096, 2048)
    L, b = ctx.model.n_layers, 2
    shapes = {opts[0].chip: opts for opts in ctx.type_shapes(b, prune_unfit=True) if opts}
    h100, a100 = "nvidia-h100", "nvidia-a100"
    start = (_block(shapes, h100, 8, 1, 1, "full"), _block(shapes, a100, 8, 2, 2, "none"),
             _block(shapes, h100, 3, 2, 4, "none"))
    target = (_block(shapes, h100, 16, 1, 1, "full"), _block(shapes, a100, 8, 2, 2, "none"),
              _block(shapes, h100, 4, 2, 2, "none"))
    alone = (_block(shapes, h100, 8, 1, 1, "full"), _block(shapes, a100, 8, 2, 2, "none"),
             _block(shapes, h100, 4, 2, 2, "none"))  # the back block's half of the move alone

    def time_of(options):
        top = TopK(1)
        search.solve(ctx, b, options, top, SearchStats())
        return top.sorted()[0].time_s

    before = time_of(start)
    assert time_of(target) < before * (1 - 5e-3) and time_of(alone) > before
    weight = ctx.sched.closed_form.steady_weight(ctx.global_batch // b, ctx.v)
    found = {merged(x) for x in moves(start, shapes, ctx.counts, L,
                                      lambda beside, s, ks: beside.cannot_beat(weight, L, s, ks, before))}
    assert target in found and alone not in found


def test_on_a_small_space_the_local_search_climbs_from_the_micro_batch_sizes_beside_the_best():
    """The 64-chip cluster's one-shape optimum runs micro-batch 1 and its best three lists
    too; the two-shape optimum (proved) runs 2, where the best one-shape list is 16 % slower.
    The local search climbs from the best list at 2 as well (search.WIDE_SPACE) and
    reaches it; from the best three alone it stops 2 % short."""
    cluster = load_cluster(C64)
    args = (cluster, "llama-100b", 4096, 2048)
    (proved,), stats = top_k(*args, prove_two_shapes=True)
    assert stats.two_shapes_proved and proved.micro_batch == 2
    (two,), two_stats = top_k(*args, mixed_shapes=True)
    assert two.time_s == pytest.approx(proved.time_s, rel=1e-12), layout(two)
    assert two_stats.space_size <= search.WIDE_SPACE
    ones, _ = top_k(*args, k=search.REFINE_STARTS)
    assert {c.micro_batch for c in ones} == {1}
    ctx = make_context(*args)
    alone = refine(ctx, ones, divisors(2048), SearchStats())
    assert alone.time_s > proved.time_s * 1.01


# Two shipped chip types (a random cluster of `benchmarks/planner.py --random-two-shapes`'s
# kind) whose proved two-shape optimum runs the A100s at both ends, on two shapes, the TPUs
# between: no move of the narrow neighbourhood improves the one-shape optimum (a new block
# goes only beside its kept stages or its neighbour); a new block at the front does.
A100_V5E = (Cluster((ChipGroup(load_chip("nvidia-a100"), 16), ChipGroup(load_chip("google-tpu-v5e"), 24)),
                    name="a100+v5e"), "llama-70b", 4096, 512)


def test_with_anywhere_a_new_block_goes_to_any_place_in_the_pipeline():
    ctx = make_context(*A100_V5E)
    (one,), _ = top_k(*A100_V5E)
    (proved,), stats = top_k(*A100_V5E, prove_two_shapes=True)
    assert stats.two_shapes_proved and proved.micro_batch == one.micro_batch
    shapes, L = Shapes(ctx).for_moves(one.micro_batch), ctx.model.n_layers
    start = merged(one.options)
    narrow = {merged(x) for x in moves(start, shapes, ctx.counts, L)}
    wide = {merged(x) for x in moves(start, shapes, ctx.counts, L, anywhere=True)}
    assert narrow < wide
    target = merged(proved.options)
    assert target in wide and target not in narrow, layout(proved)


def test_a_stuck_climb_tries_new_blocks_anywhere_on_a_small_space(monkeypatch):
    """The default plan is the proved two-shape optimum, a type at both ends on two shapes;
    without the wide search (search.WIDE_SPACE) the local search stays at the one-shape optimum."""
    (proved,), _ = top_k(*A100_V5E, prove_two_shapes=True)
    (two,), stats = top_k(*A100_V5E, mixed_shapes=True)
    assert stats.space_size <= search.WIDE_SPACE
    assert two.time_s == pytest.approx(proved.time_s, rel=1e-12), layout(two)
    a, *_, z = two.options
    assert a.chip == z.chip == "nvidia-a100" and a.shape != z.shape, layout(two)
    (one,), _ = top_k(*A100_V5E)
    assert two.time_s < one.time_s * (1 - 5e-3)
    monkeypatch.setattr(search, "WIDE_SPACE", 0)
    (narrow,), _ = top_k(*A100_V5E, mixed_shapes=True)
    assert narrow.time_s == pytest.approx(one.time_s, rel=1e-12), layout(narrow)


def test_a_climb_solves_again_a_list_shown_slower_only_than_a_lower_time():
    """`refine`'s climbs share the lists they solved: a list not kept against one climb's time
    to beat is solved again by a climb whose time to beat is higher (a start's own climb), so
    it can still move there. Filled by a climb that must beat a time just under the optimum,
    `seen` holds the optimum's list; the start's own climb then still reaches it."""
    ctx = make_context(*A100_V5E)
    (one,), _ = top_k(*A100_V5E)
    (proved,), _ = top_k(*A100_V5E, prove_two_shapes=True)
    seen, shapes, mbs = {}, Shapes(ctx), divisors(512)
    climb(ctx, one, mbs, shapes, TopK(1, cutoff=proved.time_s * (1 - 1e-6)), seen, SearchStats(), math.inf, wide=True)
    assert (proved.micro_batch, merged(proved.options)) in seen
    own = TopK(1)
    own.push(one)
    climb(ctx, one, mbs, shapes, own, seen, SearchStats(), math.inf, wide=True)
    assert own.sorted()[0].time_s == pytest.approx(proved.time_s, rel=1e-12), layout(own.sorted()[0])


# A cluster of `benchmarks/planner.py --random-two-shapes`' kind whose proved two-shape
# optimum (micro-batch 8: an MI300X stage at each end of the pipeline, a TPU v5e stage between)
# no climb reaches one move at a time: the best of them stops 2.7 % short of it. Two moves
# ahead of a climb's best list lead to a faster list, and a climb on from it to the optimum.
# (Found 2026-12-07 by trying 2-type clusters of shipped chips; the one before, 48 MI300X and
# 16 v5e with llama-70b, needed no look-ahead once `selective` recomputation was priced as
# the runtime runs it.)
MI300X_V5E = (Cluster((ChipGroup(load_chip("google-tpu-v5e"), 16), ChipGroup(load_chip("amd-mi300x"), 16)),
                      name="v5e+mi300x"), "llama-7b", 4096, 1024)


def test_looking_two_moves_ahead_reaches_an_optimum_no_single_move_leads_to(monkeypatch):
    (proved,), stats = top_k(*MI300X_V5E, prove_two_shapes=True)
    assert stats.two_shapes_proved
    (two,), two_stats = top_k(*MI300X_V5E, mixed_shapes=True)
    assert two_stats.space_size <= search.WIDE_SPACE
    assert two.time_s == pytest.approx(proved.time_s, rel=1e-12), layout(two)
    monkeypatch.setattr(mixed_shapes, "_look_ahead", lambda *args: None)
    (stuck,), _ = top_k(*MI300X_V5E, mixed_shapes=True)
    assert stuck.time_s > proved.time_s * 1.02, layout(stuck)


def test_a_climb_looks_ahead_only_from_the_best_list_it_found(monkeypatch):
    """A later start at a micro-batch size climbs in the best so far: where no move beats that,
    it is stuck at its own start, a slower list, and does not look ahead from it; a start's
    own climb looks ahead once, from its best list, and not again from a list already looked
    ahead from."""
    ctx = make_context(*A100_V5E)
    (one,), _ = top_k(*A100_V5E)
    (proved,), _ = top_k(*A100_V5E, prove_two_shapes=True)
    assert proved.time_s < one.time_s
    calls = []
    monkeypatch.setattr(mixed_shapes, "_look_ahead", lambda ctx, b, options, *rest: calls.append((b, options)))
    shapes, mbs = Shapes(ctx), divisors(512)
    best_so_far = TopK(1)
    best_so_far.push(proved)
    climb(ctx, one, mbs, shapes, best_so_far, {}, SearchStats(), math.inf, wide=True)
    assert calls == []
    own, looked = TopK(1), set()
    own.push(one)
    climb(ctx, one, mbs, shapes, own, {}, SearchStats(), math.inf, wide=True, looked=looked)
    found = own.sorted()[0]
    assert calls == [(found.micro_batch, merged(found.options))] and looked == set(calls)
    again = TopK(1)
    again.push(found)
    climb(ctx, found, mbs, shapes, again, {}, SearchStats(), math.inf, wide=True, looked=looked)
    assert len(calls) == 1


def test_a_climb_far_above_the_best_of_the_climbs_before_it_does_not_look_ahead(monkeypatch):
    """`climb`'s `overall` (the best of the climbs before it): stuck more than LOOKAHEAD_GAP
    above it, a climb does not look ahead; within it, it does."""
    ctx = make_context(*A100_V5E)
    (one,), _ = top_k(*A100_V5E)
    calls = []
    monkeypatch.setattr(mixed_shapes, "_look_ahead", lambda ctx, b, options, *rest: calls.append(b))
    shapes, mbs = Shapes(ctx), divisors(512)
    for factor, looks in ((1 - 2 * mixed_shapes.LOOKAHEAD_GAP, False), (1.0, True)):
        own = TopK(1)
        own.push(one)
        calls.clear()
        climb(ctx, one, mbs, shapes, own, {}, SearchStats(), math.inf, wide=True,
              overall=TopK(1, cutoff=one.time_s * factor))
        assert own.sorted()[0].time_s > one.time_s * (1 - mixed_shapes.LOOKAHEAD_GAP)  # (the gate decides)
        assert bool(calls) == looks


def test_a_new_blocks_shapes_are_those_no_other_beats_on_every_count():
    """mixed_shapes.undominated against its definition, pair by pair, on random shapes: a
    shape goes where another is no worse on chips per stage, per-layer time, fill, tail and
    layers held at every in-flight count, and better on one (or equal and listed first)."""
    rng = random.Random(3)
    for _ in range(200):
        shapes = [
            Option(
                "H100", 1, rng.choice([1, 2]), rng.choice([1, 2]), "none", rng.choice([1.0, 2.0]),
                StageMemoryTerms(rng.choice([1.0, 2.0]), rng.choice([1.0, 2.0]), 1, 0.0, 0.0, 0.0, rng.choice([9.0, 12.0])),
                0, rng.choice([0.5, 1.0]), rng.choice([1.0, math.nan]),
            )
            for _ in range(rng.randint(1, 6))
        ]
        flights = np.arange(1, 4)
        caps = [s.max_layers(flights) for s in shapes]
        keys = [(s.data * s.tensor, s.layer_s, s.fill, s.tail1) for s in shapes]

        def beats(i, j):
            return (all(a <= b for a, b in zip(keys[i], keys[j])) and (caps[i] >= caps[j]).all()
                    and (keys[i] != keys[j] or (caps[i] > caps[j]).any() or i < j))

        expected = [s for j, s in enumerate(shapes) if not any(beats(i, j) for i in range(len(shapes)) if i != j)]
        kept = mixed_shapes.undominated(shapes, 3, 2)
        assert [id(s) for s in kept] == [id(s) for s in expected]
