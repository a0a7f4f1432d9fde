"""Test setup: 8 forced CPU devices (set before JAX initializes) and shared fixtures."""

import os

# Tests run tiny models, where XLA's compile time dwarfs run time. The CPU compiler's
# fusion emitters and LLVM optimization cost seconds per program and buy nothing at this
# size: off, a stage compiles ~5x faster. Numerics are what the tests compare, and both
# sides of every comparison compile under the same flags. (MPI jobs inherit them.)
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
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


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    from h2jax.data import synthetic_dataset

    return synthetic_dataset(tmp_path_factory.mktemp("data") / "tokens.u8", seq_len=16).path


def skip_if_fewer_devices(n: int):
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices")
