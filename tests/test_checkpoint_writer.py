"""The asynchronous checkpoint writer's costs kept off training: arrays written from their
buffers, the commit in a thread of its own, the writer in the idle scheduling class where
no peer busy-waits. Each without changing what a checkpoint holds."""

import os
import sys
import threading

import numpy as np
import pytest

from h2jax.runtime import checkpoint as ckpt
from h2jax.runtime.train import Trainer

from tests.test_checkpoint import TWO, dataset, make_plan, train  # noqa: F401  (dataset: a fixture)


def _read_back(path, layout, spans):
    """{group: [(layout, its bytes)]} as a reader gets them from one process's file."""
    data = np.fromfile(path, np.uint8)
    return {g: [(layout[g], data[start:start + length])] for g, (start, length) in spans.items()}


def test_a_sharded_array_is_written_as_its_replica_0_shards_and_read_back_whole(tmp_path):
    """Each shard of replica 0 is one piece (written from its device buffer, no assembled
    copy of the array); a replicated array is one piece; the reader puts them back together.
    The file's recorded size and CRC-32C are its bytes'; every piece is ALIGN-aligned."""
    import crc32c
    import jax
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    values = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    odd = np.arange(7, dtype=ml_dtypes.bfloat16)  # 14 bytes: the next piece starts after padding
    snapshot = {
        "g0": {"split": jax.device_put(values, NamedSharding(mesh, P("tensor", None))),  # replicated over data
               "both": jax.device_put(values, NamedSharding(mesh, P("data", "tensor")))},
        "g1": {"odd": jax.device_put(odd, jax.devices()[5]), "whole": jax.device_put(values, NamedSharding(mesh, P())),
               "count": np.int32(3), "none": np.zeros((0, 4), np.float32)},
    }
    boxes = {k: sorted(box for box, _ in ckpt._parts(x)) for k, x in snapshot["g0"].items()}
    assert boxes["split"] == [[[0, 4], [0, 6]], [[4, 8], [0, 6]]]
    assert boxes["both"] == [[[0, 4], [0, 3]], [[0, 4], [3, 6]], [[4, 8], [0, 3]], [[4, 8], [3, 6]]]
    for round in range(2):  # the second time from the cached layouts, with other values
        shift = np.float32(100 * round)
        if round:
            snapshot = jax.tree.map(lambda x: x + shift.astype(x.dtype) if np.size(x) else x, snapshot)
        path = tmp_path / f"p{round}.bin"
        layout, spans, (size, crc) = ckpt.write_data_file(path, snapshot)
        written = path.read_bytes()
        assert size == len(written) and crc == crc32c.crc32c(written)
        assert all(offset % ckpt.ALIGN == 0 for g in layout for e in layout[g] for _, offset in e["pieces"])
        assert [len(e["pieces"]) for e in layout["g0"]] == [4, 2]  # both, split (the tree's leaf order)
        found = _read_back(path, layout, spans)
        for g, tree in snapshot.items():
            for name, x in tree.items():
                got = ckpt.unpack_leaf(name, x, found[g], "test")
                np.testing.assert_array_equal(got, np.asarray(x))
                assert got.dtype == np.asarray(x).dtype


@pytest.mark.parametrize("chunk", [8192, 1 << 20])
def test_the_direct_and_the_plain_write_give_the_same_file(tmp_path, monkeypatch, chunk):
    """Staged once, then written through O_DIRECT in chunks (the last block's padding cut off)
    or, where the file system refuses O_DIRECT, plainly: the same bytes and checksum. The
    staging buffer is kept for the next save and reused."""
    import crc32c

    rng = np.random.default_rng(0)
    snapshot = {f"g{k}": {"w": rng.standard_normal((37, 53 + k)).astype(np.float32),
                          "b": rng.standard_normal(11).astype(np.float16)} for k in range(5)}
    monkeypatch.setattr(ckpt, "DIRECT_CHUNK", chunk)
    monkeypatch.setattr(ckpt, "_STAGING", [])
    direct_calls = []
    real = ckpt._write_direct
    monkeypatch.setattr(ckpt, "_write_direct", lambda *a: direct_calls.append(real(*a)) or direct_calls[-1])
    direct = ckpt.write_data_file(tmp_path / "direct.bin", snapshot)
    monkeypatch.setattr(ckpt, "_write_direct", lambda *a: False)  # a file system without O_DIRECT
    plain = ckpt.write_data_file(tmp_path / "plain.bin", snapshot)
    assert direct == plain
    data = (tmp_path / "direct.bin").read_bytes()
    assert data == (tmp_path / "plain.bin").read_bytes()
    assert plain[2] == [len(data), crc32c.crc32c(data)] and len(data) % ckpt.DIRECT_BLOCK != 0
    assert len(ckpt._STAGING) == 1 and len(ckpt._STAGING[0]) == -(-len(data) // ckpt.DIRECT_BLOCK) * ckpt.DIRECT_BLOCK
    if not direct_calls[0]:
        pytest.skip("no O_DIRECT here (platform or file system): only the plain write ran")


def test_the_write_copies_every_array_before_it_releases_them_and_touches_the_disk(tmp_path, monkeypatch):
    """`copied` is set after the last array is read and before the first byte is written: the
    stages may overwrite their state while the disk write is still going on."""
    rng = np.random.default_rng(1)
    snapshot = {f"g{k}": {"w": rng.standard_normal((64, 33)).astype(np.float32)} for k in range(4)}
    copied, order = threading.Event(), []
    real_view, real_write = ckpt._host_view, ckpt._write_all
    monkeypatch.setattr(ckpt, "_host_view", lambda x: order.append(("read", copied.is_set())) or real_view(x))
    monkeypatch.setattr(ckpt, "_write_all", lambda fd, d: order.append(("write", copied.is_set())) or real_write(fd, d))
    ckpt.write_data_file(tmp_path / "p0.bin", snapshot, copied=copied)
    reads = [i for i, (what, _) in enumerate(order) if what == "read"]
    writes = [i for i, (what, _) in enumerate(order) if what == "write"]
    assert len(reads) == 4 and writes and max(reads) < min(writes)
    assert not any(set_ for what, set_ in order if what == "read")
    assert all(set_ for what, set_ in order if what == "write")


def test_a_failed_copy_never_releases_the_state(tmp_path, monkeypatch):
    copied = threading.Event()

    def broken(x):
        raise OSError("device lost")

    monkeypatch.setattr(ckpt, "_host_view", broken)
    with pytest.raises(OSError, match="device lost"):
        ckpt.write_data_file(tmp_path / "p0.bin", {"g": {"w": np.ones(3, np.float32)}}, copied=copied)
    assert not copied.is_set()


def test_a_damaged_piece_of_a_written_file_is_read_as_what_it_holds_not_silently_fixed(tmp_path):
    """The layout is what the reader trusts: a piece past the end of the bytes it is given
    is an error naming the file, not a short array."""
    tree = {"a": np.arange(10, dtype=np.float32)}
    layout, spans, _ = ckpt.write_data_file(tmp_path / "p0.bin", {"g": tree})
    data = np.fromfile(tmp_path / "p0.bin", np.uint8)[:20]  # truncated
    with pytest.raises(ckpt.CheckpointError, match=r"where: a lies past the end of its packed bytes"):
        ckpt.unpack_leaf("a", tree["a"], [(layout["g"], data)], "where")


def test_saving_every_step_each_checkpoint_holds_its_step(dataset, tmp_path, monkeypatch):  # noqa: F811
    """Each save lays its groups out from the layouts cached at the first: the values are
    each step's own. Every save is written by one thread the writer keeps (the training
    thread starts none), which `close` ends."""
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    writer = ckpt.CheckpointWriter(tmp_path)
    threads, real_write = set(), ckpt.write_data_file
    monkeypatch.setattr(ckpt, "write_data_file", lambda *a, **kw: threads.add(threading.get_ident()) or real_write(*a, **kw))
    params = {}
    for step in (1, 2, 3):
        train(trainer, dataset, step - 1, 1)
        params[step] = trainer.params_numpy()
        writer.save(step, trainer.executors, ckpt.checkpoint_meta(plan, step))
        writer.settle()
    writer_thread = writer._writer._thread
    assert writer_thread.name == "h2jax-ckpt-write"
    assert threads == {writer_thread.ident} != {threading.get_ident()}
    writer.close()
    assert not writer_thread.is_alive()
    for step in (1, 2, 3):
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
    release, taken, real = threading.Event(), [], ckpt.write_data_file

    def held_write(path, snapshot, copied):
        taken.extend(snapshot.values())
        assert release.wait(60)
        return real(path, snapshot, copied=copied)

    monkeypatch.setattr(ckpt, "write_data_file", held_write)
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


def test_once_the_write_has_copied_the_state_the_next_update_overwrites_it_in_place(dataset, tmp_path):  # noqa: F811
    """The update after a save donates the state as usual once the writer has copied it (here
    the write has finished): the snapshot's arrays are the update's to overwrite, and the
    checkpoint still holds the state of the step it was taken at."""
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    train(trainer, dataset, 0, 1)
    # Copies: a numpy view of a buffer (params_numpy's) would keep it from being donated.
    before = {i: [np.array(x) for x in _leaves(tree)] for i, tree in trainer.params_numpy().items()}
    live = [x for ex in trainer.executors.values() for x in _leaves((ex.params, ex.opt_state))]
    writer = ckpt.CheckpointWriter(tmp_path)
    writer.save(1, trainer.executors, ckpt.checkpoint_meta(plan, 1))
    writer.settle(background=False)  # written: copied long before
    train(trainer, dataset, 1, 1)
    assert all(x.is_deleted() for x in live if x.size)  # donated to the update, not copied
    writer.close()
    fresh = Trainer(plan, emulate_time=False)
    ckpt.open_checkpoint(tmp_path, plan, step=1).restore_all(fresh.executors.values())
    got = fresh.params_numpy()
    for i in before:
        for a, b in zip(before[i], _leaves(got[i])):
            np.testing.assert_array_equal(a, b)


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
    monkeypatch.setattr(ckpt, "lower_thread_priority", lambda tid, idle_class: seen.append(
        (tid == threading.get_native_id(), threading.current_thread().name, idle_class)))
    for idle in (True, False):  # the thread lowers its own priority before its first job
        ckpt._Worker("h2jax-ckpt-write", lower=True, idle_class=idle).stop()
    ckpt._Worker("h2jax-ckpt-commit").stop()  # the commits' thread keeps its priority
    assert seen == [(True, "h2jax-ckpt-write", True), (True, "h2jax-ckpt-write", False)]


def test_an_exiting_interpreter_finishes_the_commit_in_flight_first(tmp_path):
    """The commit thread is a daemon the writer keeps; an interpreter that exits while it has
    a commit to run (given, not yet run) runs it first. It does not wait for a write: a job
    given to a worker without finish_at_exit (here one that would never end) is dropped."""
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import pathlib, threading, time
        from h2jax.runtime import checkpoint as ckpt
        def commit():
            time.sleep(0.5)
            pathlib.Path({str(tmp_path)!r}, "committed").write_text("done")
        ckpt._Worker("write", lower=True).submit(threading.Event().wait)
        ckpt._Worker("commit", finish_at_exit=True).submit(commit)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert (tmp_path / "committed").read_text() == "done"


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


def test_group_trees_names_each_leaf_as_its_path_says_on_every_save():
    """group_trees places optimizer-state leaves from a table made once per structure: what it
    gives equals naming every leaf's path (`_opt_location`), on the first save and on later
    ones with other values, and a stage of other groups gets a table of its own."""
    import jax
    import optax

    def naming_each_path(params, opt_state):
        groups, out, shared = set(params), {g: {"params": params[g]} for g in params}, {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            group, keys = ckpt._opt_location(path, groups)
            if group is None:
                shared[keys[1]] = leaf
            else:
                ckpt._set(out[group], keys, leaf)
        for g in out:
            out[g]["opt_shared"] = dict(shared)
        return out

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    for groups in (("layer_000", "layer_001"), ("embed", "layer_002")):
        for value in (1.0, 2.0):
            params = {g: {"w": np.full((2, 3), value, np.float32), "b": np.full(3, -value, np.float32)} for g in groups}
            opt_state = jax.tree.map(lambda x: x + value, tx.init(params))
            got, want = ckpt.group_trees(params, opt_state), naming_each_path(params, opt_state)
            assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert a is b
            assert set(got) == set(groups) and "opt" in got[groups[0]] and "opt_shared" in got[groups[0]]
