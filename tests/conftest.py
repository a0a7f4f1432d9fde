"""Test setup: 8 forced CPU devices (set before JAX initializes) and shared fixtures."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`: XLA exits the process (status 1, a line on
    stderr that pytest swallows) on an unknown flag in XLA_FLAGS. jaxlib 0.10.2 knows
    --xla_cpu_use_fusion_emitters; 0.11.2 does not (seen on 2026-11-29). Probed in a
    subprocess (about a second) only from jaxlib 0.11 on."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        major, minor = 0, 0
    if (major, minor) < (0, 11):
        return True
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return probe.returncode == 0


# Tests run tiny models, where XLA's compile time dwarfs run time. The CPU compiler's
# fusion emitters and LLVM optimization cost seconds per program and buy nothing at this
# size: off, a stage compiles ~5x faster. Numerics are what the tests compare, and both
# sides of every comparison compile under the same flags. (MPI jobs inherit them.) Newer
# XLA has no switch for the fusion emitters; there only the optimization level is set.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if _xla_accepts("--xla_cpu_use_fusion_emitters=false"):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + TEST_XLA_FLAGS
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# Many tests compile the same stage programs; a persistent cache shared by the session's
# processes (and by the MPI jobs it launches) turns repeats into cache hits.
_CACHE = os.environ.setdefault("H2JAX_TEST_JAX_CACHE", "/tmp/h2jax-test-jax-cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core this process may use, at most 4
    (each worker's MPI tests start up to 4 ranks of 8 forced devices)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4, cores)


@pytest.fixture(autouse=True)
def _emulated_programs_measured_afresh(monkeypatch):
    """Each test's emulated clocks start from nothing: the least time per program is shared
    by a process's runs (h2jax.runtime.emulation.SHARED_LEAST), which must not reach from one
    test into the next (a test's timings would depend on which tests ran before it)."""
    from h2jax.runtime import emulation

    monkeypatch.setattr(emulation, "SHARED_LEAST", {})


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    from h2jax.data import synthetic_dataset

    return synthetic_dataset(tmp_path_factory.mktemp("data") / "tokens.u8", seq_len=16).path


REPO_ROOT = Path(__file__).resolve().parent.parent


def checkout_env(env: dict) -> dict:
    """`env` for a process the tests launch (mpiexec ranks, `python -m h2jax`): the checkout
    under test first on PYTHONPATH, so a rank imports this tree's h2jax, not whichever one
    is installed (an editable install may point at another clone)."""
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def skip_if_fewer_devices(n: int):
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices")
