"""One fit test: the search, the exhaustive reference and `predict` decide whether a stage fits
with the same function (memory_model `StageMemoryTerms.fits`), so a stage a byte over its chip's
capacity is never planned, and one that fits exactly is."""

import dataclasses
import math

import numpy as np
import pytest

from h2jax.cluster import ChipGroup, ChipType, Cluster
from h2jax.config import get_config
from h2jax.planner import PlannerError, plan_cluster, top_k
from h2jax.planner import cost_model as cm
from h2jax.planner.memory_model import GIB, StageMemoryTerms
from h2jax.planner.stage_shape import StageShape

# Two big layers (about 14 GB of parameters, gradients and optimizer state each): the old
# cap's slack, floor(room / per_layer + 1e-9), spans 14 bytes of such a layer.
MODEL = {"vocab_size": 256, "d_model": 8192, "n_layers": 2, "n_heads": 64, "n_kv_heads": 8, "d_ff": 28672}
SEQ = 32


def chip(memory_gib: float) -> ChipType:
    return ChipType("edge", "cpu", memory_gib, 1.0, 1, 10.0, 1.0, "t")


def one_stage_memory(memory_gib: float):
    """The memory terms of the only plan one chip allows: one stage (first and last) with both
    layers, micro-batch 1, recompute full."""
    in_flight, deferred = cm.memory_holds("1f1b", 0, 1, 1)
    return cm.stage_terms(StageShape(get_config(MODEL), SEQ, 1, chip(memory_gib), 1, 1, "full"), True, True, in_flight,
                          deferred=deferred).mem


def boundary_gib() -> float:
    """The least memory (GiB, to the float) in which the two layers fit."""
    mem = one_stage_memory(1.0)
    fixed_share = 1.0 - mem.reserve / mem.capacity  # the reserve is a fraction of the capacity
    g = (mem.total_bytes(2) - mem.reserve) / fixed_share / GIB
    while not one_stage_memory(g).fits(2):
        g = np.nextafter(g, math.inf)
    while one_stage_memory(np.nextafter(g, -math.inf)).fits(2):
        g = np.nextafter(g, -math.inf)
    return float(g)


def test_a_stage_a_byte_over_capacity_is_never_planned():
    g = boundary_gib()
    short = float(np.nextafter(g, -math.inf))
    over, exact = one_stage_memory(short), one_stage_memory(g)
    assert 0 < over.total_bytes(2) - over.capacity <= 1.0  # at most a byte over
    room = over.capacity - (over.total_bytes(0))
    assert math.floor(room / over.per_layer + 1e-9) == 2  # the old cap let it through
    assert over.max_layers() == 1 and not over.fits(2)
    assert exact.max_layers() == 2 and exact.fits(2)

    kwargs = dict(seq_len=SEQ, global_batch=1, recompute=("full",))
    for exhaustive in (False, True):
        with pytest.raises(PlannerError, match="no plan fits"):
            top_k(Cluster((ChipGroup(chip(short), 1),)), MODEL, exhaustive=exhaustive, **kwargs)
    fast, _ = top_k(Cluster((ChipGroup(chip(g), 1),)), MODEL, **kwargs)
    full, _ = top_k(Cluster((ChipGroup(chip(g), 1),)), MODEL, exhaustive=True, **kwargs)
    assert fast[0].layers == full[0].layers == (2,)
    assert fast[0].time_s == pytest.approx(full[0].time_s, rel=1e-12)
    # predict accepts the plan the search found (it raises "planner bug" on a stage over capacity)
    result = plan_cluster(Cluster((ChipGroup(chip(g), 1),)), MODEL, SEQ, 1, recompute=("full",), baselines=False)
    assert result.plan.predicted["memory_gib"][0] <= result.plan.predicted["memory_capacity_gib"][0]


def test_max_layers_is_the_largest_count_that_fits_at_every_position():
    """Vectorised over in-flight counts (the position caps of the bounds): each cap fits and
    one layer more does not."""
    mem = one_stage_memory(200.0)
    at = dataclasses.replace(mem, in_flight=np.array([1.0, 2.0, 3.5, 8.0]))
    caps = at.max_layers()
    np.testing.assert_array_equal(mem.max_layers(at.in_flight), caps)  # the terms at other counts, unbuilt
    for f, cap in zip(at.in_flight, caps):
        one = dataclasses.replace(mem, in_flight=float(f))
        assert one.max_layers() == cap == mem.max_layers(float(f))  # one stage: Python floats, same answer
        assert one.fits(cap) and not one.fits(cap + 1)
    # at the boundary and around it, both paths agree with the fit test to the byte
    for gib in (boundary_gib(), math.nextafter(boundary_gib(), 0.0), 1e-3):
        one = one_stage_memory(gib)
        n = one.max_layers()
        assert n == int(one.max_layers(np.array([one.in_flight]))[0])
        assert (n < 0 or one.fits(n)) and not one.fits(max(n, 0) + 1)
    # the quotient room / per_layer rounds over (9.45... * 50 > 472.6...) and under
    # (9.42... * 56 <= 527.9...): `fits` decides, on both paths
    for per_layer, capacity, most in ((9.452342465006595, 472.6171232503297, 49),
                                      (9.427965281195137, 527.9660557469276, 56)):
        edge = StageMemoryTerms(per_layer, 0.0, 1.0, 0.0, 0.0, 0.0, capacity)
        assert edge.max_layers() == most == int(edge.max_layers(np.array([1.0]))[0])
        assert edge.fits(most) and not edge.fits(most + 1)
    # several stages at once (the bounds' tables): each row is that stage's own caps
    stages = [mem, one_stage_memory(boundary_gib()), dataclasses.replace(mem, deferred=2, in_flight=3.0)]
    flights = np.array([1.0, 2.0, 3.5, 8.0])
    rows = StageMemoryTerms.stacked(stages).max_layers(flights[None, :])
    np.testing.assert_array_equal(rows, np.array([s_.max_layers(flights) for s_ in stages]))
    d = int(mem.layer_static / mem.layer_deferred)  # deferred gradients worth a layer's static bytes
    assert mem.max_layers(1.0, deferred=d) == dataclasses.replace(mem, deferred=d).max_layers(1.0) < mem.max_layers(1.0)
