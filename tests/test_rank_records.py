"""Naming the rank that died without a word: the records ranks write, what each launcher
prints of a failed process, and a real job launched by `h2jax launch` whose rank is killed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h2jax.runtime import rank_records
from h2jax.runtime.rank_records import RankRecord, explain_failure, parse_launcher_output, read_records

HYDRA = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 6879 RUNNING AT node7
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
"""
HYDRA_EXIT = HYDRA.replace("EXIT CODE: 9", "EXIT CODE: 3").split("YOUR APPLICATION TERMINATED")[0]
OPENMPI = ("mpirun noticed that process rank 2 with PID 4242 on node gpu03 exited on signal 11 "
           "(Segmentation fault).\n")
SRUN = "srun: error: tpu-host-1: task 5: Killed\n"


def _records(**ended):
    return {r: RankRecord(r, r // 2, f"node{r + 6}", 6878 + r, ended.get(f"r{r}")) for r in range(4)}


def test_each_launchers_report_of_a_failed_process_is_read():
    (hydra,) = parse_launcher_output(HYDRA)
    assert (hydra.rank, hydra.pid, hydra.host, hydra.how) == (None, 6879, "node7", "killed by signal 9 (SIGKILL)")
    (plain,) = parse_launcher_output(HYDRA_EXIT)
    assert plain.how == "exit code 3"
    (ompi,) = parse_launcher_output(OPENMPI)
    assert (ompi.rank, ompi.pid, ompi.host, ompi.how) == (2, 4242, "gpu03", "killed by signal 11 (SIGSEGV)")
    (srun,) = parse_launcher_output(SRUN)
    assert (srun.rank, srun.host, srun.how) == (5, "tpu-host-1", "Killed")
    assert parse_launcher_output("all ranks finished\n") == []


def test_hydras_pid_is_matched_to_the_rank_that_recorded_it():
    (line,) = explain_failure(HYDRA, _records())
    assert line.startswith("rank 1 (stage 0, host node7, pid 6879) died, killed by signal 9 (SIGKILL)")
    (line,) = explain_failure(HYDRA_EXIT, _records())  # no exit string: the code, and what it most likely means
    assert line.startswith("rank 1 (stage 0, host node7, pid 6879) died, exit code 3, most likely killed by signal 3")


def test_a_rank_that_reported_its_own_error_is_not_explained_again():
    assert explain_failure(HYDRA, _records(r1="error")) == []


def test_a_failure_no_record_matches_is_said_as_the_launcher_saw_it():
    (line,) = explain_failure(HYDRA, {})
    assert "pid 6879 on node7" in line and "no rank record" in line
    (line,) = explain_failure(OPENMPI, {})
    assert line.startswith("rank 2 (host gpu03) died, killed by signal 11 (SIGSEGV)")


def test_records_are_written_only_under_the_folder_the_launcher_names(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_records, "_me", None)
    monkeypatch.delenv(rank_records.ENV, raising=False)
    rank_records.record_start(3, 1)
    assert rank_records._me is None  # no folder, no record
    monkeypatch.setenv(rank_records.ENV, str(tmp_path / "ranks"))
    rank_records.record_start(3, 1)
    (record,) = read_records(tmp_path / "ranks").values()
    assert (record.rank, record.stage, record.ended) == (3, 1, None)
    rank_records.record_end("error")
    rank_records.record_end("exit 1")  # the first word said stays
    assert read_records(tmp_path / "ranks")[3].ended == "error"


@pytest.mark.mpi
@pytest.mark.slow
def test_launch_names_the_rank_that_was_killed(tmp_path, token_file):
    from h2jax.plan import save_plan
    from tests.test_launch import BIN, _alias_plan, _env

    if not (BIN / "mpiexec").exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    plan = _alias_plan(tmp_path)
    save_plan(plan, tmp_path / "plan.json")
    script = [sys.executable, "tests/mpi_scripts/stop_rank.py", str(tmp_path / "plan.json"), str(token_file),
              "sigkill", "1"]
    proc = subprocess.run([sys.executable, "-m", "h2jax", "launch", "--plan", str(tmp_path / "plan.json"), "--",
                           *script], capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode != 0
    named = [line for line in proc.stderr.splitlines() if line.startswith("h2jax launch: rank")]
    assert len(named) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert named[0].startswith("h2jax launch: rank 1 (stage 1, host "), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "signal 9 (SIGKILL)" in named[0], proc.stdout[-2000:] + proc.stderr[-3000:]
