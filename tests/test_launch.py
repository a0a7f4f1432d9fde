"""Launching on clusters: hosts in cluster files and plans, launcher command lines (checked
against expected files), and the pre-flight check, end to end with real `mpiexec` jobs whose
ranks sit on host aliases of this machine (127.0.0.2-4: hydra places each rank on one and
tells it so through PMI_HOSTNAME; its fork launcher starts them here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h2jax.cli import main as cli_main
from h2jax.cluster import cluster_from_dict, load_cluster
from h2jax.config import ConfigError
from h2jax.launch.commands import allocation_hosts, build, visibility_env
from h2jax.launch.hosts import expand_hosts, placements, read_hostfile
from h2jax.planner.hosts import assign_hosts
from h2jax.plan import PlanError, plan_from_dict, save_plan
from h2jax.runtime.preflight import RankReport, check, mismatches, same_host

HERE = Path(__file__).parent / "launch"
BIN = Path(sys.executable).parent
MODEL = {"vocab_size": 256, "d_model": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64}


# ----------------------------------------------------------------------------- hosts


@pytest.mark.parametrize("spec,hosts", [
    ("h100-[01-04]", ["h100-01", "h100-02", "h100-03", "h100-04"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a[1,3,5-6],b", ["a1", "a3", "a5", "a6", "b"]),
    ("r[1-2]g[0-1]", ["r1g0", "r1g1", "r2g0", "r2g1"]),
    ("127.0.0.[2-4]", ["127.0.0.2", "127.0.0.3", "127.0.0.4"]),
    (["x", "y[09-10]"], ["x", "y09", "y10"]),
])
def test_host_ranges_expand_like_slurm(spec, hosts):
    assert expand_hosts(spec) == hosts


@pytest.mark.parametrize("spec,message", [
    ("n[3-1]", "runs backwards"), ("n[1-2", "without its ']'"), ("n[a-b]", "not a number"),
    ("n[1-2],n2", "listed twice"),
])
def test_bad_host_ranges_say_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message):
        expand_hosts(spec)


def test_hostfile_forms(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# nodes\nn01 slots=8\nn02:8\n\nn[03-04]  # two more\n")
    assert read_hostfile(f) == ["n01", "n02", "n03", "n04"]


def _cluster(groups, where="c.toml"):
    return cluster_from_dict({"group": groups}, where=str(HERE / where))


def test_cluster_groups_list_hosts_and_count_their_chips():
    c = load_cluster(HERE / "hetero-cluster.toml")
    assert c.counts == {"nvidia-h100": 16, "amd-mi300x": 8, "google-tpu-v5e": 4, "huawei-ascend-910b": 8}
    assert [g.hosts for g in c.groups][:3] == [("h100-01", "h100-02"), ("mi300x-07",), ("tpu-v5e-0",)]
    assert _cluster([{"chip": "cpu", "count": 3, "hosts": ["a", "b"], "chips_per_node": 2}]).n_chips == 3
    with pytest.raises(ConfigError, match=r"count \(5\) is more than its 2 host\(s\) x chips_per_node \(2\)"):
        _cluster([{"chip": "cpu", "count": 5, "hosts": ["a", "b"], "chips_per_node": 2}])
    with pytest.raises(ConfigError, match="host 'a' is listed in both group"):
        _cluster([{"chip": "cpu", "hosts": ["a"]}, {"chip": "emu-fast", "hosts": ["a"]}])
    with pytest.raises(ConfigError, match="sets both hosts and hostfile"):
        _cluster([{"chip": "cpu", "hosts": ["a"], "hostfile": "x"}])


def _plan(stages, model=MODEL, **kw):
    return plan_from_dict({
        "format_version": 1, "model": model, "seq_len": 16, "global_batch": 8, "micro_batch": 2,
        "optimizer": {"name": "sgd", "learning_rate": 0.5, "clip_norm": 0.3}, "stages": stages, **kw,
    })


def test_stages_take_their_chip_types_hosts_in_pipeline_order():
    plan = plan_from_dict(json.loads((HERE / "hetero.json").read_text()))
    stripped = plan.with_stages([s.__class__(s.chip, s.mesh, s.layers) for s in plan.stages])
    placed = assign_hosts(stripped, load_cluster(HERE / "hetero-cluster.toml"))
    assert placed == plan  # the committed plan was placed by the same rule
    assert [(p.rank, p.stage, p.host, p.devices) for p in placements(placed)] == [
        (0, 0, "h100-01", tuple(range(8))),  # 16 chips: two processes of a whole node each
        (1, 0, "h100-02", tuple(range(8))),
        (2, 1, "mi300x-07", (0, 1, 2, 3)),  # two stages share the node, each its own chips
        (3, 2, "mi300x-07", (4, 5, 6, 7)),
        (4, 3, "tpu-v5e-0", (0, 1)),
        (5, 4, "ascend-a1", (0, 1)),
    ]
    too_big = stripped.with_stages([stripped.stages[0].__class__("amd-mi300x", s.mesh, s.layers) if i == 0 else s
                                    for i, s in enumerate(stripped.stages)])
    with pytest.raises(ConfigError, match=r"stages\[0\] needs 16 amd-mi300x chips in processes of 8, but the group's hosts have 8 chips left"):
        assign_hosts(too_big, load_cluster(HERE / "hetero-cluster.toml"))


def test_plan_hosts_are_validated():
    stage = {"chip": "cpu", "layers": [0, 3], "mesh": {"data": 2, "tensor": 1}}
    with pytest.raises(PlanError, match=r"stages\[0\]\.hosts must list one .* per process \(1\)"):
        _plan([{**stage, "hosts": [{"host": "a", "devices": [0]}, {"host": "b", "devices": [0]}]}])
    with pytest.raises(PlanError, match=r"stages\[0\]\.hosts\[0\]\.devices must list 2 distinct chip ids"):
        _plan([{**stage, "hosts": [{"host": "a", "devices": [0, 0]}]}])
    two = [{"chip": "cpu", "layers": [0, 1]}, {"chip": "cpu", "layers": [1, 3]}]
    with pytest.raises(PlanError, match=r"gives chip 0 of a to a process, but stages\[0\] already has it"):
        _plan([{**s, "hosts": [{"host": "a", "devices": [0]}]} for s in two])
    with pytest.raises(PlanError, match=r"stages \[1\] record no hosts"):
        _plan([{**two[0], "hosts": [{"host": "a", "devices": [0]}]}, two[1]])
    ok = _plan([{**stage, "processes": 2, "hosts": [{"host": "a", "devices": [1]}, {"host": "b", "devices": [1]}]}])
    assert plan_from_dict(ok.to_dict()) == ok


def test_h2jax_plan_records_the_hosts(tmp_path):
    from h2jax.planner import plan_cluster

    cluster = _cluster([{"chip": "emu-slow", "hosts": ["slow-[1-4]"]}, {"chip": "emu-fast", "hosts": ["fast-[1-2]"]}])
    plan = plan_cluster(cluster, "tiny", 16, 8, baselines=False).plan
    places = placements(plan)
    hosts = {g.chip.name: set(g.hosts) for g in cluster.groups}
    assert len(places) == plan.n_processes == sum(s.mesh.size for s in plan.stages)  # one chip per host
    for p in places:
        assert p.host in hosts[p.chip]
    assert len({p.host for p in places}) == len(places)


def test_h2jax_show_lists_each_process_host_and_chips(capsys):
    assert cli_main(["show", str(HERE / "hetero.json")]) == 0
    out = capsys.readouterr().out
    for cell in ("h100-01:0-7, h100-02:0-7", "mi300x-07:0-3", "mi300x-07:4-7", "tpu-v5e-0:0,1"):
        assert cell in out, out


# ----------------------------------------------------------------------------- command lines


def test_each_platform_gets_its_vendors_visibility_variable():
    assert visibility_env("cuda", [2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert visibility_env("rocm", [4, 5]) == {"ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "0,1"}
    assert visibility_env("gaudi", [1]) == {"HABANA_VISIBLE_MODULES": "1"}
    assert visibility_env("ascend", [0, 7]) == {"ASCEND_RT_VISIBLE_DEVICES": "0,7"}
    assert visibility_env("tpu", [4, 5, 6, 7], index_on_host=1) == {
        "TPU_VISIBLE_CHIPS": "4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": "8477"}
    assert visibility_env("cpu", [0, 1]) == {}
    with pytest.raises(ConfigError, match="process bounds exist for"):
        visibility_env("tpu", [0, 1, 2])


SLURM_PLAIN = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "h100-[01-02],mi300x-07,tpu-v5e-0,ascend-a1,spare-[1-3]"}
SLURM_HET = {"SLURM_JOB_ID": "7", "SLURM_HET_SIZE": "3", "SLURM_JOB_NODELIST_HET_GROUP_0": "h100-[01-02]",
             "SLURM_JOB_NODELIST_HET_GROUP_1": "mi300x-07", "SLURM_JOB_NODELIST_HET_GROUP_2": "tpu-v5e-0,ascend-a1"}


@pytest.mark.parametrize("name,argv,env", [
    ("mpich", [], {}),
    ("openmpi", ["--launcher", "openmpi"], {}),
    ("slurm", [], SLURM_PLAIN),
    ("slurm-het", [], SLURM_HET),
])
def test_dry_run_prints_the_expected_command_files_and_rank_table(name, argv, env, monkeypatch, capsys):
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(HERE)
    assert cli_main(["launch", "--plan", "hetero.json", "--dry-run", *argv]) == 0
    assert capsys.readouterr().out == (HERE / "expected" / f"{name}.txt").read_text()
    assert not (HERE / "hetero.launch").exists()  # a dry run writes nothing


def test_launch_refuses_a_plan_without_hosts(capsys):
    assert cli_main(["launch", "--plan", str(Path(__file__).parent.parent / "plans" / "demo.json"), "--dry-run"]) == 2
    assert "stages[0] records no hosts; plan with a cluster file whose groups list `hosts`" in capsys.readouterr().err


def test_slurm_refuses_hosts_outside_the_allocation():
    plan = plan_from_dict(json.loads((HERE / "hetero.json").read_text()))
    with pytest.raises(ConfigError, match="runs ranks on mi300x-07, tpu-v5e-0, ascend-a1, which the SLURM allocation"):
        build(plan, "slurm", ["x"], Path("d"), {"SLURM_JOB_NODELIST": "h100-[01-02]"})
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        allocation_hosts({})


# ----------------------------------------------------------------------------- pre-flight (pure)


def _resolve(table):
    def resolve(host, port):
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return [(2, 1, 6, "", (table[host], 0))]
    return resolve


def _two_stage_plan(**kw):
    return _plan([
        {"chip": "cpu", "layers": [0, 1], "hosts": [{"host": "n1", "devices": [0]}]},
        {"chip": "nvidia-h100", "layers": [1, 3], "mesh": {"data": 2, "tensor": 1},
         "hosts": [{"host": "g1", "devices": [0, 1]}]},
    ], **kw)


RESOLVE = _resolve({"n1": "10.9.0.1", "g1": "10.9.0.2", "g1.site": "10.9.0.2"})
GOOD = [RankReport(0, "n1", "cpu", 1, None, ("cpu",)), RankReport(1, "g1", "cuda", 2, 80 << 30, ("cuda",))]


def test_preflight_accepts_ranks_that_match_the_plan():
    assert mismatches(_two_stage_plan(), GOOD, resolve=RESOLVE) == []
    assert same_host("g1", "g1.site", RESOLVE) and not same_host("10.9.0.1", "10.9.0.2", RESOLVE)


@pytest.mark.parametrize("report,message", [
    (RankReport(1, "g1", "cuda", 0, None, ("cpu",), "Unknown backend: 'cuda'"),
     r"rank 1 \(stage 1, nvidia-h100\) on host g1: stage runs chip type nvidia-h100 on platform 'cuda', "
     r"which this rank does not have \(platforms found: cpu"),
    (RankReport(1, "g1", "cuda", 1, 80 << 30, ("cuda",)),
     r"rank 1 \(stage 1, nvidia-h100\) on host g1: sees 1 cuda device\(s\) but its share .* is 2"),
    (RankReport(1, "g1", "cuda", 2, 8 << 30, ("cuda",)),
     r"rank 1 .* on host g1: a device has 8.00 GiB but the plan needs 20.00 GiB per chip for stages\[1\]"),
    (RankReport(1, "n1", "cuda", 2, 80 << 30, ("cuda",)), r"rank 1 .* on host n1: the plan puts it on 'g1'"),
    (None, r"rank 1 \(stage 1, nvidia-h100\) on host g1 did not report within 30 s"),
])
def test_each_preflight_mismatch_is_one_error_naming_rank_and_host(report, message):
    plan = _two_stage_plan(predicted={"memory_gib": [1.0, 20.0]})
    with pytest.raises(ConfigError, match="^pre-flight: " + message):
        check(plan, [GOOD[0], report], resolve=RESOLVE, timeout_s=30)


def test_preflight_names_a_host_that_does_not_resolve():
    with pytest.raises(ConfigError, match=r"rank 1 .* on host g1: host 'g1' named by stages\[1\]\.hosts does not resolve"):
        check(_two_stage_plan(), GOOD, resolve=_resolve({"n1": "10.9.0.1"}))


# ----------------------------------------------------------------------------- real jobs


def _env(**extra):
    from tests.conftest import TEST_XLA_FLAGS, checkout_env

    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "XLA_FLAGS": TEST_XLA_FLAGS,
           "H2JAX_MPI_STARTUP_TIMEOUT": "60", **extra}
    for key in [k for k in env if k.startswith(("SLURM_", "PMI_", "OMPI_"))]:
        del env[key]
    return checkout_env(env)


def _launch(plan_path, *args, env=None, timeout=600):
    """`h2jax launch --plan PLAN -- python -m h2jax run --plan PLAN ARGS` (the module form runs
    from a checkout on PYTHONPATH too, where no `h2jax` script exists)."""
    if not (BIN / "mpiexec").exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    run = [sys.executable, "-m", "h2jax", "run", "--plan", str(plan_path), *args]
    return subprocess.run([sys.executable, "-m", "h2jax", "launch", "--plan", str(plan_path), "--", *run],
                          capture_output=True, text=True, timeout=timeout, env=env or _env())


ALIASES = '[[group]]\nchip = "cpu"\nchips_per_node = 1\nhosts = ["127.0.0.[2-4]"]\n'
# stage 1 on an "H100 node": the cpu group keeps .2 and .4
WITH_H100 = ('[[group]]\nchip = "cpu"\nchips_per_node = 1\nhosts = ["127.0.0.2", "127.0.0.4"]\n\n'
             '[[group]]\nchip = "nvidia-h100"\nchips_per_node = 1\nhosts = ["127.0.0.3"]\n')


def _alias_plan(tmp_path, chips=("cpu", "cpu", "cpu"), cluster=ALIASES):
    """A 3-stage plan placed by the cluster file on host aliases of this machine."""
    (tmp_path / "cluster.toml").write_text(cluster)
    plan = _plan([{"chip": c, "layers": [i, i + 1]} for i, c in enumerate(chips)])
    return assign_hosts(plan, load_cluster(tmp_path / "cluster.toml"))


@pytest.mark.mpi
@pytest.mark.slow
def test_three_stages_on_three_host_aliases_train_like_one_process(tmp_path):
    from h2jax.runtime.train import run

    plan = _alias_plan(tmp_path)
    assert [p.host for p in placements(plan)] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    save_plan(plan, tmp_path / "plan.json")
    proc = _launch(tmp_path / "plan.json", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "-launcher fork" in proc.stderr  # every host is this machine: hydra forks, no ssh
    table = proc.stderr[proc.stderr.index("pre-flight: 3 rank(s) match the plan"):].splitlines()[2:5]
    for rank, line in enumerate(table):  # rank, stage, chip, planned host, host hydra placed it on
        cells = line.split()
        assert cells[:5] == [str(rank), str(rank), "cpu", f"127.0.0.{rank + 2}", f"127.0.0.{rank + 2}"]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    local = run(plan, 2)
    np.testing.assert_allclose(got["losses"], local.losses, rtol=1e-5)
    assert got["losses"][0] != got["losses"][1]


def _preflight_error(proc, *parts):
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if "pre-flight:" in l]
    assert len(lines) == 1, proc.stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]


@pytest.mark.mpi
def test_preflight_stops_a_rank_on_the_wrong_platform(tmp_path):
    from h2jax.backends import installed_platforms

    if "cuda" in installed_platforms():
        pytest.skip("this machine has the CUDA plugin: a cuda stage is on the right platform here")
    plan = _alias_plan(tmp_path, ("cpu", "nvidia-h100", "cpu"), WITH_H100)
    assert [p.host for p in placements(plan)] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    save_plan(plan, tmp_path / "plan.json")
    proc = _launch(tmp_path / "plan.json", timeout=180)
    _preflight_error(proc, "rank 1 (stage 1, nvidia-h100) on host 127.0.0.3", "platform 'cuda'")


@pytest.mark.mpi
def test_preflight_stops_a_host_that_does_not_resolve(tmp_path):
    plan = _alias_plan(tmp_path)
    raw = plan.to_dict()
    raw["stages"][2]["hosts"][0]["host"] = "no-such-host.invalid"
    save_plan(plan_from_dict(raw), tmp_path / "plan.json")
    # Not every host is this machine now, so `h2jax launch` leaves hydra's ssh launcher on;
    # HYDRA_LAUNCHER=fork starts the unresolvable "host" here so that its rank reports in.
    proc = _launch(tmp_path / "plan.json", env=_env(HYDRA_LAUNCHER="fork"), timeout=180)
    _preflight_error(proc, "rank 2 (stage 2, cpu) on host no-such-host.invalid",
                     "host 'no-such-host.invalid' named by stages[2].hosts does not resolve")


@pytest.mark.mpi
def test_preflight_stops_ranks_started_on_other_hosts_than_the_plan_names(tmp_path):
    plan = _alias_plan(tmp_path)
    save_plan(plan, tmp_path / "plan.json")
    (tmp_path / "swapped").write_text("127.0.0.3:1\n127.0.0.2:1\n127.0.0.4:1\n")
    proc = subprocess.run(
        [str(BIN / "mpiexec"), "-launcher", "fork", "-f", str(tmp_path / "swapped"), "-n", "3",
         sys.executable, "-m", "h2jax", "run", "--plan", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=180, env=_env())
    _preflight_error(proc, "rank 0 (stage 0, cpu) on host 127.0.0.3: the plan puts it on '127.0.0.2'")
