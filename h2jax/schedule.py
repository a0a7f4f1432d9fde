"""Transitional alias of h2jax.schedules for the modules not yet moved to the registry (the
pipeline driver); everything here is the registry's own definition."""

from __future__ import annotations

from h2jax.schedules.base import (  # noqa: F401
    B, COMPUTE, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W, Action, backward_follows,
    execution_order, max_deferred, max_in_flight,
)
from h2jax.schedules.registry import get_schedule


def build(name: str, n_stages: int, n_micro: int, v: int = 1) -> list[list[Action]]:
    return get_schedule(name).build(n_stages, n_micro, v)


def stage_actions(name: str, stage: int, n_stages: int, n_micro: int, v: int = 1) -> list[Action]:
    return get_schedule(name).stage_actions(stage, n_stages, n_micro, v)
