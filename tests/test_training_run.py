"""Real training runs: a prepared BPE dataset, a cosine schedule with warm-up, evaluation on the
validation split, metrics in JSONL and TensorBoard; the public Trainer (step, evaluate,
parameters by name, save/restore with the data position); each bad input's error."""

import dataclasses
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from h2jax.config import ConfigError
from h2jax.data import DataError, PreparedDataset, TokenDataset, prepare
from h2jax.plan import plan_from_dict
from tests.test_train_settings import read_tensorboard

STEPS, PEAK, WARMUP = 5, 3e-3, 1
TINY_512 = {"vocab_size": 512, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}


def make_plan(model=TINY_512, **train):
    return plan_from_dict({
        "format_version": 1, "model": model, "seq_len": 16, "global_batch": 8, "micro_batch": 4,
        "schedule": "1f1b", "seed": 0, "optimizer": {"name": "adamw", "learning_rate": PEAK},
        "train": {"lr_schedule": "cosine", "warmup_steps": WARMUP, "eval_every": 2, "eval_batches": 2, **train},
        "stages": [
            {"chip": "cpu", "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
            {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4], "recompute": "full"},
        ],
    })


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [str(root / f) for f in ("textwrap.py", "string.py", "json/decoder.py", "json/encoder.py")]
    out = tmp_path_factory.mktemp("bpe") / "ds"
    prepare(files, "train-bpe:512", out, val_fraction=0.1)
    return out


def cosine(n, total=STEPS, warmup=WARMUP, peak=PEAK, end=0.1 * PEAK):
    if n < warmup:
        return peak * n / warmup
    t = (n - warmup) / (total - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


@pytest.fixture(scope="module")
def logged_run(bpe_data, tmp_path_factory):
    from h2jax.runtime.train import run

    log_dir = tmp_path_factory.mktemp("logs")
    dataset = PreparedDataset(bpe_data, 16, seed=0)
    result = run(make_plan(), STEPS, dataset=dataset, log_dir=str(log_dir))
    return result, log_dir, dataset


def test_run_writes_the_expected_series_to_jsonl_and_tensorboard(logged_run):
    result, log_dir, _ = logged_run
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in train] == result.losses
    assert [r["step"] for r in evals] == [2, 4, 5]  # every 2 steps and after the last
    assert [(r["step"], r["eval_loss"]) for r in evals] == result.eval_losses
    for r in evals:
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
        assert 5.0 < r["eval_loss"] < math.log(512) + 0.5  # near uniform over 512 ids after 5 steps
    for n, r in enumerate(train):
        assert r["learning_rate"] == pytest.approx(cosine(n), rel=1e-5, abs=1e-12)
        assert r["grad_norm"] > 0 and math.isfinite(r["grad_norm"])
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_time_s"])
        assert r["tokens_per_chip_per_s"] == pytest.approx(r["tokens_per_s"] / 4)
        assert r["mfu"] > 0 and r["tokens_seen"] == (n + 1) * 8 * 16
        assert len(r["stage_busy_fraction"]) == 2 and all(0 <= b <= 1 for b in r["stage_busy_fraction"])
        assert [a + b for a, b in zip(r["stage_busy_fraction"], r["stage_idle_fraction"])] == pytest.approx([1, 1])
        assert all(m > 0 for m in r["stage_memory_bytes"])
    assert train[0]["learning_rate"] == 0.0  # warm-up starts from zero
    tb = read_tensorboard(log_dir)
    assert [s for s, _ in tb["loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in tb["loss"]] == pytest.approx(result.losses, rel=1e-6)
    assert [s for s, _ in tb["eval_loss"]] == [2, 4, 5]
    assert [s for s, _ in tb["learning_rate"]] == [1, 2, 3, 4, 5]
    assert {"stage_busy_fraction/0", "stage_busy_fraction/1", "stage_memory_bytes/1", "mfu"} <= set(tb)
    run_info = json.loads((log_dir / "run.json").read_text())
    assert run_info["tokenizer"]["spec"] == "train-bpe:512" and run_info["plan"]["train"]["lr_schedule"] == "cosine"


def test_pipelined_evaluation_matches_the_unpipelined_reference(logged_run):
    from h2jax.runtime.train import run

    result, _, dataset = logged_run
    ref = run(make_plan(), STEPS, dataset=dataset, unpipelined=True)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose([v for _, v in result.eval_losses], [v for _, v in ref.eval_losses], rtol=1e-5)
    assert ref.learning_rates == result.learning_rates


def test_plot_of_the_run(logged_run):
    from h2jax.cli.plot import plot_run

    png = plot_run(logged_run[1])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_trainer_step_evaluate_parameters_save_restore(bpe_data, tmp_path):
    import h2jax

    plan = make_plan(eval_every=0)
    ds = PreparedDataset(bpe_data, 16, seed=0)
    a = h2jax.Trainer(plan, steps=4)
    assert a.needs_tokens
    before = a.evaluate(ds.batch(0, 8))
    m = a.step(ds.batch(0, 8))
    assert m.step == 1 and m.loss == pytest.approx(before, rel=1e-5)  # same parameters, same batch
    assert m.learning_rate == 0.0 and m.grad_norm > 0 and m.step_time_s > 0
    assert a.evaluate(ds.batch(0, 8)) == pytest.approx(before, rel=1e-6)  # a warm-up step at lr 0
    assert a.step(ds.batch(1, 8)).learning_rate == pytest.approx(cosine(1, total=4))
    layer = a.parameters("layer_002")
    assert layer and all(k.startswith("layer_002/") for k in layer)
    every = a.parameters(all_stages=True)
    assert every["embed/table_VD"].shape == (512, 64) and every["head/w_DV"].shape == (64, 512)
    assert {k.split("/")[0] for k in every} == {"embed", "layer_000", "layer_001", "layer_002", "layer_003", "head"}
    a.save(tmp_path / "ckpt", dataset=ds)
    uninterrupted = [a.step(ds.batch(n, 8)).loss for n in (2, 3)]

    b = h2jax.Trainer(plan, steps=4)
    b.restore(tmp_path / "ckpt", dataset=ds)
    assert b.step_count == 2
    resumed = [b.step(ds.batch(n, 8)) for n in range(b.step_count, 4)]
    assert [m.loss for m in resumed] == pytest.approx(uninterrupted, rel=1e-6)
    assert [m.step for m in resumed] == [3, 4]
    assert resumed[0].learning_rate == pytest.approx(cosine(2, total=4))

    prepare([str(Path(sysconfig.get_paths()["stdlib"]) / "string.py")], "bytes", tmp_path / "bytes", val_fraction=0.1)
    with pytest.raises(DataError, match="differs from the checkpoint's"):
        b.restore(tmp_path / "ckpt", dataset=PreparedDataset(tmp_path / "bytes", 16))
    a.close()
    b.close()


def test_bad_inputs_are_refused_before_any_compile(bpe_data, token_file):
    from h2jax.runtime.train import run

    tiny = make_plan(model="tiny", eval_every=0)
    with pytest.raises(DataError, match=r"vocabulary \(512 tokens\) is larger than the model's vocab_size \(256\)"):
        run(tiny, 2, dataset=PreparedDataset(bpe_data, 16))
    with pytest.raises(ConfigError, match=r"train.eval_every \(2\) evaluates on a validation split"):
        run(make_plan(model="tiny"), 2, dataset=TokenDataset(token_file, 16))
    with pytest.raises(ConfigError, match=r"train.warmup_steps \(1\) must be less than the schedule's length \(1 steps"):
        run(make_plan(eval_every=0), 1, dataset=PreparedDataset(bpe_data, 16))


def test_cli_flags_override_the_train_section():
    import argparse

    from h2jax.cli.run import with_overrides

    plan = make_plan()
    args = argparse.Namespace(lr_schedule="linear", warmup_steps=None, decay_steps=50, final_lr_fraction=None,
                              eval_every=0, eval_batches=None, log_every=10, learning_rate=1e-2)
    new = with_overrides(plan, args)
    assert new.train == dataclasses.replace(plan.train, lr_schedule="linear", decay_steps=50, eval_every=0, log_every=10)
    assert new.optimizer.learning_rate == 1e-2
    args.log_every = 0
    with pytest.raises(ConfigError, match="train.log_every must be an integer >= 1"):
        with_overrides(plan, args)


@pytest.mark.slow
def test_train_on_your_text_example_end_to_end(tmp_path):
    """The example's three steps on a small folder: dataset, trained model, metrics, plot."""
    import os
    import subprocess
    import sys

    from tests.conftest import TEST_XLA_FLAGS, checkout_env

    texts = tmp_path / "texts"
    texts.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "json/decoder.py"):
        (texts / name.replace("/", "_")).write_text((stdlib / name).read_text())
    env = checkout_env({**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS})
    env.pop("JAX_PLATFORMS", None)
    example = Path(__file__).resolve().parent.parent / "examples" / "train_on_your_text.py"
    proc = subprocess.run([sys.executable, str(example), str(texts), "--out", str(tmp_path / "run"),
                           "--steps", "6", "--vocab", "400"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [5, 6]  # log_every 5, and the last step
    assert [r["step"] for r in records if "eval_loss" in r] == [6]
    assert (tmp_path / "run" / "logs" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["tokenizer"]["vocab_size"] == 400


def test_the_loop_reads_no_tokens_on_a_process_whose_stages_need_none():
    """A middle stage's process (needs_tokens false) never asks the dataset for a batch, while
    evaluating and logging on the same steps as every other process."""
    from h2jax.runtime.train import StepMetrics, train

    class NoReads:
        def batch(self, *a):
            raise AssertionError("read a training batch")

        def val_batch(self, *a):
            raise AssertionError("read a validation batch")

    class MiddleStage:
        needs_tokens = False
        calls: list = []

        def step(self, tokens):
            self.calls.append(("step", tokens))
            return StepMetrics(len(self.calls), 1.0, 0.5, 0.01, 1e-3)

        def evaluate(self, tokens):
            self.calls.append(("eval", tokens))
            return 2.0

    learner = MiddleStage()
    logged = []
    losses, _, _, _, evals = train(learner, make_plan(eval_every=2, eval_batches=3), NoReads(), 4,
                                   stage_figures=lambda t: logged.append(t) or {})
    assert [kind for kind, _ in learner.calls] == ["step", "step"] + ["eval"] * 3 + ["step", "step"] + ["eval"] * 3
    assert all(tokens is None for _, tokens in learner.calls)
    assert losses == [1.0] * 4 and evals == [(2, 2.0), (4, 2.0)] and len(logged) == 4
