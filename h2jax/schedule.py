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

1F1B bounds memory: stage i of p runs min(p - i - 1, m) warm-up forwards, then alternates
one forward and one backward, so it never holds more than p - i micro-batches of
activations. GPipe runs every forward before any backward and holds all m.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

F, B = "F", "B"
SEND_ACT, RECV_ACT = "SEND_ACT", "RECV_ACT"
SEND_GRAD, RECV_GRAD = "SEND_GRAD", "RECV_GRAD"
COMPUTE = (F, B)


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    kind: str
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}"


def _forward(stage: int, n_stages: int, k: int) -> list[Action]:
    out = [] if stage == 0 else [Action(RECV_ACT, k)]
    out.append(Action(F, k))
    if stage < n_stages - 1:
        out.append(Action(SEND_ACT, k))
    return out


def _backward(stage: int, n_stages: int, k: int) -> list[Action]:
    out = [] if stage == n_stages - 1 else [Action(RECV_GRAD, k)]
    out.append(Action(B, k))
    if stage > 0:
        out.append(Action(SEND_GRAD, k))
    return out


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


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, at any point."""
    live = peak = 0
    for a in actions:
        live += a.kind == F
        live -= a.kind == B
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
