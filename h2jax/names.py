"""One name per quantity, for every JSON output (run, plan, simulate, compare, demo --json,
show --json, metrics) and one text format for layer ranges and meshes in every table.

Who computed a figure (the planner's closed form, the simulator, a measured run) is said by the
object that holds it (`"predicted": {...}`, `"simulated": {...}`, `"measured": {...}`), never
by a different key for the same quantity. No imports: planner, simulator and runtime all use it.
"""

from __future__ import annotations

# --- per step
STEP = "step"
STEP_TIME_S = "step_time_s"  # one optimizer step (an iteration), seconds
# the schedule's closed form of the same step, where that form is the search's estimate only
# (ZB-H1: the predicted step replays the schedule's order)
CLOSED_FORM_STEP_TIME_S = "closed_form_step_time_s"
TOKENS_PER_S = "tokens_per_s"
TOKENS_PER_CHIP_PER_S = "tokens_per_chip_per_s"  # TGS, over every chip of the cluster
TOKENS_PER_USED_CHIP_PER_S = "tokens_per_used_chip_per_s"  # over the chips a plan uses
MFU = "mfu"  # model FLOP utilization against the chips' peak dense bf16 FLOP/s
BUBBLE_FRACTION = "bubble_fraction"
LOSS = "loss"
LOSSES = "losses"
GRAD_NORM = "grad_norm"
GRAD_NORMS = "grad_norms"
LEARNING_RATE = "learning_rate"
EVAL_LOSS = "eval_loss"
EVAL_PERPLEXITY = "eval_perplexity"
TOKENS_SEEN = "tokens_seen"

# --- per stage (lists in pipeline order)
STAGE_BUSY_FRACTION = "stage_busy_fraction"
STAGE_IDLE_FRACTION = "stage_idle_fraction"
STAGE_MEMORY_BYTES = "stage_memory_bytes"

# --- who computed it
PREDICTED = "predicted"
SIMULATED = "simulated"
MEASURED = "measured"

# Table column headers for the same quantities.
HEADERS = {
    STEP_TIME_S: "step s",
    TOKENS_PER_S: "tokens/s",
    TOKENS_PER_CHIP_PER_S: "tokens/chip/s",
    MFU: "MFU",
    BUBBLE_FRACTION: "bubble",
    LOSS: "loss",
    EVAL_LOSS: "eval loss",
}


def format_layers(layers) -> str:
    """A layer range `[start, end)` (or several, for interleaved chunks) as every table shows it."""
    layers = list(layers)
    if len(layers) == 2 and all(isinstance(x, int) for x in layers):
        layers = [layers]
    return ", ".join(f"[{start}, {end})" for start, end in layers)


def format_mesh(data: int, tensor: int) -> str:
    """A `("data", "tensor")` mesh as every table shows it."""
    return f"data={data},tensor={tensor}"
