"""How this process's C heap treats the large buffers it frees (glibc's malloc).

A training step on a host backend allocates and frees the same large buffers step after step
(XLA's CPU buffers come from malloc), and so does a checkpoint saved while training (its
staging buffer's pages, and an update that writes the new state to fresh buffers while the
old one is still being copied: `StageExecutor.share_state`). glibc's defaults hand such
buffers back to the kernel when freed (a buffer above `mmap_threshold` is its own mapping;
free heap above `trim_threshold` is trimmed) and fault fresh, zeroed pages in when the next
one is allocated: kernel time on the cores the step runs on, every step.

`keep_freed_memory` keeps them in the heap instead: buffers below 32 MiB (glibc's largest
`mmap_threshold`) come from the heap, and up to 1 GiB of free heap stays mapped for the next
allocation. Measured on the `small` model on a 2-core machine (benchmarks/checkpoint.py, three
runs with and three without, in turn, 2026-12-04): saving every step cost +5.4, +5.5 and
+3.9 % of the step against +7.5, +5.4 and +6.5 % without. The price is resident memory: a
process keeps up to 1 GiB of heap it has freed, on top of what it uses.

Set H2JAX_KEEP_FREED_MEMORY=0 to keep glibc's defaults. Elsewhere than glibc (macOS, musl),
nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
ENV = "H2JAX_KEEP_FREED_MEMORY"

_applied = False


def _glibc():
    """The process's C library if it is glibc (whose mallopt numbers these are), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory(libc=None) -> bool:
    """Keep freed buffers below 32 MiB in this process's heap (see the module's docstring);
    whether it is in effect. Once per process; a no-op after the first call, with
    $H2JAX_KEEP_FREED_MEMORY=0, and where the C library is not glibc. `libc`: for tests."""
    global _applied
    if _applied:
        return True
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success. Fixing mmap_threshold also stops glibc's own adjustment
    # of both thresholds, which is what would otherwise move them back.
    _applied = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _applied
