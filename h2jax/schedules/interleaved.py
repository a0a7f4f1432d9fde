"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each stage holds v non-adjacent
layer chunks (chunk c of stage i is virtual stage c*p + i), so a micro-batch passes through
the stages v times. Micro-batches go in groups of p: stage i runs the group's forwards
chunk by chunk (backwards with the chunks reversed; m must be a multiple of p), after 2*(p - i - 1) + (v - 1)*p
warm-up forwards alternates one forward and one backward, then drains.

In flight: stage i holds min(2*(p - i - 1) + (v - 1)*p + 1, m*v) chunk activations, each 1/v
of the stage's layers. Bubble, uniform stages: (p - 1)/v of one micro-batch's stage time,
against 1F1B's p - 1, for v times the stage-to-stage messages. Closed form: sum_i (f_i +
b_i)/v + 2 * links + (m - 1/v) * max(max_i (f_i + b_i), v * send) + tail.
"""

from __future__ import annotations

from h2jax.schedules.base import B, F, ClosedForm, Order, Schedule


def _sequence(p: int, m: int, v: int, reverse: bool) -> list[tuple[int, int]]:
    out = []
    for start in range(0, m, p):
        group = range(start, min(start + p, m))
        for c in range(v):
            out += [(k, v - 1 - c if reverse else c) for k in group]
    return out


def _warmup(stage: int, p: int, m: int, v: int) -> int:
    return min(2 * (p - stage - 1) + (v - 1) * p, m * v)


def order(stage: int, p: int, m: int, v: int = 2) -> Order:
    fwd, bwd = _sequence(p, m, v, False), _sequence(p, m, v, True)
    warmup = _warmup(stage, p, m, v)
    out: Order = [(F, k, c) for k, c in fwd[:warmup]]
    for j in range(m * v - warmup):
        out += [(F, *fwd[warmup + j]), (B, *bwd[j])]
    out += [(B, k, c) for k, c in bwd[m * v - warmup:]]
    return out


def in_flight(stage: int, p: int, m: int, v: int = 2) -> int:
    return min(_warmup(stage, p, m, v) + 1, m * v)


def unsupported(p: int, m: int, v: int) -> str | None:
    # Whole groups of p micro-batches: Megatron's condition. With a partial last group the
    # warm-up counts above can wait on a forward that has not run; with fewer than p
    # micro-batches the stages starve and the closed form does not hold.
    if m % p:
        return (f"interleaved-1f1b needs the number of micro-batches ({m}) to be a multiple of the "
                f"stage count ({p}); change global_batch or micro_batch")
    return None


SCHEDULE = Schedule(
    name="interleaved-1f1b",
    summary="1F1B over v layer chunks per stage: 1/v of the bubble for v times the messages",
    order=order,
    in_flight=in_flight,
    closed_form=ClosedForm(fill=(1, 1, 0), fill_last=(1, 1, 0), steady=((1, 1, 0),), chunked=True),
    virtual=True,
    position_in_flight=lambda j, m, v: min((v + 1) * j - 1, m * v) / v,
    unsupported=unsupported,
)
