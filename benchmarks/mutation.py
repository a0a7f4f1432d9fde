"""Mutation score of the core modules: how many small bugs (mutants) their tests catch.

Runs mutmut (3.x; `pip install -e ".[mutation]"`) once per module, each against the narrow,
fast selection of tests that exercise that module, in a scratch copy of this checkout (mutmut
writes a `mutants/` tree; the checkout is never touched). Each mutant runs in a fresh process
forked from a server that has collected the tests (imported JAX, flax, optax and the test
modules) but never started a JAX backend (`process_isolation = "forkserver"`): XLA's thread
pools would not survive a fork, imports do.

    nice -n 19 python benchmarks/mutation.py                    # every module below
    nice -n 19 python benchmarks/mutation.py --modules optim,memory --survivors out.json
    nice -n 19 python benchmarks/mutation.py --keep /tmp/mut       # keep the work; run again to go on
    python benchmarks/mutation.py --keep /tmp/mut --summarize      # the figures of a run stopped early
    nice -n 19 python benchmarks/mutation.py --modules model --sample 150   # a random sample, with its interval

Prints one JSON object: per module, mutants, killed (a test failed or timed out), survived,
no_tests (no selected test reaches the mutated function), score = killed / mutants, and the
names of the survivors (`--survivors FILE` also writes each survivor's diff). Not part of the
test suite: a full run takes tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# module -> (file to mutate, pytest arguments selecting its tests). Narrow on purpose: every
# selected test that reaches a mutated function runs for each of its mutants.
MODULES: dict[str, tuple[str, list[str]]] = {
    "model": ("h2jax/model.py", ["tests/test_reference_model.py", "tests/test_model.py",
                                 "tests/test_mutation_kills.py", "-k", "not recompute and not kills_ or kills_model"]),
    # the schedule registry (h2jax/schedules/) where it exists, else the one-module h2jax/schedule.py
    "schedule": ("h2jax/schedules/*.py" if (REPO / "h2jax" / "schedules").is_dir() else "h2jax/schedule.py",
                 ["tests/test_schedule.py", "tests/test_mutation_kills.py", "-k", "not kills_ or kills_schedule"]),
    "reshard": ("h2jax/transport/reshard.py", ["tests/test_reshard.py", "tests/test_mutation_kills.py", "-k", "not kills_ or kills_reshard"]),
    "optim": ("h2jax/runtime/optim.py", ["tests/test_reference_runtime.py", "tests/test_train_settings.py",
                                         "tests/test_mutation_kills.py", "-k", "clip or schedule or warmup or kills_optim"]),
    # the figures by hand from made-up analyses (no compile); tests/test_reference_runtime.py checks
    # them against a compiled stage's arrays, too slow to repeat for each mutant
    "memory": ("h2jax/runtime/memory.py", ["tests/test_mutation_kills.py", "-k", "kills_memory_"]),
    "cost_model": ("h2jax/planner/cost_model.py", ["tests/test_planner.py", "tests/test_cost_terms.py", "tests/test_mutation_kills.py",
                                                   "-k", "not kills_ or kills_planner_cost"]),
    "memory_model": ("h2jax/planner/memory_model.py", ["tests/test_planner.py", "tests/test_mutation_kills.py",
                                                       "-k", "not kills_ or kills_planner_memory"]),
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 34: "skipped",
          36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          -11: "crashed", -9: "crashed", 37: "killed", None: "not_checked"}

COPIED = ["h2jax", "tests", "backends", "plans", "pyproject.toml", "README.md"]


def scratch_copy(dest: Path) -> None:
    """This checkout's working tree (what you are testing, committed or not), minus caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "mutants")
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def mutmut_config(path: str, tests: list[str]) -> str:
    q = lambda items: "[" + ", ".join(json.dumps(i) for i in items) + "]"
    return f"""
[tool.mutmut]
source_paths = ["h2jax"]
only_mutate = [{json.dumps(path)}]
also_copy = ["backends", "plans", "README.md"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"]
pytest_add_cli_args_test_selection = {q([t for t in tests])}
process_isolation = "forkserver"
forkserver_warmup = "collect"
use_git_change_detection = false
timeout_constant = 60.0
timeout_multiplier = 3.0
"""


def mutant_names(root: Path, path: str) -> list[str]:
    return sorted(k for meta in (root / "mutants").glob(path + ".meta")
                  for k in json.loads(meta.read_text())["exit_code_by_key"])


def run_module(name: str, workdir: Path, max_children: int, sample: int | None = None, seed: int = 0) -> dict:
    path, tests = MODULES[name]
    if not list(REPO.glob(path)):
        return {"module": path, "error": "not in this checkout"}
    tests = [t for t in tests if not t.startswith("tests/") or (REPO / t).exists()]
    root = workdir / name
    if not (root / "h2jax").exists():  # else: continue the run kept there
        scratch_copy(root)
        with open(root / "pyproject.toml", "a") as f:
            f.write(mutmut_config(path, tests))
    env = {**os.environ, "PYTHONPATH": ""}
    mutmut = [shutil.which("mutmut") or "mutmut", "run", "--max-children", str(max_children)]
    chosen = None
    t0 = time.monotonic()
    if sample is not None:
        # mutmut writes every mutant (and its .meta) before it runs the named ones: a first
        # run naming none that exists generates them, then a seeded random sample runs
        if not mutant_names(root, path):
            subprocess.run([*mutmut, "h2jax.no_such_mutant"], cwd=root, env=env, capture_output=True, text=True)
        names = mutant_names(root, path)
        chosen = sorted(random.Random(seed).sample(names, min(sample, len(names))))
        (root / "sample.json").write_text(json.dumps(chosen))  # for --summarize of a run stopped early
        proc = subprocess.run([*mutmut, *chosen], cwd=root, env=env, capture_output=True, text=True)
    else:
        proc = subprocess.run(mutmut, cwd=root, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    result = summarize(name, root, elapsed, chosen)
    if "error" in result:
        result["error"] += f"; mutmut exited {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"
    return result


def summarize(name: str, root: Path, elapsed: float | None = None, sample: list[str] | None = None) -> dict:
    """The module's figures from mutmut's result files in `root` (a finished or partial run);
    with `sample`, over those mutants only."""
    path = MODULES[name][0]
    metas = sorted((root / "mutants").glob(path + ".meta"))
    if not metas:
        return {"module": path, "error": f"no mutmut results under {root}"}
    codes = {k: v for meta in metas for k, v in json.loads(meta.read_text())["exit_code_by_key"].items()}
    population = len(codes)
    if sample is None and (root / "sample.json").exists():
        sample = json.loads((root / "sample.json").read_text())
    if sample is not None:
        codes = {k: codes[k] for k in sample}
    by_status: dict[str, list[str]] = {}
    for mutant, code in codes.items():
        by_status.setdefault(STATUS.get(code, "suspicious"), []).append(mutant)
    killed = len(by_status.get("killed", [])) + len(by_status.get("timeout", []))
    total = len(codes) - len(by_status.get("skipped", []))
    checked = total - len(by_status.get("not_checked", []))
    survivors = sorted(by_status.get("survived", []) + by_status.get("no_tests", [])
                       + by_status.get("suspicious", []) + by_status.get("not_checked", []))
    return {
        "module": path,
        "tests": MODULES[name][1],
        "mutants": total,
        "killed": killed,
        "survived": len(by_status.get("survived", [])),
        "no_tests": len(by_status.get("no_tests", [])),
        "other": {k: len(v) for k, v in by_status.items() if k not in ("killed", "timeout", "survived", "no_tests")},
        "not_checked": len(by_status.get("not_checked", [])),
        "score": round(killed / total, 4) if total else None,
        # a run stopped early: the score over the mutants it checked (re-run with --keep to go on)
        "score_of_checked": round(killed / checked, 4) if checked else None,
        "seconds": None if elapsed is None else round(elapsed, 1),
        **({} if sample is None else {"sampled_of": population,
                                       "score_95pct_interval": wilson(killed, total)}),
        "survivors": survivors,
        "_root": str(root),
    }


def wilson(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson interval of a score estimated from a random sample of n mutants."""
    if n == 0:
        return None
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return [round(mid - half, 4), round(mid + half, 4)]


def survivor_diffs(result: dict) -> dict[str, str]:
    out = {}
    for mutant in result.get("survivors", []):
        show = subprocess.run([shutil.which("mutmut") or "mutmut", "show", mutant], cwd=result["_root"],
                              capture_output=True, text=True)
        out[mutant] = show.stdout
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of: {', '.join(MODULES)}")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--survivors", help="write each survivor's diff to this JSON file")
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary one, removed); "
                        "running again with the same folder continues where mutmut stopped")
    parser.add_argument("--sample", type=int, default=None,
                        help="test a seeded random sample of N mutants per module (for modules whose full run "
                             "takes hours); the score comes with its 95%% interval")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--summarize", action="store_true",
                        help="only read the results already in --keep (e.g. of a run stopped early)")
    args = parser.parse_args()
    names = [m.strip() for m in args.modules.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; choose among {', '.join(MODULES)}")
    if shutil.which("mutmut") is None:
        parser.error('mutmut is not installed: pip install -e ".[mutation]"')
    if args.summarize:
        if not args.keep:
            parser.error("--summarize reads the results in --keep DIR; name it")
        results = {n: summarize(n, Path(args.keep) / n) for n in names}
        print(json.dumps({"tool": "mutmut", "modules": results}))
        return 0
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="h2jax-mutation-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results, diffs = {}, {}
    try:
        for name in names:
            results[name] = run_module(name, workdir, args.max_children, args.sample, args.seed)
            print(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k not in ('survivors', '_root')})}",
                  file=sys.stderr, flush=True)
            if args.survivors:
                diffs[name] = survivor_diffs(results[name])
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.survivors:
        Path(args.survivors).write_text(json.dumps(diffs, indent=1))
    for r in results.values():
        r.pop("_root", None)
    total = sum(r.get("mutants", 0) for r in results.values())
    killed = sum(r.get("killed", 0) for r in results.values())
    print(json.dumps({"tool": "mutmut", "modules": results,
                      "overall_score": round(killed / total, 4) if total else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
