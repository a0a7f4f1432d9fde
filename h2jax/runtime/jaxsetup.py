"""Per-process JAX set-up, before JAX initializes its backends.

In one process, a plan's CPU stages need one host device per mesh position
(`prepare_local_devices`). Under `mpiexec` each process selects only its own stage's PJRT
platform (`configure_jax`). A stage that spans several
processes forms its own `jax.distributed` group (coordinator: the stage's first process; CPU
collectives through gloo), so its mesh covers the devices of all of them while each process
addresses only its own. Processes of *different*
stages never share a JAX runtime (they may run different PJRT backends); MPI joins them.

Everything here that touches JAX must run before JAX's backends start: device counts and
collectives implementations are fixed at initialization.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Sequence

from h2jax.plan import Plan, PlanError


def jax_backends_started() -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API moved: let config.update decide
        return False


# Host devices one process may ask the CPU backend for: each costs start-up time and memory
# (4,096 took 9 s and 0.6 GB on a 2-core machine; 100,000 had not started after 120 s and
# 3.4 GB). $H2JAX_MAX_CPU_DEVICES raises it.
MAX_CPU_DEVICES = 1024


def check_host_devices(n: int) -> None:
    """Refuse, before XLA tries, more forced CPU devices than this machine can host."""
    limit = int(os.environ.get("H2JAX_MAX_CPU_DEVICES", MAX_CPU_DEVICES))
    if n > limit:
        raise PlanError(
            f"the plan's CPU stages need {n:,} host devices (the sum of their meshes' data*tensor) but one "
            f"process hosts at most {limit:,}; shrink the meshes, run the stages as separate MPI processes, "
            "or raise H2JAX_MAX_CPU_DEVICES"
        )


def force_cpu_devices(n: int) -> None:
    """Ask the CPU backend for at least `n` devices (one per mesh position of a plan).

    Must run before JAX creates its backends; XLA_FLAGS is read once, at that moment.
    """
    check_host_devices(n)
    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if match and int(match.group(1)) >= n:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def cpu_devices_needed(plan: Plan) -> int:
    """Host devices a one-process run of `plan` uses: the mesh positions of its CPU stages
    (emulated chips run on the CPU backend too)."""
    from h2jax.cluster import load_chip

    return sum(s.mesh.size for s in plan.stages if load_chip(s.chip).platform == "cpu")


def prepare_local_devices(plan: Plan) -> None:
    """Make the host devices a one-process run of `plan` needs, if JAX has not started yet;
    once it has, refuse a plan it cannot host with the exact fix."""
    need = cpu_devices_needed(plan)
    if need == 0:
        return
    if not jax_backends_started():
        force_cpu_devices(need)
        return
    import jax

    have = len(jax.devices("cpu"))
    if have < need:
        raise PlanError(
            f"the plan's CPU stages need {need} host devices but JAX already started with {have}; "
            f"call h2jax.run before any other use of JAX in this process (it then sets them up), "
            f"or set XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def coordinator_address() -> str:
    host = os.environ.get("H2JAX_COORDINATOR_HOST") or socket.gethostname()
    return f"{host}:{_free_port()}"


def configure_jax(chip: str, local_devices: int, *, group=None, stage_size: int = 1,
                  stage_rank: int = 0, local_device_ids: Sequence[int] | None = None,
                  timeout_s: int = 120) -> None:
    """Select the PJRT platform chip type `chip` runs on (registering a library plugin where
    its chip file names one; `h2jax.backends.select_platforms`), set the CPU device count and,
    for a stage spanning `stage_size` processes, join the stage's `jax.distributed` group.
    `group` is an MPI communicator over the stage's processes (it shares the coordinator's
    address)."""
    if jax_backends_started():
        raise RuntimeError(
            "JAX has already started its backends in this process, so its devices can no longer "
            "be configured for the stage; call configure_process_for_plan() before any JAX "
            "operation (before building arrays, meshes or models)"
        )
    import jax

    from h2jax.backends import platform_devices, select_platforms

    backend = select_platforms([chip])[chip]
    platform = backend.jax_platform
    if platform == "cpu":
        check_host_devices(local_devices)
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", local_devices)
    if stage_size > 1:
        _join_stage_group(platform, group, stage_size, stage_rank, local_device_ids, timeout_s)
    platform_devices(backend)  # starts the backend now: a plugin that cannot load names itself


def _join_stage_group(platform, group, stage_size, stage_rank, local_device_ids, timeout_s) -> None:
    import jax

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


def stage_local_device_ids(plan: Plan, stage_index: int, stage_rank: int) -> list[int] | None:
    """The share of `stages[stage_index].devices` (local ids on its host) of the stage's
    process `stage_rank`, if the plan lists them."""
    stage = plan.stages[stage_index]
    if stage.devices is None:
        return None
    per = stage.mesh.size // stage.processes
    return list(stage.devices[stage_rank * per : (stage_rank + 1) * per])


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
