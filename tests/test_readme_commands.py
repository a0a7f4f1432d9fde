"""Every command in README.md, run the way a reader would type it: from a fresh process with no
XLA_FLAGS, in a directory laid out like the checkout. Long commands run with tiny settings
(fewer steps, one cluster); the few that cannot run on one CPU machine say why. A command added
to the README without an entry here fails `test_every_readme_command_is_accounted_for`."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def _normal(command: str) -> str:
    return re.sub(r"\s+", " ", command).strip()


def readme_commands() -> list[str]:
    """Shell lines of the README's bash blocks (continuations joined, comments dropped) and
    each python block whole, prefixed `python:`."""
    out = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", README.read_text(), re.S):
        if lang == "python":
            out.append("python:" + body.strip())
        elif lang in ("bash", "sh"):
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append(_normal(line))
    return out


class Skip(str):
    """A command this test does not run, and why."""


PLAN_64 = ("h2jax plan --cluster plans/cluster-64.toml --model llama-7b --seq-len 2048 "
           "--global-batch-tokens 2097152 --out plans/llama7b-64.json")
# README command -> what runs (the same command, or the same with smaller numbers), or Skip.
RUNS = {
    'pip install -e ".[dev]" && h2jax demo': "h2jax demo --model tiny --seq-len 16 --steps 8 --baseline-steps 2",
    "pytest": Skip("this suite"),
    "h2jax show plans/demo.json": None,
    "h2jax run --plan plans/demo.json --steps 50": "h2jax run --plan plans/demo.json --steps 2",
    "h2jax run --plan plans/demo.json --steps 5 --json": None,
    "h2jax run --plan plans/demo.json --steps 5 --unpipelined": None,
    "python:" + 'import h2jax\nresult = h2jax.run("plans/demo.json", steps=20)\nprint(result.losses, result.tokens_per_s)':
        'python:import h2jax\nresult = h2jax.run("plans/demo.json", steps=2)\nprint(result.losses, result.tokens_per_s)',
    "h2jax data prepare --input my_texts/ --tokenizer train-bpe:8192 --out data/mine --val-fraction 0.01": None,
    "h2jax run --plan my-plan.json --data data/mine --steps 2000 --lr-schedule cosine --warmup-steps 100 "
    "--eval-every 200 --log-dir runs/mine":
        "h2jax run --plan my-plan.json --data data/mine --steps 4 --lr-schedule cosine --warmup-steps 1 "
        "--eval-every 2 --log-dir runs/mine",
    "h2jax plot runs/mine": None,
    "python examples/train_on_your_text.py my_texts/":
        "python examples/train_on_your_text.py my_texts/ --steps 3 --out runs/example",
    PLAN_64: None,
    "h2jax plan ... --exhaustive": (PLAN_64 + " --exhaustive", 2, "--exhaustive would evaluate"),
    "h2jax plan ... --one-shape-per-type": PLAN_64 + " --one-shape-per-type",
    "h2jax plan ... --prove-two-shapes": PLAN_64 + " --prove-two-shapes --no-baselines --time-limit 20",
    "h2jax plan ... --jobs 1": PLAN_64 + " --jobs 1",
    "h2jax plan ... --profile prof.json": Skip("its profile must be measured for llama-7b at seq 2048; the "
                                                 "profile section below measures one and plans with it"),
    "h2jax simulate --plan plans/llama7b-64.json --trace trace.json --plot timeline.png": None,
    "h2jax compare --cluster plans/cluster-768.toml --model llama-100b --seq-len 4096 "
    "--global-batch-tokens 8388608 --baseline-global-batch-tokens 2097152": None,
    "python examples/batch_size_study.py":
        "python examples/batch_size_study.py --clusters 768 --time-limit 2 --out runs/study",
    "mpiexec -n 3 h2jax run --plan plans/demo.json --steps 20": "mpiexec -n 3 h2jax run --plan plans/demo.json --steps 2",
    "mpiexec -hosts node-a,node-b -n 4 h2jax run --plan my-plan.json --steps 100 --json":
        Skip("needs the two hosts it names"),
    "h2jax launch --plan plan.json --dry-run": Skip("needs a plan with hosts (tests/test_launch.py runs --dry-run)"),
    "h2jax launch --plan plan.json --dry-run --launcher openmpi": Skip("as above"),
    "h2jax launch --plan plan.json -- h2jax run --plan plan.json --steps 1000 --json": Skip("needs the plan's hosts"),
    "h2jax profile --chips emu-fast,emu-slow --model tiny --seq-len 16 --tensor 1 --micro-batch 1,2 --max-spread 2 --out prof.json": None,
    "h2jax plan --cluster plans/cluster-emu-2type.toml --model tiny --seq-len 16 --global-batch 8 --profile prof.json": None,
    "h2jax align --chips cpu,cpu-bf16 --steps 300": "h2jax align --chips cpu,cpu-bf16 --steps 10",
    "python examples/mixed_gpu_cpu.py": None,
    "bash benchmarks/gpu_check.sh": Skip("needs a GPU"),
    "h2jax run --plan plans/demo.json --steps 200 --checkpoint-dir ckpt --save-every 50 --keep 2":
        "h2jax run --plan plans/demo.json --steps 4 --checkpoint-dir ckpt --save-every 2 --keep 2",
    "h2jax run --plan plans/demo.json --steps 63 --checkpoint-dir ckpt --resume":
        "h2jax run --plan plans/demo.json --steps 2 --checkpoint-dir ckpt --resume",
    "h2jax replan --checkpoint ckpt --cluster plans/cluster-emu-2type.toml --out new.json": None,
    "h2jax run --plan new.json --steps 63 --checkpoint-dir ckpt --resume":
        "h2jax run --plan new.json --steps 2 --checkpoint-dir ckpt --resume",
    "mpiexec -n 3 h2jax run --plan plans/demo.json --steps 63 --checkpoint-dir ckpt --resume":
        "mpiexec -n 3 h2jax run --plan plans/demo.json --steps 2 --checkpoint-dir ckpt --resume",
    "python benchmarks/checkpoint.py": Skip("a measurement (prints one JSON object); run by hand"),
    'pip install -e ".[mutation]"': Skip("installs the mutation-testing tool"),
    "nice -n 19 python benchmarks/mutation.py --modules memory,optim --survivors survivors.json":
        Skip("a mutation score: hours of test runs; run by hand"),
    "python benchmarks/mutation.py": Skip("as above"),
    **{f"python benchmarks/{b}.py": Skip("a measurement (prints one JSON object); run by hand")
       for b in ("pipeline_overhead", "transport", "reshard", "planner", "simulator", "chip_speed", "schedules",
                 "cost_model")},
}


# Python blocks too long to key by their text: a line that identifies the block -> what runs
# (the block with these replacements).
PYTHON_RUNS = {
    "trainer = h2jax.Trainer(plan, steps=1000)": [("1000", "3")],
}


def how_to_run(command: str):
    if command in RUNS:
        return RUNS[command]
    for marker, replacements in PYTHON_RUNS.items():
        if command.startswith("python:") and marker in command:
            for old, new in replacements:
                command = command.replace(old, new)
            return command
    raise KeyError(command)


def test_every_readme_command_is_accounted_for():
    commands = readme_commands()
    assert len(commands) >= 25
    missing = []
    for c in commands:
        try:
            how_to_run(c)
        except KeyError:
            missing.append(c)
    assert not missing, f"README commands with no entry in RUNS: {missing}"


def _workspace(root: Path) -> Path:
    """A directory laid out like the checkout: plans/ (copied: commands write there),
    examples/ and benchmarks/ (linked), a folder of text and a plan for its vocabulary."""
    shutil.copytree(REPO / "plans", root / "plans")
    for name in ("examples", "benchmarks", "backends"):
        (root / name).symlink_to(REPO / name)
    texts = root / "my_texts"
    texts.mkdir()
    for f in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        shutil.copy(f, texts / (f.stem + ".txt"))
    (root / "my-plan.json").write_text(json.dumps({
        "format_version": 1, "seq_len": 32, "global_batch": 4, "micro_batch": 2,
        "model": {"vocab_size": 8448, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128},
        "stages": [{"chip": "cpu", "layers": [0, 1]}, {"chip": "cpu", "layers": [1, 2]}],
    }))
    return root


def _run(command: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)  # this checkout's h2jax
    if command.startswith("python:"):
        argv = [sys.executable, "-c", command.removeprefix("python:")]
    else:
        argv = ["bash", "-c", command]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("H2JAX_README_COMMANDS") != "1",
    reason="runs every README command (10-40 min on 2 cores); H2JAX_README_COMMANDS=1 pytest "
           "tests/test_readme_commands.py runs it",
)
def test_every_readme_command_runs(tmp_path):
    cwd = _workspace(tmp_path)
    failures = []
    for command in readme_commands():
        how = how_to_run(command)
        if isinstance(how, Skip):
            continue
        run, rc, says = (command, 0, "") if how is None else (how, 0, "") if isinstance(how, str) else how
        proc = _run(run, cwd)
        if proc.returncode != rc or says not in proc.stdout + proc.stderr:
            failures.append(f"$ {run}\n(exit {proc.returncode}, wanted {rc})\n{proc.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)
