"""Chrome / Perfetto trace-event JSON: the one timeline format for simulated and measured runs.

Input is a plain list of records `(stage, name, start_s, duration_s, args[, lane])`. Each
pipeline stage becomes one process track in ui.perfetto.dev ("stage 3 (mi300x)"), with one
thread per lane: "compute" for F/B/W and "comm" for sends and receives, so slices on a thread
never overlap. A zero-duration record becomes an instant event (a receive completing).
Times are written in microseconds, as the format requires.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

LANES = ("compute", "comm")


class TraceEvent(NamedTuple):
    stage: int
    name: str
    start_s: float
    duration_s: float
    args: Mapping[str, Any] | None = None
    lane: str = "compute"


def _as_event(record: Sequence[Any]) -> TraceEvent:
    if isinstance(record, TraceEvent):
        return record
    if not 5 <= len(record) <= 6:
        raise ValueError(
            f"a trace record is (stage, name, start_s, duration_s, args[, lane]), got {record!r}"
        )
    return TraceEvent(*record)


def trace_dict(
    events: Iterable[Sequence[Any]],
    stage_names: Mapping[int, str] | Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The trace as a JSON-ready dict: {"traceEvents": [...], "displayTimeUnit": "ms", ...}."""
    out: list[dict[str, Any]] = []
    stages: set[int] = set()
    lanes: set[tuple[int, str]] = set()
    for record in events:
        e = _as_event(record)
        if e.lane not in LANES:
            raise ValueError(f"trace lane {e.lane!r} is unknown; use one of {', '.join(LANES)}")
        if e.duration_s < 0:
            raise ValueError(f"trace event {e.name} on stage {e.stage} has negative duration")
        stages.add(e.stage)
        lanes.add((e.stage, e.lane))
        item: dict[str, Any] = {
            "name": e.name,
            "cat": e.lane,
            "pid": e.stage,
            "tid": LANES.index(e.lane),
            "ts": e.start_s * 1e6,
        }
        if e.duration_s > 0:
            item["ph"] = "X"
            item["dur"] = e.duration_s * 1e6
        else:
            item["ph"] = "i"
            item["s"] = "t"
        if e.args:
            item["args"] = dict(e.args)
        out.append(item)
    meta: list[dict[str, Any]] = []
    for s in sorted(stages):
        label = f"stage {s}"
        if stage_names is not None:
            try:
                label = str(stage_names[s])
            except (KeyError, IndexError):
                pass
        meta.append({"name": "process_name", "ph": "M", "pid": s, "tid": 0, "args": {"name": label}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": s, "tid": 0,
                     "args": {"sort_index": s}})
    for s, lane in sorted(lanes):
        meta.append({"name": "thread_name", "ph": "M", "pid": s, "tid": LANES.index(lane),
                     "args": {"name": lane}})
    result: dict[str, Any] = {"traceEvents": meta + out, "displayTimeUnit": "ms"}
    if metadata:
        result["metadata"] = dict(metadata)
    return result


def write_trace(
    events: Iterable[Sequence[Any]],
    path: str | os.PathLike[str],
    stage_names: Mapping[int, str] | Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a trace that opens in ui.perfetto.dev and chrome://tracing; atomic."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(trace_dict(events, stage_names, metadata)))
    tmp.replace(path)
    return path


def read_trace(path: str | os.PathLike[str]) -> list[TraceEvent]:
    """The records back from a trace written by `write_trace` (metadata events dropped)."""
    raw = json.loads(Path(path).read_text())
    out = []
    for e in raw["traceEvents"]:
        if e["ph"] == "M":
            continue
        out.append(TraceEvent(e["pid"], e["name"], e["ts"] / 1e6, e.get("dur", 0.0) / 1e6,
                              e.get("args"), e["cat"]))
    return out


COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#C9A227", "SEND": "#8172B2", "RECV": "#999999"}


def plot_timeline(
    events: Iterable[Sequence[Any]],
    path: str | os.PathLike[str],
    stage_names: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """A PNG timeline: one row per stage, F/B/W slices coloured by kind (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_row: dict[tuple[int, str], list[tuple[float, float]]] = {}
    stages: set[int] = set()
    for record in events:
        e = _as_event(record)
        stages.add(e.stage)
        if e.lane != "compute" or e.duration_s <= 0:
            continue
        kind = e.name.rstrip("0123456789")
        by_row.setdefault((e.stage, kind), []).append((e.start_s, e.duration_s))
    n = max(stages) + 1 if stages else 1
    fig, ax = plt.subplots(figsize=(12, max(2.0, 0.3 * n + 1.2)))
    for (stage, kind), spans in by_row.items():
        ax.broken_barh(spans, (stage - 0.4, 0.8), facecolors=COLORS.get(kind, "#333333"),
                       edgecolor="white", linewidth=0.3 if len(spans) < 2000 else 0)
    ax.set_ylim(n - 0.5, -0.5)
    ticks = list(range(n)) if n <= 40 else list(range(0, n, max(1, n // 20)))
    ax.set_yticks(ticks)
    ax.set_yticklabels([stage_names[i] if stage_names else f"stage {i}" for i in ticks], fontsize=7)
    ax.set_xlabel("seconds")
    kinds = sorted({k for _, k in by_row}, key="FBW".find)
    ax.legend(handles=[Patch(color=COLORS.get(k, "#333333"), label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
