"""`h2jax data prepare` throughput, and the time to load one step's batch against the step time.

Corpus: the Python standard library's source (real text on every machine, no download), as
one document per file. Measured: prepare with the bytes tokenizer, with `train-bpe:VOCAB`
(training included) and with the trained tokenizer.json (encoding only), in MB/s of input
(wall clock; `cpu_seconds` is the process's CPU time, all threads, for a loaded machine);
then the batch load time of a prepared dataset (median over steps) and the step time of
`plans/demo.json` trained on it, and their ratio.

Prints one JSON object.
    nice -n 10 python benchmarks/data.py [--mb 32] [--vocab 8192] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def stdlib_files(limit_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        try:
            f.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        files.append(f)
        total += f.stat().st_size
        if total >= limit_bytes:
            break
    return files


def timed_prepare(files, spec, out) -> tuple[float, dict]:
    from h2jax.data import prepare

    t0, c0 = time.perf_counter(), time.process_time()
    m = prepare([str(f) for f in files], spec, out, val_fraction=0.01)
    return time.perf_counter() - t0, time.process_time() - c0, m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=32.0, help="corpus size in MB (default 32)")
    ap.add_argument("--vocab", type=int, default=8192, help="train-bpe vocabulary (default 8192)")
    ap.add_argument("--steps", type=int, default=8, help="training steps for the step time (default 8)")
    ap.add_argument("--plan", default="plans/demo.json")
    args = ap.parse_args()

    files = stdlib_files(int(args.mb * 2**20))
    work = Path(tempfile.mkdtemp(prefix="h2jax-bench-data-"))
    out: dict = {"corpus": {"files": len(files), "mb": sum(f.stat().st_size for f in files) / 2**20,
                            "source": "Python standard library *.py"}}
    try:
        prepare_figures = {}
        for name, spec in (("bytes", "bytes"), (f"train-bpe:{args.vocab}", f"train-bpe:{args.vocab}")):
            seconds, cpu, m = timed_prepare(files, spec, work / name.replace(":", "-"))
            prepare_figures[name] = {"seconds": seconds, "cpu_seconds": cpu,
                                     "mb_per_s": m.input_bytes / 2**20 / seconds,
                                     "tokens": m.n_tokens, "bytes_per_token": m.input_bytes / m.n_tokens}
        tok_json = work / f"train-bpe-{args.vocab}" / "tokenizer.json"
        seconds, cpu, m = timed_prepare(files, str(tok_json), work / "tokenizer-json")
        prepare_figures["tokenizer.json (encode only)"] = {
            "seconds": seconds, "cpu_seconds": cpu, "mb_per_s": m.input_bytes / 2**20 / seconds,
            "tokens": m.n_tokens}
        out["prepare"] = prepare_figures

        import h2jax
        from h2jax.data import PreparedDataset

        plan = h2jax.load_plan(args.plan)
        dataset = PreparedDataset(work / "bytes", plan.seq_len, seed=plan.seed)
        load_s = []
        for n in range(200):
            t0 = time.perf_counter()
            dataset.batch(n, plan.global_batch)
            load_s.append(time.perf_counter() - t0)
        result = h2jax.run(plan, args.steps, dataset=dataset)
        batch_s = statistics.median(load_s)
        out["loading"] = {
            "plan": args.plan, "global_batch": plan.global_batch, "seq_len": plan.seq_len,
            "batch_load_s": batch_s, "step_time_s": result.step_time_s,
            "load_fraction_of_step": batch_s / result.step_time_s,
            "emulated": result.emulation_note or None,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
