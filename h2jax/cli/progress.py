"""Live progress: training's bar (step, loss, evaluation loss, tokens/s, tokens per chip per
second) and the two-shape proof's status line (nodes, the best plan, the bound, the gap)."""

from __future__ import annotations

import contextlib
import math
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


PROOF_LOG_EVERY_S = 30.0  # without a terminal (a log file): a line this often, and the first


def proof_line(p) -> str:
    """One line of where a two-shape proof stands (a planner.ProofProgress)."""
    bound = f"optimum >= {p.bound_s:.6g} s (gap {p.gap:.2%})" if p.bound_s > 0 else "no bound yet"
    return (f"two-shape proof ({p.schedule}): {p.nodes:,} nodes, {p.open:,} open; best {p.best_s:.6g} s, "
            f"{bound}; {p.elapsed_s:.0f} s")


@contextlib.contextmanager
def proof_status(console: Console | None = None) -> Iterator:
    """Yields a `progress(ProofProgress)` callback for `plan_cluster(proof_progress=...)`: on
    a terminal a live status line that ends with the proof; elsewhere (a log) a line when a
    proof begins and every PROOF_LOG_EVERY_S seconds of it."""
    console = console or Console(stderr=True)
    hint = "Ctrl-C stops it, keeping the best plan found"
    if not console.is_terminal:
        last = [-math.inf]

        def log(p) -> None:
            if p.nodes == 0 or p.elapsed_s - last[0] >= PROOF_LOG_EVERY_S:
                last[0] = p.elapsed_s
                console.print(proof_line(p) + (f" ({hint})" if p.nodes == 0 else ""), highlight=False, soft_wrap=True)

        yield log
        return
    with console.status("planning", spinner="dots") as status:
        def show(p) -> None:
            status.update(f"{proof_line(p)} [dim]({hint})[/dim]")

        yield show
