"""Host names: SLURM-style range expansion, hostfiles, and placing a plan's stages on hosts.

`expand_hosts("h100-[01-04],a100-7")` gives `h100-01 .. h100-04, a100-7` (zero padding kept,
several brackets multiply, `[1,3,5-7]` lists); it also reads `SLURM_JOB_NODELIST`.
`placements(plan)` lists every rank of a plan whose stages record hosts (the planner puts
them there: `h2jax.planner.hosts.assign_hosts`) with its stage, host and chips.

No JAX import, nothing of the plan or the cluster modules: cluster files and the launcher
both use this.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterable, Sequence

from h2jax.config import ConfigError

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text!r} has a ']' without its '['")
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"host list {text!r} has a '[' without its ']'")
    out.append(text[start:])
    return [p.strip() for p in out if p.strip()]


def _range_values(body: str, where: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ConfigError(
                f"host range [{body}] in {where!r}: {part!r} is not a number or a range lo-hi; "
                "write e.g. node[01-04,07]"
            )
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"host range [{body}] in {where!r}: {part} runs backwards; write {hi}-{lo}")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _expand_one(pattern: str) -> list[str]:
    m = _BRACKET.search(pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [h for v in _range_values(m.group(1), pattern) for h in _expand_one(head + v + tail)]


def expand_hosts(spec: str | Sequence[str]) -> list[str]:
    """Host names from SLURM-style range patterns, in order, duplicates refused."""
    patterns = [spec] if isinstance(spec, str) else list(spec)
    hosts: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(f"a host pattern must be a string, got {pattern!r}")
        for part in _split_top_level(pattern):
            hosts.extend(_expand_one(part))
    seen: set[str] = set()
    for h in hosts:
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", h):
            raise ConfigError(f"host name {h!r} has characters a host name cannot have")
        if h in seen:
            raise ConfigError(f"host {h!r} is listed twice; list each host once")
        seen.add(h)
    return hosts


def read_hostfile(path: str | Path) -> list[str]:
    """Hosts from a hostfile: one per line, `#` comments; MPICH `host:N` and Open MPI
    `host slots=N` forms are accepted (the count is ignored: chips per host come from the
    cluster file's `chips_per_node`). Range patterns are expanded."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hostfile {path} does not exist; write one host name per line")
    patterns = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0]
        if ":" in name and name.rsplit(":", 1)[1].isdigit():
            name = name.rsplit(":", 1)[0]
        patterns.append(name)
    if not patterns:
        raise ConfigError(f"hostfile {path} lists no hosts")
    return expand_hosts(patterns)


# ----------------------------------------------------------------------------- placement


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one MPI rank runs: its stage, its host, and that host's chips it gets."""

    rank: int
    stage: int
    chip: str
    host: str
    devices: tuple[int, ...]


def placements(plan) -> list[Placement]:
    """Rank -> placement for a plan whose stages record hosts (ranks fill stages in order,
    a stage's processes in the order of its `hosts`)."""
    out: list[Placement] = []
    for i, stage in enumerate(plan.stages):
        if stage.hosts is None:
            raise ConfigError(
                f"stages[{i}] records no hosts; plan with a cluster file whose groups list `hosts` "
                "(or add \"hosts\": [{\"host\": ..., \"devices\": [...]}] to the stage)"
            )
        for slot in stage.hosts:
            out.append(Placement(len(out), i, stage.chip, slot.host, slot.devices))
    return out


def hosts_of(places: Iterable[Placement]) -> list[str]:
    """Distinct hosts in rank order."""
    return list(dict.fromkeys(p.host for p in places))
