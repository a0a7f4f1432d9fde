"""The asynchronous checkpoint writer's costs kept off training: packed buffers reused save
after save, the commit in a thread of its own, the writer in the idle scheduling class where
no peer busy-waits. Each without changing what a checkpoint holds."""

import os
import sys
import threading

import numpy as np
import pytest

from h2jax.runtime import checkpoint as ckpt
from h2jax.runtime.train import Trainer

from tests.test_checkpoint import TWO, dataset, make_plan, train  # noqa: F401  (dataset: a fixture)


def test_pack_group_fills_the_array_it_is_given_when_the_length_fits():
    tree = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 5), np.int32)}
    fresh, layout = ckpt.pack_group(tree)
    reuse = np.full(fresh.shape, 7, np.uint8)  # stale bytes, padding included, must not survive
    packed, layout2 = ckpt.pack_group(tree, reuse=reuse)
    assert packed is reuse and layout2 == layout
    np.testing.assert_array_equal(packed, fresh)
    wrong = np.zeros(fresh.size + 64, np.uint8)
    other, _ = ckpt.pack_group(tree, reuse=wrong)
    assert other is not wrong and other.shape == fresh.shape


def test_a_sharded_array_packs_as_its_replica_0_shards_and_unpacks_whole():
    """Each shard of replica 0 is one piece (copied from its device buffer, no assembled
    copy of the array); a replicated array is one piece; unpack puts them back together."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    values = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    tree = {"split": jax.device_put(values, NamedSharding(mesh, P("tensor", None))),  # replicated over data
            "both": jax.device_put(values, NamedSharding(mesh, P("data", "tensor"))),
            "whole": jax.device_put(values, NamedSharding(mesh, P()))}
    for _ in range(2):  # the second time from the cached choice of shards
        boxes = {k: sorted(box for box, _ in ckpt._parts(x)) for k, x in tree.items()}
        assert boxes["split"] == [[[0, 4], [0, 6]], [[4, 8], [0, 6]]]
        assert boxes["both"] == [[[0, 4], [0, 3]], [[0, 4], [3, 6]], [[4, 8], [0, 3]], [[4, 8], [3, 6]]]
        assert boxes["whole"] == [[[0, 8], [0, 6]]]
        packed, layout = ckpt.pack_group(tree)
        for entry in layout:
            got = ckpt.unpack_leaf(entry["path"], values, [(layout, packed)], "test")
            np.testing.assert_array_equal(got, values)


def test_saving_every_step_reuses_the_packed_buffers_and_each_checkpoint_holds_its_step(dataset, tmp_path):  # noqa: F811
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    writer = ckpt.CheckpointWriter(tmp_path)
    params, buffers = {}, []
    for step in (1, 2, 3):
        train(trainer, dataset, step - 1, 1)
        params[step] = trainer.params_numpy()
        writer.save(step, trainer.executors, ckpt.checkpoint_meta(plan, step))
        writer.settle()
        buffers.append({g: id(b) for g, b in writer._buffers.items()})
    writer.close()
    assert buffers[0] and buffers[0] == buffers[1] == buffers[2]  # the same arrays every save
    for step in (2, 3):  # a later save's packing did not touch an earlier checkpoint
        fresh = Trainer(plan, emulate_time=False)
        ckpt.open_checkpoint(tmp_path, plan, step=step).restore_all(fresh.executors.values())
        got = fresh.params_numpy()
        for i in params[step]:
            for a, b in zip(_leaves(params[step][i]), _leaves(got[i])):
                np.testing.assert_array_equal(a, b)


def test_a_save_holds_the_state_without_a_copy_and_training_on_leaves_it_intact(dataset, tmp_path, monkeypatch):  # noqa: F811
    """The snapshot is the stages' own arrays (no device copy); the next update writes the new
    state elsewhere instead of donating them, so a write still reading them after training
    has moved on stores the state of the step it was taken at."""
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    train(trainer, dataset, 0, 1)
    before = trainer.params_numpy()
    live = {i: _leaves(ex.params) for i, ex in trainer.executors.items()}
    writer = ckpt.CheckpointWriter(tmp_path)
    release, taken, real = threading.Event(), [], ckpt.pack_group

    def held_pack(tree, *args, **kw):
        taken.append(tree)
        assert release.wait(60)
        return real(tree, *args, **kw)

    monkeypatch.setattr(ckpt, "pack_group", held_pack)
    writer.save(1, trainer.executors, ckpt.checkpoint_meta(plan, 1))
    train(trainer, dataset, 1, 2)  # two updates while the write waits
    release.set()
    assert writer.wait() == ckpt.step_dir(tmp_path, 1)
    writer.close()
    held = {id(x) for tree in taken for x in _leaves(tree["params"])}
    assert all(id(x) in held for leaves in live.values() for x in leaves)  # the very arrays, not copies
    assert all(not x.is_deleted() for leaves in live.values() for x in leaves)
    fresh = Trainer(plan, emulate_time=False)
    ckpt.open_checkpoint(tmp_path, plan, step=1).restore_all(fresh.executors.values())
    got, after = fresh.params_numpy(), trainer.params_numpy()
    for i in before:
        for a, b, c in zip(_leaves(before[i]), _leaves(got[i]), _leaves(after[i])):
            np.testing.assert_array_equal(a, b)
            assert not np.array_equal(a, c)  # training did move on


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_the_commit_runs_off_the_training_thread_and_its_failure_surfaces(dataset, tmp_path, monkeypatch):  # noqa: F811
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    train(trainer, dataset, 0, 1)
    writer = ckpt.CheckpointWriter(tmp_path)
    release, real = threading.Event(), ckpt._write_json

    def slow_meta(path, obj, **kw):
        if path.name == ckpt.META:
            assert release.wait(30)
        real(path, obj, **kw)

    monkeypatch.setattr(ckpt, "_write_json", slow_meta)
    writer.save(1, trainer.executors, ckpt.checkpoint_meta(plan, 1))
    assert writer.settle() == ckpt.step_dir(tmp_path, 1)  # returns while the commit waits
    assert ckpt.complete_steps(tmp_path) == []
    release.set()
    assert writer.wait() is None and ckpt.complete_steps(tmp_path) == [1]

    def failing(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_fsync_dir", failing)
    writer.save(2, trainer.executors, ckpt.checkpoint_meta(plan, 2))
    writer.settle()
    with pytest.raises(ckpt.CheckpointError, match=r"committing checkpoint .*step_000002 failed.*No space"):
        writer.wait()


def test_the_writer_runs_in_the_idle_class_in_one_process_only(monkeypatch):
    assert ckpt.LocalWorld.writer_idle_class is True
    assert ckpt.TransportWorld.writer_idle_class is False  # MPI ranks busy-wait on shared cores
    seen = []
    monkeypatch.setattr(ckpt, "_yield_cpu", seen.append)
    w = ckpt._ItemWrite.__new__(ckpt._ItemWrite)
    w.idle_class, w.rows, w.buffers, w.path = True, None, {}, None
    w.done = threading.Event()
    w._write({})  # fails at the write (no path): the priority was set first
    assert seen == [True]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread scheduling classes are Linux's")
def test_lower_thread_priority_puts_a_thread_in_the_idle_class():
    got = {}

    def run(idle):
        ckpt.lower_thread_priority(threading.get_native_id(), idle_class=idle)
        got[idle] = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    for idle in (False, True):
        t = threading.Thread(target=run, args=(idle,))
        t.start()
        t.join()
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert got[False] == (os.SCHED_OTHER, min(19, base + ckpt.BACKGROUND_NICENESS))
    assert got[True][0] == os.SCHED_IDLE
