"""Configure JAX for a command before JAX initializes its backends."""

from __future__ import annotations

import os
import re


def force_cpu_devices(n: int) -> None:
    """Ask the CPU backend for at least `n` devices (one per mesh position of a plan).

    Must run before JAX creates its backends; XLA_FLAGS is read once, at that moment.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if match and int(match.group(1)) >= n:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
