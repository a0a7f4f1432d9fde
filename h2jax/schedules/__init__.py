"""Pipeline schedules, one module each, found by name (`get_schedule`): each defines its
per-stage action lists, the activations each stage holds in flight and the closed-form
iteration time the planner uses. No JAX: the planner and the simulator import this."""

from h2jax.schedules.base import (
    B, COMPUTE, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W, Action, ClosedForm, Schedule,
    actions_from_order, backward_follows, bubble_fraction, check_order, execution_order,
    max_deferred, max_in_flight, receiver, sender,
)
from h2jax.schedules.registry import AUTO, NAMES, SCHEDULES, VIRTUAL_STAGES, get_schedule, variants

__all__ = [
    "AUTO", "Action", "B", "COMPUTE", "ClosedForm", "F", "NAMES", "RECV_ACT", "RECV_GRAD", "SCHEDULES",
    "SEND_ACT", "SEND_GRAD", "Schedule", "VIRTUAL_STAGES", "W", "actions_from_order", "backward_follows",
    "bubble_fraction", "check_order", "execution_order", "get_schedule", "max_deferred", "max_in_flight",
    "receiver", "sender", "variants",
]
