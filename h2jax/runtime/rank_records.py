"""Who each rank of a job was, and whether it ended by itself: small files a launcher reads
after the job to name a rank that died without a word.

When a rank dies by a signal (the kernel's OOM killer, a segfault in a native library, `kill -9`),
MPICH's hydra kills every other rank at once: no survivor is left to say which rank it was, and
hydra's banner names only a process id. So each rank, once it knows its place in the job,
writes `rank-R.json` (rank, stage, host, pid) into the folder `H2JAX_RANK_DIR` names (set by
`h2jax launch`), and `rank-R.end` when it ends by itself (a clean exit, an error it reported,
a stop on a signal it handled). After a failed job the launcher reads its launcher's output
(hydra: "PID P RUNNING AT HOST", Open MPI: "process rank R with PID P on node N", srun:
"task R") and these records, and says which rank, stage and host died and how.

Without `H2JAX_RANK_DIR` nothing is written. On several hosts the folder must be on a shared
file system for the launcher to see every record (next to the plan, where `h2jax launch`
puts it, usually is); a record it cannot see is reported as unknown, never guessed.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import signal
import socket
from pathlib import Path
from typing import Iterable

ENV = "H2JAX_RANK_DIR"
_me: int | None = None  # this process's rank, once record_start has run


@dataclasses.dataclass(frozen=True, slots=True)
class RankRecord:
    rank: int
    stage: int
    host: str
    pid: int
    ended: str | None  # how it ended by itself; None: it never said (killed, or still running)

    def label(self, host: str | None = None) -> str:
        """Named on `host` where the launcher names one (it says where it placed the rank;
        the record holds what the machine calls itself)."""
        return f"rank {self.rank} (stage {self.stage}, host {host or self.host}, pid {self.pid})"


def _folder() -> Path | None:
    where = os.environ.get(ENV)
    return Path(where) if where else None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a record


def record_start(rank: int, stage: int) -> None:
    """This process is `rank`, running `stage` (no-op unless H2JAX_RANK_DIR is set). An
    interpreter that exits normally records "exit" (`atexit`); `os._exit` paths call
    `record_end` themselves."""
    global _me
    folder = _folder()
    if folder is None:
        return
    if _me is None:
        atexit.register(lambda: record_end("exit"))
    _me = rank
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / f"rank-{rank}.json",
               json.dumps({"rank": rank, "stage": stage, "host": socket.gethostname(), "pid": os.getpid()}))
    except OSError:  # records help a launcher explain a failure; they never fail a job
        pass


def record_end(how: str) -> None:
    """This process ends by itself: `how` in a few words ("exit 0", "error"). The first word
    said stays (an error, then the exit it causes)."""
    folder = _folder()
    if folder is None or _me is None:
        return
    path = folder / f"rank-{_me}.end"
    try:
        if not path.exists():
            _write(path, how)
    except OSError:
        pass


def read_records(folder: str | Path) -> dict[int, RankRecord]:
    """Every readable record in `folder`, by rank."""
    out: dict[int, RankRecord] = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            raw = json.loads(path.read_text())
            rank = int(raw["rank"])
            end = path.with_suffix(".end")
            ended = end.read_text().strip() if end.exists() else None
            out[rank] = RankRecord(rank, int(raw["stage"]), str(raw["host"]), int(raw["pid"]), ended)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class LauncherReport:
    """What the launcher's output says of the process it saw fail."""

    rank: int | None
    pid: int | None
    host: str | None
    how: str  # "killed by signal 9 (SIGKILL)", "exit code 3", ...


def _signal_text(number: int) -> str:
    try:
        return f"killed by signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"killed by signal {number}"


_HYDRA = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*EXIT CODE: (-?\d+)")
_HYDRA_STRING = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")
_OPENMPI = re.compile(r"process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)")
_OPENMPI_STATUS = re.compile(r"process rank (\d+) with PID (\d+) on node (\S+) exited with(?: a)? non-zero status (\d+)")
_SRUN = re.compile(r"srun: error: (\S+): task (\d+): (.+)")


def parse_launcher_output(text: str) -> list[LauncherReport]:
    """The failed processes MPICH's hydra, Open MPI's mpirun or SLURM's srun name in `text`."""
    found: list[LauncherReport] = []
    signal_number = _HYDRA_STRING.search(text)
    for m in _HYDRA.finditer(text):
        code = int(m.group(3))
        how = _signal_text(int(signal_number.group(1))) if signal_number else f"exit code {code}"
        found.append(LauncherReport(None, int(m.group(1)), m.group(2), how))
    for m in _OPENMPI.finditer(text):
        found.append(LauncherReport(int(m.group(1)), int(m.group(2)), m.group(3), _signal_text(int(m.group(4)))))
    for m in _OPENMPI_STATUS.finditer(text):
        found.append(LauncherReport(int(m.group(1)), int(m.group(2)), m.group(3), f"exit code {m.group(4)}"))
    for m in _SRUN.finditer(text):
        found.append(LauncherReport(int(m.group(2)), None, m.group(1), m.group(3).strip()))
    return found


def explain_failure(output: str, records: dict[int, RankRecord]) -> list[str]:
    """One line for each rank the launcher saw fail that did not say why itself (a rank that
    reported its own error has printed it already). Matches by rank where the launcher names
    one, else by process id; a failure no record matches is said as the launcher saw it."""
    by_pid = {r.pid: r for r in records.values()}
    lines = []
    for report in parse_launcher_output(output):
        record = records.get(report.rank) if report.rank is not None else by_pid.get(report.pid)
        if record is not None and record.ended is not None:
            continue  # it said why itself
        how = report.how
        if record is not None:
            who = record.label(report.host)
            code = re.fullmatch(r"exit code (\d+)", how)
            if code and 0 < int(code.group(1)) < 32:
                # it never ended through Python (no end record), and hydra gives a killed
                # process's signal number as its exit code
                how = f"{how}, most likely {_signal_text(int(code.group(1)))}"
        elif report.rank is not None:
            who = f"rank {report.rank} (host {report.host})"
        else:
            who = f"the process with pid {report.pid} on {report.host} (no rank record: it died before it " \
                  "knew its rank, or its host does not share the record folder)"
        lines.append(f"{who} died, {how}, without a message of its own; the launcher then stopped "
                     "the other ranks")
    return _unique(lines)


def _unique(lines: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for line in lines:
        seen.setdefault(line, None)
    return list(seen)
