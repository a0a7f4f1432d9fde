import copy
import json
import subprocess
import sys

import pytest

from h2jax.config import ConfigError
from h2jax.plan import PlanError, check_devices, load_plan, plan_from_dict, save_plan

BASE = {
    "format_version": 1,
    "model": "tiny",
    "seq_len": 16,
    "global_batch": 8,
    "micro_batch": 2,
    "schedule": "1f1b",
    "stages": [
        {"chip": "cpu", "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
        {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4]},
    ],
}


def plan_with(**changes):
    raw = copy.deepcopy(BASE)
    for key, value in changes.items():
        if key.startswith("stage1_"):
            raw["stages"][1][key.removeprefix("stage1_")] = value
        else:
            raw[key] = value
    return raw


def test_valid_plan_round_trips(tmp_path):
    plan = plan_from_dict(BASE)
    assert plan.n_micro == 4 and plan.n_devices == 4 and plan.stages[1].mesh.tensor == 2
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    assert json.loads((tmp_path / "p.json").read_text())["format_version"] == 1


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"stage1_layers": [1, 4]}, r"stages\[1\]\.layers \[1, 4\] overlaps the previous stage, which ends at layer 2; start this stage at 2"),
        ({"stage1_layers": [3, 4]}, r"stages\[1\]\.layers \[3, 4\] leaves layers \[2, 3\) uncovered"),
        ({"stage1_layers": [2, 3]}, r"stages cover layers \[0, 3\) but the model has 4 layers"),
        ({"stage1_layers": [2, 2]}, r"stages\[1\]\.layers \[2, 2\] must satisfy 0 <= start < end"),
        ({"global_batch": 7}, r"global_batch \(7\) is not divisible by micro_batch \(2\); choose a micro_batch among the divisors of 7"),
        ({"micro_batch": 1, "global_batch": 8}, r"micro_batch \(1\) is not divisible by stages\[0\]\.mesh\.data \(2\)"),
        ({"stage1_mesh": {"data": 1, "tensor": 8}}, r"stages\[1\]: model\.n_heads \(4\) is not divisible by mesh\.tensor \(8\)"),
        ({"stage1_mesh": {"data": 1, "tensor": 3}}, r"model\.n_heads \(4\) is not divisible by mesh\.tensor \(3\)"),
        ({"model": "llama-3b"}, r"model: unknown model preset 'llama-3b'; known presets: tiny, small"),
        ({"schedule": "interleaved"}, r"schedule 'interleaved' is unknown; use one of gpipe, 1f1b, interleaved-1f1b, zb-h1"),
        ({"format_version": 2}, r"format_version is 2 but this h2jax reads format_version 1"),
        ({"stage1_chip": "nvidia-b900"}, r"unknown chip type 'nvidia-b900'.*known chip types: .*cpu"),
        ({"stage1_recompute": "some"}, r"stages\[1\]\.recompute 'some' is unknown; use one of none, selective, full"),
        ({"stage1_devices": [0, 1, 2]}, r"stages\[1\]\.devices lists 3 device\(s\) but mesh data\*tensor = 2"),
        ({"seq_len": 0}, r"plan\.seq_len must be an integer >= 1, got 0"),
        ({"optimizer": {"name": "lion"}}, r"optimizer\.name 'lion' is unknown"),
        ({"optimizer": {"shard_over_data": "yes"}}, r"optimizer\.shard_over_data must be true or false"),
        ({"stages": []}, r"stages must be a non-empty list"),
    ],
)
def test_validation_errors_name_the_field_and_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        plan_from_dict(plan_with(**changes))


def test_ffn_not_divisible_by_tensor():
    raw = plan_with(model={"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4,
                           "n_kv_heads": 4, "d_ff": 129})
    with pytest.raises(ConfigError, match=r"model\.d_ff \(129\) is not divisible by mesh\.tensor \(2\)"):
        plan_from_dict(raw)


def test_overlapping_devices():
    raw = plan_with()
    raw["stages"][0]["devices"] = [0, 1]
    raw["stages"][1]["devices"] = [1, 2]
    with pytest.raises(PlanError, match=r"stages\[1\]\.devices uses device 1, already used by stages\[0\]"):
        plan_from_dict(raw)


def test_more_devices_than_exist():
    plan = plan_from_dict(BASE)
    with pytest.raises(PlanError, match=r"need 4 devices .* but only 3 cpu device\(s\) exist"):
        check_devices(plan, 3)


def test_cli_reports_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan_with(global_batch=7)))
    proc = subprocess.run([sys.executable, "-m", "h2jax", "run", "--plan", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "h2jax run: error: global_batch (7) is not divisible by micro_batch (2); "
        "choose a micro_batch among the divisors of 7"
    ]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(tmp_path / "x.json")
