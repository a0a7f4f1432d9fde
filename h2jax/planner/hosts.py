"""Where each stage's processes run: the plan's stages placed on their chip type's hosts.

After the search, `assign_hosts(plan, cluster)` gives every stage of a plan its hosts from
the cluster file's groups: each stage's processes on hosts of its own chip type, each process
holding the same number of one host's chips (the lowest free ids), whole tensor-parallel
groups per process where the host has room for them, stages placed in pipeline order.
"""

from __future__ import annotations

import dataclasses

from h2jax.cluster import Cluster
from h2jax.config import ConfigError
from h2jax.plan import HostSlot, Plan


def _per_process(size: int, tensor: int, per_host: int) -> int:
    """Chips per process for a stage of `size` chips on hosts of `per_host` chips: the most
    that divides the stage and fits a host, keeping tensor-parallel groups whole if it can."""
    fits = [k for k in range(min(size, per_host), 0, -1) if size % k == 0]
    whole = [k for k in fits if k % tensor == 0]
    return (whole or fits)[0]


def assign_hosts(plan: Plan, cluster: Cluster) -> Plan:
    """The plan with every stage's hosts filled in from the cluster's groups; unchanged if no
    group lists hosts. Stages take their chip type's hosts in pipeline order, each process
    the lowest free chips of the first host with room for them."""
    groups = {g.chip.name: g for g in cluster.groups}
    if not any(g.hosts for g in cluster.groups):
        return plan
    free: dict[str, dict[str, list[int]]] = {
        name: {h: list(range(g.chip.chips_per_node)) for h in g.hosts} for name, g in groups.items()
    }
    stages = []
    for i, stage in enumerate(plan.stages):
        group = groups.get(stage.chip)
        if group is None or not group.hosts:
            raise ConfigError(
                f"stages[{i}] runs on {stage.chip!r}, whose cluster group lists no hosts; "
                f"add hosts = [...] (or hostfile = \"...\") to that [[group]], or to none of them"
            )
        per = _per_process(stage.mesh.size, stage.mesh.tensor, group.chip.chips_per_node)
        slots = []
        left = sum(len(ids) for ids in free[stage.chip].values())
        for _ in range(stage.mesh.size // per):
            host = next((h for h, ids in free[stage.chip].items() if len(ids) >= per), None)
            if host is None:
                raise ConfigError(
                    f"stages[{i}] needs {stage.mesh.size} {stage.chip} chips in processes of {per}, "
                    f"but the group's hosts have {left} chips left for it ({len(group.hosts)} hosts x "
                    f"{group.chip.chips_per_node} chips_per_node, earlier stages placed first); list more hosts"
                )
            ids, free[stage.chip][host] = free[stage.chip][host][:per], free[stage.chip][host][per:]
            slots.append(HostSlot(host, tuple(ids)))
        stages.append(dataclasses.replace(stage, processes=len(slots), hosts=tuple(slots)))
    return plan.with_stages(stages)
