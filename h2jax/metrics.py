"""Run metrics: the figures of a step, and a writer to JSONL and TensorBoard under a log dir.

`<log_dir>/metrics.jsonl` holds one JSON object per record, `{"step": n, <name>: value, ...}`,
with the names of `h2jax.names`; per-stage figures are lists in pipeline order. The same
records go to TensorBoard event files (tensorboardX) in `<log_dir>/tensorboard/`, a list as
one scalar per stage (`stage_busy_fraction/0`, ...). `<log_dir>/run.json` says what ran (the
plan, the dataset). No JAX import: `h2jax plot` reads these files without a backend.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from h2jax import names as N

METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"
TENSORBOARD_DIR = "tensorboard"


def chips_peak_flops(plan) -> float | None:
    """Sum of the plan's chips' peak dense FLOP/s; None when a chip's peak is unknown."""
    from h2jax.cluster import load_chip

    total = 0.0
    for stage in plan.stages:
        peak = load_chip(stage.chip).peak_tflops
        if not peak or peak <= 0:
            return None
        total += peak * 1e12 * stage.mesh.size
    return total


def throughput(plan, step_time_s: float, n_chips: int | None = None) -> dict[str, float | None]:
    """tokens/s, tokens per chip per second and MFU of one step of `plan` taking `step_time_s`
    (the planner's MFU formula: model FLOPs per token x tokens/s over the chips' peak)."""
    from h2jax.planner.cost_model import model_flops_per_token

    n_chips = plan.n_devices if n_chips is None else n_chips
    tokens_per_s = plan.tokens_per_step / step_time_s
    peak = chips_peak_flops(plan) if n_chips == plan.n_devices else None
    mfu = None if peak is None else model_flops_per_token(plan.model, plan.seq_len) * tokens_per_s / peak
    return {N.TOKENS_PER_S: tokens_per_s, N.TOKENS_PER_CHIP_PER_S: tokens_per_s / n_chips, N.MFU: mfu}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows a float past ~709


class MetricsWriter:
    """Appends records to `<log_dir>/metrics.jsonl` and TensorBoard; one writer per run (the
    process that reports progress)."""

    def __init__(self, log_dir: str | Path, run_info: Mapping[str, Any] | None = None):
        from tensorboardX import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if run_info is not None:
            (self.log_dir / RUN_FILE).write_text(json.dumps(dict(run_info), indent=2, default=str) + "\n")
        self._jsonl = open(self.log_dir / METRICS_FILE, "a")
        self._tb = SummaryWriter(str(self.log_dir / TENSORBOARD_DIR))

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        record = {N.STEP: int(step), **{k: v for k, v in values.items() if v is not None}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key == N.STEP:
                continue
            if isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, (int, float)):
                        self._tb.add_scalar(f"{key}/{i}", v, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(log_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(log_dir) / METRICS_FILE
    if not path.is_file():
        from h2jax.config import ConfigError

        raise ConfigError(f"{path} does not exist; give the --log-dir of an `h2jax run` (or a Trainer's)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[Mapping[str, Any]], key: str) -> tuple[list[int], list[Any]]:
    """(steps, values) of the records that hold `key`."""
    pairs = [(r[N.STEP], r[key]) for r in records if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]
