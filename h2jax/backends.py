"""PJRT backends: which JAX platform each chip type runs on, registered before JAX starts.

A chip file's `platform` names the PJRT platform and its `[plugin]` table says where the
platform comes from:

- `kind = "builtin"`: the CPU backend built into jaxlib, or the standard plugin package JAX
  discovers through its `jax_plugins` namespace package and entry points (CUDA:
  `jax_cuda13_plugin`, ROCm: `jax_rocm7_plugin`, oneAPI: `intel_extension_for_openxla`), or
  `libtpu` for TPUs;
- `kind = "library"` with `path = "/.../pjrt_plugin.so"`: a PJRT C-API plugin loaded from a
  shared library and registered under the chip's platform name through JAX's plugin
  registration call (`jax._src.xla_bridge.register_plugin`).

`select_platforms(chips)` must run before JAX creates its backends (the first
`jax.devices()`): it registers library plugins and sets `jax_platforms` to exactly the
platforms the process needs. Afterwards it only checks that they are there. Nothing here
imports JAX at module level, so resolution (and its errors) costs microseconds.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import pkgutil
import re
from pathlib import Path
from typing import Iterable, Sequence

from h2jax.cluster import ChipType, load_chip
from h2jax.config import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class Provider:
    """Where a standard platform comes from: module names JAX discovers, and what to install."""

    jax_platform: str  # the name JAX's devices report (`device.platform`)
    modules: str  # regular expression over plugin module names
    install: str  # what `pip install` provides it


PROVIDERS: dict[str, Provider] = {
    "cpu": Provider("cpu", r"$^", "jax (built in)"),
    "cuda": Provider("cuda", r"(jax_plugins\.)?(jax_)?cuda\d*(_plugin)?|(jax_plugins\.)?xla_cuda\d*", "jax[cuda13]"),
    "rocm": Provider("rocm", r"(jax_plugins\.)?(jax_)?rocm\d*(_plugin)?|(jax_plugins\.)?xla_rocm\d*", "jax[rocm7-local]"),
    "tpu": Provider("tpu", r"libtpu", "jax[tpu]"),
    "oneapi": Provider("xpu", r"(jax_plugins\.)?intel_extension_for_openxla", "intel-extension-for-openxla"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """A resolved platform: the name JAX knows it by and what provides it."""

    platform: str  # the chip file's platform
    jax_platform: str
    provider: str  # "built in", a plugin module, or a library path
    library_path: str | None = None


def plugin_modules() -> list[str]:
    """PJRT plugin modules installed for JAX to discover (namespace package + entry points),
    found without importing JAX or any plugin."""
    found: set[str] = set()
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        for info in pkgutil.iter_modules(list(spec.submodule_search_locations), "jax_plugins."):
            found.add(info.name)
    for ep in importlib.metadata.entry_points(group="jax_plugins"):
        found.add(ep.value)
    if importlib.util.find_spec("libtpu") is not None:
        found.add("libtpu")
    return sorted(found)


def installed_platforms(modules: Sequence[str] | None = None) -> dict[str, str]:
    """Standard platform -> the installed module that provides it (`cpu` is always there)."""
    modules = plugin_modules() if modules is None else list(modules)
    out = {"cpu": "built in"}
    for platform, provider in PROVIDERS.items():
        for module in modules:
            if re.fullmatch(provider.modules, module):
                out[platform] = module
                break
    return out


def resolve(chip: ChipType, modules: Sequence[str] | None = None) -> Backend:
    """The backend `chip` runs on; a ConfigError naming the fix if it is not available here."""
    kind = chip.plugin.get("kind", "builtin")
    where = f"backends/{chip.name}.toml"
    if kind == "library":
        path = str(chip.plugin.get("path", "")).strip()
        if not path:
            raise ConfigError(
                f"chip type {chip.name!r} runs on PJRT plugin {chip.platform!r}, loaded from a library, "
                f"but {where} sets no [plugin] path; set path to the plugin's .so file"
            )
        if not Path(path).is_file():
            raise ConfigError(
                f"chip type {chip.name!r}: PJRT plugin library {path} (platform {chip.platform!r}, "
                f"[plugin] path in {where}) does not exist; install the vendor's PJRT plugin and "
                "point path at its .so file"
            )
        return Backend(chip.platform, chip.platform, path, library_path=path)
    if kind != "builtin":
        raise ConfigError(
            f"{where}: [plugin] kind {kind!r} is unknown; use \"builtin\" (jaxlib's CPU or an "
            "installed jax_plugins package) or \"library\" with a path to a PJRT plugin .so"
        )
    if chip.platform not in PROVIDERS:
        raise ConfigError(
            f"chip type {chip.name!r}: platform {chip.platform!r} has no standard JAX plugin; "
            f"use one of {', '.join(PROVIDERS)}, or set [plugin] kind = \"library\" and path in {where}"
        )
    installed = installed_platforms(modules)
    if chip.platform not in installed:
        listed = ", ".join(f"{p} ({m})" for p, m in installed.items())
        raise ConfigError(
            f"chip type {chip.name!r} needs JAX platform {chip.platform!r}, which is not installed; "
            f"installed platforms: {listed}. Install it with `pip install \"{PROVIDERS[chip.platform].install}\"`"
        )
    return Backend(chip.platform, PROVIDERS[chip.platform].jax_platform, installed[chip.platform])


def resolve_all(chip_names: Iterable[str]) -> dict[str, Backend]:
    """Chip-type name -> its backend, for each distinct name (errors before JAX starts)."""
    modules = plugin_modules()
    return {name: resolve(load_chip(name), modules) for name in dict.fromkeys(chip_names)}


def select_platforms(chip_names: Iterable[str]) -> dict[str, Backend]:
    """Register and select the platforms these chip types need, before JAX initializes.

    Library plugins are registered with JAX; `jax_platforms` is set to the needed platforms
    (CPU last, always present: the host runs the driver). If JAX's backends already exist,
    only checks that every needed platform is among them.
    """
    backends = resolve_all(chip_names)
    import jax
    from jax._src import xla_bridge

    needed = list(dict.fromkeys(b.jax_platform for b in backends.values()))
    if xla_bridge.backends_are_initialized():
        have = set(xla_bridge.backends())
        missing = [p for p in needed if p not in have]
        if missing:
            raise ConfigError(
                f"JAX already started with platforms {sorted(have)} and cannot add {missing} now; "
                "select the plan's platforms before the first use of JAX (h2jax does this when "
                "it is the first to touch JAX), or set JAX_PLATFORMS accordingly"
            )
        return backends
    for b in backends.values():
        if b.library_path is not None and b.jax_platform not in xla_bridge._backend_factories:
            try:
                xla_bridge.register_plugin(b.jax_platform, library_path=b.library_path)
            except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error type
                raise ConfigError(
                    f"PJRT plugin library {b.library_path} (platform {b.platform!r}) could not be "
                    f"loaded: {str(e).splitlines()[0]}; point [plugin] path at the vendor's PJRT "
                    "plugin .so built for this jaxlib"
                ) from None
    platforms = [p for p in needed if p != "cpu"] + ["cpu"]
    jax.config.update("jax_platforms", ",".join(platforms))
    return backends


def platform_devices(backend: Backend) -> list:
    """The local devices of a resolved backend; a clear error if none can be used."""
    import jax

    try:
        return jax.local_devices(backend=backend.jax_platform)
    except RuntimeError as e:
        raise ConfigError(
            f"platform {backend.platform!r} ({backend.provider}) is installed but has no usable "
            f"device here: {e}"
        ) from None
