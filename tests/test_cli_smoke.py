"""The success paths of the `h2jax` commands, through the command line, checking what they print.

Each is kept short (tiny settings, few steps). `run` trains the shipped plans/demo.json
pipelined and as the unpipelined reference, and the two must agree; `demo` runs in its own
process (it sets JAX's compilation cache for itself).
"""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from h2jax.cli import main as cli_main
from h2jax.plan import load_plan
from tests.conftest import REPO_ROOT, TEST_XLA_FLAGS, checkout_env

DEMO_PLAN = str(REPO_ROOT / "plans" / "demo.json")
STEPS = 2


def cli_json(capsys, *argv) -> dict:
    """Run `h2jax ARGV` in this process; its last stdout line must be one JSON object."""
    assert cli_main(list(argv)) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.strip()]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def demo_runs():
    """`h2jax run --json` on plans/demo.json, pipelined and unpipelined (2 steps each)."""
    out = {}  # capsys is per test: this module-scoped fixture captures stdout itself
    for name, extra in (("pipelined", []), ("unpipelined", ["--unpipelined"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli_main(["run", "--plan", DEMO_PLAN, "--steps", str(STEPS), "--json", *extra])
        assert rc == 0
        out[name] = json.loads([l for l in buf.getvalue().splitlines() if l.strip()][-1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipelined", "unpipelined"])
def test_run_json_on_the_shipped_demo_plan(demo_runs, mode):
    plan = load_plan(DEMO_PLAN)
    r = demo_runs[mode]
    assert len(r["losses"]) == STEPS and len(r["grad_norms"]) == STEPS
    assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
    # byte-level model, untrained: the first loss is near log(vocab)
    assert abs(r["losses"][0] - math.log(plan.model.vocab_size)) < 0.5
    assert r["losses"][1] != r["losses"][0]  # the optimizer stepped
    assert r["step_time_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(plan.global_batch * plan.seq_len / r["step_time_s"], rel=1e-9)
    chips = 1 if mode == "unpipelined" else plan.n_devices
    assert r["tokens_per_chip_per_s"] == pytest.approx(r["tokens_per_s"] / chips, rel=1e-9)
    assert r["emulated"] == {}  # plans/demo.json runs on real (cpu) chips


@pytest.mark.slow
def test_the_demo_plan_trains_like_its_unpipelined_reference(demo_runs):
    """The shipped plan (three stages, three meshes, three recompute policies) reproduces the
    reference's losses and gradient norms at f32 tolerance."""
    pipe, ref = demo_runs["pipelined"], demo_runs["unpipelined"]
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(pipe["grad_norms"], ref["grad_norms"], rtol=1e-5)


def test_show_prints_every_stage_of_the_plan(capsys):
    assert cli_main(["show", DEMO_PLAN]) == 0
    out = capsys.readouterr().out
    plan = load_plan(DEMO_PLAN)
    assert f"{plan.n_stages}-stage plan, {plan.schedule}, {plan.n_micro} micro-batches of " \
           f"{plan.micro_batch} x {plan.seq_len} tokens" in out
    rows = [l for l in out.splitlines() if "[" in l and ")" in l and "stage" not in l]
    assert len(rows) == plan.n_stages
    for row, s in zip(rows, plan.stages):
        cells = [c.strip() for c in row.strip("│┃|").split("│")]
        assert cells[1:6] == [s.chip, str(s.mesh.data), str(s.mesh.tensor),
                              f"[{s.layers[0]}, {s.layers[1]})", s.recompute], row


def test_compare_json_is_batch_matched_and_consistent(capsys):
    d = cli_json(capsys, "compare", "--cluster", str(REPO_ROOT / "plans" / "cluster-64.toml"),
                 "--model", "llama-7b", "--seq-len", "2048", "--global-batch-tokens", "2M",
                 "--baseline-global-batch-tokens", "1M", "--json")
    assert d["global_batch_tokens"] == 2 * 2**20 and d["baseline_global_batch_tokens"] == 2**20
    mixed, same, fixed = d["mixed"], d["baselines_same_batch"], d["baselines_fixed_batch"]
    assert set(same) == set(fixed) == {"nvidia-h100", "nvidia-a100"}
    assert mixed["cluster_chips"] == 64 and mixed["chips_used"] <= 64
    for run in [mixed, *same.values(), *fixed.values()]:
        if run["error"] is None:
            sim = run["simulated"]
            assert sim["tokens_per_s"] == pytest.approx(run["global_batch_tokens"] / sim["step_time_s"], rel=1e-9)
            assert sim["tokens_per_chip_per_s"] == pytest.approx(sim["tokens_per_s"] / run["cluster_chips"], rel=1e-9)
    for run in same.values():  # batch-matched: every baseline at the mixed run's batch
        assert run["global_batch_tokens"] == d["global_batch_tokens"]
    for run in fixed.values():
        assert run["global_batch_tokens"] == d["baseline_global_batch_tokens"]
    # HeteroSpeedupRatio = N * TGS / sum N_i * TGS_i = mixed tokens/s / sum of the baselines' tokens/s
    rate = lambda runs: sum(r["simulated"]["tokens_per_s"] or 0.0 for r in runs.values())
    tps = mixed["simulated"]["tokens_per_s"]
    assert d["hetero_speedup_ratio"] == pytest.approx(tps / rate(same), rel=1e-9)
    assert d["hetero_speedup_ratio_paper_method"] == pytest.approx(tps / rate(fixed), rel=1e-9)
    assert d["batch_size_effect"] == pytest.approx(
        d["hetero_speedup_ratio_paper_method"] - d["hetero_speedup_ratio"], abs=1e-12)
    assert 0.5 < d["hetero_speedup_ratio"] < 1.5


def test_align_json_reports_each_chips_error_against_the_first(capsys):
    d = cli_json(capsys, "align", "--chips", "cpu,cpu-bf16", "--steps", "3", "--seq-len", "16",
                 "--batch", "4", "--json")
    assert d["reference"] == "cpu" and set(d["chips"]) == {"cpu-bf16"}
    e = d["chips"]["cpu-bf16"]
    assert 0 < e["mean_relative_error"] < d["tolerance"] and e["passed"] and d["passed"]
    assert 0 <= e["worst_step"] < 3 and e["worst_relative_error"] >= e["mean_relative_error"]


@pytest.mark.slow
def test_demo_profiles_plans_trains_and_reports(tmp_path):
    """`h2jax demo --json` with tiny settings on the 2-type emulated cluster, in its own
    process: the narrative on stderr, one JSON object of its figures on stdout."""
    env = checkout_env({**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "h2jax", "demo", "--cluster", str(REPO_ROOT / "plans" / "cluster-emu-2type.toml"),
         "--model", "tiny", "--seq-len", "16", "--global-batch", "4", "--steps", "3", "--baseline-steps", "2",
         "--json"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    out = proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + out[-3000:]
    assert "EMULATED chips" in out and "emu-fast" in out and "emu-slow" in out
    for step in ("1. Profiling", "2. Planning", "3. Training 3 steps", "4. Each chip type alone"):
        assert step in out, step
    assert "HeteroAuto plan:" in out
    ratio_line = next(l for l in out.splitlines() if l.startswith("HeteroSpeedupRatio (measured"))
    value = ratio_line.split("=")[-1].split()[0]
    assert value == "n/a" or 0 < float(value) < 10, ratio_line
    first, last = (float(x) for x in re.search(r"^\s*loss ([0-9.]+) -> ([0-9.]+)", out, re.MULTILINE).groups())
    assert last < first  # the demo's own success criterion, checked from its output
    # the JSON: every chip used or idle, throughput per chip of the cluster and per chip used
    d = json.loads(proc.stdout)
    for chip, n in d["chips"].items():
        assert d["chips_used"].get(chip, 0) + d["chips_idle"].get(chip, 0) == n
    used = sum(d["chips_used"].values())
    assert d["tokens_per_used_chip_per_s"] == pytest.approx(d["tokens_per_s"] / used, rel=1e-9)
    assert d["tokens_per_chip_per_s"] == pytest.approx(d["tokens_per_s"] / sum(d["chips"].values()), rel=1e-9)
