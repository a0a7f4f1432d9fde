"""The simulator on real plans: agreement with the planner's closed form, the CLI, trace
export, the batch-matched HeteroSpeedupRatio, and re-ranking by simulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h2jax.cli import main as cli_main
from h2jax.cluster import load_chip, load_cluster
from h2jax.config import ConfigError
from h2jax.plan import load_plan
from h2jax.planner import cost_model
from h2jax.planner.search import candidate_plan, top_k
from h2jax.planner.stage_cost import StageCost
from h2jax.sim import simulate
from h2jax.sim_plans import plan_report, rerank_by_simulation, simulate_plan
from h2jax.speedup import compare, parse_tokens, sequences

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "plans" / "demo.json"


def uniform(f, b, p):
    return [StageCost(f, b, b / 3, 0.0, 0, 0.0, 0.0, 1, 0, 0.0)] * p


@pytest.mark.parametrize("p,m,f,b", [(1, 5, 1.0, 2.0), (4, 16, 0.013, 0.029), (12, 7, 2.5, 4.75),
                                     (30, 200, 1e-3, 2.2e-3)])
def test_simulator_matches_cost_model_closed_form(p, m, f, b):
    costs = uniform(f, b, p)
    closed = cost_model.iteration_time(costs, m, "1f1b")
    assert closed == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    sim = simulate(costs, m, "1f1b", global_clip=False).iteration_s
    assert abs(sim - closed) <= 1e-9 * closed


def test_demo_plan_report_shows_both_and_difference():
    plan = load_plan(DEMO)
    chips = {s.chip: load_chip(s.chip) for s in plan.stages}
    costs = cost_model.stage_costs(plan, chips)
    r = simulate_plan(plan, costs)
    rep = plan_report(plan, costs, r)
    assert rep["predicted"]["step_time_s"] == cost_model.iteration_time(costs, plan.n_micro, "1f1b")
    assert rep["sim_minus_closed_s"] == pytest.approx(r.iteration_s - rep["predicted"]["step_time_s"])
    assert rep["tokens_per_s"] == pytest.approx(plan.tokens_per_step / r.iteration_s)
    assert [s["peak_in_flight"] for s in rep["stages"]] == [min(3 - i, plan.n_micro) for i in range(3)]
    # The simulated step can never beat the busiest stage's compute plus its own tail.
    c0 = costs[0]
    assert r.iteration_s >= plan.n_micro * (c0.forward_s + c0.backward_s) + c0.dp_reduce_s


def test_simulate_cli_json_trace_plot(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = cli_main(["simulate", "--plan", str(DEMO), "--json", "--trace", str(trace),
                   "--plot", str(png), "--all-schedules"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_stages"] == 3 and out["schedule"] == "1f1b"
    # every registered schedule the plan's 3 stages and 4 micro-batches can run (interleaved
    # needs a multiple of 3 micro-batches)
    assert set(out["schedules"]) == {"gpipe", "1f1b", "zb-h1"}
    # more micro-batches than stages: ZB-H1's W, a whole backward as the runtime runs it
    # (cost_model.split_backward_as_run), costs more than its W's save in the fill and drain
    assert out["schedules"]["zb-h1"]["step_time_s"] > out["schedules"]["1f1b"]["step_time_s"]
    assert out["schedules"]["1f1b"]["step_time_s"] == out["step_time_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    assert sum(e["name"].startswith("F") for e in events) == 3 * 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_cli_bad_plan_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli_main(["simulate", "--plan", str(bad)]) == 2
    assert "format_version" in capsys.readouterr().err


def test_parse_tokens():
    assert parse_tokens("4M") == 4 * 2**20
    assert parse_tokens("512K") == 2**19
    assert parse_tokens("4194304") == 4194304
    assert parse_tokens("1.5M") == 3 * 2**19
    with pytest.raises(ConfigError):
        parse_tokens("four")
    with pytest.raises(ConfigError, match="multiple of 2048"):
        sequences(3000, 2048)


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("c") / "small.toml"
    path.write_text('name = "small"\n[[group]]\nchip = "nvidia-h100"\ncount = 8\n'
                    '[[group]]\nchip = "nvidia-a100"\ncount = 8\n')
    return load_cluster(path)


def test_compare_ratio_is_batch_matched(small_cluster):
    c = compare(small_cluster, "llama-7b", 1024, 2**18, baseline_global_batch_tokens=2**16)
    d = c.to_dict()
    rate = lambda r: r["global_batch_tokens"] / r["simulated"]["step_time_s"]  # noqa: E731
    same = d["baselines_same_batch"]
    assert all(r["global_batch_tokens"] == 2**18 for r in same.values())
    assert all(r["global_batch_tokens"] == 2**16 for r in d["baselines_fixed_batch"].values())
    assert d["hetero_speedup_ratio"] == pytest.approx(rate(d["mixed"]) / sum(map(rate, same.values())))
    fixed = d["baselines_fixed_batch"]
    assert d["hetero_speedup_ratio_paper_method"] == pytest.approx(
        rate(d["mixed"]) / sum(map(rate, fixed.values())))
    # A 4x smaller baseline batch has more bubble per token, so the paper's method flatters.
    assert d["batch_size_effect"] > 0
    for r in [d["mixed"], *same.values()]:
        assert r["simulated"]["step_time_s"] == pytest.approx(r["predicted"]["step_time_s"], rel=0.1)


def test_rerank_by_simulation_orders_by_simulated_time(small_cluster):
    model, seq, batch = "llama-7b", 1024, 256
    cands, _ = top_k(small_cluster, model, seq, batch, k=4)
    from h2jax.config import get_config

    plans = [candidate_plan(c, get_config(model), seq, batch, "1f1b") for c in cands]
    ranked = rerank_by_simulation(plans, small_cluster)
    times = [r.iteration_s for _, r in ranked]
    assert times == sorted(times)
    assert sorted(map(id, (p for p, _ in ranked))) == sorted(map(id, plans))
    for plan, r in ranked:
        costs = cost_model.stage_costs(plan, small_cluster)
        assert r.iteration_s == simulate_plan(plan, costs).iteration_s


def test_plan_refine_with_sim_keeps_the_fastest_simulated_plan(tmp_path):
    out = tmp_path / "refined.json"
    assert cli_main([
        "plan", "--cluster", str(ROOT / "plans" / "cluster-64.toml"), "--model", "llama-7b",
        "--seq-len", "2048", "--global-batch-tokens", "2097152", "--refine-with-sim", "4",
        "--no-baselines", "--json", "--out", str(out),
    ]) == 0
    plan = load_plan(out)
    refined = plan.predicted["refined_with_sim"]
    assert refined["k"] == 4 and 0 <= refined["rank_under_cost_model"] < 4
    assert refined["simulated"]["step_time_s"] == sorted(refined["simulated"]["step_time_s"])
    costs = cost_model.stage_costs(plan, load_cluster(ROOT / "plans" / "cluster-64.toml"))
    assert simulate_plan(plan, costs).iteration_s == pytest.approx(refined["simulated"]["step_time_s"][0], rel=1e-12)
    assert plan.predicted["simulated"]["step_time_s"] == refined["simulated"]["step_time_s"][0]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bubble_fraction_is_one_number_in_plan_simulate_and_compare(schedule, tmp_path, capsys):
    """The same plan's bubble fraction, as `h2jax plan`, `h2jax simulate` and `h2jax compare`
    print it (the demo prints the plan's own `predicted` figure): one definition, one number."""
    args = ["--cluster", str(ROOT / "plans" / "cluster-64.toml"), "--model", "llama-7b", "--seq-len", "2048",
            "--global-batch-tokens", "2M", "--schedule", schedule]
    out = tmp_path / "plan.json"
    assert cli_main(["plan", *args, "--no-baselines", "--out", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["plan"]["predicted"]["bubble_fraction"]
    assert cli_main(["simulate", "--plan", str(out), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert cli_main(["compare", *args, "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)["mixed"]["predicted"]["bubble_fraction"]
    assert 0 < planned < 1
    assert planned == simulated["bubble_fraction"] == compared
    # the replayed timeline's own figure is reported beside it, under its own name
    assert 0 < simulated["simulated_bubble_fraction"] < 1


def test_one_stage_has_no_bubble(tmp_path, capsys):
    plan = json.loads(DEMO.read_text())
    plan["stages"] = [{**plan["stages"][0], "layers": [0, 8], "mesh": {"data": 1, "tensor": 1}}]
    plan.pop("predicted", None)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(plan))
    assert cli_main(["simulate", "--plan", str(path), "--json", "--all-schedules"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_fraction"] == 0.0 and out["simulated_bubble_fraction"] == 0.0
    assert all(s["bubble_fraction"] == 0.0 for s in out["schedules"].values())
