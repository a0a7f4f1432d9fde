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


def no_faster_than_holds(slow, fast) -> list[str]:
    """What fails of `slow.no_faster_than = fast.name`: every plan of `slow` runs no faster and
    fits under `fast` (the planner's `auto` then leaves `slow` out where it searches `fast`)."""
    import numpy as np

    bad = []
    a, b = slow.closed_form, fast.closed_form
    if a.chunked != b.chunked or slow.virtual != fast.virtual or not (a.exact and b.exact):
        bad.append("closed forms of another kind (chunks, or one not exact)")
    if min(np.subtract(a.fill, b.fill)) < 0 or min(np.subtract(a.fill_last, b.fill_last)) < 0:
        bad.append("a fill coefficient below the other's")
    # sum_k max(max_i c_k . x_i, send) >= max(max_i c . x_i, send) for x >= 0 where the c_k
    # add up to at least c (and are >= 0): the other has one steady component
    if len(b.steady) != 1 or min(np.sum(a.steady, axis=0) - b.steady[0]) < 0 or np.min(a.steady) < 0:
        bad.append("a steady state that can be below the other's")
    for v in ((2, 4) if slow.virtual else (1,)):
        for p in range(1, 13):
            for m in range(1, 17):
                if slow.unsupported(p, m, v) is not None:
                    continue
                if fast.unsupported(p, m, v) is not None:
                    bad.append(f"p={p} m={m} v={v} runs only under the slower one")
                for i in range(p):
                    if (slow.memory_in_flight(i, p, m, v) < fast.memory_in_flight(i, p, m, v)
                            or slow.deferred(i, p, m, v) < fast.deferred(i, p, m, v)):
                        bad.append(f"stage {i} of p={p} m={m} holds less than under the other")
    # and the closed forms themselves, on random stages (f, b, w >= 0, w <= b) and sends
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, m = int(rng.integers(1, 9)), int(rng.integers(1, 17))
        f, bw = rng.exponential(1.0, (2, p))
        w = bw * rng.uniform(0, 1, p)
        links, send = rng.exponential(0.3, 2)
        if a.pipeline_time(f, bw, w, links, send, m) < b.pipeline_time(f, bw, w, links, send, m) - 1e-12:
            bad.append(f"slower on stages f={f}, b={bw}, w={w}")
            break
    return bad


def test_a_schedule_no_faster_than_another_is_never_faster_and_fits_wherever_it_does():
    """`Schedule.no_faster_than` (GPipe's 1F1B) is a claim the planner relies on: under `auto`
    it never searches the slower schedule. Checked from the closed forms' coefficients, the
    in-flight and deferred counts and the (p, m) each runs, and on random stages; and the
    check itself refuses claims that do not hold (ZB-H1 moves W's into the fill: it can be
    faster than 1F1B; 1F1B holds fewer micro-batches than GPipe)."""
    claims = {name: s.no_faster_than for name, s in sched.SCHEDULES.items() if s.no_faster_than}
    assert claims == {"gpipe": "1f1b"}
    for slow, fast in claims.items():
        assert no_faster_than_holds(sched.get_schedule(slow), sched.get_schedule(fast)) == []
    get = sched.get_schedule
    assert no_faster_than_holds(get("zb-h1"), get("1f1b"))  # its fill is below 1F1B's
    assert no_faster_than_holds(get("1f1b"), get("gpipe"))  # it holds fewer micro-batches
    assert no_faster_than_holds(get("1f1b"), get("zb-h1"))
    assert no_faster_than_holds(get("interleaved-1f1b"), get("1f1b"))  # chunks: another kind of form


def test_schedules_import_no_jax():
    import subprocess
    import sys

    code = "import sys, h2jax.schedules, h2jax.sim; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
