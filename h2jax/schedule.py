"""Pipeline schedules as per-stage action lists.

A schedule is data: `build(name, n_stages, n_micro)[i]` is the ordered list of actions
stage `i` performs in one optimizer step. The runtime executes these lists and the
simulator replays them; neither re-derives the order.

Actions:
  F k          forward of micro-batch k
  B k          backward of micro-batch k (input and weight gradients)
  SEND_ACT k   send F k's output to the next stage
  RECV_ACT k   receive micro-batch k's input from the previous stage
  SEND_GRAD k  send B k's input gradient to the previous stage
  RECV_GRAD k  receive micro-batch k's output gradient from the next stage
  W k          weight gradient of micro-batch k (zero-bubble schedules only; there B k
               computes the input gradient alone, so the next stage back can start sooner)

1F1B bounds memory: stage i of p runs min(p - i - 1, m) warm-up forwards, then alternates
one forward and one backward, so it never holds more than p - i micro-batches of
activations. GPipe runs every forward before any backward and holds all m.

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) keeps 1F1B's order of
forwards and input-gradient backwards and moves the weight-gradient passes W, which nothing
downstream waits for, into the bubbles. Where to put each W depends on the stage costs, so
the cost-aware order comes from `h2jax.sim.zb_h1_orders`; `compute_order_zb_h1` here is the
cost-free form (W right after its B in the steady state, the cool-down's W's after its last
B), whose peak memory equals 1F1B's on every stage. ZB-H1 lives in ZB_ORDERS, not in
COMPUTE_ORDERS, because the runtime executes COMPUTE_ORDERS and has no W action yet.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

F, B, W = "F", "B", "W"
SEND_ACT, RECV_ACT = "SEND_ACT", "RECV_ACT"
SEND_GRAD, RECV_GRAD = "SEND_GRAD", "RECV_GRAD"
COMPUTE = (F, B)


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    kind: str
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}"


@functools.lru_cache(maxsize=None)
def _forward_cached(first: bool, last: bool, k: int) -> tuple[Action, ...]:
    # Actions are immutable, so one instance per (kind, micro) is shared by every list:
    # building a 2,432-chip, 1,000-micro-batch schedule stays well under a second.
    out = [] if first else [Action(RECV_ACT, k)]
    out.append(Action(F, k))
    if not last:
        out.append(Action(SEND_ACT, k))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _backward_cached(first: bool, last: bool, k: int) -> tuple[Action, ...]:
    out = [] if last else [Action(RECV_GRAD, k)]
    out.append(Action(B, k))
    if not first:
        out.append(Action(SEND_GRAD, k))
    return tuple(out)


def _forward(stage: int, n_stages: int, k: int) -> list[Action]:
    return list(_forward_cached(stage == 0, stage == n_stages - 1, k))


def _backward(stage: int, n_stages: int, k: int) -> list[Action]:
    return list(_backward_cached(stage == 0, stage == n_stages - 1, k))


def compute_order_gpipe(stage: int, n_stages: int, n_micro: int) -> list[tuple[str, int]]:
    return [(F, k) for k in range(n_micro)] + [(B, k) for k in range(n_micro)]


def compute_order_1f1b(stage: int, n_stages: int, n_micro: int) -> list[tuple[str, int]]:
    warmup = min(n_stages - stage - 1, n_micro)
    order = [(F, k) for k in range(warmup)]
    for j in range(n_micro - warmup):
        order += [(F, warmup + j), (B, j)]
    order += [(B, j) for j in range(n_micro - warmup, n_micro)]
    return order


COMPUTE_ORDERS: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {
    "gpipe": compute_order_gpipe,
    "1f1b": compute_order_1f1b,
}


def stage_actions(name: str, stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """Stage `stage`'s actions for one step, with its sends and receives around each compute."""
    if name not in COMPUTE_ORDERS:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(COMPUTE_ORDERS)}")
    actions: list[Action] = []
    for kind, k in COMPUTE_ORDERS[name](stage, n_stages, n_micro):
        actions += _forward(stage, n_stages, k) if kind == F else _backward(stage, n_stages, k)
    return actions


def build(name: str, n_stages: int, n_micro: int) -> list[list[Action]]:
    return [stage_actions(name, i, n_stages, n_micro) for i in range(n_stages)]


def backward_follows(actions: list[Action], pos: int) -> bool:
    """Whether forward `actions[pos]` is directly followed by the backward of the same
    micro-batch (the last stage under 1F1B): the runtime then runs both as one program."""
    a = actions[pos]
    if a.kind != F or pos + 1 >= len(actions):
        return False
    b = actions[pos + 1]
    return b.kind == B and b.micro == a.micro


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, at any point.

    With a zero-bubble list (one that has W actions) a micro-batch's activations stay until
    its W, which needs them for the weight gradient.
    """
    release = W if any(a.kind == W for a in actions) else B
    live = peak = 0
    for a in actions:
        live += a.kind == F
        live -= a.kind == release
        peak = max(peak, live)
    return peak


def execution_order(schedule: list[list[Action]]) -> list[tuple[int, Action]]:
    """A global order in which every stage runs its list and every receive follows its send.

    Raises RuntimeError if the schedule deadlocks. The single-process runtime uses the same
    rule (run a stage while its next action is ready) to interleave its stages.
    """
    n = len(schedule)
    pos = [0] * n
    sent: set[tuple[str, int, int]] = set()  # (kind, receiving stage, micro)
    order: list[tuple[int, Action]] = []
    total = sum(len(s) for s in schedule)
    while len(order) < total:
        progressed = False
        for i in range(n):
            while pos[i] < len(schedule[i]):
                a = schedule[i][pos[i]]
                if a.kind == RECV_ACT and (SEND_ACT, i, a.micro) not in sent:
                    break
                if a.kind == RECV_GRAD and (SEND_GRAD, i, a.micro) not in sent:
                    break
                if a.kind == SEND_ACT:
                    sent.add((SEND_ACT, i + 1, a.micro))
                elif a.kind == SEND_GRAD:
                    sent.add((SEND_GRAD, i - 1, a.micro))
                order.append((i, a))
                pos[i] += 1
                progressed = True
        if not progressed:
            stuck = {i: schedule[i][pos[i]] for i in range(n) if pos[i] < len(schedule[i])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    return order


# ----------------------------------------------------------------------------- zero bubble


def compute_order_zb_h1(stage: int, n_stages: int, n_micro: int) -> list[tuple[str, int]]:
    """Cost-free ZB-H1: 1F1B with B split into B and W; the cool-down's W's wait until its
    last B, where 1F1B would leave the stage idle waiting for gradients."""
    warmup = min(n_stages - stage - 1, n_micro)
    order = [(F, k) for k in range(warmup)]
    for j in range(n_micro - warmup):
        order += [(F, warmup + j), (B, j), (W, j)]
    order += [(B, j) for j in range(n_micro - warmup, n_micro)]
    order += [(W, j) for j in range(n_micro - warmup, n_micro)]
    return order


ZB_ORDERS: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {
    "zb-h1": compute_order_zb_h1,
}

# Every schedule the simulator replays; the runtime executes COMPUTE_ORDERS only.
SIM_SCHEDULES = (*COMPUTE_ORDERS, *ZB_ORDERS)


def actions_from_order(stage: int, n_stages: int, order: list[tuple[str, int]]) -> list[Action]:
    """Stage `stage`'s actions for a compute order of F, B and W: receives before and sends
    after each F and B; a W moves no data."""
    actions: list[Action] = []
    for kind, k in order:
        if kind == F:
            actions += _forward(stage, n_stages, k)
        elif kind == B:
            actions += _backward(stage, n_stages, k)
        elif kind == W:
            actions.append(Action(W, k))
        else:
            raise ValueError(f"unknown compute kind {kind!r} in stage {stage}'s order; use F, B or W")
    return actions


def check_order(order: list[tuple[str, int]], n_micro: int, stage: int = 0) -> None:
    """Raise unless `order` runs F, B (and W, if any) once per micro-batch, in dependency order
    (F k before B k before W k) and each kind in micro-batch order."""
    kinds = {kind for kind, _ in order}
    expected = (F, B, W) if W in kinds else (F, B)
    for kind in expected:
        micros = [k for c, k in order if c == kind]
        if micros != list(range(n_micro)):
            raise ValueError(f"stage {stage}: {kind} runs micro-batches {micros[:8]}..., "
                             f"expected 0..{n_micro - 1} in order")
    seen: set[tuple[str, int]] = set()
    before = {B: F, W: B}
    for kind, k in order:
        if kind in before and (before[kind], k) not in seen:
            raise ValueError(f"stage {stage}: {kind}{k} comes before {before[kind]}{k}")
        seen.add((kind, k))


def build_sim(
    name: str, n_stages: int, n_micro: int, orders: list[list[tuple[str, int]]] | None = None
) -> list[list[Action]]:
    """Per-stage action lists for any schedule in SIM_SCHEDULES. `orders` (one compute order
    per stage, e.g. from `h2jax.sim.zb_h1_orders`) overrides the cost-free order."""
    if orders is not None:
        if len(orders) != n_stages:
            raise ValueError(f"got {len(orders)} compute orders for {n_stages} stages")
        for i, order in enumerate(orders):
            check_order(order, n_micro, i)
        return [actions_from_order(i, n_stages, order) for i, order in enumerate(orders)]
    if name in COMPUTE_ORDERS:
        return build(name, n_stages, n_micro)
    if name in ZB_ORDERS:
        return [
            actions_from_order(i, n_stages, ZB_ORDERS[name](i, n_stages, n_micro))
            for i in range(n_stages)
        ]
    raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SIM_SCHEDULES)}")
