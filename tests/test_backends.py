"""Platform resolution: built-in CPU, installed plugin packages, missing platforms, library paths."""

import dataclasses

import pytest

from h2jax import backends
from h2jax.cluster import load_chip
from h2jax.config import ConfigError


def test_cpu_is_builtin_and_selected():
    b = backends.resolve(load_chip("cpu"))
    assert (b.platform, b.jax_platform, b.provider, b.library_path) == ("cpu", "cpu", "built in", None)
    got = backends.select_platforms(["cpu", "emu-fast", "emu-slow"])  # JAX is already up: checks only
    assert {c: b.jax_platform for c, b in got.items()} == {"cpu": "cpu", "emu-fast": "cpu", "emu-slow": "cpu"}
    assert len(backends.platform_devices(got["cpu"])) == 8


@pytest.mark.parametrize("modules, platform, jax_platform", [
    (["jax_cuda13_plugin"], "cuda", "cuda"),
    (["jax_plugins.xla_cuda12"], "cuda", "cuda"),
    (["jax_rocm7_plugin"], "rocm", "rocm"),
    (["libtpu"], "tpu", "tpu"),
    (["jax_plugins.intel_extension_for_openxla"], "oneapi", "xpu"),
])
def test_installed_plugin_package_resolves(modules, platform, jax_platform):
    chip = dataclasses.replace(load_chip("cpu"), name=f"x-{platform}", platform=platform)
    b = backends.resolve(chip, modules=modules)
    assert (b.platform, b.jax_platform, b.provider) == (platform, jax_platform, modules[0])


def test_missing_platform_lists_installed_and_names_the_package():
    with pytest.raises(ConfigError) as e:
        backends.resolve(load_chip("nvidia-h100"), modules=["jax_rocm7_plugin"])
    msg = str(e.value)
    assert "'nvidia-h100' needs JAX platform 'cuda', which is not installed" in msg
    assert "installed platforms: cpu (built in), rocm (jax_rocm7_plugin)" in msg
    assert 'pip install "jax[cuda13]"' in msg


def test_missing_platform_on_this_machine():
    installed = backends.installed_platforms()
    if "cuda" in installed:
        pytest.skip("this machine has a CUDA plugin")
    with pytest.raises(ConfigError, match=r"jax\[cuda13\]"):
        backends.resolve_all(["cpu", "nvidia-h100"])


def test_custom_library_path_must_exist(tmp_path):
    chip = dataclasses.replace(
        load_chip("intel-gaudi2"), plugin={"kind": "library", "path": str(tmp_path / "pjrt_gaudi.so")}
    )
    with pytest.raises(ConfigError, match=r"PJRT plugin library .*pjrt_gaudi\.so \(platform 'gaudi'.*does not exist"):
        backends.resolve(chip)
    (tmp_path / "pjrt_gaudi.so").write_bytes(b"")
    b = backends.resolve(chip)
    assert (b.jax_platform, b.library_path) == ("gaudi", str(tmp_path / "pjrt_gaudi.so"))


def test_library_kind_without_path_says_where_to_set_it():
    with pytest.raises(ConfigError, match=r"backends/huawei-ascend-910b.toml sets no \[plugin\] path"):
        backends.resolve(load_chip("huawei-ascend-910b"))


def test_unknown_platform_and_kind():
    cpu = load_chip("cpu")
    with pytest.raises(ConfigError, match="has no standard JAX plugin"):
        backends.resolve(dataclasses.replace(cpu, platform="npu"))
    with pytest.raises(ConfigError, match=r"\[plugin\] kind 'wheel' is unknown"):
        backends.resolve(dataclasses.replace(cpu, plugin={"kind": "wheel"}))


def test_platform_missing_from_a_started_jax_is_a_clear_error(tmp_path, monkeypatch):
    from h2jax.cluster import backends_dir

    for f in backends_dir().glob("*.toml"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "pjrt_gaudi.so").write_bytes(b"")  # exists, so resolution passes
    gaudi = (tmp_path / "intel-gaudi2.toml").read_text().replace('path = ""', f'path = "{tmp_path / "pjrt_gaudi.so"}"')
    (tmp_path / "intel-gaudi2.toml").write_text(gaudi)
    monkeypatch.setenv("H2JAX_BACKENDS_DIR", str(tmp_path))
    import jax

    jax.devices()  # start JAX (the tests' CPU platform) here: alone or first in a worker, nothing else has
    with pytest.raises(ConfigError, match=r"JAX already started with platforms \['cpu'\] and cannot add \['gaudi'\]"):
        backends.select_platforms(["cpu", "intel-gaudi2"])
