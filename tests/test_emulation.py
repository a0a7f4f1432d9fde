"""Emulated chips: a mixed-emulated-chip plan equals the unpipelined reference; emulation
really waits; a stage over its chip's memory cap is refused before running."""

import time

import jax
import numpy as np
import pytest

from h2jax.cluster import backends_dir
from h2jax.config import ConfigError
from h2jax.data import TokenDataset
from h2jax.plan import plan_from_dict
from h2jax.runtime.stage import StageExecutor
from h2jax.runtime.train import Trainer, run

STEPS = 3


def mixed_plan(first_chip="emu-slow"):
    return plan_from_dict({
        # the shapes and optimizer of tests/test_pipeline.py: its compiled reference is reused
        "format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8, "micro_batch": 2,
        "optimizer": {"name": "adamw", "learning_rate": 0.01, "weight_decay": 0.1, "clip_norm": 0.3},
        "stages": [
            {"chip": first_chip, "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
            {"chip": "emu-mid", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4], "recompute": "selective"},
        ],
    })


@pytest.fixture(scope="module")
def trained(token_file):
    """Three emulated steps, each checked against its own chips' busy time."""
    plan = mixed_plan()
    trainer = Trainer(plan)
    dataset = TokenDataset(token_file, 16)
    losses, walls, busy = [], [], []
    for n in range(STEPS):
        for clock in trainer.clocks.values():
            clock.busy_s = 0.0
        t0 = time.perf_counter()
        losses.append(trainer.step(dataset.batch(n, plan.global_batch)).loss)
        walls.append(time.perf_counter() - t0)
        busy.append(max(c.busy_s for c in trainer.clocks.values()))
    return plan, trainer, losses, walls, busy


def test_mixed_emulated_plan_equals_unpipelined_reference(trained, token_file):
    plan, trainer, losses, _, _ = trained
    want = run(plan, STEPS, dataset=TokenDataset(token_file, 16), unpipelined=True)
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)
    assert len(set(np.round(losses, 6))) == STEPS  # the parameters moved


def test_emulation_waits_for_the_slowest_chip(trained):
    _, trainer, _, walls, busy = trained
    assert trainer.emulated == {"emu-slow": 16.0, "emu-mid": 8.0}
    assert {i: c.slowdown for i, c in trainer.clocks.items()} == {0: 16.0, 1: 8.0}
    for wall, chip_busy in zip(walls, busy):
        # A step cannot end before its busiest emulated chip has worked `slowdown` times the
        # host's measured compute: the stretch is real waiting.
        assert wall >= chip_busy > 0


def test_emulate_time_off_keeps_numerics(trained, token_file):
    plan, _, losses, _, _ = trained
    fast = run(plan, STEPS, dataset=TokenDataset(token_file, 16), emulate_time=False)
    assert fast.emulated == {} and fast.emulation_note == ""
    np.testing.assert_array_equal(fast.losses, losses)


@pytest.fixture
def capped_chip(tmp_path, monkeypatch):
    """Writes backends/emu-capped.toml with a given cap in bytes (a copy of the shipped chips)."""
    for f in backends_dir().glob("*.toml"):
        (tmp_path / f.name).write_text(f.read_text())
    monkeypatch.setenv("H2JAX_BACKENDS_DIR", str(tmp_path))
    template = (tmp_path / "emu-fast.toml").read_text()

    def write(cap_bytes: int) -> None:
        gib = cap_bytes / 2**30
        text = template.replace('name = "emu-fast"', 'name = "emu-capped"')
        text = text.replace("memory_gib = 0.0234375", f"memory_gib = {gib!r}")
        (tmp_path / "emu-capped.toml").write_text(text)

    return write


def test_stage_over_its_memory_cap_is_refused_before_running(trained, capped_chip):
    _, trainer, _, _, _ = trained
    need = trainer.executors[0].memory.needed_bytes
    mem = trainer.executors[0].memory
    assert need == mem.persistent_bytes + max(mem.in_flight * mem.per_micro_batch_bytes + mem.working_bytes,
                                               mem.update_bytes)
    assert mem.in_flight == 2 and mem.persistent_bytes > 0 and mem.per_micro_batch_bytes > 0
    devices = jax.devices()[:2]

    capped_chip(need - 1)
    with pytest.raises(ConfigError) as e:
        StageExecutor(mixed_plan("emu-capped"), 0, devices)
    assert (
        f"stages[0] (chip emu-capped, layers [0, 2], mesh data=2 tensor=1, recompute=none) needs "
        f"{need:,} bytes per device but chip emu-capped has {need - 1:,} bytes" in str(e.value)
    )
    assert not hasattr(e.value, "params")

    capped_chip(need)  # exactly enough fits
    ex = StageExecutor(mixed_plan("emu-capped"), 0, devices)
    assert ex.memory.needed_bytes == need


def test_stages_of_one_computation_share_a_program_identity(trained):
    """The runtime names a stage's programs by what makes them one computation: the same for
    two middle stages of one shape whatever layers they hold, different when anything that
    changes the program differs (the end stages' embedding and head, the layer count, the
    recompute policy, the mesh)."""
    _, trainer, _, _, _ = trained
    assert trainer.executors[0].program_identity != trainer.executors[1].program_identity
    assert set(trainer.executors[0]._programs.values()) >= {"forward", "forward_backward", "backward", "update"}

    def identity(stages, i):
        plan = plan_from_dict({"format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8,
                               "micro_batch": 2, "stages": stages})
        devices = jax.devices()[: stages[i]["mesh"]["data"]]
        return StageExecutor(plan, i, devices, check_memory=False).program_identity

    def stage(layers, recompute="none", data=1):
        return {"chip": "emu-mid", "mesh": {"data": data, "tensor": 1}, "layers": layers, "recompute": recompute}

    four = [stage([0, 1]), stage([1, 2]), stage([2, 3]), stage([3, 4])]
    assert identity(four, 1) == identity(four, 2)  # layers 1 and 2: one computation
    assert identity(four, 0) != identity(four, 1) != identity(four, 3)  # embedding, head
    assert identity([stage([0, 1]), stage([1, 3]), stage([3, 4])], 1) != identity(four, 1)  # two layers
    assert identity([*four[:2], stage([2, 3], "full"), four[3]], 2) != identity(four, 1)  # recompute
    assert identity([*four[:2], stage([2, 3], data=2), four[3]], 2) != identity(four, 1)  # the mesh
