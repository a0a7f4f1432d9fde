"""What the cost model says one pipeline stage costs: the contract between the planner's cost
model (which produces it) and the simulator (which replays a schedule with it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class StageCost:
    """Per-micro-batch times (seconds) and bytes of one stage of a plan.

    `backward_s` is the whole backward of one micro-batch, recomputation included;
    `backward_weight_s` is the part of it that computes weight gradients, which a
    zero-bubble schedule (ZB-H1) may defer. `send_s` moves this stage's output
    activation to the next stage (0 on the last stage); the activation gradient going back
    costs the same (mirror resharding). `send_bytes` is what crosses the link per
    micro-batch under the topology-aware resharding rule.
    """

    forward_s: float
    backward_s: float
    backward_weight_s: float
    send_s: float
    send_bytes: int
    dp_reduce_s: float  # data-parallel gradient reduction, once per iteration
    optimizer_s: float  # optimizer step, once per iteration
    activation_bytes: int  # per device, one micro-batch's saved activations
    static_bytes: int  # per device: parameters, gradients, optimizer state, reserve
    link_latency_s: float = 0.0  # fixed latency of the send to the next stage
