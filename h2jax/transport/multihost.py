"""Which MPI process runs which stage, and per-process JAX set-up before JAX initializes.

Ranks are given to stages in pipeline order: stage i owns `stages[i].processes` consecutive
ranks. A stage that spans several processes forms its own `jax.distributed` group
(coordinator: the stage's first process; CPU collectives through gloo), so its mesh covers the
devices of all of them while each process addresses only its own. Processes of *different*
stages never share a JAX runtime (they may run different PJRT backends); MPI joins them.

Everything here that touches JAX must run before JAX's backends start: device counts and
collectives implementations are fixed at initialization.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Sequence

from h2jax.plan import Plan, PlanError


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


def first_ranks(processes: Sequence[int]) -> tuple[int, ...]:
    out, r = [], 0
    for p in processes:
        out.append(r)
        r += p
    return tuple(out)


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


def jax_backends_started() -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API moved: let config.update decide
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def coordinator_address() -> str:
    host = os.environ.get("H2JAX_COORDINATOR_HOST") or socket.gethostname()
    return f"{host}:{_free_port()}"


def configure_jax(platform: str, local_devices: int, *, group=None, stage_size: int = 1,
                  stage_rank: int = 0, local_device_ids: Sequence[int] | None = None,
                  timeout_s: int = 120) -> None:
    """Set this process's JAX platform and device count and, for a stage spanning
    `stage_size` processes, join the stage's `jax.distributed` group. `group` is an MPI
    communicator over the stage's processes (used to share the coordinator's address)."""
    if jax_backends_started():
        raise RuntimeError(
            "JAX has already started its backends in this process, so its devices can no longer "
            "be configured for the stage; call configure_process_for_plan() before any JAX "
            "operation (before building arrays, meshes or models)"
        )
    import jax

    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", local_devices)
    else:
        jax.config.update("jax_platforms", platform)
    if stage_size == 1:
        return
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = group.bcast(coordinator_address() if stage_rank == 0 else None, root=0)
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=stage_size,
        process_id=stage_rank,
        local_device_ids=None if platform == "cpu" else local_device_ids,
        initialization_timeout=timeout_s,
    )


def stage_local_device_ids(plan: Plan, role: ProcessRole) -> list[int] | None:
    """This process's share of `stages[i].devices` (local ids on its host), if the plan lists them."""
    stage = plan.stages[role.stage]
    if stage.devices is None:
        return None
    per = stage.mesh.size // stage.processes
    return list(stage.devices[role.stage_rank * per : (role.stage_rank + 1) * per])


def stage_mesh_devices(data: int, tensor: int):
    """The devices of this process's stage mesh, `(data, tensor)`-shaped, process-major: in a
    multi-process stage each process holds whole consecutive rows of mesh positions."""
    import jax
    import numpy as np

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) < data * tensor:
        raise PlanError(
            f"the stage mesh needs data*tensor = {data * tensor} devices but this stage's "
            f"processes see {len(devices)}"
        )
    return np.array(devices[: data * tensor]).reshape(data, tensor)
