"""Cluster files: parsing, per-group overrides, and errors that name the fix."""

from pathlib import Path

import pytest

from h2jax.cluster import load_chip, load_cluster
from h2jax.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
REAL_CHIPS = ["nvidia-h100", "nvidia-a100", "amd-mi300x", "google-tpu-v5e", "intel-gaudi2", "huawei-ascend-910b"]


@pytest.mark.parametrize("name", REAL_CHIPS)
def test_real_chip_files_load_with_a_source(name):
    chip = load_chip(name)
    assert chip.name == name
    assert chip.peak_tflops > 10 and chip.memory_gib >= 16
    assert chip.intra_node_gbps > chip.inter_node_gbps
    assert len(chip.source) > 20 and chip.emulate is None


@pytest.mark.parametrize(
    "path, chips, types",
    [("cluster-64.toml", 64, 2), ("cluster-768.toml", 768, 3), ("cluster-1024.toml", 1024, 4), ("cluster-2432.toml", 2432, 4)],
)
def test_shipped_clusters(path, chips, types):
    cluster = load_cluster(REPO / "plans" / path)
    assert cluster.n_chips == chips
    assert len(cluster.groups) == types


def test_group_overrides_apply_to_that_group_only(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        '[[group]]\nchip = "nvidia-a100"\ncount = 16\ninter_node_gbps = 12.5\nchips_per_node = 4\n'
        '[[group]]\nchip = "nvidia-h100"\ncount = 8\n'
    )
    cluster = load_cluster(f)
    a100 = cluster.chips["nvidia-a100"]
    assert (a100.inter_node_gbps, a100.chips_per_node) == (12.5, 4)
    assert a100.intra_node_gbps == load_chip("nvidia-a100").intra_node_gbps
    assert "overridden" in a100.source
    assert cluster.chips["nvidia-h100"] == load_chip("nvidia-h100")
    assert cluster.counts == {"nvidia-a100": 16, "nvidia-h100": 8}
    assert cluster.only("nvidia-h100").n_chips == 8


def test_unknown_chip_lists_known_ones(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[[group]]\nchip = "nvidia-b300"\ncount = 8\n')
    with pytest.raises(ConfigError, match=r"unknown chip type 'nvidia-b300'.*nvidia-h100"):
        load_cluster(f)


@pytest.mark.parametrize(
    "body, message",
    [
        ('[[group]]\nchip = "cpu"\n', r"group\[0\]\.count must be an integer >= 1"),
        ('[[group]]\nchip = "cpu"\ncount = 2\nbandwidth = 3\n', r"unknown key\(s\) \['bandwidth'\]"),
        ('[[group]]\nchip = "cpu"\ncount = 2\ninter_node_gbps = -1\n', r"inter_node_gbps must be a positive"),
        ('[[group]]\nchip = "cpu"\ncount = 2\n[[group]]\nchip = "cpu"\ncount = 3\n', r"lists chip type 'cpu' twice"),
        ('name = "x"\n', r"no \[\[group\]\] tables"),
        ('[[group]]\ncount = 2\n', r"chip is missing; name a chip type, one of: .*cpu"),
    ],
)
def test_bad_cluster_files_say_what_to_fix(tmp_path, body, message):
    f = tmp_path / "c.toml"
    f.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_cluster(f)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "nope.toml")


def test_cluster_only_unknown_type():
    cluster = load_cluster(REPO / "plans" / "cluster-64.toml")
    with pytest.raises(ConfigError, match="has no chip type 'cpu'; it has nvidia-h100, nvidia-a100"):
        cluster.only("cpu")
