"""Trace export: valid JSON, one track per stage, every action of the schedule present."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from h2jax import schedules as sched
from h2jax.planner.stage_cost import StageCost
from h2jax.sim import simulate
from h2jax.trace import read_trace, trace_dict, write_trace


def _costs(p):
    return [
        StageCost(forward_s=1.0 + i, backward_s=2.0, backward_weight_s=0.8, send_s=0.3,
                  send_bytes=1024, dp_reduce_s=0.1, optimizer_s=0.05, activation_bytes=8,
                  static_bytes=64, link_latency_s=0.01)
        for i in range(p)
    ]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_simulated_trace_has_every_action_on_its_stage(tmp_path, name, v):
    p, m = 4, 8
    r = simulate(_costs(p), m, name, virtual_stages=v, record=True)
    path = write_trace(r.events, tmp_path / "t.json", stage_names=[f"stage {i} (x)" for i in range(p)])
    raw = json.loads(path.read_text())  # parses as JSON
    slices = [e for e in raw["traceEvents"] if e["ph"] != "M"]
    names = {e["pid"]: e["args"]["name"] for e in raw["traceEvents"] if e["name"] == "process_name"}
    assert names == {i: f"stage {i} (x)" for i in range(p)}  # one track per stage
    assert {e["pid"] for e in slices} == set(range(p))
    lists = sched.get_schedule(name).build(p, m, v)
    for i in range(p):
        got = Counter(e["name"] for e in slices if e["pid"] == i)
        assert got == Counter(repr(a) for a in lists[i])
    # Compute slices on one stage never overlap; their sum is the stage's busy time.
    for i in range(p):
        comp = sorted((e["ts"], e["dur"]) for e in slices if e["pid"] == i and e["cat"] == "compute")
        assert all(a[0] + a[1] <= b[0] + 1e-6 for a, b in zip(comp, comp[1:]))
        assert sum(d for _, d in comp) / 1e6 == pytest.approx(r.busy_s[i], rel=1e-9)
    back = read_trace(path)
    assert len(back) == len(r.events)
    assert max(e.start_s + e.duration_s for e in back) == pytest.approx(r.pipeline_s, rel=1e-9)


def test_plain_tuples_are_accepted_and_checked(tmp_path):
    events = [(0, "F0", 0.0, 0.5, None), (1, "F0", 0.6, 0.5, {"micro": 0}, "compute"),
              (0, "SEND_ACT0", 0.5, 0.1, None, "comm")]
    d = trace_dict(events, metadata={"source": "measured"})
    assert d["metadata"] == {"source": "measured"}
    xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in xs] == [
        (0, 0, 0.0, 500000.0), (1, 0, 600000.0, 500000.0), (0, 1, 500000.0, 100000.0)]
    with pytest.raises(ValueError, match="lane"):
        trace_dict([(0, "F0", 0.0, 1.0, None, "gpu")])
    with pytest.raises(ValueError, match="negative"):
        trace_dict([(0, "F0", 0.0, -1.0, None)])
    with pytest.raises(ValueError, match="record"):
        trace_dict([(0, "F0", 0.0)])
