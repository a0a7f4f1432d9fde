"""Pre-flight: before any compile, every rank of an MPI job reports where it is and what it
has, and rank 0 checks the reports against the plan.

Each rank reports its host (the name its launcher placed it on: hydra's PMI_HOSTNAME,
SLURM's SLURMD_NODENAME, else the machine's name), the platform of its stage's devices, how
many it sees and how much memory each has. A mismatch with the plan (a chip type's platform
missing on the rank, fewer devices than its share of the stage's mesh, less memory than the
planner predicted the stage needs, a rank on another host than its stage names, a host name
that does not resolve, a rank that never reports) stops the job with one error that names
the rank, its stage and its host.

The exchange is point-to-point with a deadline (a collective would hang on a missing rank);
the checks are pure functions of the plan and the reports, tested without MPI.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from typing import Callable, Sequence

from h2jax.config import ConfigError

GIB = 1 << 30


class PreflightError(ConfigError):
    """A rank does not match the plan; the message names the rank, its stage and its host."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    host: str
    platform: str  # the JAX platform the rank looked for (its stage's)
    devices: int  # how many devices of that platform it sees
    memory_bytes: int | None  # the smallest device's memory limit (None: not reported, e.g. CPU)
    found: tuple[str, ...] = ()  # platforms the rank's JAX does have
    error: str | None = None  # why the platform could not be used, if it could not


def rank_host() -> str:
    """The host this process runs on, as its launcher named it."""
    for key in ("PMI_HOSTNAME", "SLURMD_NODENAME"):
        if os.environ.get(key):
            return os.environ[key]
    return socket.gethostname()


def stage_jax_platform(chip_name: str) -> str:
    from h2jax.backends import PROVIDERS
    from h2jax.cluster import load_chip

    platform = load_chip(chip_name).platform
    return PROVIDERS[platform].jax_platform if platform in PROVIDERS else platform


def local_report(rank: int, platform: str, setup_error: BaseException | None = None) -> RankReport:
    """This rank's report: its devices of `platform` (starts JAX's backends; call it after
    the process's platform selection, before any compile)."""
    host = rank_host()
    if setup_error is not None:
        return RankReport(rank, host, platform, 0, None, error=str(setup_error))
    import jax

    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError as e:  # the platform's plugin is missing or has no device
        found = []
        for other in ("cpu",) if platform != "cpu" else ():
            try:
                jax.local_devices(backend=other)
                found.append(other)
            except RuntimeError:
                pass
        return RankReport(rank, host, platform, 0, None, tuple(found), error=str(e).splitlines()[0])
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return RankReport(rank, host, platform, len(devices), min(limits) if limits else None, (platform,))


def _addresses(host: str, resolve: Callable) -> set[str]:
    return {info[4][0] for info in resolve(host, None)}


def same_host(planned: str, reported: str, resolve: Callable = socket.getaddrinfo) -> bool:
    """Whether a rank that reports `reported` runs on `planned`: the same name, the same
    short name (node01 vs node01.cluster), or names that resolve to a common address."""
    if planned.lower() == reported.lower():
        return True
    if planned.split(".")[0].lower() == reported.split(".")[0].lower() and not planned[0].isdigit():
        return True
    try:
        return bool(_addresses(planned, resolve) & _addresses(reported, resolve))
    except OSError:
        return False


def mismatches(plan, reports: Sequence[RankReport | None], *, timeout_s: float = 0.0,
               resolve: Callable = socket.getaddrinfo) -> list[str]:
    """What is wrong, one line per rank that does not match the plan ([] when all match).
    `reports[r]` is None for a rank that did not report."""
    from h2jax.launch.hosts import placements

    places = placements(plan) if all(s.hosts is not None for s in plan.stages) else None
    stage_of = [i for i, s in enumerate(plan.stages) for _ in range(s.processes)]
    problems = []
    resolved: dict[str, str | None] = {}
    for rank, rep in enumerate(reports):
        stage = plan.stages[stage_of[rank]]
        planned = places[rank].host if places else None
        where = f"rank {rank} (stage {stage_of[rank]}, {stage.chip}) on host "
        if rep is None:
            problems.append(
                f"{where}{planned or '?'} did not report within {timeout_s:g} s: it is unreachable, "
                "or stuck starting its backend (raise H2JAX_MPI_STARTUP_TIMEOUT if it is merely slow)"
            )
            continue
        where += rep.host
        if planned is not None:
            if planned not in resolved:
                try:
                    resolve(planned, None)
                    resolved[planned] = None
                except OSError as e:
                    resolved[planned] = str(e)
            if resolved[planned] is not None:
                problems.append(
                    f"{where}: host {planned!r} named by stages[{stage_of[rank]}].hosts does not resolve "
                    f"({resolved[planned]}); fix the cluster file's hosts or the name service"
                )
                continue
            if not same_host(planned, rep.host, resolve):
                problems.append(
                    f"{where}: the plan puts it on {planned!r}; launch with `h2jax launch` (or list the "
                    "hosts in the plan's rank order)"
                )
                continue
        need = stage.mesh.size // stage.processes
        if rep.error is not None or rep.devices == 0:
            found = ", ".join(rep.found) or "none"
            problems.append(
                f"{where}: stage runs chip type {stage.chip} on platform {rep.platform!r}, which this "
                f"rank does not have (platforms found: {found}; {rep.error}); run this stage on a "
                f"{stage.chip} host or fix its plugin"
            )
            continue
        if rep.devices < need:
            problems.append(
                f"{where}: sees {rep.devices} {rep.platform} device(s) but its share of the stage's "
                f"mesh ({stage.mesh.data}x{stage.mesh.tensor} over {stage.processes} process(es)) is {need}; "
                "check the device visibility variables (h2jax launch sets them) or the host's chips"
            )
            continue
        predicted = (plan.predicted or {}).get("memory_gib")
        if rep.memory_bytes is not None and predicted:
            needed = float(predicted[stage_of[rank]]) * GIB
            if rep.memory_bytes < needed:
                problems.append(
                    f"{where}: a device has {rep.memory_bytes / GIB:.2f} GiB but the plan needs "
                    f"{needed / GIB:.2f} GiB per chip for stages[{stage_of[rank]}]; run it on "
                    f"{stage.chip} chips with that memory, or re-plan"
                )
    return problems


def check(plan, reports: Sequence[RankReport | None], **kw) -> None:
    problems = mismatches(plan, reports, **kw)
    if problems:
        more = f" (and {len(problems) - 1} more: " + "; ".join(problems[1:]) + ")" if len(problems) > 1 else ""
        raise PreflightError(f"pre-flight: {problems[0]}{more}")


def run_preflight(plan, rank: int, comm, *, timeout_s: float,
                  setup_error: BaseException | None = None) -> list[RankReport] | None:
    """Every rank sends its report to rank 0, which checks them all and raises a
    PreflightError on a mismatch; the other ranks wait for rank 0's word and, on a mismatch,
    exit with status 2 without a word of their own (the launcher ends any rank that never
    reported once one exits non-zero). Returns the reports on rank 0."""
    from mpi4py import MPI

    stage_of = [i for i, s in enumerate(plan.stages) for _ in range(s.processes)]
    report = local_report(rank, stage_jax_platform(plan.stages[stage_of[rank]].chip), setup_error)
    tag = int(comm.Get_attr(MPI.TAG_UB)) - 2  # below the start-up barrier's two tags
    if rank != 0:
        comm.send(dataclasses.astuple(report), dest=0, tag=tag)
        verdict = comm.irecv(source=0, tag=tag - 1)
        deadline = time.monotonic() + timeout_s + 5.0
        while True:
            done, ok = verdict.test()
            if done:
                break
            if time.monotonic() > deadline:
                raise PreflightError(f"pre-flight: rank 0 gave no verdict within {timeout_s:g} s")
            time.sleep(0.001)
        if not ok:  # rank 0 reports the mismatch; one error for the whole job
            sys.exit(2)
        return None
    reports: list[RankReport | None] = [report] + [None] * (comm.size - 1)
    pending = {r: comm.irecv(source=r, tag=tag) for r in range(1, comm.size)}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for r, req in list(pending.items()):
            done, value = req.test()
            if done:
                reports[r] = RankReport(*value)
                del pending[r]
        time.sleep(0.001)
    try:
        check(plan, reports, timeout_s=timeout_s)
    except PreflightError:
        for r in range(1, comm.size):
            if r not in pending:
                comm.send(False, dest=r, tag=tag - 1)
        raise
    for r in range(1, comm.size):
        comm.send(True, dest=r, tag=tag - 1)
    print(table(plan, reports), file=sys.stderr, flush=True)
    return reports


def table(plan, reports: Sequence[RankReport]) -> str:
    """What was planned next to what each rank found (rank 0 prints it before compiling)."""
    from h2jax.launch.hosts import placements

    places = placements(plan) if all(s.hosts is not None for s in plan.stages) else None
    stage_of = [i for i, s in enumerate(plan.stages) for _ in range(s.processes)]
    rows = [("rank", "stage", "chip", "planned host", "host", "platform", "devices", "memory GiB")]
    for rep in reports:
        stage = plan.stages[stage_of[rep.rank]]
        rows.append((
            str(rep.rank), str(stage_of[rep.rank]), stage.chip, places[rep.rank].host if places else "-",
            rep.host, rep.platform, f"{rep.devices}/{stage.mesh.size // stage.processes}",
            f"{rep.memory_bytes / GIB:.1f}" if rep.memory_bytes is not None else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return f"pre-flight: {len(reports)} rank(s) match the plan\n" + "\n".join(lines)
