"""GPipe (Huang et al. 2019): every forward, then every backward.

In flight: stage i holds all m micro-batches' activations (m). Bubble, uniform stages:
(p - 1) / (m + p - 1). Closed form: sum_i (f_i + b_i) + 2 * links + (m - 1) * (max(max_i f_i,
send) + max(max_i b_i, send)) + tail.
"""

from __future__ import annotations

from h2jax.schedules.base import B, F, ClosedForm, Order, Schedule


def order(stage: int, p: int, m: int, v: int = 1) -> Order:
    return [(F, k, 0) for k in range(m)] + [(B, k, 0) for k in range(m)]


def in_flight(stage: int, p: int, m: int, v: int = 1) -> int:
    return m


SCHEDULE = Schedule(
    name="gpipe",
    summary="all forwards, then all backwards; holds every micro-batch",
    order=order,
    in_flight=in_flight,
    closed_form=ClosedForm(fill=(1, 1, 0), fill_last=(1, 1, 0), steady=((1, 0, 0), (0, 1, 0))),
    position_in_flight=lambda j, m, v: float(m),
    # the same fill, a steady state of max f + max b >= max (f + b), m micro-batches in flight
    # where 1F1B holds min(p - i, m): a plan runs no slower, and fits, under 1F1B
    no_faster_than="1f1b",
)
