"""The schedule registry: every schedule's lists respect every dependency, never deadlock,
and hold exactly the activations (and deferred weight gradients) its rule says."""

import pytest

from h2jax import schedules as sched
from h2jax.schedules import B, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W

VARIANTS = [(n, v) for n, s in sched.SCHEDULES.items() for v in ((2, 3) if s.virtual else (1,))]


def _supported(name, p, m, v):
    return sched.get_schedule(name).unsupported(p, m, v) is None


@pytest.mark.parametrize("name, v", VARIANTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_every_dependency_is_respected(name, v, p, m):
    if not _supported(name, p, m, v):
        pytest.skip("not a supported shape")
    schedule = sched.get_schedule(name).build(p, m, v)
    order = sched.execution_order(schedule)  # raises on deadlock
    done: set[tuple[int, str, int, int]] = set()
    for i, a in order:
        k, c = a.micro, a.chunk
        first, last = i == 0 and c == 0, i == p - 1 and c == v - 1
        if a.kind == F:
            assert first or (i, RECV_ACT, k, c) in done
        if a.kind == B:
            assert (i, F, k, c) in done  # backward after its own forward
            assert last or (i, RECV_GRAD, k, c) in done
        if a.kind == W:
            assert (i, B, k, c) in done
        if a.kind == RECV_ACT:
            j, c2 = sched.sender(i, c, p, RECV_ACT)
            assert (j, SEND_ACT, k, c2) in done
        if a.kind == RECV_GRAD:
            j, c2 = sched.sender(i, c, p, RECV_GRAD)
            assert (j, SEND_GRAD, k, c2) in done
        if a.kind == SEND_ACT:
            assert (i, F, k, c) in done
        if a.kind == SEND_GRAD:
            assert (i, B, k, c) in done
        done.add((i, a.kind, k, c))
    # every stage computes every (micro-batch, chunk)'s forward and backward exactly once
    split = sched.get_schedule(name).splits_backward
    for actions in schedule:
        for kind in (F, B, W) if split else (F, B):
            assert sorted((a.micro, a.chunk) for a in actions if a.kind == kind) == sorted(
                (k, c) for k in range(m) for c in range(v))


@pytest.mark.parametrize("name, v", VARIANTS)
@pytest.mark.parametrize("p", [1, 2, 4, 6])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_peak_in_flight_and_deferred_are_the_registrys_rule(name, v, p, m):
    s = sched.get_schedule(name)
    if not _supported(name, p, m, v):
        pytest.skip("not a supported shape")
    for i, actions in enumerate(s.build(p, m, v)):
        assert sched.max_in_flight(actions) == s.in_flight(i, p, m, v)
        assert sched.max_deferred(actions) == s.deferred(i, p, m, v)
        # the planner's position bound never exceeds what a stage of any pipeline holds
        assert s.position_in_flight(p - i, m, v) <= s.memory_in_flight(i, p, m, v) + 1e-12


def test_1f1b_holds_p_minus_i_gpipe_all_zb_h1_p():
    assert [sched.max_in_flight(a) for a in sched.get_schedule("1f1b").build(4, 8)] == [4, 3, 2, 1]
    assert [sched.max_in_flight(a) for a in sched.get_schedule("gpipe").build(3, 5)] == [5, 5, 5]
    assert [sched.max_in_flight(a) for a in sched.get_schedule("zb-h1").build(4, 8)] == [4, 4, 4, 4]


def test_zb_h1_keeps_1f1bs_order_of_forwards_and_backwards():
    for p, m in ((2, 3), (4, 8), (5, 2)):
        zb = sched.get_schedule("zb-h1").build(p, m)
        one = sched.get_schedule("1f1b").build(p, m)
        for a, b in zip(zb, one):
            assert [x for x in a if x.kind != W] == list(b)


def test_interleaved_chunks_wrap_from_the_last_stage_to_the_first():
    acts = sched.get_schedule("interleaved-1f1b").build(2, 2, 2)
    assert [repr(a) for a in acts[0][:4]] == ["F0", "SEND_ACT0", "F1", "SEND_ACT1"]
    assert sched.receiver(1, 0, 2, SEND_ACT) == (0, 1)  # last stage, chunk 0 -> stage 0, chunk 1
    assert sched.sender(0, 1, 2, RECV_ACT) == (1, 0)
    assert sched.receiver(0, 1, 2, SEND_GRAD) == (1, 0)


def test_interleaved_needs_whole_groups_of_p():
    s = sched.get_schedule("interleaved-1f1b")
    with pytest.raises(ValueError, match="multiple of the stage count"):
        s.build(4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        s.build(4, 8, 1)
    with pytest.raises(ValueError, match="one chunk per stage"):
        sched.get_schedule("1f1b").build(4, 8, 2)


def test_backward_follows_never_fuses_a_split_backward():
    one = sched.get_schedule("1f1b").stage_actions(1, 2, 2)
    assert sched.backward_follows(one, one.index(sched.Action(F, 0)))
    zb = sched.get_schedule("zb-h1").stage_actions(1, 2, 2)
    assert not sched.backward_follows(zb, zb.index(sched.Action(F, 0)))


def test_deadlock_is_detected():
    bad = [[sched.Action(RECV_GRAD, 0), sched.Action(F, 0), sched.Action(SEND_ACT, 0)],
           [sched.Action(RECV_ACT, 0), sched.Action(F, 0), sched.Action(B, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        sched.execution_order(bad)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown; use one of gpipe, 1f1b, interleaved-1f1b, zb-h1"):
        sched.get_schedule("interleaved")


def test_auto_searches_every_schedule_and_v():
    assert sched.variants() == [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
                                ("zb-h1", 1)]


def test_schedules_import_no_jax():
    import subprocess
    import sys

    code = "import sys, h2jax.schedules, h2jax.sim; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
