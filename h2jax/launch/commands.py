"""Launcher command lines for a plan whose stages record hosts.

Every rank runs on the host its stage's `hosts` names, sees only its own chips through the
vendor's visibility variable, and loads only its own platform (`JAX_PLATFORMS`). Three
launchers, one rank table (`h2jax.launch.hosts.placements`):

- MPICH (hydra): a hostfile with `host:n` lines in rank order (hydra places ranks in the
  file's order, repeats included) and one `-n k -env ...` segment per run of ranks with the
  same environment. When every host is this machine (127.0.0.0/8, `localhost`, its own name)
  hydra's default ssh launcher would try to log in to itself; `-launcher fork` starts the
  proxies locally, and hydra still tells each rank the host it was placed on (PMI_HOSTNAME).
- Open MPI: one `-np k --host h:k -x VAR=value ...` application context per run of ranks on
  one host with one environment.
- SLURM, inside an allocation: `srun --distribution=arbitrary --multi-prog` with
  `SLURM_HOSTFILE` naming each task's node; in a heterogeneous allocation
  (`SLURM_HET_SIZE`), one `--het-group` component per run of ranks on one component's nodes.

No JAX import: a launcher node builds the command without a backend.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex
import socket
from pathlib import Path
from typing import Mapping, Sequence

from h2jax.config import ConfigError
from h2jax.launch.hosts import Placement, expand_hosts, placements

LAUNCHERS = ("mpich", "openmpi", "slurm")

# TPU chips per process -> TPU_CHIPS_PER_PROCESS_BOUNDS (x,y,z) of the host's chip grid.
_TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
_TPU_BASE_PORT = 8476


def visibility_env(platform: str, devices: Sequence[int], index_on_host: int = 0) -> dict[str, str]:
    """The vendor variables that make a process see exactly `devices` (local chip ids) of
    its host. `index_on_host`: this process's place among the job's processes on the host
    (TPU processes sharing a host need their own ports)."""
    ids = ",".join(str(d) for d in devices)
    if platform == "cpu":
        return {}  # the CPU backend's device count is set per process (jax_num_cpu_devices)
    if platform == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ids}
    if platform == "rocm":
        # ROCR selects physical GPUs; HIP indexes into what ROCR left, so it names them 0..k-1
        # (and overrides any HIP_VISIBLE_DEVICES inherited from the environment).
        return {"ROCR_VISIBLE_DEVICES": ids, "HIP_VISIBLE_DEVICES": ",".join(map(str, range(len(devices))))}
    if platform == "tpu":
        if len(devices) not in _TPU_BOUNDS:
            raise ConfigError(
                f"a TPU process gets {len(devices)} chips, but libtpu's process bounds exist for "
                f"{sorted(_TPU_BOUNDS)} chips per process; plan stages whose processes hold that many"
            )
        return {
            "TPU_VISIBLE_CHIPS": ids,
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _TPU_BOUNDS[len(devices)],
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(_TPU_BASE_PORT + index_on_host),
        }
    if platform == "gaudi":
        return {"HABANA_VISIBLE_MODULES": ids}
    if platform == "ascend":
        return {"ASCEND_RT_VISIBLE_DEVICES": ids}
    if platform == "oneapi":
        return {"ZE_AFFINITY_MASK": ids}
    raise ConfigError(
        f"h2jax launch does not know how to give a {platform!r} process its own chips; "
        "supported platforms: cpu, cuda, rocm, tpu, gaudi, ascend, oneapi"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Rank:
    """One rank of the job: where it runs and the environment the launcher gives it."""

    place: Placement
    platform: str  # the chip file's platform
    env: Mapping[str, str]


def ranks(plan) -> list[Rank]:
    """Every rank's placement, platform and environment (visibility + JAX_PLATFORMS)."""
    from h2jax.backends import PROVIDERS
    from h2jax.cluster import load_chip

    out: list[Rank] = []
    on_host: dict[str, int] = {}
    for place in placements(plan):
        platform = load_chip(place.chip).platform
        index = on_host.get(place.host, 0)
        on_host[place.host] = index + 1
        jax_platform = PROVIDERS[platform].jax_platform if platform in PROVIDERS else platform
        env = dict(visibility_env(platform, place.devices, index))
        # Only this platform's plugin starts (the host CPU runs the driver, so it stays).
        env["JAX_PLATFORMS"] = jax_platform if jax_platform == "cpu" else f"{jax_platform},cpu"
        out.append(Rank(place, platform, env))
    return out


@dataclasses.dataclass
class LaunchCommand:
    """What `h2jax launch` runs: argv, extra environment for the launcher itself, the files
    to write first (path -> text), and the rank table."""

    launcher: str
    argv: list[str]
    files: dict[str, str]
    ranks: list[Rank]
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def shell(self) -> str:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        return prefix + " ".join(shlex.quote(a) for a in self.argv)

    def table(self) -> str:
        rows = [("rank", "host", "stage", "chip", "devices", "environment")]
        for r in self.ranks:
            p = r.place
            visible = " ".join(f"{k}={v}" for k, v in r.env.items())
            rows.append((str(p.rank), p.host, str(p.stage), p.chip, ",".join(map(str, p.devices)), visible))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
        )


def _runs(rs: Sequence[Rank], same_host: bool) -> list[list[Rank]]:
    """Consecutive ranks grouped while their environment (and, if asked, host) stays the same."""
    out: list[list[Rank]] = []
    for r in rs:
        if out and out[-1][0].env == r.env and (not same_host or out[-1][0].place.host == r.place.host):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _env_args(flag: str, env: Mapping[str, str], joined: bool) -> list[str]:
    out: list[str] = []
    for k, v in env.items():
        out += [flag, f"{k}={v}"] if joined else [flag, k, v]
    return out


def _is_this_machine(host: str) -> bool:
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def mpich(rs: list[Rank], args: Sequence[str], files_dir: Path) -> LaunchCommand:
    hostfile = files_dir / "hosts"
    lines: list[list] = []  # [host, ranks]: consecutive ranks on one host share a line
    for r in rs:
        if lines and lines[-1][0] == r.place.host:
            lines[-1][1] += 1
        else:
            lines.append([r.place.host, 1])
    argv = ["mpiexec", "-f", str(hostfile)]
    if all(_is_this_machine(r.place.host) for r in rs):
        argv += ["-launcher", "fork"]
    for i, run in enumerate(_runs(rs, same_host=False)):
        argv += ([":"] if i else []) + ["-n", str(len(run))] + _env_args("-env", run[0].env, False) + list(args)
    return LaunchCommand("mpich", argv, {str(hostfile): "".join(f"{h}:{n}\n" for h, n in lines)}, rs)


def openmpi(rs: list[Rank], args: Sequence[str], files_dir: Path) -> LaunchCommand:
    argv = ["mpirun"]
    for i, run in enumerate(_runs(rs, same_host=True)):
        n = len(run)
        argv += ([":"] if i else []) + ["-np", str(n), "--host", f"{run[0].place.host}:{n}"]
        argv += _env_args("-x", run[0].env, True) + list(args)
    return LaunchCommand("openmpi", argv, {}, rs)


def allocation_hosts(environ: Mapping[str, str]) -> dict[str, int]:
    """Host -> heterogeneous-job component (0 for a plain allocation) from SLURM's variables."""
    het = environ.get("SLURM_HET_SIZE")
    if het:
        out: dict[str, int] = {}
        for g in range(int(het)):
            nodes = environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}")
            if not nodes:
                raise ConfigError(f"SLURM_HET_SIZE is {het} but SLURM_JOB_NODELIST_HET_GROUP_{g} is not set")
            out.update({h: g for h in expand_hosts(nodes)})
        return out
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodes:
        raise ConfigError(
            "--launcher slurm runs inside an allocation, but SLURM_JOB_NODELIST is not set; "
            "get one first (salloc/sbatch with the plan's hosts, e.g. salloc --nodelist=...)"
        )
    return {h: 0 for h in expand_hosts(nodes)}


def slurm(rs: list[Rank], args: Sequence[str], files_dir: Path, environ: Mapping[str, str]) -> LaunchCommand:
    alloc = allocation_hosts(environ)
    missing = [h for h in dict.fromkeys(r.place.host for r in rs) if h not in alloc]
    if missing:
        raise ConfigError(
            f"the plan runs ranks on {', '.join(missing)}, which the SLURM allocation does not hold "
            f"(it has {', '.join(alloc)}); allocate them (salloc --nodelist=...) or re-plan with this allocation's hosts"
        )
    if "SLURM_HET_SIZE" in environ:
        return _slurm_het(rs, args, alloc)
    hostfile, conf = files_dir / "slurm-hosts", files_dir / "multi-prog.conf"
    lines = []
    for run in _runs(rs, same_host=False):
        first, last = run[0].place.rank, run[-1].place.rank
        spec = str(first) if first == last else f"{first}-{last}"
        env = [f"{k}={v}" for k, v in run[0].env.items()]
        lines.append(" ".join([spec, "env", *map(shlex.quote, env), *map(shlex.quote, args)]))
    argv = ["srun", f"--ntasks={len(rs)}", "--distribution=arbitrary", "--multi-prog", str(conf)]
    files = {str(hostfile): "".join(f"{r.place.host}\n" for r in rs), str(conf): "\n".join(lines) + "\n"}
    return LaunchCommand("slurm", argv, files, rs, env={"SLURM_HOSTFILE": str(hostfile)})


def _slurm_het(rs: list[Rank], args: Sequence[str], alloc: Mapping[str, int]) -> LaunchCommand:
    """One `--het-group` component per run of ranks in one component with one environment
    and the same number of tasks on each of its nodes, in block order (SLURM's default
    layout), so task ids follow the plan's ranks."""
    comps: list[list[list[Rank]]] = []  # component -> its nodes' blocks of ranks
    for r in rs:
        blocks = comps[-1] if comps else None
        same = blocks and blocks[0][0].env == r.env and alloc[blocks[0][0].place.host] == alloc[r.place.host]
        if same and blocks[-1][0].place.host == r.place.host and (len(blocks) == 1 or len(blocks[-1]) < len(blocks[0])):
            blocks[-1].append(r)
        elif same and len(blocks[-1]) == len(blocks[0]) and all(b[0].place.host != r.place.host for b in blocks):
            blocks.append([r])
        else:
            comps.append([[r]])
    argv = ["srun"]
    for i, blocks in enumerate(comps):
        if len(blocks) > 1 and len(blocks[-1]) < len(blocks[0]):  # a short last node: its own component
            comps.insert(i + 1, [blocks.pop()])
        hosts = [b[0].place.host for b in blocks]
        first = blocks[0][0]
        argv += ([":"] if i else []) + [
            f"--het-group={alloc[first.place.host]}", f"--nodelist={','.join(hosts)}", f"--nodes={len(hosts)}",
            f"--ntasks={sum(map(len, blocks))}", f"--ntasks-per-node={len(blocks[0])}",
            "env", *(f"{k}={v}" for k, v in first.env.items()), *args,
        ]
    return LaunchCommand("slurm", argv, {}, rs)


def build(plan, launcher: str, args: Sequence[str], files_dir: Path,
          environ: Mapping[str, str] | None = None) -> LaunchCommand:
    """The launch of `plan` with `launcher`; `args` is what every rank runs."""
    import os

    rs = ranks(plan)
    if launcher == "mpich":
        return mpich(rs, args, files_dir)
    if launcher == "openmpi":
        return openmpi(rs, args, files_dir)
    if launcher == "slurm":
        return slurm(rs, args, files_dir, os.environ if environ is None else environ)
    raise ConfigError(f"--launcher {launcher!r} is unknown; use one of {', '.join(LAUNCHERS)}")
