"""What every schedule shares: actions, the send/receive wrapping around each compute, the
closed-form iteration time's shape, the bubble fraction, and checks over action lists.

A schedule (one module each, found by name in `registry`) is data: per stage, per virtual
chunk, the order of its compute actions; the runtime executes the resulting action lists and
the simulator replays them. No JAX here: the planner and the simulator use this package.

Actions (`chunk` is the virtual chunk of the stage, 0 unless interleaved):
  F k          forward of micro-batch k
  B k          backward of micro-batch k: input and weight gradients, or, when the schedule
               splits the backward (ZB-H1), the input gradient only
  W k          weight gradient of micro-batch k (split-backward schedules only)
  SEND_ACT k   send F k's output to the next (virtual) stage
  RECV_ACT k   receive micro-batch k's input from the previous (virtual) stage
  SEND_GRAD k  send B k's input gradient to the previous (virtual) stage
  RECV_GRAD k  receive micro-batch k's output gradient from the next (virtual) stage

Virtual stages: with v chunks per stage, chunk c of stage i is virtual stage c*p + i (p
stages), so the model runs through stage 0..p-1 with chunk 0, then again with chunk 1, ...;
the last stage's chunk c sends to stage 0's chunk c + 1.

Bubble fraction (one definition, every command): the share of stage-time in the pipeline
phase (fill, steady state, drain; the once-per-step gradient reduction and optimizer step
excluded) in which a stage computes nothing,

    bubble = 1 - sum_i m*(f_i + b_i) / (p * T_pipe),

with f_i + b_i stage i's forward and whole backward per micro-batch and T_pipe the cost
model's pipeline time (`cost_model.pipeline_time`: the schedule's closed form, or, where that
is not exact (ZB-H1), its order replayed). It is 0 for one stage. The simulator
reports the same quantity measured on its replayed timeline as the *simulated* bubble.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import numpy as np

F, B, W = "F", "B", "W"
SEND_ACT, RECV_ACT = "SEND_ACT", "RECV_ACT"
SEND_GRAD, RECV_GRAD = "SEND_GRAD", "RECV_GRAD"
COMPUTE = (F, B, W)


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    kind: str
    micro: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f"c{self.chunk}" if self.chunk else "")


Order = list[tuple[str, int, int]]  # one stage's compute order: (F|B|W, micro, chunk)


# ----------------------------------------------------------------------------- the closed form


@dataclasses.dataclass(frozen=True)
class ClosedForm:
    """A schedule's closed-form step time over per-stage, per-micro-batch times: f (forward),
    b (whole backward), w (its weight-gradient part), each stage's send and link latency,
    and its tail (data-parallel reduction + optimizer, once per step):

        T_pipe = fill_scale * sum_i fill_i . (f_i, b_i, w_i) + 2 * sum_i (send_i + latency_i)
                 + steady_weight(m, v) * sum_k max(max_i steady_k . (f_i, b_i, w_i), send_floor)
        T      = T_pipe + max_i tail_i

    fill_i is `fill_last` on the last stage and `fill` elsewhere; send_floor is the largest
    send (times v when `chunked`: each micro-batch crosses every link once per chunk).
    The planner's exact search builds its objective from these coefficients, so what it
    optimises is what the cost model reports -- for a schedule whose form is `exact`. One
    that is not (ZB-H1: its form is the paper's uniform case and falls short of its own
    order on uneven stages) is the search's estimate only: a plan's pipeline time is then its
    order replayed (cost_model.pipeline_time).
    """

    fill: tuple[float, float, float]
    fill_last: tuple[float, float, float]
    steady: tuple[tuple[float, float, float], ...]
    chunked: bool = False  # interleaved: weight m - 1/v, fill / v, send floor v * send
    exact: bool = True  # never below the replay of the schedule's order (see above)

    def steady_weight(self, m: int, v: int = 1) -> float:
        return m - 1.0 / v if self.chunked else m - 1.0

    def fill_scale(self, v: int = 1) -> float:
        return 1.0 / v if self.chunked else 1.0

    def send_factor(self, v: int = 1) -> float:
        return float(v) if self.chunked else 1.0

    def fill_coefficients(self, p: int, v: int = 1) -> np.ndarray:
        """(p, 3) per-stage coefficients of (f, b, w) in the fill, scale included."""
        c = np.empty((p, 3))
        c[:] = self.fill
        c[-1] = self.fill_last
        return c * self.fill_scale(v)

    def pipeline_time(self, f, b, w, links: float, max_send: float, m: int, v: int = 1):
        """T_pipe; f, b, w are arrays (..., p) (one row per layer split when vectorised),
        `links` = sum_i (send_i + latency_i), `max_send` the largest send (floats, or arrays
        that broadcast against f's leading axes: one per stage list when several are batched)."""
        f, b, w = (np.asarray(x, dtype=float) for x in (f, b, w))
        p = f.shape[-1]
        c = self.fill_coefficients(p, v)
        fill = f @ c[:, 0] + b @ c[:, 1] + w @ c[:, 2]
        floor = max_send * self.send_factor(v)
        steady = sum(np.maximum((cf * f + cb * b + cw * w).max(axis=-1), floor) for cf, cb, cw in self.steady)
        return fill + 2.0 * links + self.steady_weight(m, v) * steady


def bubble_fraction(busy_s: Sequence[float], pipeline_s: float) -> float:
    """1 - sum(busy) / (p * pipeline_s): the idle share of the pipeline phase (see the module
    docstring); busy_s is each stage's compute seconds in the step."""
    if pipeline_s <= 0:
        return 0.0
    idle = 1.0 - sum(busy_s) / (len(busy_s) * pipeline_s)
    return idle if idle > 1e-12 else 0.0  # (sums of the same terms in another order: no bubble)


# ----------------------------------------------------------------------------- a schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pipeline schedule, defined in one module. `order(stage, p, m, v)` is the stage's
    compute order; `in_flight(stage, p, m, v)` the most (micro-batch, chunk) activations it
    holds at once (forward ran, its last gradient action has not); `deferred` the most
    micro-batches whose input gradient ran but weight gradient has not (split backward)."""

    name: str
    summary: str
    order: Callable[[int, int, int, int], Order]
    in_flight: Callable[[int, int, int, int], int]
    closed_form: ClosedForm
    splits_backward: bool = False
    virtual: bool = False  # takes v >= 2 chunks per stage (interleaved)
    deferred: Callable[..., int] = lambda stage, p, m, v=1: 0
    # a lower bound on in_flight(p - j, p, m, v) / v over every p >= j (position j from the
    # end): the planner's position bounds, which do not know p, use it
    position_in_flight: Callable[[int, int, int], float] = lambda j, m, v: float(min(j, m))
    # why (p stages, m micro-batches, v chunks) cannot run this schedule, or None
    unsupported: Callable[[int, int, int], str | None] = lambda p, m, v: None
    # another schedule that runs every plan of this one at least as fast and in no more
    # memory: its closed form is never above this one's, each stage holds no more micro-batches
    # (activations, deferred gradients) and it runs every (p, m) this one does. `--schedule
    # auto` then leaves this one out where it searches that one: no plan of this one can beat
    # that one's best (tests/test_schedule.py checks each such claim)
    no_faster_than: str | None = None

    def check_v(self, v: int) -> None:
        if self.virtual and v < 2:
            raise ValueError(f"schedule {self.name!r} needs virtual_stages >= 2, got {v}")
        if not self.virtual and v != 1:
            raise ValueError(f"schedule {self.name!r} runs one chunk per stage; set virtual_stages to 1 "
                             f"or use interleaved-1f1b")

    def check(self, p: int, m: int, v: int = 1) -> None:
        """Raise ValueError, naming the fix, unless this schedule runs p stages, m micro-batches
        and v chunks per stage."""
        self.check_v(v)
        why = self.unsupported(p, m, v)
        if why is not None:
            raise ValueError(why)

    def stage_actions(self, stage: int, p: int, m: int, v: int = 1) -> list[Action]:
        """Stage `stage`'s actions for one step, with its sends and receives around each compute."""
        self.check(p, m, v)
        return actions_from_order(stage, p, self.order(stage, p, m, v), v)

    def build(self, p: int, m: int, v: int = 1) -> list[list[Action]]:
        return [self.stage_actions(i, p, m, v) for i in range(p)]

    def memory_in_flight(self, stage: int, p: int, m: int, v: int = 1) -> float:
        """Activations held at peak in units of one micro-batch through the whole stage (a
        chunk holds 1/v of them)."""
        return self.in_flight(stage, p, m, v) / v


# ----------------------------------------------------------------------------- action lists


@functools.lru_cache(maxsize=None)
def _forward(first: bool, last: bool, k: int, c: int) -> tuple[Action, ...]:
    # Actions are immutable, so one instance per (kind, micro, chunk) is shared by every list:
    # building a 2,432-chip, 1,000-micro-batch schedule stays well under a second.
    out = [] if first else [Action(RECV_ACT, k, c)]
    out.append(Action(F, k, c))
    if not last:
        out.append(Action(SEND_ACT, k, c))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _backward(first: bool, last: bool, k: int, c: int) -> tuple[Action, ...]:
    out = [] if last else [Action(RECV_GRAD, k, c)]
    out.append(Action(B, k, c))
    if not first:
        out.append(Action(SEND_GRAD, k, c))
    return tuple(out)


def actions_from_order(stage: int, p: int, order: Order, v: int = 1) -> list[Action]:
    """Receives before and sends after each F and B; a W moves no data. The first virtual
    stage (stage 0, chunk 0) receives no activation, the last (stage p-1, chunk v-1) no
    gradient."""
    actions: list[Action] = []
    for kind, k, c in order:
        first = stage == 0 and c == 0
        last = stage == p - 1 and c == v - 1
        if kind == F:
            actions += _forward(first, last, k, c)
        elif kind == B:
            actions += _backward(first, last, k, c)
        elif kind == W:
            actions.append(Action(W, k, c))
        else:
            raise ValueError(f"unknown compute kind {kind!r} in stage {stage}'s order; use F, B or W")
    return actions


def sender(stage: int, chunk: int, p: int, kind: str) -> tuple[int, int]:
    """(stage, chunk) that sends stage `stage`'s chunk `chunk` its input activation (kind
    RECV_ACT) or its output gradient (RECV_GRAD)."""
    vs = chunk * p + stage + (-1 if kind == RECV_ACT else 1)
    return vs % p, vs // p


def receiver(stage: int, chunk: int, p: int, kind: str) -> tuple[int, int]:
    """(stage, chunk) that receives what SEND_ACT / SEND_GRAD of (stage, chunk) sends."""
    vs = chunk * p + stage + (1 if kind == SEND_ACT else -1)
    return vs % p, vs // p


def max_in_flight(actions: Sequence[Action]) -> int:
    """Most (micro-batch, chunk) activations held at once: counted from the forward until the
    last gradient action that needs them (W when the list has W's, else B)."""
    release = W if any(a.kind == W for a in actions) else B
    live = peak = 0
    for a in actions:
        live += a.kind == F
        live -= a.kind == release
        peak = max(peak, live)
    return peak


def max_deferred(actions: Sequence[Action]) -> int:
    """Most (micro-batch, chunk)s whose B ran and whose W has not (0 without W's)."""
    if not any(a.kind == W for a in actions):
        return 0
    live = peak = 0
    for a in actions:
        live += a.kind == B
        live -= a.kind == W
        peak = max(peak, live)
    return peak


def backward_follows(actions: Sequence[Action], pos: int) -> bool:
    """Whether forward `actions[pos]` is directly followed by the (whole) backward of the same
    micro-batch and chunk (the last stage under 1F1B): the runtime then runs both as one
    program. Never under a split backward (its B is not the whole backward)."""
    a = actions[pos]
    if a.kind != F or pos + 1 >= len(actions):
        return False
    b = actions[pos + 1]
    if b.kind != B or b.micro != a.micro or b.chunk != a.chunk:
        return False
    return not any(x.kind == W for x in actions)


def execution_order(schedule: Sequence[Sequence[Action]]) -> list[tuple[int, Action]]:
    """A global order in which every stage runs its list and every receive follows its send.

    Raises RuntimeError if the schedule deadlocks. The single-process runtime uses the same
    rule (run a stage while its next action is ready) to interleave its stages.
    """
    p = len(schedule)
    pos = [0] * p
    sent: set[tuple[str, int, int, int]] = set()  # (kind, receiving stage, micro, chunk)
    order: list[tuple[int, Action]] = []
    total = sum(len(s) for s in schedule)
    while len(order) < total:
        progressed = False
        for i in range(p):
            while pos[i] < len(schedule[i]):
                a = schedule[i][pos[i]]
                if a.kind == RECV_ACT and (SEND_ACT, i, a.micro, a.chunk) not in sent:
                    break
                if a.kind == RECV_GRAD and (SEND_GRAD, i, a.micro, a.chunk) not in sent:
                    break
                if a.kind in (SEND_ACT, SEND_GRAD):
                    j, c = receiver(i, a.chunk, p, a.kind)
                    sent.add((a.kind, j, a.micro, c))
                order.append((i, a))
                pos[i] += 1
                progressed = True
        if not progressed:
            stuck = {i: schedule[i][pos[i]] for i in range(p) if pos[i] < len(schedule[i])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    return order


def check_order(order: Order, n_micro: int, v: int = 1, stage: int = 0) -> None:
    """Raise unless `order` runs F and B (and W, if any) once per micro-batch and chunk, F
    before B before W for each."""
    kinds = {kind for kind, _, _ in order}
    expected = (F, B, W) if W in kinds else (F, B)
    for kind in expected:
        got = sorted((k, c) for x, k, c in order if x == kind)
        if got != sorted((k, c) for k in range(n_micro) for c in range(v)):
            raise ValueError(f"stage {stage}: {kind} runs {got[:8]}..., expected every micro-batch "
                             f"0..{n_micro - 1} x chunk 0..{v - 1} once")
    seen: set[tuple[str, int, int]] = set()
    before = {B: F, W: B}
    for kind, k, c in order:
        if kind in before and (before[kind], k, c) not in seen:
            raise ValueError(f"stage {stage}: {kind}{k} (chunk {c}) comes before {before[kind]}{k}")
        seen.add((kind, k, c))
