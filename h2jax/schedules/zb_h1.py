"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward
split into B (the input gradient, which the previous stage waits for) and W (the weight
gradient, which nothing waits for). Stage i runs 1F1B's order of F and B and each W_j right
after B_{j+i} (the drain's W's after its last B): the W's move into the bubbles of the fill
and drain, so the backward chain through the pipeline carries only the B's.

In flight: every stage holds min(p, m) micro-batches' activations (from F until W), the peak
of 1F1B's first stage; micro-batches between B and W also hold their per-layer output
gradients: at most min(i + 1, m) on stage i.

As this runtime runs it, W re-runs each block's whole backward (the cost model's
`split_backward_as_run`: B = b - w, W = b, b the whole backward and w its weight-gradient
part), so W >= B, where the paper has W = w <= B. On uniform stages with m >= p the step is
then m (f + B + W) + (p - 1) max(f, B, f + B - W) (the simulator's replay, checked in
tests/test_planner.py): each middle stage's share of the fill is max(f, B), B where the
backward's input-gradient chain is at least the forward, as the cost model's terms always
have it. Closed form: sum_{i<p-1} B_i + (f_last + B_last + W_last) + 2 * links + (m - 1) *
max(max_i (f_i + B_i + W_i), send) + tail, in (f, b, w) = (f, B + W, W). It falls short of
the order replayed on uneven stages and with fewer micro-batches than stages (and, with the
paper's W <= B, by (p - 1)(f - W) on uniform stages): it is the search's estimate
(`exact=False`), and a plan's predicted step replays the order.
"""

from __future__ import annotations

from h2jax.schedules import one_f_one_b
from h2jax.schedules.base import B, W, ClosedForm, Order, Schedule


def order(stage: int, p: int, m: int, v: int = 1) -> Order:
    out: Order = []
    for kind, k, c in one_f_one_b.order(stage, p, m):
        out.append((kind, k, c))
        if kind == B and k - stage >= 0:
            out.append((W, k - stage, 0))
    out += [(W, j, 0) for j in range(max(m - stage, 0), m)]
    return out


def in_flight(stage: int, p: int, m: int, v: int = 1) -> int:
    return min(p, m)


def deferred(stage: int, p: int, m: int, v: int = 1) -> int:
    return min(stage + 1, m)


SCHEDULE = Schedule(
    name="zb-h1",
    summary="1F1B with the weight gradient (W) split from the backward and moved into the bubbles",
    order=order,
    in_flight=in_flight,
    closed_form=ClosedForm(fill=(0, 1, -1), fill_last=(1, 1, 0), steady=((1, 1, 0),), exact=False),
    splits_backward=True,
    deferred=deferred,
)
