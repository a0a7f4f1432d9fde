"""Which local devices each stage of a single-process run uses."""

from __future__ import annotations

import jax

from h2jax.plan import Plan, check_devices


def assign_devices(plan: Plan, devices: list | None = None) -> dict[int, list]:
    """Stage index -> its devices (data-major). Stages that list `devices` get those ids;
    the others take the next unused devices in order."""
    devices = list(devices if devices is not None else jax.devices())
    check_devices(plan, len(devices), devices[0].platform if devices else "cpu")
    taken = {d for s in plan.stages for d in (s.devices or ())}
    free = [i for i in range(len(devices)) if i not in taken]
    out: dict[int, list] = {}
    for i, stage in enumerate(plan.stages):
        if stage.devices is not None:
            ids = list(stage.devices)
        else:
            ids, free = free[: stage.mesh.size], free[stage.mesh.size:]
        out[i] = [devices[d] for d in ids]
    return out
