import pytest

from h2jax import schedule as sched


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_every_dependency_is_respected(name, p, m):
    schedule = sched.build(name, p, m)
    order = sched.execution_order(schedule)  # raises on deadlock
    done: set[tuple[int, str, int]] = set()
    for i, a in order:
        if a.kind == sched.F:
            assert i == 0 or (i, sched.RECV_ACT, a.micro) in done
        if a.kind == sched.B:
            assert (i, sched.F, a.micro) in done  # backward after its own forward
            assert i == p - 1 or (i, sched.RECV_GRAD, a.micro) in done
        if a.kind == sched.RECV_ACT:
            assert (i - 1, sched.SEND_ACT, a.micro) in done
        if a.kind == sched.RECV_GRAD:
            assert (i + 1, sched.SEND_GRAD, a.micro) in done
        if a.kind == sched.SEND_ACT:
            assert (i, sched.F, a.micro) in done
        if a.kind == sched.SEND_GRAD:
            assert (i, sched.B, a.micro) in done
        done.add((i, a.kind, a.micro))
    # every stage computes every micro-batch's forward and backward exactly once
    for i, actions in enumerate(schedule):
        for kind in (sched.F, sched.B):
            assert sorted(a.micro for a in actions if a.kind == kind) == list(range(m))


@pytest.mark.parametrize("p", [1, 2, 4, 6])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_1f1b_holds_at_most_p_minus_i_microbatches(p, m):
    for i, actions in enumerate(sched.build("1f1b", p, m)):
        assert sched.max_in_flight(actions) == min(p - i, m)


def test_gpipe_holds_all_microbatches():
    assert [sched.max_in_flight(a) for a in sched.build("gpipe", 3, 5)] == [5, 5, 5]


def test_deadlock_is_detected():
    bad = [[sched.Action(sched.RECV_GRAD, 0), sched.Action(sched.F, 0), sched.Action(sched.SEND_ACT, 0)],
           [sched.Action(sched.RECV_ACT, 0), sched.Action(sched.F, 0), sched.Action(sched.B, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        sched.execution_order(bad)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        sched.build("interleaved", 2, 2)
