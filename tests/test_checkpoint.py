"""Checkpoints: resume bit-exact on the same plan, within f32 tolerance on another plan, never
from a half-written or foreign checkpoint."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from h2jax.data import TokenDataset
from h2jax.plan import plan_from_dict
from h2jax.runtime import checkpoint as ckpt
from h2jax.runtime.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16
ADAMW = {"name": "adamw", "learning_rate": 0.01, "weight_decay": 0.1, "clip_norm": 0.3}


def stage(chip, data, tensor, layers, recompute="none"):
    return {"chip": chip, "mesh": {"data": data, "tensor": tensor}, "layers": layers, "recompute": recompute}


def make_plan(stages, schedule="1f1b", model="tiny", **extra):
    return plan_from_dict({
        "format_version": 1, "model": model, "seq_len": SEQ, "global_batch": 8, "micro_batch": 2,
        "schedule": schedule, "seed": 0, "stages": stages, "optimizer": ADAMW, **extra,
    })


# Written under two stages (ZeRO-1 over data=2 on the first)...
TWO = [stage("cpu", 2, 1, [0, 2]), stage("cpu", 1, 2, [2, 4])]
# ... read under three, other meshes, emulated chip types, the other schedule.
THREE = [stage("emu-fast", 1, 2, [0, 1]), stage("emu-mid", 2, 1, [1, 3], "selective"),
         stage("cpu", 2, 2, [3, 4])]


def train(trainer, dataset, start, n):
    return [trainer.step(dataset.batch(k, trainer.plan.global_batch)).loss for k in range(start, start + n)]


def save(trainer, directory, step, keep=None):
    writer = ckpt.CheckpointWriter(directory, keep=keep)
    writer.save(step, trainer.executors, ckpt.checkpoint_meta(trainer.plan, step))
    return writer.wait()


@pytest.fixture(scope="module")
def dataset(token_file):
    return TokenDataset(token_file, SEQ)


@pytest.fixture(scope="module")
def straight(dataset):
    trainer = Trainer(make_plan(TWO), emulate_time=False)
    return train(trainer, dataset, 0, 6), trainer.params_numpy()


@pytest.fixture(scope="module")
def saved(dataset, tmp_path_factory):
    """3 steps under TWO, saved at step 3; the writer's trainer."""
    directory = tmp_path_factory.mktemp("ckpt")
    trainer = Trainer(make_plan(TWO), emulate_time=False)
    losses = train(trainer, dataset, 0, 3)
    path = save(trainer, directory, 3)
    return directory, path, losses


def test_same_plan_resume_is_bit_identical(straight, saved, dataset):
    directory, path, first = saved
    assert path == ckpt.step_dir(directory, 3) and (path / ckpt.META).is_file()
    plan = make_plan(TWO)
    checkpoint = ckpt.open_checkpoint(directory, plan)
    assert checkpoint.step == 3
    trainer = Trainer(plan, emulate_time=False)
    for ex in trainer.executors.values():
        checkpoint.restore(ex)
    losses = first + train(trainer, dataset, checkpoint.meta["data"]["position"], 3)
    want_losses, want_params = straight
    np.testing.assert_array_equal(losses, want_losses)
    got = trainer.params_numpy()
    assert got.keys() == want_params.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want_params[k], err_msg=k)


def test_other_plan_resumes_within_f32_tolerance(straight, saved, dataset):
    directory, _, first = saved
    plan = make_plan(THREE, schedule="gpipe")
    checkpoint = ckpt.open_checkpoint(directory, plan)
    trainer = Trainer(plan, emulate_time=False)
    for ex in trainer.executors.values():
        checkpoint.restore(ex)
    # The optimizer moments now lie split over the new stages' data axes (ZeRO-1).
    mu = trainer.executors[1].opt_state[0].mu["layer_001"]["mlp"]["w_up_DF"]
    assert "data" in str(mu.sharding.spec)
    losses = train(trainer, dataset, 3, 3)
    np.testing.assert_allclose(first + losses, straight[0], rtol=1e-5)
    got = trainer.params_numpy()
    for k, want in straight[1].items():
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7, err_msg=k)


def test_group_trees_round_trip_the_optimizer_state(saved):
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    ex = trainer.executors[0]
    groups = ckpt.group_trees(ex.params, ex.opt_state)
    assert sorted(groups) == ["embed", "layer_000", "layer_001"]
    assert set(groups["layer_000"]["opt"]) == {"0_mu", "0_nu"}
    assert set(groups["layer_000"]["opt_shared"]) == {"0_count"}
    back = ckpt.opt_state_from_groups(ex.opt_state, groups)
    import jax

    assert jax.tree.structure(back) == jax.tree.structure(ex.opt_state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ex.opt_state)):
        assert a is b


def test_keep_prunes_and_pending_is_never_read(dataset, tmp_path):
    plan = make_plan(TWO)
    trainer = Trainer(plan, emulate_time=False)
    writer = ckpt.CheckpointWriter(tmp_path, keep=2)
    for step in (1, 2, 3):
        train(trainer, dataset, step - 1, 1)
        writer.save(step, trainer.executors, ckpt.checkpoint_meta(plan, step))
    assert writer.pending_step == 3  # asynchronous: the last one is still in flight
    assert writer.close() == ckpt.step_dir(tmp_path, 3)
    assert ckpt.complete_steps(tmp_path) == [2, 3]
    # A write that never finished (a crash) is invisible: the newest complete one is used.
    (tmp_path / "step_000004.pending" / "layers_000-003").mkdir(parents=True)
    assert ckpt.open_checkpoint(tmp_path, plan).step == 3



def test_resume_continues_the_learning_rate_schedule(dataset, tmp_path):
    """A run of 6 steps under a cosine schedule, stopped after 3 and resumed for 3 without
    --decay-steps: the schedule keeps the stopped run's length (6, from the checkpoint), so the
    learning rates and the losses are the straight run's."""
    from h2jax.runtime.train import run

    plan = make_plan(TWO, train={"lr_schedule": "cosine", "warmup_steps": 2})
    straight = run(plan, 6, dataset=dataset, emulate_time=False)
    stopped = Trainer(plan, steps=6, emulate_time=False)  # as `h2jax run --steps 6`, stopped after 3
    first = train(stopped, dataset, 0, 3)
    stopped.save(tmp_path)
    assert json.loads((ckpt.step_dir(tmp_path, 3) / ckpt.META).read_text())["lr_schedule_steps"] == 6
    resumed = run(plan, 3, dataset=dataset, emulate_time=False, checkpoint_dir=str(tmp_path), resume=True)
    assert resumed.learning_rates == straight.learning_rates[3:]
    np.testing.assert_array_equal(first + resumed.losses, straight.losses)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of the saved checkpoint directory, to damage."""
    import shutil

    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    return directory


def _array_file(directory):
    item = ckpt.step_dir(directory, 3) / "layers_000-003"  # one process: one item
    sums = json.loads((item.parent / ("layers_000-003" + ckpt.MANIFEST)).read_text())["files"]
    rel = max(sums, key=lambda r: sums[r][0])  # the largest file: array data
    return item / rel


def test_another_model_config_is_refused(copy):
    other = make_plan([stage("cpu", 1, 1, [0, 4])], model={
        "vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 256})
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint\.json: written for another model config \(d_ff: checkpoint 128, plan 256\)"):
        ckpt.open_checkpoint(copy, other)


def _flip_a_byte(path, where: float, bits: int) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= bits
    path.write_bytes(bytes(data))


def test_corrupted_array_file_is_named(copy):
    path = _array_file(copy)
    _flip_a_byte(path, 0.5, 0xFF)
    with pytest.raises(ckpt.CheckpointError, match=f"{path}: corrupted"):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def _rewrite_manifest(directory, change):
    manifest = ckpt.step_dir(directory, 3) / ("layers_000-003" + ckpt.MANIFEST)
    data = json.loads(manifest.read_text())
    change(data, manifest.with_suffix(""))
    manifest.write_text(json.dumps(data))
    return manifest


def test_a_checkpoint_of_crc32_sums_still_reads_and_its_corruption_is_named(copy):
    """Manifests written before CRC-32C name no checksum and hold zlib CRC-32s: still checked."""
    import zlib

    def to_crc32(data, item):
        del data["checksum"]
        data["files"] = {rel: [size, zlib.crc32((item / rel).read_bytes())] for rel, (size, _) in data["files"].items()}

    _rewrite_manifest(copy, to_crc32)
    ckpt.open_checkpoint(copy, make_plan(TWO))  # verifies every file: no error
    path = _array_file(copy)
    _flip_a_byte(path, 1 / 3, 0x01)
    with pytest.raises(ckpt.CheckpointError, match=f"{path}: corrupted: its CRC32 differs"):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def test_an_unknown_checksum_is_named(copy):
    manifest = _rewrite_manifest(copy, lambda data, item: data.update(checksum="sha3"))
    with pytest.raises(ckpt.CheckpointError, match=f"{manifest}: checksum 'sha3' unknown"):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def test_a_manifest_without_the_spans_of_its_groups_is_named(copy):
    manifest = _rewrite_manifest(copy, lambda data, item: data["spans"].pop("layer_001"))
    with pytest.raises(ckpt.CheckpointError, match=f"{manifest}: field 'spans' expected, one \\[offset, length\\] per group"):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def test_a_file_shorter_than_its_layout_is_named_when_read_unverified(copy):
    """open_checkpoint(verify=False) skips the checksums; the read still never returns a
    short array."""
    path = _array_file(copy)
    os.truncate(path, path.stat().st_size // 2)
    checkpoint = ckpt.open_checkpoint(copy, make_plan(TWO), verify=False)
    with pytest.raises(ckpt.CheckpointError, match=f"{path}: ends before (layer_|head)"):
        checkpoint.restore_all(Trainer(make_plan(TWO), emulate_time=False).executors.values())


def test_a_format_this_h2jax_does_not_read_is_named(copy):
    meta = ckpt.step_dir(copy, 3) / ckpt.META
    data = json.loads(meta.read_text())
    assert data["format"] == ckpt.FORMAT == 3
    meta.write_text(json.dumps({**data, "format": 1}))
    with pytest.raises(ckpt.CheckpointError, match=f"{meta}: checkpoint format 1, this h2jax reads 2 and 3"):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def test_truncated_array_file_is_named(copy):
    path = _array_file(copy)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ckpt.CheckpointError, match=f"{path}: truncated"):
        ckpt.open_checkpoint(copy, make_plan(THREE))


def test_truncated_metadata_is_named(copy):
    meta = ckpt.step_dir(copy, 3) / ckpt.META
    os.truncate(meta, meta.stat().st_size // 2)
    with pytest.raises(ckpt.CheckpointError, match=f"{meta}: unreadable or truncated"):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def test_missing_item_is_named(copy):
    import shutil

    item = ckpt.step_dir(copy, 3) / "layers_000-003"
    shutil.rmtree(item)
    with pytest.raises(ckpt.CheckpointError, match=f"{item}: missing \\(it holds embed, head, layer_000, "):
        ckpt.open_checkpoint(copy, make_plan(TWO))


def test_missing_step_names_the_steps_there(copy):
    with pytest.raises(ckpt.CheckpointError, match=r"step_000005: no checkpoint of step 5; this directory holds steps 3"):
        ckpt.open_checkpoint(copy, make_plan(TWO), step=5)


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ckpt.CheckpointError, match=f"{tmp_path}: not an h2jax checkpoint directory"):
        ckpt.open_checkpoint(tmp_path, make_plan(TWO))
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint directory"):
        ckpt.open_checkpoint(tmp_path / "nope", make_plan(TWO))


def test_other_data_settings_are_refused(copy):
    with pytest.raises(ckpt.CheckpointError, match=r"data global_batch is 8 in the checkpoint but 16 in the plan"):
        ckpt.open_checkpoint(copy, make_plan(TWO).__class__(**{**_fields(make_plan(TWO)), "global_batch": 16}))


def _fields(plan):
    import dataclasses

    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}


def test_replan_keeps_the_run_and_resumes_it(straight, saved, dataset, tmp_path, capsys):
    from h2jax.cli import main
    from h2jax.plan import load_plan

    directory = saved[0]
    out = tmp_path / "new.json"
    assert main(["replan", "--checkpoint", str(directory), "--cluster", str(ROOT / "plans" / "cluster-emu-3type.toml"),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "old plan (wrote the checkpoint)" in printed and f"--checkpoint-dir {directory} --resume" in printed
    new, old = load_plan(out), make_plan(TWO)
    assert (new.model, new.seq_len, new.global_batch, new.seed) == (old.model, old.seq_len, old.global_batch, old.seed)
    assert {s.chip for s in new.stages} <= {"emu-fast", "emu-mid", "emu-slow"}
    checkpoint = ckpt.open_checkpoint(directory, new)
    trainer = Trainer(new, emulate_time=False)
    for ex in trainer.executors.values():
        checkpoint.restore(ex)
    np.testing.assert_allclose(saved[2] + train(trainer, dataset, 3, 3), straight[0], rtol=1e-5)


# ----------------------------------------------------------------------------- failures, signals, the CLI


def _cli(*args, env=None):
    import subprocess
    import sys

    from tests.conftest import checkout_env

    return subprocess.run([sys.executable, "-m", "h2jax", *args], capture_output=True, text=True,
                          env=checkout_env({**os.environ, **(env or {})}), timeout=900)


def test_kill_during_an_asynchronous_save_resumes_the_previous_checkpoint(straight, token_file, tmp_path):
    """(c) in one process: SIGKILL while step 5 is being written; step 3 stays the newest
    complete checkpoint and `h2jax run --resume` reproduces the straight run bit for bit."""
    import subprocess
    import sys

    from h2jax.plan import save_plan
    from tests.conftest import checkout_env

    plan_file, directory, out = tmp_path / "plan.json", tmp_path / "ckpt", tmp_path / "losses.json"
    save_plan(make_plan(TWO), plan_file)
    env = checkout_env({**os.environ, "H2JAX_TEST_TOKENS": str(token_file)})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mpi_scripts" / "checkpoint_crash.py"),
                           str(plan_file), str(directory), str(out), "0"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == straight[0][:5]
    assert (directory / "step_000005.pending").is_dir()  # the write was in flight
    assert ckpt.complete_steps(directory) == [3]
    proc = _cli("run", "--plan", str(plan_file), "--steps", "3", "--data", str(token_file),
                "--checkpoint-dir", str(directory), "--resume", "--json")
    assert proc.returncode == 0, _tails(proc)
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])["losses"]
    assert resumed == straight[0][3:]
    assert ckpt.complete_steps(directory) == [3, 6]  # the crashed write was cleared, the end saved


def test_sigterm_saves_the_step_and_exits_0(token_file, tmp_path):
    """(d): SIGTERM during training: the step finishes, a checkpoint of it is committed, exit 0."""
    import signal
    import subprocess
    import sys
    import time

    from h2jax.plan import save_plan
    from tests.conftest import checkout_env

    plan_file, directory = tmp_path / "plan.json", tmp_path / "ckpt"
    save_plan(make_plan(TWO), plan_file)
    proc = subprocess.Popen(
        [sys.executable, "-m", "h2jax", "run", "--plan", str(plan_file), "--steps", "100000", "--data",
         str(token_file), "--checkpoint-dir", str(directory), "--save-every", "2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env(dict(os.environ)))
    deadline = time.monotonic() + 600  # a guard against a hang, not a measurement
    while not ckpt.complete_steps(directory) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ckpt.complete_steps(directory), "no checkpoint appeared"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    steps = ckpt.complete_steps(directory)
    last = ckpt.step_dir(directory, steps[-1])
    assert f"stopped by SIGTERM after step {steps[-1]}; checkpoint of step {steps[-1]} written to {last}" in err
    assert ckpt.open_checkpoint(directory, make_plan(TWO)).step == steps[-1]


def test_resume_refuses_bad_input_before_compiling(tmp_path, token_file):
    """(e) through the CLI: one line naming the file and the cause, exit status 2, no traceback."""
    from h2jax.plan import save_plan

    save_plan(make_plan(TWO), tmp_path / "plan.json")
    (tmp_path / "empty").mkdir()
    proc = _cli("run", "--plan", str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "empty"), "--resume")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"h2jax run: error: {tmp_path / 'empty'}: not an h2jax checkpoint directory "
                                   "(no step_NNNNNN/ checkpoints in it)")


# ----------------------------------------------------------------------------- under mpiexec

MPI_WRITER = [  # stage 0 spans two processes (its own jax.distributed group): one write per shard
    {**stage("cpu", 2, 1, [0, 2]), "processes": 2}, stage("cpu", 1, 2, [2, 4])]
MPI_READER = [stage("emu-fast", 1, 2, [0, 1]), stage("emu-mid", 2, 1, [1, 4], "selective")]


def _tails(proc) -> str:
    """A failed launch's last words: the ranks' standard error, the launcher's report of the
    process that failed (MPICH's hydra writes it to standard output), and each rank's record
    (h2jax.runtime.rank_records): which rank had that process id, and whether it had ended by
    itself before it died (a job that printed its results and then exited with status 9 was
    seen twice, under load, without a word from any rank)."""
    from h2jax.runtime import rank_records

    records = rank_records.read_records(proc.rank_dir) if getattr(proc, "rank_dir", None) else {}
    said = "\n".join(rank_records.explain_failure(proc.stdout + proc.stderr, records)) if records else ""
    ranks = "\n".join(f"  {r}" for r in records.values())
    return (f"stderr:\n{proc.stderr[-3000:]}\nstdout:\n{proc.stdout[-1500:]}\n"
            f"rank records:\n{ranks}\n{said}")


def _mpi_cli(n, *args, env=None):
    import subprocess
    import sys

    from tests.conftest import TEST_XLA_FLAGS, checkout_env
    from tests.test_mpi_transport import MPIEXEC

    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    import shutil
    import tempfile
    import weakref

    rank_dir = tempfile.mkdtemp(prefix="h2jax-test-ranks-")
    full = checkout_env({**os.environ, **(env or {}), "XLA_FLAGS": TEST_XLA_FLAGS, "H2JAX_RANK_DIR": rank_dir})
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], capture_output=True, text=True,
                          env=full, timeout=900)
    proc.rank_dir = rank_dir  # read by _tails when the launch failed
    weakref.finalize(proc, shutil.rmtree, rank_dir, True)
    return proc


@pytest.mark.mpi
@pytest.mark.slow
def test_under_mpi_kill_during_save_then_resume_on_the_same_and_another_plan(token_file, tmp_path):
    """(a), (b), (c) under mpiexec: each process writes its own shards; SIGKILL of one rank
    while step 5 is written leaves step 3 the newest; resuming on the same plan (3 processes)
    reproduces the run bit for bit, on another plan (2 processes, other meshes and emulated chip
    types) within rtol 1e-5."""
    from h2jax.plan import save_plan

    writer, reader = tmp_path / "writer.json", tmp_path / "reader.json"
    save_plan(make_plan(MPI_WRITER), writer)
    save_plan(make_plan(MPI_READER, schedule="gpipe"), reader)
    directory, out = tmp_path / "ckpt", tmp_path / "losses.json"
    proc = _mpi_cli(3, str(ROOT / "tests" / "mpi_scripts" / "checkpoint_crash.py"), str(writer), str(directory),
                    str(out), "2", env={"H2JAX_TEST_TOKENS": str(token_file)})
    assert proc.returncode != 0 and "unreachable" not in proc.stderr, proc.stderr[-3000:]
    straight = json.loads(out.read_text())
    assert len(straight) == 5 and ckpt.complete_steps(directory) == [3]
    items = sorted(p.name for p in ckpt.step_dir(directory, 3).iterdir() if p.is_dir())
    # One item per stage, named by its layers; stage 0's two processes wrote each element of its
    # arrays once between them (replicated ones by one process, ZeRO-1 halves each), each
    # recording where its parts lie.
    assert items == ["layers_000-001", "layers_002-003"]
    step3 = ckpt.step_dir(directory, 3)
    layouts = [json.loads((step3 / "layers_000-001.manifest").read_text())["groups"],
               json.loads((step3 / "layers_000-001.p1.layout").read_text())["groups"]]
    assert all(layout for layout in layouts)  # both processes wrote parts
    for group in ("embed", "layer_000", "layer_001"):
        entries = [e for layout in layouts for e in layout[group]]
        for path in {e["path"] for e in entries}:
            written = sum(np.prod([b - a for a, b in box]) for e in entries if e["path"] == path
                          for box, _ in e["pieces"])
            shape = next(e["shape"] for e in entries if e["path"] == path)
            assert written == np.prod(shape), (group, path)

    resume = ["-m", "h2jax", "run", "--steps", "2", "--data", str(token_file), "--checkpoint-dir",
              str(directory), "--resume", "3", "--json"]
    proc = _mpi_cli(3, *resume[:3], "--plan", str(writer), *resume[3:])
    assert proc.returncode == 0, _tails(proc)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["losses"] == straight[3:5]

    proc = _mpi_cli(2, *resume[:3], "--plan", str(reader), *resume[3:])
    assert proc.returncode == 0, _tails(proc)
    np.testing.assert_allclose(json.loads(proc.stdout.strip().splitlines()[-1])["losses"], straight[3:5], rtol=1e-5)


def _ranks_of(launcher_pid: int) -> list[int]:
    """The pids of the `python -m h2jax run` processes under an mpiexec (read from /proc): an
    argument that is `h2jax` itself, not a path through a checkout named h2jax (the launcher's
    proxy runs from the checkout's virtual environment)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            children.setdefault(int(rest.rsplit(") ", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    found, todo = [], [launcher_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                if b"h2jax" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                    found.append(child)
            except OSError:
                pass
    return found


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
def test_under_mpi_sigterm_saves_the_step_and_exits_0(token_file, tmp_path):
    """(d) under mpiexec: SIGTERM to one rank of a 3-process job (stage 0 spans two processes)
    -- every rank stops after the same step, the checkpoint of it is committed, exit status 0,
    and another plan in one process resumes it."""
    import signal
    import subprocess
    import sys
    import time

    from h2jax.plan import save_plan
    from tests.conftest import TEST_XLA_FLAGS, checkout_env
    from tests.test_mpi_transport import MPIEXEC

    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    plan_file, directory, rank_dir = tmp_path / "plan.json", tmp_path / "ckpt", tmp_path / "ranks"
    save_plan(make_plan(MPI_WRITER), plan_file)
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "3", sys.executable, "-m", "h2jax", "run", "--plan", str(plan_file), "--steps", "100000",
         "--data", str(token_file), "--checkpoint-dir", str(directory), "--save-every", "2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=checkout_env({**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "H2JAX_RANK_DIR": str(rank_dir)}))
    try:
        deadline = time.monotonic() + 600  # a guard against a hang, not a measurement
        while not ckpt.complete_steps(directory) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ckpt.complete_steps(directory), "no checkpoint appeared"
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 3, ranks
        os.kill(ranks[-1], signal.SIGTERM)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    # (hydra reports a process it saw fail, and why, on standard output; the records say
    # which rank that was and whether it had ended by itself)
    assert proc.returncode == 0, _tails(SimpleNamespace(stdout=out, stderr=err, rank_dir=rank_dir))
    steps = ckpt.complete_steps(directory)
    last = ckpt.step_dir(directory, steps[-1])
    assert f"stopped by SIGTERM after step {steps[-1]}; checkpoint of step {steps[-1]} written to {last}" in err, err
    assert not list(directory.glob("*.pending")), "a write left unfinished"
    plan = make_plan(TWO)
    checkpoint = ckpt.open_checkpoint(directory, plan)  # every file's size and CRC-32
    trainer = Trainer(plan, emulate_time=False)
    checkpoint.restore_all(trainer.executors.values())
    assert np.isfinite(train(trainer, TokenDataset(token_file, SEQ), checkpoint.step, 1)[0])


MPI_BAD_READER = [stage("cpu", 1, 1, [0, 2]), stage("cpu", 1, 1, [2, 4])]  # two processes


def _damage(case: str, directory: Path) -> tuple[dict, str, str]:
    """Damage the checkpoint copy in `directory` as `case` says: (the plan's changes, --resume's
    argument, the error expected: the file and the cause)."""
    import shutil

    step3 = ckpt.step_dir(directory, 3)
    if case == "another model config":
        return ({"model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                           "d_ff": 256}}, "3",
                f"{step3 / ckpt.META}: written for another model config (d_ff: checkpoint 128, plan 256)")
    if case == "other data settings":
        return ({"global_batch": 16}, "3", f"{step3 / ckpt.META}: data global_batch is 8 in the checkpoint but 16")
    if case in ("corrupted", "truncated"):
        path = _array_file(directory)
        if case == "corrupted":
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            os.truncate(path, path.stat().st_size // 2)
        return ({}, "3", f"{path}: {case}")
    if case == "truncated metadata":
        os.truncate(step3 / ckpt.META, (step3 / ckpt.META).stat().st_size // 2)
        return ({}, "3", f"{step3 / ckpt.META}: unreadable or truncated")
    if case == "missing item":
        shutil.rmtree(step3 / "layers_000-003")
        return ({}, "3", f"{step3 / 'layers_000-003'}: missing (it holds embed, head, layer_000, ")
    if case == "missing step":
        return ({}, "5", f"{ckpt.step_dir(directory, 5)}: no checkpoint of step 5; this directory holds steps 3")
    assert case == "not a checkpoint directory"
    shutil.rmtree(directory)
    directory.mkdir()
    return ({}, "3", f"{directory}: not an h2jax checkpoint directory (no step_NNNNNN/ checkpoints in it)")


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["another model config", "other data settings", "corrupted", "truncated",
                                  "truncated metadata", "missing item", "missing step",
                                  "not a checkpoint directory"])
def test_under_mpi_resume_refuses_bad_input_naming_the_file(case, copy, token_file, tmp_path):
    """(e) under mpiexec: each rank checks the items of its own stage before compiling; the
    job ends with the error naming the file and the cause, no traceback."""
    from h2jax.plan import save_plan

    changes, step, expected = _damage(case, copy)
    save_plan(make_plan(MPI_BAD_READER, **changes), tmp_path / "plan.json")
    proc = _mpi_cli(2, "-m", "h2jax", "run", "--plan", str(tmp_path / "plan.json"), "--steps", "1", "--data",
                    str(token_file), "--checkpoint-dir", str(copy), "--resume", step)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert expected in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
