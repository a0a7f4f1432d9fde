"""The plan's `train` section, learning-rate schedules, the metrics writer and `h2jax plot`."""

import json
import math
import struct

import pytest

from h2jax.plan import Optimizer, PlanError, Train, load_plan, parse_train, plan_from_dict
from h2jax.runtime.optim import learning_rate_at, learning_rate_schedule


def read_tensorboard(log_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the TFRecord event files under `log_dir` (read with the
    record framing and the Event protobuf, not with the writer's code)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_train_section_round_trips_and_defaults_stay_out_of_the_file():
    raw = json.loads(open("plans/demo.json").read())
    assert load_plan("plans/demo.json").train == Train()
    assert "train" not in load_plan("plans/demo.json").to_dict()
    raw["train"] = {"lr_schedule": "cosine", "warmup_steps": 5, "eval_every": 10, "log_every": 2}
    plan = plan_from_dict(raw)
    assert plan.train == Train(lr_schedule="cosine", warmup_steps=5, eval_every=10, log_every=2)
    assert plan_from_dict(plan.to_dict()).train == plan.train


@pytest.mark.parametrize("raw, message", [
    ({"lr_schedule": "step"}, r"train.lr_schedule 'step' is unknown; use one of constant, linear, cosine"),
    ({"warmup": 3}, r"train: unknown field\(s\) \['warmup'\]"),
    ({"warmup_steps": -1}, r"train.warmup_steps must be an integer >= 0"),
    ({"eval_every": 1.5}, r"train.eval_every must be an integer >= 0"),
    ({"log_every": 0}, r"train.log_every must be an integer >= 1"),
    ({"decay_steps": 0}, r"train.decay_steps must be an integer >= 1"),
    ({"final_lr_fraction": 2}, r"train.final_lr_fraction must be in \[0, 1\]"),
    ("cosine", r"train must be an object"),
])
def test_bad_train_sections_name_the_field(raw, message):
    with pytest.raises(PlanError, match=message):
        parse_train(raw)


def test_cosine_schedule_matches_its_formula():
    peak, warm, horizon, frac = 3e-3, 4, 20, 0.1
    s = learning_rate_schedule(Optimizer(learning_rate=peak),
                               Train(lr_schedule="cosine", warmup_steps=warm, final_lr_fraction=frac), steps=horizon)
    for n in range(horizon + 3):
        if n < warm:
            want = peak * n / warm
        else:
            t = min(n - warm, horizon - warm) / (horizon - warm)
            want = peak * frac + (peak - peak * frac) * 0.5 * (1 + math.cos(math.pi * t))
        assert learning_rate_at(s, n) == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_linear_and_constant_schedules():
    opt = Optimizer(learning_rate=1.0)
    lin = learning_rate_schedule(opt, Train(lr_schedule="linear", decay_steps=10, final_lr_fraction=0.0), steps=99)
    assert [round(learning_rate_at(lin, n), 6) for n in (0, 5, 10, 12)] == [1.0, 0.5, 0.0, 0.0]
    warm = learning_rate_schedule(opt, Train(warmup_steps=4), steps=10)
    assert [learning_rate_at(warm, n) for n in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    # constant without warm-up stays a float: the optimizer is exactly what it was before schedules
    assert learning_rate_schedule(opt, Train(), steps=10) == 1.0


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(PlanError, match=r"train.warmup_steps \(10\) must be less than the schedule's length \(10 steps"):
        learning_rate_schedule(Optimizer(), Train(lr_schedule="cosine", warmup_steps=10), steps=10)


def test_metrics_writer_writes_jsonl_and_tensorboard(tmp_path):
    from h2jax.metrics import METRICS_FILE, MetricsWriter, read_metrics, series

    with MetricsWriter(tmp_path, {"plan": "x"}) as w:
        for step in range(3):
            w.write(step, {"loss": 5.0 - step, "learning_rate": 0.1 * step, "mfu": None,
                           "stage_busy_fraction": [0.5, 0.25 + step / 10]})
        w.write(2, {"eval_loss": 4.5, "eval_perplexity": math.exp(4.5)})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 0, "loss": 5.0, "learning_rate": 0.0, "stage_busy_fraction": [0.5, 0.25]}
    assert series(read_metrics(tmp_path), "eval_loss") == ([2], [4.5])
    tb = read_tensorboard(tmp_path)
    assert tb["loss"] == [(0, 5.0), (1, 4.0), (2, 3.0)]
    assert [round(v, 6) for _, v in tb["stage_busy_fraction/1"]] == [0.25, 0.35, 0.45]
    assert tb["eval_loss"] == [(2, 4.5)] and "mfu" not in tb
    assert json.loads((tmp_path / "run.json").read_text()) == {"plan": "x"}


def test_plot_draws_a_png_and_refuses_a_dir_without_metrics(tmp_path, capsys):
    from h2jax.cli import main
    from h2jax.metrics import MetricsWriter

    with MetricsWriter(tmp_path / "run") as w:
        for step in range(5):
            w.write(step, {"loss": 3.0 / (step + 1), "tokens_per_s": 100.0 + step, "tokens_per_chip_per_s": 10.0})
        w.write(4, {"eval_loss": 1.0})
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = (tmp_path / "run" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
