"""A live progress bar for training: step, loss, evaluation loss, tokens/s, tokens per chip per second."""

from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def training_progress(steps: int, tokens_per_step: int, n_chips: int, enabled: bool = True,
                      label: str = "train") -> Iterator:
    """Yields an `on_step(step, loss, seconds)` callback that advances the bar; its
    `evaluated(step, eval_loss)` shows the latest evaluation."""
    if not enabled:
        yield None
        return
    progress = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[tps]} tok/s  "
                   "{task.fields[tgs]} tok/chip/s"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    task = progress.add_task(label, total=steps, loss="-", eval="-", tps="-", tgs="-")

    def on_step(step: int, loss: float, seconds: float) -> None:
        tps = tokens_per_step / seconds
        progress.update(task, advance=1, loss=f"{loss:.4f}", tps=f"{tps:,.0f}", tgs=f"{tps / n_chips:,.0f}")

    def evaluated(step: int, loss: float) -> None:
        progress.update(task, eval=f"{loss:.4f} (step {step + 1})")

    on_step.evaluated = evaluated
    with progress:
        try:
            yield on_step
        except BaseException:
            # The run failed or was stopped: its one line says so; no half-drawn bar above it.
            progress.live.transient = True
            raise
