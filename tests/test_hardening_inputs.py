"""Malformed plan files, chip files and token files: each gets exit status 2 and one line
naming the field (or flag) and the fix, never a traceback, and nothing is silently accepted."""

import copy
import json
import os
import threading
from pathlib import Path

import pytest

from h2jax.cli import main as cli_main
from h2jax.cluster import load_chip
from h2jax.config import ConfigError
from h2jax.plan import load_plan, plan_from_dict, save_plan

REPO = Path(__file__).resolve().parent.parent
PLAN = {
    "format_version": 1,
    "model": "tiny",
    "seq_len": 16,
    "global_batch": 8,
    "micro_batch": 2,
    "seed": 0,
    "optimizer": {"name": "adamw", "learning_rate": 0.003, "clip_norm": 1.0},
    "stages": [
        {"chip": "cpu", "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
        {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4]},
    ],
}


def _cli(argv, capsys) -> tuple[int, str]:
    """Exit status and stderr of `h2jax ARGV` run in this process."""
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _set(raw: dict, dotted: str, value) -> dict:
    raw = copy.deepcopy(raw)
    *path, last = dotted.split(".")
    node = raw
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return raw


# (field to set, value, what the one error line must name)
PLAN_CASES = [
    ("seed", -1, "seed"),
    ("seed", 2**64, "seed"),
    ("seed", "1", "seed"),
    ("optimizer.learning_rate", "0.01", "optimizer.learning_rate"),
    ("optimizer.learning_rate", float("inf"), "optimizer.learning_rate"),
    ("optimizer.learning_rate", float("nan"), "optimizer.learning_rate"),
    ("optimizer.clip_norm", "1.0", "optimizer.clip_norm"),
    ("optimizer.clip_norm", float("inf"), "optimizer.clip_norm"),
    ("optimizer.b1", 1.0, "optimizer.b1"),
    ("optimizer.b2", 1.5, "optimizer.b2"),
    ("optimizer.b1", -0.1, "optimizer.b1"),
    ("optimizer.eps", -1e-8, "optimizer.eps"),
    ("optimizer.weight_decay", -0.1, "optimizer.weight_decay"),
    ("optimizer.weight_decay", True, "optimizer.weight_decay"),
    ("optimizer.name", 5, "optimizer.name"),
    ("stages.0.chip", "../backends/cpu", "stages[0].chip"),
    ("stages.0.chip", "/etc/passwd", "stages[0].chip"),
    ("stages.0.chip", 7, "stages[0].chip"),
    ("predicted", {"memory_gib": "lots"}, "predicted.memory_gib"),
    ("predicted", {"memory_gib": [1.0]}, "predicted.memory_gib"),
    ("predicted", {"memory_gib": [1.0, "x"]}, "predicted.memory_gib[1]"),
    ("predicted", [1, 2], "predicted"),
]


@pytest.mark.parametrize("field, value, names", PLAN_CASES, ids=[f"{c[0]}={c[1]!r}" for c in PLAN_CASES])
def test_a_bad_plan_field_is_one_error_naming_it(field, value, names, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_set(PLAN, field, value)))
    rc, err = _cli(["show", path], capsys)
    assert rc == 2
    assert names in _one_error_line(err)


def test_the_unmodified_fuzz_base_is_a_valid_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    assert _cli(["show", path], capsys)[0] == 0


@pytest.mark.parametrize(
    "content, names",
    [
        (b'{"format_version": 1, "model": "tiny\xff\xfe"}', "UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nests JSON too deeply"),
        (b"{" * 50, "not valid JSON"),
        (b"", "not valid JSON"),
    ],
    ids=["invalid-utf8", "deeply-nested", "truncated", "empty"],
)
def test_an_unreadable_plan_file_is_one_error(content, names, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    rc, err = _cli(["show", path], capsys)
    assert rc == 2
    line = _one_error_line(err)
    assert names in line and str(path) in line


def test_concurrent_saves_of_one_plan_never_fail(tmp_path):
    """Each writer renames its own uniquely named temporary file: none collides, none is left."""
    plan = plan_from_dict(PLAN)
    target = tmp_path / "sub" / "plan.json"  # a missing directory is created
    errors: list[BaseException] = []

    def writer():
        try:
            for _ in range(25):
                save_plan(plan, target)
        except BaseException as e:  # noqa: BLE001 -- any failure fails the test
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert load_plan(target) == plan
    assert sorted(os.listdir(target.parent)) == ["plan.json"]
    assert (target.stat().st_mode & 0o777) == 0o644


# ------------------------------------------------------------------------------ chip files

CHIP = """name = "{name}"
platform = "cpu"
memory_gib = 16.0
peak_tflops = 0.5
chips_per_node = 8
intra_node_gbps = 20.0
inter_node_gbps = 10.0
source = "test"

[plugin]
kind = "builtin"

[precision]
param_dtype = "float32"
compute_dtype = "float32"
matmul_precision = "highest"
"""


def _chip_text(replace: tuple[str, str] | None = None, append: str = "", name: str = "bad") -> str:
    text = CHIP.format(name=name)
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    return text + append


CHIP_CASES = [
    (("memory_gib = 16.0", 'memory_gib = "16"'), "", "memory_gib"),
    (("memory_gib = 16.0", "memory_gib = nan"), "", "memory_gib"),
    (("peak_tflops = 0.5", "peak_tflops = inf"), "", "peak_tflops"),
    (("intra_node_gbps = 20.0", "intra_node_gbps = -inf"), "", "intra_node_gbps"),
    (("inter_node_gbps = 10.0", 'inter_node_gbps = "fast"'), "", "inter_node_gbps"),
    (("chips_per_node = 8", "chips_per_node = 8.5"), "", "chips_per_node"),
    (("chips_per_node = 8", "chips_per_node = nan"), "", "chips_per_node"),
    (("chips_per_node = 8", 'chips_per_node = "8"'), "", "chips_per_node"),
    (("param_dtype = \"float32\"", "param_dtype = \"float8\""), "", "precision.param_dtype"),
    (("compute_dtype = \"float32\"", "compute_dtype = \"f32\""), "", "precision.compute_dtype"),
    (("matmul_precision = \"highest\"", "matmul_precision = \"ultra\""), "", "precision.matmul_precision"),
    (("matmul_precision = \"highest\"", "matmul_precison = \"high\""), "", "[precision]"),
    (None, "\n[emulate]\nslowdown = 2.0\nmemory_gib = -1\n", "memory_gib"),
    (None, "\n[emulate]\nslowdown = nan\nmemory_gib = 1\n", "slowdown"),
    (None, "\n[emulate]\nslowdown = 0.5\nmemory_gib = 1\n", "slowdown"),
    (("[plugin]", "emulate = 5\n[plugin]"), "", "emulate"),
    (("name = \"bad\"", "name = \"other\""), "", "name"),
    (("source = \"test\"", "source = \"test"), "", "not valid TOML"),
]


@pytest.mark.parametrize("replace, append, names", CHIP_CASES, ids=[c[2] + str(i) for i, c in enumerate(CHIP_CASES)])
def test_a_bad_chip_file_is_one_error_naming_the_field(replace, append, names, tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.toml").write_text(_chip_text(replace, append))
    with pytest.raises(ConfigError, match="bad.toml") as info:
        load_chip("bad", tmp_path)
    assert names in str(info.value)
    # Through the command line: the planner reads the chip file, exit 2, one line.
    monkeypatch.setenv("H2JAX_BACKENDS_DIR", str(tmp_path))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[[group]]\nchip = "bad"\ncount = 2\n')
    rc, err = _cli(["plan", "--cluster", cluster, "--model", "tiny", "--seq-len", "16", "--global-batch", "8"], capsys)
    assert rc == 2
    assert names in _one_error_line(err)


def test_the_unmodified_chip_file_loads(tmp_path):
    (tmp_path / "bad.toml").write_text(_chip_text())
    chip = load_chip("bad", tmp_path)
    assert chip.name == "bad" and chip.chips_per_node == 8 and chip.precision.matmul_precision == "highest"


def test_invalid_utf8_in_a_chip_file_is_one_error(tmp_path):
    (tmp_path / "bad.toml").write_bytes(_chip_text().encode() + b'\nsource2 = "\xff"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_chip("bad", tmp_path)


@pytest.mark.parametrize("name", ["../backends/cpu", "/etc/hosts", "..", ".hidden", "a/b", ""])
def test_a_chip_name_that_is_a_path_is_refused(name, tmp_path):
    with pytest.raises(ConfigError, match="not a chip type name"):
        load_chip(name)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'[[group]]\nchip = "{name}"\ncount = 2\n')
    from h2jax.cluster import load_cluster

    with pytest.raises(ConfigError, match="not a chip type name"):
        load_cluster(cluster)


@pytest.mark.parametrize("key, value", [("intra_node_gbps", "nan"), ("inter_node_gbps", "inf"),
                                        ("chips_per_node", "2.5"), ("intra_node_gbps", "-1.0")])
def test_a_bad_cluster_override_names_the_group_field(key, value, tmp_path):
    from h2jax.cluster import load_cluster

    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'[[group]]\nchip = "cpu"\ncount = 2\n{key} = {value}\n')
    with pytest.raises(ConfigError, match=rf"group\[0\]\.{key}"):
        load_cluster(cluster)


def test_every_shipped_chip_file_still_loads():
    from h2jax.cluster import known_chips

    names = known_chips()
    assert len(names) >= 10
    for name in names:
        assert load_chip(name).name == name


# ------------------------------------------------------------------------------ token files


@pytest.mark.parametrize("content, names", [(None, "does not exist"), (b"", "holds 0 tokens"),
                                            (b"abc", "holds 3 tokens")], ids=["missing", "empty", "too-short"])
def test_a_bad_token_file_is_one_error_naming_data(content, names, tmp_path):
    from h2jax.data import DataError, TokenDataset

    path = tmp_path / "tokens.u8"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match="--data") as info:
        TokenDataset(path, seq_len=16)
    assert names in str(info.value)


# ------------------------------------------------------------------------------ huge meshes


def test_a_mesh_larger_than_the_machine_can_host_is_refused_naming_the_number(tmp_path):
    """XLA would spend minutes and gigabytes creating 100,000 host devices (or abort): the run
    is refused first, in a fresh process, with the count and the fix."""
    import subprocess
    import sys

    from tests.conftest import checkout_env

    raw = copy.deepcopy(PLAN)
    raw["stages"] = [{"chip": "cpu", "mesh": {"data": 100_000, "tensor": 1}, "layers": [0, 4]}]
    raw["global_batch"] = raw["micro_batch"] = 100_000
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(raw))
    env = checkout_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    proc = subprocess.run([sys.executable, "-m", "h2jax", "run", "--plan", str(path), "--steps", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "100,000 host devices" in lines[0] and "H2JAX_MAX_CPU_DEVICES" in lines[0], proc.stderr


def test_the_host_device_cap_is_configurable(monkeypatch):
    from h2jax.plan import PlanError
    from h2jax.runtime.jaxsetup import MAX_CPU_DEVICES, check_host_devices

    check_host_devices(MAX_CPU_DEVICES)
    with pytest.raises(PlanError, match="at most 1,024"):
        check_host_devices(MAX_CPU_DEVICES + 1)
    monkeypatch.setenv("H2JAX_MAX_CPU_DEVICES", "4096")
    check_host_devices(4096)


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(token_file, tmp_path, capsys):
    """Byte tokens go up to 255: a 128-token embedding would read past its end (NaN losses)."""
    raw = copy.deepcopy(PLAN)
    raw["model"] = {"vocab_size": 128, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}
    path = tmp_path / "small-vocab.json"
    path.write_text(json.dumps(raw))
    rc, err = _cli(["run", "--plan", path, "--steps", "1", "--data", token_file], capsys)
    assert rc == 2
    line = _one_error_line(err)
    assert "vocab_size (128)" in line and "256" in line, line
