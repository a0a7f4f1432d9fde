"""Runs that go wrong end cleanly: a non-finite loss stops training naming the step and the
stage where it first appeared (before that step's update); Ctrl-C and SIGTERM stop every
process after the same step with one line; under MPI a stopped rank is named by the step
watchdog instead of stalling the job."""

import os
import types
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h2jax.cli import main as cli_main
from h2jax.plan import plan_from_dict
from h2jax.runtime.pipeline import NonFiniteLossError
from h2jax.runtime.signals import RunInterrupted, StopSignals, stop_signal
from h2jax.runtime import watchdog
from h2jax.runtime.watchdog import StepWatchdog, step_limit
from tests.conftest import TEST_XLA_FLAGS, checkout_env

SCRIPTS = Path(__file__).parent / "mpi_scripts"
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
TWO_STAGES = {
    "format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 4, "micro_batch": 2,
    "stages": [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2]},
               {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]}],
}


class _OutOfVocabulary:
    """A dataset whose every batch starts with an input id past the embedding (from `bad_from` on)."""

    vocab_size, has_val = 256, False

    def __init__(self, inner, bad_from: int):
        self.inner, self.bad_from = inner, bad_from

    def batch(self, step, batch_size):
        tokens = self.inner.batch(step, batch_size)
        if step >= self.bad_from:
            tokens = tokens.copy()
            tokens[:, 0] = 300
        return tokens


def test_a_non_finite_loss_stops_the_run_naming_step_and_stage(token_file):
    from h2jax.data import TokenDataset
    from h2jax.runtime.train import Trainer

    plan = plan_from_dict(TWO_STAGES)
    data = _OutOfVocabulary(TokenDataset(token_file, 16), bad_from=1)
    trainer = Trainer(plan)
    trainer.step(data.batch(0, plan.global_batch))
    before = trainer.params_numpy()
    with pytest.raises(NonFiniteLossError) as info:
        trainer.step(data.batch(1, plan.global_batch))
    message = str(info.value)
    assert message.startswith("step 2: the gradient norm is nan")
    assert "stage 0 (cpu)'s forward output" in message and "after step 1" in message
    after = trainer.params_numpy()  # the failing step did not update anything
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


def test_a_non_finite_loss_of_the_unpipelined_reference_names_the_step(token_file):
    import h2jax
    from h2jax.data import TokenDataset

    data = _OutOfVocabulary(TokenDataset(token_file, 16), bad_from=1)
    with pytest.raises(NonFiniteLossError, match=r"^step 2: the loss is nan \(the unpipelined model\)"):
        h2jax.run(plan_from_dict(TWO_STAGES), 5, dataset=data, unpipelined=True)


def test_the_cli_ends_a_diverged_run_with_one_line(token_file, tmp_path, capsys, monkeypatch):
    import h2jax.cli.run as run_cli
    from h2jax.data import TokenDataset

    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(TWO_STAGES))
    monkeypatch.setattr("h2jax.data.open_dataset",
                        lambda p, s, seed=0: _OutOfVocabulary(TokenDataset(p, s, seed), bad_from=2))
    rc = cli_main(["run", "--plan", str(path), "--steps", "5", "--data", str(token_file), "--json"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("h2jax run: error: step 3:") and "stage 0" in lines[0]
    assert run_cli  # the module under test


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_training_after_the_whole_step(signum, token_file):
    import h2jax
    from h2jax.data import TokenDataset

    def on_step(n, loss, seconds):
        if n == 1:
            os.kill(os.getpid(), signum)

    before = signal.getsignal(signum)
    with pytest.raises(RunInterrupted) as info:
        h2jax.run(plan_from_dict(TWO_STAGES), 20, dataset=TokenDataset(token_file, 16), on_step=on_step)
    assert info.value.step == 2 and info.value.exit_code == 128 + signum
    assert str(info.value) == f"stopped by {signal.Signals(signum).name} after step 2"
    assert signal.getsignal(signum) is before  # handlers restored


def test_the_cli_prints_one_line_on_ctrl_c(token_file, tmp_path, capsys, monkeypatch):
    import contextlib

    import h2jax.cli.run as run_cli

    class Interrupting:  # a progress bar that presses Ctrl-C after the first step
        def __call__(self, n, loss, seconds):
            if n == 0:
                os.kill(os.getpid(), signal.SIGINT)

        def evaluated(self, n, loss):
            pass

    @contextlib.contextmanager
    def interrupting_progress(*args, **kwargs):
        yield Interrupting()

    monkeypatch.setattr(run_cli, "training_progress", interrupting_progress)
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(TWO_STAGES))
    rc = cli_main(["run", "--plan", str(path), "--steps", "20", "--data", str(token_file)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 130
    assert err[-1] == "h2jax run: stopped by SIGINT after step 1", err
    assert not any("Traceback" in line for line in err)


def test_stop_decisions_are_agreed_through_the_transport():
    class SumOf:  # a transport whose other processes contributed these per-stage values
        def __init__(self, others):
            self.others = others

        def sum_across_stages(self, local):
            return sum(local.values()) + sum(self.others)

    quiet = StopSignals()
    assert stop_signal(quiet, SumOf([0.0, 0.0]), [0], n_stages=3) is None
    assert stop_signal(quiet, SumOf([1.0, 0.0]), [0], n_stages=3) == signal.SIGINT  # another rank: Ctrl-C
    assert stop_signal(quiet, SumOf([1.0, 4.0]), [0], n_stages=3) == signal.SIGTERM
    asked = StopSignals()
    asked.signum = signal.SIGTERM
    assert stop_signal(asked, SumOf([1.0, 1.0]), [0], n_stages=3) == signal.SIGTERM


class _FakeComm:
    """Rank 0 of 3: `inbox` holds (source, message) in arrival order; `sent` what it isent."""

    def __init__(self, inbox=()):
        self.inbox, self.sent = list(inbox), []

    def Dup(self):
        return self

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 3

    def isend(self, message, dest, tag):
        self.sent.append((dest, message))
        return types.SimpleNamespace(Test=lambda: True)

    def iprobe(self, source, tag, status):
        if self.inbox:
            status.Set_source(self.inbox[0][0])
        return bool(self.inbox)

    def recv(self, source, tag):
        i = next(k for k, (src, _) in enumerate(self.inbox) if src == source)
        return self.inbox.pop(i)[1]


def test_closing_receives_every_heartbeat_up_to_each_watched_ranks_closing_message():
    # a heartbeat left unreceived at MPI_Finalize is a UCX warning on stdout after `--json`'s line
    inbox = [(1, (3, 0.5)), (2, (3, 0.5)), (1, None), (2, (4, 0.5)), (2, None)]
    comm = _FakeComm(inbox)
    dog = StepWatchdog(comm, lambda r: f"rank {r}", interval_s=3600)
    dog.close()
    assert comm.inbox == []
    assert comm.sent == [(1, None), (2, None)]  # its own closing message to the ranks it beats to


def test_closing_gives_up_on_a_rank_that_never_closes(monkeypatch):
    monkeypatch.setattr(watchdog, "DRAIN_S", 0.05)
    comm = _FakeComm([(1, (3, 0.5)), (1, None)])  # rank 2 never says it is closing
    dog = StepWatchdog(comm, lambda r: f"rank {r}", interval_s=3600)
    dog.close()  # returns: a failed peer must not hang this rank's exit
    assert comm.inbox == []


def test_the_watchdog_names_the_silent_rank_and_the_laggard():
    now = [100.0]
    dog = StepWatchdog(_FakeComm(), lambda r: f"rank {r}", interval_s=3600, clock=lambda: now[0])
    try:
        env = {"H2JAX_STEP_TIMEOUT": "10"}
        assert step_limit(None, {}) == 1800.0 and step_limit(2.0, env) == 10.0 and step_limit(20.0, {}) == 400.0
        os.environ["H2JAX_STEP_TIMEOUT"] = "10"
        dog.beat(1, 0.5)
        for r in (1, 2):
            dog.heard_from(r, 1, 0.5, 100.0)
        now[0] = 105.0
        dog.heard_from(1, 2, 0.5, 105.0)
        dog.beat(2, 0.5)
        assert dog.verdict(106.0) is None
        dog.heard_from(1, 2, 0.5, 112.0)  # rank 1 keeps beating; rank 2 went quiet at 100
        verdict = dog.verdict(112.0)
        assert verdict.startswith("rank 2 sent no heartbeat for 12 s (limit 10 s)"), verdict
        dog.heard_from(2, 2, 0.5, 112.0)  # all beat, but no step finished since 105
        verdict = dog.verdict(116.0)
        assert verdict.startswith("no step finished for 11 s") and "rank 0, rank 1, rank 2 at step 2" in verdict
    finally:
        os.environ.pop("H2JAX_STEP_TIMEOUT", None)
        dog.close()


def test_a_stall_names_the_rank_that_stopped_beating_after_the_last_step():
    """The job's last step finished (105) before the stopped rank's last heartbeat (106): the
    stall reaches the limit first, and the verdict names that rank as silent, not the stall
    (the MPI test below saw the stall's message under two suites at once). Ranks that still
    beat leave the stall's verdict as it was."""
    now = [100.0]
    dog = StepWatchdog(_FakeComm(), lambda r: f"rank {r}", interval_s=3600, clock=lambda: now[0])
    dog.interval_s = 1.0  # (its thread sleeps on the first interval: no verdict of its own here)
    try:
        os.environ["H2JAX_STEP_TIMEOUT"] = "10"
        dog.beat(2, 0.5)
        dog.progress_at = 105.0
        dog.heard_from(1, 1, 0.5, 106.0)  # its last heartbeat, then SIGSTOP
        dog.heard_from(2, 2, 0.5, 115.5)
        verdict = dog.verdict(116.0)
        assert verdict.startswith("rank 1 sent no heartbeat for 10 s (limit 10 s)"), verdict
        dog.heard_from(1, 1, 0.5, 115.5)  # both still beat: the stall, naming the laggard
        verdict = dog.verdict(116.0)
        assert verdict.startswith("no step finished for 11 s") and "rank 1 at step 1" in verdict, verdict
    finally:
        os.environ.pop("H2JAX_STEP_TIMEOUT", None)
        dog.close()


def _mpiexec(n, *args, env=None, timeout=240):
    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    full_env = checkout_env({**os.environ, **(env or {})})
    full_env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(SCRIPTS / "stop_rank.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture
def two_stage_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(TWO_STAGES))
    return path


@pytest.mark.mpi
def test_mpi_a_stopped_rank_is_named_by_the_watchdog(two_stage_plan, token_file):
    proc = _mpiexec(2, two_stage_plan, token_file, "sigstop", 1, env={"H2JAX_STEP_TIMEOUT": "5"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "step watchdog: rank 1 (stage 1) sent no heartbeat" in out, out


@pytest.mark.mpi
def test_mpi_sigterm_on_one_rank_stops_every_rank_after_the_same_step(two_stage_plan, token_file):
    proc = _mpiexec(2, two_stage_plan, token_file, "sigterm", 0)
    # mpiexec forwards each rank's output as it comes: two ranks' lines may arrive unseparated.
    assert proc.stdout.count("stopped by") == 2, proc.stdout + proc.stderr
    assert proc.stdout.count("rank 0 (stage 0): stopped by SIGTERM after step 3") == 1, proc.stdout
    assert proc.stdout.count("rank 1 (stage 1): stopped by SIGTERM after step 3") == 1, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_mpi_a_non_finite_loss_names_step_and_stage_once(two_stage_plan, token_file):
    proc = _mpiexec(2, two_stage_plan, token_file, "nan", 0)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("step 3: the gradient norm is nan (it first appeared in stage 0 (cpu)'s forward output)") == 1, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_the_launcher_process_that_started_it():
    """ranks.die_with_parent (armed by init_mpi): a rank whose parent -- the launcher's proxy
    -- is killed goes with it instead of waiting on its dead peers forever."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"child = subprocess.Popen([sys.executable, {str(Path(__file__).parent / 'mpi_scripts' / 'orphan.py')!r}],"
         " stdout=subprocess.PIPE, text=True)\n"
         "assert child.stdout.readline().strip() == 'armed'\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, env=checkout_env(dict(os.environ)),
    )
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
        except FileNotFoundError:
            return False

    for _ in range(600):  # a hang detector, not a timing: the kernel signals at once
        if not alive(child):
            break
        subprocess.run(["sleep", "0.1"])
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its killed parent by a minute")


@pytest.mark.mpi
@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_leaves_first_does_not_take_the_slower_ranks_with_it(code):
    """ranks.leave_process (how `h2jax` ends a rank): MPICH's launcher kills the ranks still
    running when one closes its connection without the MPI library's exit hook (os._exit) --
    here rank 0, still at work after rank 1 has left, lives on, and the job ends with the
    status rank 0 leaves with."""
    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(SCRIPTS / "leave_unevenly.py"), str(code)],
                          capture_output=True, text=True, timeout=240, env=checkout_env(dict(os.environ)))
    assert "rank 0 outlived rank 1" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == code, proc.stdout + proc.stderr
