"""An MPI job's processes: which stage each rank runs, start-up, and failure handling.

`mpiexec -n K h2jax run --plan FILE` starts K processes; stage i owns `stages[i].processes`
consecutive ranks (`h2jax.transport.mpi.first_ranks`). Before JAX starts, every rank:

1. starts MPI (with a watchdog: a rank that never reaches MPI_Init, or never gets through
   it, ends itself instead of hanging the job; see `watch_startup`) and checks the job's
   size against the plan;
2. makes any uncaught exception print once, labelled with its rank and stage, and abort the
   whole job (`install_abort_on_error`), so no peer waits forever on a dead rank;
3. selects its own stage's PJRT platform through `h2jax.backends.select_platforms` (library
   plugins included) and, for a stage spanning several processes, joins the stage's
   `jax.distributed` group (`h2jax.runtime.jaxsetup`);
4. meets every other rank at a start-up barrier that names the ranks that never arrive.

The transport (`h2jax.transport.mpi`) only moves arrays; everything about the job's shape
and its failures lives here.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import NoReturn, Sequence

from h2jax.config import ConfigError
from h2jax.plan import Plan, PlanError
from h2jax.runtime import rank_records
from h2jax.runtime.signals import RunInterrupted
from h2jax.transport.mpi import comm_world, first_ranks

_ENV_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS_WORLD")
_ENV_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessRole:
    """This process's place in the job."""

    rank: int
    world: int
    stage: int
    stage_rank: int  # index among the stage's processes (its jax.distributed process_id)
    stage_size: int
    first_rank: tuple[int, ...]  # first MPI rank of every stage

    def ranks_of(self, stage: int) -> range:
        end = self.first_rank[stage + 1] if stage + 1 < len(self.first_rank) else self.world
        return range(self.first_rank[stage], end)

    @property
    def label(self) -> str:
        return f"rank {self.rank} (stage {self.stage})"


def role_for_rank(processes: Sequence[int], rank: int, world: int) -> ProcessRole:
    """The stage and in-stage index of `rank`; refuses a world size the plan does not expect."""
    need = sum(processes)
    if world != need:
        detail = " + ".join(str(p) for p in processes)
        raise PlanError(
            f"mpiexec started {world} process(es) but the plan's stages need {need} "
            f"(stages[i].processes: {detail}); launch with `mpiexec -n {need}` or change the plan"
        )
    starts = first_ranks(processes)
    for stage, (start, count) in enumerate(zip(starts, processes)):
        if start <= rank < start + count:
            return ProcessRole(rank, world, stage, rank - start, count, starts)
    raise PlanError(f"rank {rank} is outside the job's {world} processes")


def plan_processes(plan: Plan) -> list[int]:
    return [s.processes for s in plan.stages]




def in_mpi_job() -> bool:
    """Whether this process is one of several started by `mpiexec` (read from the launcher's
    environment; MPI itself is not started)."""
    return mpi_world_size() > 1


def mpi_world_size() -> int:
    """How many processes `mpiexec` started, read from the launcher's environment without
    starting MPI (1 when not launched by mpiexec)."""
    for key in _ENV_SIZE:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def mpi_rank() -> int:
    """This process's rank, from the launcher's environment (0 when not under mpiexec)."""
    for key in _ENV_RANK:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def watch_startup(timeout_s: float | None = None) -> None:
    """End this process -- every thread's stack on standard error, exit status 1 -- unless it
    reaches MPI_Init within `timeout_s` (H2JAX_MPI_STARTUP_TIMEOUT). `h2jax run` calls it
    first thing under mpiexec, so that each rank ends itself if it is stuck before it joins
    the job (an import, a plugin or a file system that hangs). The launcher cannot be relied
    on for such a rank: MPICH's hydra ends a job's other processes when one that has started
    MPI fails, but waits for those that never did; and once, on a loaded CI machine, it left a
    rank that never started MPI running although its peer, which had, had left (why is not
    known). `init_mpi` replaces this deadline with its own for MPI_Init, then cancels it.
    Not for a library call: a script's own work before `h2jax.run` is not start-up."""
    import faulthandler

    faulthandler.dump_traceback_later(_startup_timeout(timeout_s), exit=True)


def init_mpi(timeout_s: float | None = None):
    """Start MPI and return COMM_WORLD. MPI_Init waits for every rank of the job; if one never
    gets there, exit non-zero instead of hanging. The watchdog is faulthandler's C thread:
    MPI_Init holds the GIL, so no Python timer could fire. Any deadline `watch_startup` set
    covers the way here, the library's load included; MPI_Init then gets one of its own, and
    none is left once this returns. A rank's own deadlines end it, whether or not the
    launcher ends the job's other ranks."""
    timeout_s = _startup_timeout(timeout_s)
    die_with_parent()
    mpi = _load_mpi_library()
    import faulthandler

    try:
        if mpi.Is_initialized():
            return mpi.COMM_WORLD
        faulthandler.dump_traceback_later(timeout_s, exit=True)  # prints where it hung, _exit(1)
        return _mpi_init_waits_for_every_rank_of_the_job(mpi)
    finally:
        faulthandler.cancel_dump_traceback_later()


def die_with_parent() -> None:
    """Have the kernel kill this process (SIGKILL) when its parent -- the launcher's proxy
    that started this rank -- dies (Linux; elsewhere nothing). When a job aborts, the launcher
    kills its ranks; a rank it missed (seen once under heavy load: a rank of an aborted job
    left spinning in MPI with no parent) would otherwise wait for its dead peers forever. A
    parent that died before this call is caught by the parent id check."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died between the two calls
        os._exit(1)


EXIT_HOOKS_TIMEOUT_S = 600.0


def leave_process(code: int) -> NoReturn:
    """End this process with exit status `code` without finalizing the interpreter (see
    `h2jax.cli.run_and_exit`), and, for a rank of an MPI job, the way its launcher expects.

    MPI_Finalize first (it waits for every rank). Then a rank leaves through the C library's
    `exit()`, not `os._exit`: MPICH (the `mpich` wheel's 5.0) holds its process-manager
    finalize back to a C exit hook, so that a process that dies after MPI_Finalize still
    shows as failed. A rank that skips the hook closes its connection to the launcher's proxy
    unannounced, and MPICH's hydra proxy then SIGKILLs every rank of the job still running on
    that host: a rank that was descheduled between its MPI_Finalize and its exit ended with
    status 9 (seen under load: a job whose every rank had finished its work failed). The hook waits until every
    rank has reached it. `exit()` runs the C exit hooks and static destructors only, holding
    the GIL (no Python thread runs meanwhile; Python's own finalization stays skipped); a
    rank still in them after EXIT_HOOKS_TIMEOUT_S -- a peer that never finishes -- leaves
    with `_exit(1)`, every thread's stack on standard error, and the launcher ends the job."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        os._exit(code)
    if not mpi.Is_finalized():
        mpi.Finalize()
    import ctypes
    import faulthandler

    faulthandler.dump_traceback_later(EXIT_HOOKS_TIMEOUT_S, exit=True)
    ctypes.PyDLL(None).exit(int(code))
    os._exit(code)  # not reached: exit() does not return


def _startup_timeout(given: float | None) -> float:
    """`given`, or H2JAX_MPI_STARTUP_TIMEOUT; checked before MPI starts, where every rank
    finds the same bad value: rank 0 says so, the others leave without a word."""
    if given is not None:
        return given
    try:
        return default_startup_timeout()
    except ConfigError:
        if mpi_rank() == 0:
            raise
        sys.exit(2)


def _load_mpi_library():
    """mpi4py.MPI with libmpi loaded but, unless something initialized it already, MPI not
    started; finalized at exit as when mpi4py starts it on import."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
    from mpi4py import MPI

    return MPI


def _mpi_init_waits_for_every_rank_of_the_job(mpi):
    # Named for the traceback the watchdog prints when a rank never starts.
    import mpi4py

    if mpi4py.rc.threads:
        levels = {"single": mpi.THREAD_SINGLE, "funneled": mpi.THREAD_FUNNELED,
                  "serialized": mpi.THREAD_SERIALIZED, "multiple": mpi.THREAD_MULTIPLE}
        mpi.Init_thread(levels[mpi4py.rc.thread_level])
    else:
        mpi.Init()
    return mpi.COMM_WORLD


def configure_process_for_plan(plan, *, startup_timeout_s: float | None = None) -> ProcessRole:
    """Everything a process of an MPI run does before JAX starts: check the process count
    against the plan, make any exception abort the job, configure JAX for this process's
    stage (platform, device count, the stage's jax.distributed group) and meet the other
    ranks at a start-up barrier. Returns this process's role."""
    from h2jax.runtime import jaxsetup, preflight

    startup_timeout_s = _startup_timeout(startup_timeout_s)
    comm = init_mpi(startup_timeout_s)
    try:
        role = role_for_rank(plan_processes(plan), comm.rank, comm.size)
    except ConfigError:
        if comm.rank == 0:  # every rank finds the same mismatch; one says so
            raise
        sys.exit(2)
    rank_records.record_start(role.rank, role.stage)
    install_abort_on_error(comm, label=role.label)
    startup_barrier(comm, startup_timeout_s, describe=lambda r: _describe_rank(role, r))
    stage = plan.stages[role.stage]
    group = comm.Split(color=role.stage, key=role.rank)
    setup_error = None
    try:
        jaxsetup.configure_jax(
            stage.chip,
            stage.mesh.size // stage.processes,
            group=group,
            stage_size=role.stage_size,
            stage_rank=role.stage_rank,
            local_device_ids=jaxsetup.stage_local_device_ids(plan, role.stage, role.stage_rank),
        )
    except ConfigError as e:  # e.g. its platform is missing: the pre-flight names its host
        setup_error = e
    group.Free()
    # Before any compile: every rank's host, platform, devices and memory against the plan.
    preflight.run_preflight(plan, role.rank, comm, setup_error=setup_error, timeout_s=startup_timeout_s)
    global _role
    _role = role
    return role


def _describe_rank(role: ProcessRole, rank: int) -> str:
    stage = max(i for i, start in enumerate(role.first_rank) if start <= rank)
    return f"rank {rank} (stage {stage})"


# Start-up takes seconds on a loaded machine (Python's imports, the library's load, MPI_Init):
# a shorter deadline would fail healthy jobs.
MIN_STARTUP_TIMEOUT_S = 5.0


def default_startup_timeout() -> float:
    """H2JAX_MPI_STARTUP_TIMEOUT in seconds (default 120), refused below MIN_STARTUP_TIMEOUT_S
    or when it is not a number."""
    raw = os.environ.get("H2JAX_MPI_STARTUP_TIMEOUT", "120")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"H2JAX_MPI_STARTUP_TIMEOUT={raw!r} is not a number of seconds; set it to e.g. 120 (the default)"
        ) from None
    if not value >= MIN_STARTUP_TIMEOUT_S:  # (NaN too)
        raise ConfigError(
            f"H2JAX_MPI_STARTUP_TIMEOUT={raw} is below {MIN_STARTUP_TIMEOUT_S:g} s: a rank's start-up "
            "(imports, loading MPI, MPI_Init) takes seconds on a loaded machine, and healthy jobs would "
            f"fail; set it to {MIN_STARTUP_TIMEOUT_S:g} or more (default 120)"
        )
    return value


class MPIStartupError(RuntimeError):
    """A rank of the job did not arrive; the message names it."""


def startup_barrier(comm, timeout_s: float | None = None, describe=lambda r: f"rank {r}") -> None:
    """A barrier that gives up after `timeout_s` with an error naming the ranks that never
    arrived (rank 0 names them; the others wait a little longer so its message comes first).
    Point-to-point only, on tags at the top of the tag space: a collective (even creating a
    communicator) would itself hang on the missing rank."""
    from mpi4py import MPI

    timeout_s = default_startup_timeout() if timeout_s is None else timeout_s
    hello = int(comm.Get_attr(MPI.TAG_UB))
    go = hello - 1
    if comm.rank == 0:
        pending = {r: comm.irecv(source=r, tag=hello) for r in range(1, comm.size)}
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            pending = {r: q for r, q in pending.items() if not q.Test()}
            time.sleep(0.001)
        if pending:
            missing = ", ".join(describe(r) for r in sorted(pending))
            raise MPIStartupError(
                f"start-up barrier: {missing} did not arrive within {timeout_s:g} s; it may have "
                "failed, or be stuck initializing its backend "
                "(raise H2JAX_MPI_STARTUP_TIMEOUT if it is merely slow)"
            )
        for r in range(1, comm.size):
            comm.send(True, dest=r, tag=go)
    else:
        comm.send(comm.rank, dest=0, tag=hello)
        release = comm.irecv(source=0, tag=go)
        deadline = time.monotonic() + timeout_s + 3.0
        while not release.Test():
            if time.monotonic() > deadline:
                raise MPIStartupError(f"start-up barrier: {describe(0)} never released the barrier")
            time.sleep(0.001)


_hook_installed = False
_aborting = False


ABORT_GRACE_S = 1.0


def _let_the_launcher_forward_it() -> None:
    """mpiexec forwards each rank's output from a pipe as it reads it; MPI_Abort kills the job
    at once and what the launcher has not read yet is lost (seen with MPICH's hydra: a rank's
    error message missing from the job's output). A moment's pause after the flush lets the
    one line that says why the job ends reach the user."""
    time.sleep(ABORT_GRACE_S)


def install_abort_on_error(comm=None, label: str | None = None) -> None:
    """Make an uncaught exception (in any thread) print once, labelled with this rank, and
    abort the whole MPI job, so the other ranks do not wait forever on a dead peer."""
    global _hook_installed
    if _hook_installed:
        return
    comm = comm or comm_world()
    label = label or f"rank {comm.rank}"

    def abort(exc_type, exc, tb, code=1):
        global _aborting
        if _aborting:  # already reported; MPI_Abort may return before the launcher kills us
            os._exit(code)
        _aborting = True
        if isinstance(exc, (ConfigError, MPIStartupError)):  # one line, as the CLI prints it
            text = f"h2jax [{label}]: error: {exc}\n"
        elif isinstance(exc, KeyboardInterrupt):  # Ctrl-C or SIGTERM outside the training loop
            text = f"h2jax [{label}]: stopped by {signal.Signals(getattr(exc, 'signum', signal.SIGINT)).name}\n"
        else:
            text = f"h2jax [{label}] failed; aborting the MPI job:\n" + "".join(
                traceback.format_exception(exc_type, exc, tb)
            )
        try:
            rank_records.record_end("error")
            sys.stderr.write(text)
            sys.stderr.flush()
            sys.stdout.flush()
            _let_the_launcher_forward_it()
        finally:
            comm.Abort(code)
            os._exit(code)

    sys.excepthook = abort
    threading.excepthook = lambda a: abort(a.exc_type, a.exc_value, a.exc_traceback)
    _hook_installed = True


@contextmanager
def abort_on_failure(comm=None, label: str | None = None):
    """`with abort_on_failure(): ...` aborts the job on an exception raised inside, and on a
    non-zero `SystemExit` (a rank that returns an error code would otherwise leave the others
    blocked in MPI)."""
    comm = comm or comm_world()
    label = label or f"rank {comm.rank}"
    try:
        yield
    except SystemExit as e:
        if e.code not in (None, 0):
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int):
                sys.stderr.write(f"{e.code}\n")
            sys.stderr.flush()
            rank_records.record_end(f"exit {code}")
            _let_the_launcher_forward_it()
            comm.Abort(code)
            os._exit(code)
        raise
    except RunInterrupted:  # every rank stops after the same step: nothing to abort
        raise
    except BaseException as e:  # noqa: BLE001 - every failure must take the job down
        install_abort_on_error(comm, label)
        sys.excepthook(type(e), e, e.__traceback__)
        raise


_role: ProcessRole | None = None


def process_role(plan) -> ProcessRole:
    """This process's role, configuring it for `plan` on first use (before JAX starts)."""
    global _role
    if _role is None:
        _role = configure_process_for_plan(plan)
    return _role
