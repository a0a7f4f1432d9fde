"""Planner properties on hundreds of random clusters: 2-4 chip types, both schedules, tight
memory so that "no plan fits" is a common answer, not a corner.

- the fast search equals exhaustive enumeration, including on which clusters nothing fits;
- every plan it returns is well formed: one block of stages per chip type (in any order),
  no chip type used beyond its count, layers covering the model, micro-batches dividing the
  global batch, memory per stage within the chip's;
- metamorphic: more memory on every chip, or more chips of a type, is never slower (the old
  plan is still in the space), and what fits keeps fitting.

The spaces are kept small (a few chips per type, one model of 4 layers, a drawn subset of the
recompute policies and micro-batch sizes) so that the exhaustive reference stays fast.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2jax.cluster import ChipGroup, ChipType, Cluster, Precision
from h2jax.config import PRESETS
from h2jax.planner import PlannerError, top_k

SCHEDULES = ["1f1b", "gpipe"]
TIGHT = 0.1  # a memory scale under which about half of the clusters cannot hold the model


# the values a random chip type's figures are drawn from (`clusters`, `random_cluster`)
CHIP_VALUES = {
    "memory_gib": [0.004, 0.008, 0.016, 0.05, 1.0],
    "peak_tflops": [0.1, 0.3, 1.0, 2.5],
    "chips_per_node": [1, 2, 4],
    "intra_node_gbps": [5.0, 50.0],
    "inter_node_gbps": [0.5, 2.0, 10.0],
    "compute": ["float32", "bfloat16"],
}


def chip_type(i: int, source: str, memory_scale: float = 1.0, **fig) -> ChipType:
    """Chip type i of a random cluster, from one value per CHIP_VALUES key."""
    return ChipType(
        name=f"chip{i}", platform="cpu", memory_gib=memory_scale * fig["memory_gib"],
        peak_tflops=fig["peak_tflops"], chips_per_node=fig["chips_per_node"],
        intra_node_gbps=fig["intra_node_gbps"], inter_node_gbps=fig["inter_node_gbps"], source=source,
        precision=Precision("float32", fig["compute"]),
    )


@st.composite
def clusters(draw, n_types, max_count):
    scale = draw(st.sampled_from([TIGHT, 1.0]))
    groups = []
    for i in range(n_types):
        chip = chip_type(i, "hypothesis", scale, **{k: draw(st.sampled_from(v)) for k, v in CHIP_VALUES.items()})
        groups.append(ChipGroup(chip, draw(st.integers(1, max_count))))
    return Cluster(tuple(groups), name="random")


# 2 types of up to 8 chips, 3 of up to 4, 4 of up to 2: the exhaustive search's space grows
# with types x counts, times the j! pipeline orders of j types (4 types of up to 3 chips:
# up to 100,000 stage lists, seconds each); these stay under ~0.1 s each on an idle core.
any_cluster = st.one_of(clusters(2, 8), clusters(3, 4), clusters(4, 2))
search_args = st.fixed_dictionaries({
    "seq_len": st.sampled_from([32, 128]),
    "global_batch": st.sampled_from([2, 4, 6, 8]),
    "schedule": st.sampled_from(SCHEDULES),
    "recompute": st.sampled_from([("none",), ("full",), ("none", "selective", "full")]),
    "micro_batches": st.sampled_from([(1,), (1, 2), None]),
})

MODEL = "tiny"
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def best(cluster, exhaustive=False, model=MODEL, **kwargs):
    """(candidate, stats), or (None, message) when no plan fits."""
    try:
        (cand,), stats = top_k(cluster, model, exhaustive=exhaustive, **kwargs)
    except PlannerError as e:
        return None, str(e)
    return cand, stats


def check_well_formed(cand, cluster, kwargs):
    cfg = PRESETS[MODEL]
    used = {}
    for o in cand.options:
        used[o.chip] = used.get(o.chip, 0) + o.stages * o.data * o.tensor
        assert o.recompute in kwargs["recompute"]
        assert cluster.chips[o.chip].chips_per_node % o.tensor == 0  # tensor parallel within a node
    for chip, n in used.items():
        assert n <= cluster.counts[chip], (chip, n, cluster.counts[chip])
    # one block of consecutive stages per chip type, the types in any order
    names = [o.chip for o in cand.options]
    assert len(set(names)) == len(names)
    assert len(cand.layers) == sum(o.stages for o in cand.options)
    assert sum(cand.layers) == cfg.n_layers and min(cand.layers) >= 1
    assert kwargs["global_batch"] % cand.micro_batch == 0
    if kwargs["micro_batches"] is not None:
        assert cand.micro_batch in kwargs["micro_batches"]
    # the data axis splits each micro-batch evenly
    assert all(cand.micro_batch % o.data == 0 for o in cand.options)


@pytest.mark.slow
@settings(max_examples=80, **SETTINGS)  # with the 200 clusters of tests/test_planner_order.py
@given(cluster=any_cluster, kwargs=search_args)
def test_fast_search_equals_exhaustive_on_random_clusters(cluster, kwargs):
    fast, fast_info = best(cluster, **kwargs)
    full, full_info = best(cluster, exhaustive=True, **kwargs)
    assert (fast is None) == (full is None), (fast_info, full_info)
    if fast is None:
        assert "no plan fits" in fast_info and "no plan fits" in full_info
        return
    assert fast.time_s == pytest.approx(full.time_s, rel=1e-9)
    assert fast_info.proved_optimal
    assert fast_info.plans_evaluated <= full_info.plans_evaluated
    check_well_formed(fast, cluster, kwargs)
    check_well_formed(full, cluster, kwargs)


def scaled_memory(cluster, factor):
    return Cluster(tuple(ChipGroup(dataclasses.replace(g.chip, memory_gib=g.chip.memory_gib * factor), g.count)
                         for g in cluster.groups), cluster.name)


def more_chips(cluster, index, extra):
    groups = list(cluster.groups)
    groups[index] = ChipGroup(groups[index].chip, groups[index].count + extra)
    return Cluster(tuple(groups), cluster.name)


@pytest.mark.slow
@settings(max_examples=50, **SETTINGS)
@given(cluster=any_cluster, kwargs=search_args, factor=st.sampled_from([2.0, 10.0]))
def test_more_memory_everywhere_is_never_slower(cluster, kwargs, factor):
    """Scaling every chip type's memory keeps every plan that fitted."""
    before, _ = best(cluster, **kwargs)
    after, info = best(scaled_memory(cluster, factor), **kwargs)
    if before is None:
        return
    assert after is not None, info
    assert after.time_s <= before.time_s * (1 + 1e-9)


@pytest.mark.slow
@settings(max_examples=50, **SETTINGS)
@given(cluster=any_cluster, kwargs=search_args, data=st.data())
def test_more_chips_of_a_type_is_never_slower(cluster, kwargs, data):
    """Chips may be left unused, so the old optimum is still in the larger space."""
    index = data.draw(st.integers(0, len(cluster.groups) - 1))
    extra = data.draw(st.integers(1, 2))
    before, _ = best(cluster, **kwargs)
    after, info = best(more_chips(cluster, index, extra), **kwargs)
    if before is None:
        return
    assert after is not None, info
    assert after.time_s <= before.time_s * (1 + 1e-9)


def test_the_random_clusters_include_both_answers():
    """The strategies above reach the 'no plan fits' branch and feasible plans alike, with
    2, 3 and 4 chip types (a fixed sample of them, drawn once)."""
    from hypothesis import Phase, find

    args = dict(seq_len=128, global_batch=8, schedule="1f1b", recompute=("none",), micro_batches=(1,))
    quick = settings(max_examples=50, phases=(Phase.generate,), database=None, **SETTINGS)
    for n_types, max_count in [(2, 8), (3, 4), (4, 2)]:
        find(clusters(n_types, max_count), lambda c: best(c, **args)[0] is None, settings=quick)
        find(clusters(n_types, max_count), lambda c: best(c, **args)[0] is not None, settings=quick)


def random_cluster(rng, n_types, max_count):
    """A cluster of CHIP_VALUES' figures (memory unscaled), from a seeded random.Random."""
    return Cluster(tuple(
        ChipGroup(chip_type(i, "random", **{k: rng.choice(v) for k, v in CHIP_VALUES.items()}),
                  rng.randint(1, max_count))
        for i in range(n_types)), name="random")


@pytest.mark.slow
def test_ranges_of_lengths_halved_down_to_one_length_stay_exact(monkeypatch):
    """ZB-H1 and interleaved 1F1B (what a stage holds depends on the pipeline's length), the
    8-layer model, 40 seeded random clusters of 2 types of up to 8 chips, every micro-batch
    size searched in boxes (RESOLVE_LISTS 0) over one range of every length (LENGTH_RATIO 8),
    so that a box about to be resolved is halved by length (`range_halves`) down to one
    length: the optimum equals the exhaustive one, and the halving is reached often."""
    import random

    from h2jax.planner import dual_search as ds

    halves = ds.range_halves
    halved = []

    def counted(batch):
        out = halves(batch)
        halved.append(bool(out))
        return out

    monkeypatch.setattr(ds, "range_halves", counted)
    rng = random.Random(7)
    for case in range(40):
        cluster = random_cluster(rng, 2, 8)
        kwargs = dict(seq_len=rng.choice([32, 128]), global_batch=rng.choice([2, 4, 6, 8]),
                      schedule=rng.choice(["zb-h1", "interleaved-1f1b"]),
                      recompute=rng.choice([("none",), ("full",), ("none", "selective", "full")]),
                      micro_batches=rng.choice([(1,), (1, 2), None]))
        with monkeypatch.context() as mp:
            mp.setattr(ds, "RESOLVE_LISTS", 0)
            mp.setattr(ds, "LENGTH_RATIO", 8.0)
            fast, stats = best(cluster, model="small", **kwargs)
        full, _ = best(cluster, model="small", exhaustive=True, **kwargs)
        assert (fast is None) == (full is None), (case, cluster, kwargs)
        if fast is not None:
            assert stats.proved_optimal, (case, cluster, kwargs)
            assert fast.time_s == pytest.approx(full.time_s, rel=1e-9), (case, cluster, kwargs)
    assert sum(halved) >= 100, sum(halved)
