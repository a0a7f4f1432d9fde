"""Checkpoints written before format 3 (format 2: one orbax item per writing unit, a packed
byte array per group) still resume. `tests/data/checkpoint-format2` was written by the code of
2026-12-03 (1132770): the model below under the two-stage plan TWO, one AdamW step on the batch
below."""

from pathlib import Path

import jax
import numpy as np
import pytest

from h2jax.runtime import checkpoint as ckpt
from h2jax.runtime.train import Trainer

from tests.test_checkpoint import THREE, TWO, make_plan

WRITTEN = Path(__file__).resolve().parent / "data" / "checkpoint-format2"
MODEL = {"vocab_size": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "n_kv_heads": 2, "d_ff": 32}


def _batch():
    return np.random.default_rng(0).integers(0, 32, (8, 17)).astype(np.int32)


def _state(trainer):
    return {i: jax.tree.map(np.asarray, (ex.params, ex.opt_state)) for i, ex in trainer.executors.items()}


@pytest.mark.parametrize("stages", [TWO, THREE], ids=["same-plan", "another-plan"])
def test_a_format_2_checkpoint_resumes(stages):
    plan = make_plan(stages, model=MODEL)
    checkpoint = ckpt.open_checkpoint(WRITTEN, plan)  # every file's size and CRC checked
    assert checkpoint.meta["format"] == 2 and checkpoint.step == 1
    resumed = Trainer(plan, emulate_time=False)
    checkpoint.restore_all(resumed.executors.values())
    # The same step taken now, on the plan that wrote it, gives the state the file holds.
    straight = Trainer(make_plan(TWO, model=MODEL), emulate_time=False)
    straight.step(_batch())
    want, got = straight.params_numpy(), resumed.params_numpy()
    flat = lambda params: {k: v for i in sorted(params) for k, v in jax.tree_util.tree_flatten_with_path(params[i])[0]}  # noqa: E731
    want, got = flat(want), flat(got)
    assert set(want) == set(got)
    # Retaking the step here need not repeat its last bits (another host's XLA; here ~1e-6),
    # far below what the step moved every parameter by (AdamW's first step: ~lr = 0.01).
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-5, err_msg=str(k))
    if stages is TWO:  # the optimizer's moments too (the second ~1e-8: relative), stage by stage
        for (i, a), (_, b) in zip(sorted(_state(straight).items()), sorted(_state(resumed).items())):
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(y, x, rtol=2e-3, atol=1e-12)


def test_a_format_2_checkpoint_with_a_damaged_file_is_refused(tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(WRITTEN, copy)
    item = ckpt.step_dir(copy, 1) / "layers_000-003"
    largest = max((p for p in item.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=f"{largest}: corrupted"):
        ckpt.open_checkpoint(copy, make_plan(TWO, model=MODEL))
