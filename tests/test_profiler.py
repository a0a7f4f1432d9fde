"""`h2jax profile` writes the planner's profile format; a measured profile steers the planner."""

import dataclasses
import json
import types

import pytest

from h2jax.cli import main as cli_main
from h2jax.cluster import load_cluster
from h2jax.planner import load_profile, plan_cluster
from h2jax.planner.profile import Profile, ProfileEntry


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    rc = cli_main(["profile", "--chip", "emu-mid,emu-slow", "--model", "tiny", "--seq-len", "16",
                   "--tensor", "1", "--micro-batch", "1,2", "--repeats", "3", "--warmup", "1",
                   "--max-spread", "100", "--out", str(out)])  # a shared test machine is noisy
    assert rc == 0
    return out


def test_profile_file_is_the_planners_format(profile_file):
    raw = json.loads(profile_file.read_text())
    assert raw["format_version"] == 1 and raw["model"] == "tiny" and raw["seq_len"] == 16
    assert "EMULATED" in raw["source"]
    profile = load_profile(profile_file)
    mid, slow = profile.entries("emu-mid", 1, "none"), profile.entries("emu-slow", 1, "none")
    assert [e.tokens for e in mid] == [16, 32] == [e.tokens for e in slow]
    for m, s in zip(mid, slow):
        assert m.forward_s > 0 and m.backward_s > 0
        # one host measurement, stretched by each chip's slowdown (8 and 16)
        assert s.forward_s == pytest.approx(2 * m.forward_s, rel=1e-12)
        assert s.backward_s == pytest.approx(2 * m.backward_s, rel=1e-12)
        assert s.activation_bytes == m.activation_bytes > 0
    assert mid[1].activation_bytes > mid[0].activation_bytes  # more tokens keep more


def test_profile_merges_into_an_existing_file(profile_file, tmp_path):
    from h2jax.profiler import merge_into

    other = load_profile(profile_file)
    extra = dataclasses.replace(other, chips={"emu-fast": other.chips["emu-mid"]})
    merged = merge_into(extra, profile_file)
    assert set(merged.chips) == {"emu-mid", "emu-slow", "emu-fast"}


def _layers_per_chip(plan):
    out = {}
    for s in plan.stages:
        out[s.chip] = out.get(s.chip, 0) + s.n_layers
    return out


def _scaled(profile: Profile, chip: str, factor: float) -> Profile:
    chips = dict(profile.chips)
    chips[chip] = tuple(
        dataclasses.replace(e, forward_s=e.forward_s * factor, backward_s=e.backward_s * factor) for e in chips[chip]
    )
    return dataclasses.replace(profile, chips=chips)


def _injected_profile() -> Profile:
    """Fixed per-layer costs for tiny at seq_len 16 (no measurement: the planner's answer must
    not depend on how loaded the machine was when a profile was taken). 10 ms a layer: well
    above the analytical head and dispatch, so the layers' balance decides the split."""
    from h2jax.config import get_config

    entries = tuple(ProfileEntry(tensor=1, tokens=16 * b, forward_s=1e-2 * b, backward_s=2e-2 * b) for b in (1, 2))
    return Profile(model=get_config("tiny"), seq_len=16, chips={"emu-mid": entries}, source="injected",
                   model_name="tiny")


def test_doubling_a_chips_measured_layer_time_shifts_layers_away_from_it(tmp_path):
    cluster_file = tmp_path / "two.toml"
    cluster_file.write_text('[[group]]\nchip = "emu-mid"\ncount = 1\n\n[[group]]\nchip = "emu-slow"\ncount = 1\n')
    cluster = load_cluster(cluster_file)
    injected = _injected_profile()
    # Both chip types with the same per-layer costs: equally fast per layer.
    even = dataclasses.replace(injected, chips={"emu-mid": injected.chips["emu-mid"],
                                                "emu-slow": injected.chips["emu-mid"]})
    kwargs = dict(micro_batches=(1,), recompute=("none",), baselines=False)
    base = plan_cluster(cluster, "tiny", 16, 8, profile=even, **kwargs).plan
    slower = plan_cluster(cluster, "tiny", 16, 8, profile=_scaled(even, "emu-mid", 2.0), **kwargs).plan
    assert base.predicted["cost_model"] == "profile"
    before, after = _layers_per_chip(base), _layers_per_chip(slower)
    assert before.get("emu-mid", 0) >= 1 and before.get("emu-slow", 0) >= 1, before
    assert after.get("emu-mid", 0) < before["emu-mid"], (before, after)
    assert slower.predicted["step_time_s"] > base.predicted["step_time_s"]


def test_a_sample_of_short_calls_spans_enough_calls_to_be_resolved(monkeypatch):
    """A sub-millisecond call is timed over as many calls as span MIN_SAMPLE_S, and each
    sample reports seconds per call (a process's CPU clock resolves other threads' time only
    every few ms: one short call's worker time reads 0)."""
    from h2jax import profiler

    now = [0.0]
    monkeypatch.setattr(profiler, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls = []

    def call():
        calls.append(1)
        now[0] += 0.002  # a 2 ms call on the injected clock
        return 0

    n = profiler.calls_per_sample(call)
    assert (n, len(calls)) == (25, 1)  # 0.05 s / 2 ms, from one call
    calls.clear()
    assert profiler._call_seconds(call, emulated=False, calls=n) == pytest.approx(0.002)
    assert len(calls) == n
    now[0] += 1.0
    assert profiler.calls_per_sample(lambda: now.__setitem__(0, now[0] + 0.2)) == 1  # a long call: one
