"""1F1B (PipeDream-flush, Narayanan et al. 2021): stage i of p runs min(p - i - 1, m) warm-up
forwards, then alternates one forward and one backward, then drains its backwards.

In flight: stage i holds min(p - i, m) micro-batches' activations. Bubble, uniform stages:
(p - 1) / (m + p - 1), as GPipe, at a fraction of its memory. Closed form: sum_i (f_i + b_i)
+ 2 * links + (m - 1) * max(max_i (f_i + b_i), send) + tail.
"""

from __future__ import annotations

from h2jax.schedules.base import B, F, ClosedForm, Order, Schedule


def order(stage: int, p: int, m: int, v: int = 1) -> Order:
    warmup = min(p - stage - 1, m)
    out: Order = [(F, k, 0) for k in range(warmup)]
    for j in range(m - warmup):
        out += [(F, warmup + j, 0), (B, j, 0)]
    out += [(B, j, 0) for j in range(m - warmup, m)]
    return out


def in_flight(stage: int, p: int, m: int, v: int = 1) -> int:
    return min(p - stage, m)


SCHEDULE = Schedule(
    name="1f1b",
    summary="one forward, one backward; stage i holds p - i micro-batches",
    order=order,
    in_flight=in_flight,
    closed_form=ClosedForm(fill=(1, 1, 0), fill_last=(1, 1, 0), steady=((1, 1, 0),)),
)
