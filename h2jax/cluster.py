"""Chip types (backends/<name>.toml) and clusters (TOML files listing chip groups).

No JAX import here: the planner reads chip files without touching a backend.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from h2jax.config import ConfigError

PLATFORMS = ("cpu", "cuda", "rocm", "tpu", "oneapi")

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


def chip_from_dict(name: str, raw: Mapping[str, Any], where: str) -> ChipType:
    missing = [k for k in _CHIP_REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}")
    emulate = None
    if "emulate" in raw:
        em = raw["emulate"]
        if "slowdown" not in em or "memory_gib" not in em:
            raise ConfigError(f"{where}: [emulate] needs both 'slowdown' and 'memory_gib'")
        if float(em["slowdown"]) < 1.0:
            raise ConfigError(f"{where}: emulate.slowdown must be >= 1 (the CPU is the fastest it can go)")
        emulate = Emulation(float(em["slowdown"]), float(em["memory_gib"]))
    precision = Precision(**raw.get("precision", {}))
    for key in ("memory_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        if float(raw[key]) <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {raw[key]!r}")
    if int(raw["chips_per_node"]) < 1:
        raise ConfigError(f"{where}: chips_per_node must be >= 1")
    return ChipType(
        name=str(raw.get("name", name)),
        platform=str(raw["platform"]),
        memory_gib=float(raw["memory_gib"]),
        peak_tflops=float(raw["peak_tflops"]),
        chips_per_node=int(raw["chips_per_node"]),
        intra_node_gbps=float(raw["intra_node_gbps"]),
        inter_node_gbps=float(raw["inter_node_gbps"]),
        source=str(raw["source"]),
        plugin=dict(raw.get("plugin", {})),
        emulate=emulate,
        precision=precision,
    )


def load_chip(name: str, directory: Path | None = None) -> ChipType:
    """Read backends/<name>.toml; an unknown name lists the known chip types."""
    directory = directory or backends_dir()
    path = directory / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown chip type {name!r}: no file {path}; known chip types: "
            f"{', '.join(known_chips(directory)) or '(none)'}"
        )
    with path.open("rb") as f:
        raw = tomllib.load(f)
    return chip_from_dict(name, raw, where=str(path))
