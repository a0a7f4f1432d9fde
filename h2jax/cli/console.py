"""The consoles commands print through: a terminal's own width, or, when the output is a file
or a pipe, wide enough that no table column is cut to an ellipsis and no line is wrapped."""

from __future__ import annotations

from rich.console import Console

# Wider than any table or line a command prints; rich sizes tables to their content.
PIPE_WIDTH = 1000


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console = Console(stderr=stderr, width=PIPE_WIDTH)
    return console


def count(n: int, noun: str) -> str:
    """'1 stage', '3 stages', '1 micro-batch', '4 micro-batches'."""
    if n == 1:
        return f"{n:,} {noun}"
    return f"{n:,} {noun}" + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


def gib(x: float) -> str:
    """GiB with three significant figures, so that emulated chips' MiB do not print as 0.0."""
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"
