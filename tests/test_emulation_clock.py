"""An emulated chip charges each program the least CPU time measured for it: one program on
inputs of one shape takes the same time on a chip every call, while the host's measurement
grows with whatever else the host does (and the slowdown multiplies that noise)."""

import numpy as np
import pytest

from h2jax.runtime import emulation
from tests.test_reference_runtime import fake_time  # noqa: F401  (the fixture: a clock tests move by hand)


def test_a_program_is_charged_the_least_cpu_time_measured_for_it_so_far(fake_time):
    clock = emulation.StageClock(slowdown=4.0, defer=True)
    measured = iter([0.3, 0.2, 0.5, 0.25])  # one program's CPU seconds per call on a busy host

    def program(x):
        return fake_time.work(next(measured))

    x = np.zeros((2, 3), np.float32)
    charged = []
    for _ in range(4):
        before = clock.measured_s
        clock.run(program, x)
        charged.append(round(clock.measured_s - before, 9))
    # min so far: 0.3, then 0.2 for good (the 0.5 and 0.25 calls were slowed by the host)
    assert charged == [0.3, 0.2, 0.2, 0.2]
    assert clock.busy_s == pytest.approx(4.0 * 0.9)  # raw charging would give 4 x 1.25
    assert clock.last_interval[1] - clock.last_interval[0] == pytest.approx(4.0 * 0.2)


def test_other_programs_keep_their_own_least_time(fake_time):
    clock = emulation.StageClock(slowdown=2.0, defer=True)
    clock.run(lambda x: fake_time.work(0.1), np.zeros(4, np.float32))

    def program(x):
        return fake_time.work(0.5)

    clock.run(program, np.zeros(4, np.float32))
    clock.run(program, np.zeros(8, np.float32))  # another input shape: another program
    assert clock.measured_s == pytest.approx(0.1 + 0.5 + 0.5)
    assert clock.busy_s == pytest.approx(2.0 * 1.1)


def test_program_key_is_the_function_and_its_inputs_shapes_not_their_values():
    def f(*args):
        return args

    a, b = np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)
    key = emulation.program_key
    assert key(f, (a, {"w": a})) == key(f, (b, {"w": b}))
    assert key(f, (a,)) != key(f, (a.astype(np.float64),))
    assert key(f, (a,)) != key(f, (np.zeros((3, 2), np.float32),))
    assert key(f, (a, 0.5)) != key(f, (a, 0.25))  # a host value is part of the program
    assert key(f, (a,)) != key(lambda *args: args, (a,))


def test_a_real_chip_is_charged_its_wall_time_every_call(fake_time):
    """A real chip's time is what the host really takes: no least-time charging."""
    clock = emulation.StageClock(slowdown=1.0, defer=True, emulated=False)
    walls = iter([1.0, 0.5, 0.75])

    def program():
        return fake_time.work(0.25, wall=next(walls))

    for _ in range(3):
        clock.run(program)
    assert clock.measured_s == pytest.approx(2.25)


def test_a_named_program_shares_its_least_time_with_every_clock_of_the_process(fake_time):
    """A program the runtime names (StageClock.run(..., program=...)) is one computation in
    every run: a later clock starts from the least time an earlier one measured for it (a
    calibration run and the run it predicts), while unnamed programs and other names keep
    their own."""
    x = np.zeros((2, 3), np.float32)
    first = emulation.StageClock(slowdown=4.0, defer=True)
    for cpu in (0.3, 0.2):
        first.run(lambda v, cpu=cpu: fake_time.work(cpu), x, program=("stage A", "forward"))
    later = emulation.StageClock(slowdown=4.0, defer=True)
    later.run(lambda v: fake_time.work(0.5), x, program=("stage A", "forward"))  # a busy host's call
    assert later.measured_s == pytest.approx(0.2)
    later.run(lambda v: fake_time.work(0.5), x, program=("stage A", "backward"))  # another program
    assert later.measured_s == pytest.approx(0.2 + 0.5)
    later.run(lambda v: fake_time.work(0.4), np.zeros((3, 3), np.float32), program=("stage A", "forward"))
    assert later.measured_s == pytest.approx(0.2 + 0.5 + 0.4)  # another input shape
    fresh = emulation.StageClock(slowdown=4.0, defer=True)
    fresh.run(lambda v: fake_time.work(0.5), x)  # unnamed: this clock's own
    assert fresh.measured_s == pytest.approx(0.5)
    assert emulation.SHARED_LEAST[emulation.program_key(("stage A", "forward"), (x,))] == 0.2
