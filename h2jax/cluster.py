"""Chip types (backends/<name>.toml) and clusters (TOML files listing chip groups).

No JAX import here: the planner reads chip files without touching a backend.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

from h2jax.config import ConfigError

PLATFORMS = ("cpu", "cuda", "rocm", "tpu", "oneapi")
# What a chip's [precision] may name: the dtypes stages train in, and JAX's matmul precisions.
DTYPES = ("float32", "bfloat16", "float16")
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
# A chip type is a file stem in backends/: no directories, no "..", no hidden files.
_CHIP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

REPO_ROOT = Path(__file__).resolve().parent.parent


def backends_dir() -> Path:
    """Where chip files live: $H2JAX_BACKENDS_DIR, else the repository's backends/."""
    return Path(os.environ.get("H2JAX_BACKENDS_DIR", REPO_ROOT / "backends"))


@dataclasses.dataclass(frozen=True, slots=True)
class Emulation:
    """A chip emulated on the CPU backend: compute stretched by `slowdown`, memory capped."""

    slowdown: float
    memory_gib: float


@dataclasses.dataclass(frozen=True, slots=True)
class Precision:
    """Numerics a chip trains with: parameter dtype, compute dtype, matmul precision."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    matmul_precision: str = "highest"


ATTENTION_CHOICES = ("fused", "xla")


def default_attention(platform: str) -> str:
    """[kernels] attention when a chip file does not say: "fused" where JAX has the platform's
    own flash kernel (cuDNN on `cuda`), else "xla" (the explicit path; "fused" there means the
    blocked XLA kernel, which trades extra backward compute for memory -- a chip file opts in)."""
    return "fused" if platform == "cuda" else "xla"


@dataclasses.dataclass(frozen=True, slots=True)
class Kernels:
    """Which kernels a chip type runs: `attention` is "fused" (never materializes the s x s
    scores) or "xla" (the explicit path, scores materialized and kept for the backward)."""

    attention: str = "xla"


@dataclasses.dataclass(frozen=True, slots=True)
class EfficiencyCurve:
    """Fraction of dense peak a layer's matmuls reach on `tokens` tokens per device and a layer
    width `width` per device (h2jax.planner.cost_model.efficiency):

        eff(n, w) = max * n/(n + half_tokens) * w/(w + half_width)

    A chip file's [efficiency] table sets it (defaults: the curve below); a measured profile's
    fit replaces it."""

    max: float = 0.75
    half_tokens: float = 256.0
    half_width: float = 256.0


# Defaults of the optional chip-file figures (docs/planner.md, "Chip figures"):
MACHINE_BALANCE = 200.0  # FLOP per HBM byte: hbm_gbps = peak / MACHINE_BALANCE when a file gives none
DEFAULT_DISPATCH_US = 50.0  # host dispatch of one compiled stage program (one stage, one micro-batch)


@dataclasses.dataclass(frozen=True, slots=True)
class ChipType:
    name: str
    platform: str
    memory_gib: float
    peak_tflops: float
    chips_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    source: str
    plugin: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    emulate: Emulation | None = None
    precision: Precision = Precision()
    kernels: Kernels = Kernels()
    # Optional figures (None: the documented default, see the properties below).
    hbm_gbps: float | None = None  # memory bandwidth, GB/s: memory-bound work and the optimizer
    nics_per_node: int | None = None  # NICs sharing inter-node traffic; inter_node_gbps is per NIC
    dispatch_us: float | None = None  # fixed host cost of one stage compute (F or B of a micro-batch)
    efficiency: EfficiencyCurve = EfficiencyCurve()
    # Measured / modelled time of the last stage's head and loss: set by a calibrated profile's
    # fits (h2jax.calibrate), not by chip files.
    head_scale: float = 1.0

    @property
    def hbm_bytes_per_s(self) -> float:
        """HBM bandwidth in bytes/s: the file's hbm_gbps, else peak / MACHINE_BALANCE."""
        if self.hbm_gbps is not None:
            return self.hbm_gbps * 1e9
        return self.peak_tflops * 1e12 / MACHINE_BALANCE

    @property
    def nics(self) -> int:
        """NICs per node: the file's nics_per_node, else one per chip."""
        return self.nics_per_node if self.nics_per_node is not None else self.chips_per_node

    @property
    def dispatch_s(self) -> float:
        return (self.dispatch_us if self.dispatch_us is not None else DEFAULT_DISPATCH_US) * 1e-6

    def inter_node_share_gbps(self, chips_on_node: int) -> float:
        """Inter-node GB/s each of `chips_on_node` chips of one node gets when all of them send
        at once over the node's NICs: min(one NIC, nics x NIC / chips)."""
        k = max(1, min(chips_on_node, self.chips_per_node))
        return min(self.inter_node_gbps, self.nics * self.inter_node_gbps / k)

    @property
    def attention_kernel(self) -> str:
        """The attention kernel this chip's stages run (h2jax.config.ATTENTION_KERNELS): "xla";
        under "fused", cuDNN's flash kernel on `cuda` with a 16-bit compute dtype (it has no f32
        path), else the blocked XLA kernel."""
        if self.kernels.attention == "xla":
            return "xla"
        if self.platform == "cuda" and self.precision.compute_dtype in ("bfloat16", "float16"):
            return "cudnn"
        return "blocked"

    @property
    def is_emulated(self) -> bool:
        return self.emulate is not None

    @property
    def usable_memory_gib(self) -> float:
        return self.emulate.memory_gib if self.emulate else self.memory_gib


_CHIP_REQUIRED = (
    "platform",
    "memory_gib",
    "peak_tflops",
    "chips_per_node",
    "intra_node_gbps",
    "inter_node_gbps",
    "source",
)


def known_chips(directory: Path | None = None) -> list[str]:
    directory = directory or backends_dir()
    return sorted(p.stem for p in directory.glob("*.toml"))


def check_chip_name(name: Any, where: str) -> str:
    """A chip type names a file in backends/: refuse paths (`../x`, `/etc/x`) and non-strings."""
    if not isinstance(name, str) or ".." in name or not _CHIP_NAME.fullmatch(name):
        raise ConfigError(
            f"{where} {name!r} is not a chip type name; use a file name from backends/ without "
            f"directory or .toml (letters, digits, '.', '_', '-'), e.g. \"cpu\""
        )
    return name


def _positive(raw: Mapping[str, Any], key: str, where: str, unit: str) -> float:
    """A finite number > 0: refuses strings, booleans, NaN and infinity, naming the key."""
    value = raw[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: {key} must be a finite positive number ({unit}), got {value!r}")
    return float(value)


def _table(raw: Mapping[str, Any], key: str, where: str, known: tuple[str, ...] | None) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {key} must be a [{key}] table, got {value!r}")
    if known is not None and set(value) - set(known):
        raise ConfigError(
            f"{where}: unknown key(s) {sorted(set(value) - set(known))} in [{key}]; known keys: {', '.join(known)}"
        )
    return value


def _precision(raw: Mapping[str, Any], where: str) -> Precision:
    table = _table(raw, "precision", where, tuple(f.name for f in dataclasses.fields(Precision)))
    for key in ("param_dtype", "compute_dtype"):
        if key in table and table[key] not in DTYPES:
            raise ConfigError(f"{where}: precision.{key} {table[key]!r} is unknown; use one of {', '.join(DTYPES)}")
    if "matmul_precision" in table and table["matmul_precision"] not in MATMUL_PRECISIONS:
        raise ConfigError(
            f"{where}: precision.matmul_precision {table['matmul_precision']!r} is unknown; "
            f"use one of {', '.join(MATMUL_PRECISIONS)}"
        )
    return Precision(**table)


def _kernels(raw: Mapping[str, Any], where: str) -> Kernels:
    table = _table(raw, "kernels", where, tuple(f.name for f in dataclasses.fields(Kernels)))
    attention = table.get("attention", default_attention(str(raw["platform"])))
    if attention not in ATTENTION_CHOICES:
        raise ConfigError(
            f"{where}: kernels.attention {attention!r} is unknown; use \"fused\" (never materializes "
            f"the attention scores) or \"xla\" (the explicit path), or leave it out for the platform's default"
        )
    return Kernels(attention=attention)


def _efficiency(raw: Mapping[str, Any], where: str) -> EfficiencyCurve:
    known = tuple(f.name for f in dataclasses.fields(EfficiencyCurve))
    table = _table(raw, "efficiency", where, known)
    values = {k: _positive(table, k, f"{where}: [efficiency]", "a number") for k in known if k in table}
    if values.get("max", 0.75) > 1.0:
        raise ConfigError(f"{where}: efficiency.max must be <= 1 (a fraction of peak), got {values['max']!r}")
    return EfficiencyCurve(**values)


def _optional_figures(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """hbm_gbps, nics_per_node, dispatch_us: optional; refused when present and invalid."""
    out: dict[str, Any] = {}
    if "hbm_gbps" in raw:
        out["hbm_gbps"] = _positive(raw, "hbm_gbps", where, "GB/s of memory bandwidth")
    if "dispatch_us" in raw:
        v = raw["dispatch_us"]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{where}: dispatch_us must be a finite number >= 0 (microseconds), got {v!r}")
        out["dispatch_us"] = float(v)
    if "nics_per_node" in raw:
        v = raw["nics_per_node"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{where}: nics_per_node must be an integer >= 1, got {v!r}")
        out["nics_per_node"] = v
    return out


def chip_from_dict(name: str, raw: Mapping[str, Any], where: str) -> ChipType:
    missing = [k for k in _CHIP_REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}")
    if raw.get("name", name) != name:
        raise ConfigError(
            f"{where}: name {raw['name']!r} differs from the file's name {name!r}; plans and clusters "
            f"name a chip type by its file, so set name = \"{name}\" (or rename the file)"
        )
    emulate = None
    if "emulate" in raw:
        em = _table(raw, "emulate", where, ("slowdown", "memory_gib"))
        if "slowdown" not in em or "memory_gib" not in em:
            raise ConfigError(f"{where}: [emulate] needs both 'slowdown' and 'memory_gib'")
        slowdown = _positive(em, "slowdown", f"{where}: [emulate]", "times slower than the host")
        if slowdown < 1.0:
            raise ConfigError(f"{where}: emulate.slowdown must be >= 1 (the CPU is the fastest it can go)")
        emulate = Emulation(slowdown, _positive(em, "memory_gib", f"{where}: [emulate]", "GiB"))
    precision = _precision(raw, where)
    units = {"memory_gib": "GiB", "peak_tflops": "TFLOP/s", "intra_node_gbps": "GB/s", "inter_node_gbps": "GB/s"}
    for key, unit in units.items():
        _positive(raw, key, where, unit)
    cpn = raw["chips_per_node"]
    if not isinstance(cpn, int) or isinstance(cpn, bool) or cpn < 1:
        raise ConfigError(f"{where}: chips_per_node must be an integer >= 1, got {cpn!r}")
    for key in ("platform", "source"):
        if not isinstance(raw[key], str) or not raw[key]:
            raise ConfigError(f"{where}: {key} must be a non-empty string, got {raw[key]!r}")
    return ChipType(
        name=name,
        platform=str(raw["platform"]),
        memory_gib=float(raw["memory_gib"]),
        peak_tflops=float(raw["peak_tflops"]),
        chips_per_node=int(raw["chips_per_node"]),
        intra_node_gbps=float(raw["intra_node_gbps"]),
        inter_node_gbps=float(raw["inter_node_gbps"]),
        source=str(raw["source"]),
        plugin=dict(_table(raw, "plugin", where, None)),
        emulate=emulate,
        precision=precision,
        kernels=_kernels(raw, where),
        efficiency=_efficiency(raw, where),
        **_optional_figures(raw, where),
    )


def load_chip(name: str, directory: Path | None = None) -> ChipType:
    """Read backends/<name>.toml; an unknown name lists the known chip types."""
    directory = directory or backends_dir()
    check_chip_name(name, "chip")
    path = directory / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown chip type {name!r}: no file {path}; known chip types: "
            f"{', '.join(known_chips(directory)) or '(none)'}"
        )
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"chip file {path} is not valid TOML: {e}") from None
    return chip_from_dict(name, raw, where=str(path))


# ----------------------------------------------------------------------------- clusters

# Per-group fields that may override the chip file (a site's nodes can differ from the sheet).
_GROUP_OVERRIDES = ("chips_per_node", "intra_node_gbps", "inter_node_gbps", "nics_per_node")
_GROUP_KEYS = ("chip", "count", "hosts", "hostfile") + _GROUP_OVERRIDES


@dataclasses.dataclass(frozen=True, slots=True)
class ChipGroup:
    """`count` chips of one type; `chip` already has the group's overrides applied.
    `hosts`: the nodes they sit on (`chip.chips_per_node` each), when the cluster file lists them."""

    chip: ChipType
    count: int
    hosts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    """Chip groups, at most one per chip type, in the order the cluster file lists them."""

    groups: tuple[ChipGroup, ...]
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError(f"cluster {self.name!r} has no [[group]]; add at least one chip group")
        seen: set[str] = set()
        for g in self.groups:
            if g.chip.name in seen:
                raise ConfigError(
                    f"cluster {self.name!r} lists chip type {g.chip.name!r} twice; "
                    "merge the groups into one (counts add up)"
                )
            seen.add(g.chip.name)
            if g.count < 1:
                raise ConfigError(f"cluster {self.name!r}: group {g.chip.name!r} count must be >= 1")
        host_group: dict[str, str] = {}
        for g in self.groups:
            for h in g.hosts:
                if h in host_group:
                    raise ConfigError(
                        f"cluster {self.name!r}: host {h!r} is listed in both group {host_group[h]!r} "
                        f"and group {g.chip.name!r}; a host holds chips of one type"
                    )
                host_group[h] = g.chip.name

    @property
    def chips(self) -> dict[str, ChipType]:
        return {g.chip.name: g.chip for g in self.groups}

    @property
    def counts(self) -> dict[str, int]:
        return {g.chip.name: g.count for g in self.groups}

    @property
    def n_chips(self) -> int:
        return sum(g.count for g in self.groups)

    def only(self, chip_name: str) -> "Cluster":
        """The sub-cluster of one chip type (for homogeneous baselines)."""
        groups = tuple(g for g in self.groups if g.chip.name == chip_name)
        if not groups:
            raise ConfigError(
                f"cluster {self.name!r} has no chip type {chip_name!r}; it has {', '.join(self.chips)}"
            )
        return Cluster(groups, name=f"{self.name}[{chip_name}]")


def cluster_from_dict(raw: Mapping[str, Any], where: str, directory: Path | None = None) -> Cluster:
    """Parse `{name?, group: [{chip, count, chips_per_node?, intra_node_gbps?, inter_node_gbps?,
    hosts? | hostfile?}]}`; a group that lists hosts may leave out `count` (all their chips)."""
    unknown = sorted(set(raw) - {"name", "description", "group"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown top-level key(s) {unknown}; a cluster file has `name`, "
            "`description` and [[group]] tables"
        )
    groups_raw = raw.get("group")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ConfigError(
            f"{where}: no [[group]] tables; add e.g.\n[[group]]\nchip = \"nvidia-h100\"\ncount = 8"
        )
    groups = []
    for i, g in enumerate(groups_raw):
        gw = f"{where}: group[{i}]"
        if not isinstance(g, Mapping):
            raise ConfigError(f"{gw} must be a table with `chip` and `count`")
        bad = sorted(set(g) - set(_GROUP_KEYS))
        if bad:
            raise ConfigError(f"{gw}: unknown key(s) {bad}; known keys: {', '.join(_GROUP_KEYS)}")
        if "chip" not in g:
            raise ConfigError(
                f"{gw}.chip is missing; name a chip type, one of: {', '.join(known_chips(directory))}"
            )
        hosts = _group_hosts(g, gw, Path(where).parent)
        count = g.get("count")
        if count is None and hosts:
            count = -1  # filled in below: every chip of every listed host
        elif not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"{gw}.count must be an integer >= 1, got {count!r}")
        chip = load_chip(str(g["chip"]), directory)
        overrides: dict[str, Any] = {}
        for key in _GROUP_OVERRIDES:
            if key in g:
                value = g[key]
                if key in ("chips_per_node", "nics_per_node"):
                    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                        raise ConfigError(f"{gw}.{key} must be an integer >= 1, got {value!r}")
                elif (not isinstance(value, (int, float)) or isinstance(value, bool)
                      or not math.isfinite(value) or value <= 0):
                    raise ConfigError(f"{gw}.{key} must be a positive, finite number (GB/s per chip), got {value!r}")
                overrides[key] = int(value) if key == "nics_per_node" else type(getattr(chip, key))(value)
        if overrides:
            chip = dataclasses.replace(
                chip, source=f"{chip.source}; overridden by {where}: {sorted(overrides)}", **overrides
            )
        if hosts:
            room = len(hosts) * chip.chips_per_node
            if count == -1:
                count = room
            elif count > room:
                raise ConfigError(
                    f"{gw}.count ({count}) is more than its {len(hosts)} host(s) x chips_per_node "
                    f"({chip.chips_per_node}) = {room}; list more hosts, set chips_per_node, or lower count"
                )
        groups.append(ChipGroup(chip, count, tuple(hosts)))
    return Cluster(tuple(groups), name=str(raw.get("name", where)))


def _group_hosts(g: Mapping[str, Any], gw: str, base: Path) -> list[str]:
    """A group's hosts: `hosts = ["h100-[01-04]"]` (SLURM-style ranges) or `hostfile = "..."`
    (relative to the cluster file)."""
    from h2jax.launch.hosts import expand_hosts, read_hostfile

    if "hosts" in g and "hostfile" in g:
        raise ConfigError(f"{gw} sets both hosts and hostfile; keep one")
    if "hostfile" in g:
        if not isinstance(g["hostfile"], str):
            raise ConfigError(f"{gw}.hostfile must be a path, got {g['hostfile']!r}")
        return read_hostfile(base / g["hostfile"])
    if "hosts" in g:
        spec = g["hosts"]
        if isinstance(spec, str):
            spec = [spec]
        if not isinstance(spec, list) or not spec:
            raise ConfigError(f"{gw}.hosts must be a list of host names or ranges, e.g. [\"h100-[01-04]\"]")
        return expand_hosts(spec)
    return []


def load_cluster(path: str | Path, directory: Path | None = None) -> Cluster:
    """Read a cluster TOML file; unknown chip types list the known ones."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster file {path} does not exist; see plans/cluster-*.toml for examples")
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cluster file {path} is not valid TOML: {e}") from None
    raw.setdefault("name", path.stem)
    return cluster_from_dict(raw, where=str(path), directory=directory)
