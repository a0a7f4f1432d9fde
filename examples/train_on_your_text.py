"""From a folder of text files to a trained model, its metrics and its loss plot.

    python examples/train_on_your_text.py MY_TEXT_DIR [--out runs/mine] [--steps 150]

1. `h2jax data prepare`: trains a byte-level BPE on the folder (offline) and writes token
   shards + manifest, holding 5% back for validation.
2. `h2jax run`: a two-stage pipeline (stage 0 on data=2, stage 1 on tensor=2, 4 CPU devices)
   trains a small model sized to that vocabulary, cosine learning rate after a warm-up,
   evaluating on the validation split as it goes; metrics go to OUT/logs (metrics.jsonl and
   TensorBoard: `tensorboard --logdir OUT/logs`).
3. `h2jax plot`: OUT/logs/curves.png, loss and throughput.

Without a folder it uses the Python standard library's `json`, `email` and `http` packages.
The same three steps on the command line:

    h2jax data prepare --input MY_TEXT_DIR --tokenizer train-bpe:1024 --out OUT/data --val-fraction 0.05
    h2jax run --plan OUT/plan.json --data OUT/data --steps 150 --log-dir OUT/logs
    h2jax plot OUT/logs
"""

from __future__ import annotations

import argparse
import shutil
import sysconfig
import time
from pathlib import Path


def plan_for(vocab_size: int, steps: int) -> dict:
    return {
        "format_version": 1,
        "model": {"vocab_size": vocab_size, "d_model": 96, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 256},
        "seq_len": 64, "global_batch": 16, "micro_batch": 8, "schedule": "1f1b", "seed": 0,
        "optimizer": {"name": "adamw", "learning_rate": 0.003, "weight_decay": 0.01, "clip_norm": 1.0},
        "train": {"lr_schedule": "cosine", "warmup_steps": min(20, steps // 4), "eval_every": 25, "eval_batches": 4, "log_every": 5},
        "stages": [
            {"chip": "cpu", "mesh": {"data": 2, "tensor": 1}, "layers": [0, 2]},
            {"chip": "cpu", "mesh": {"data": 1, "tensor": 2}, "layers": [2, 4]},
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text", nargs="*", help="folders / files / globs of text (default: some stdlib packages)")
    ap.add_argument("--out", default="runs/your-text", help="output folder (replaced)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary to train")
    args = ap.parse_args()

    import h2jax
    from h2jax.cli.plot import plot_run
    from h2jax.cli.progress import training_progress
    from h2jax.data import PreparedDataset, prepare

    t0 = time.perf_counter()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = args.text or [str(stdlib / p) for p in ("json", "email", "http")]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    m = prepare(inputs, f"train-bpe:{args.vocab}", out / "data", val_fraction=0.05, progress=True)
    print(f"data: {m.documents} documents, {m.input_bytes:,} bytes -> {m.n_tokens:,} tokens "
          f"({m.input_bytes / m.n_tokens:.2f} bytes/token), vocab {m.vocab_size}  [{time.perf_counter() - t0:.0f} s]")

    plan = h2jax.plan.plan_from_dict(plan_for(m.vocab_size, args.steps))
    h2jax.save_plan(plan, out / "plan.json")
    dataset = PreparedDataset(out / "data", plan.seq_len, seed=plan.seed)
    with training_progress(args.steps, plan.tokens_per_step, plan.n_devices) as bar:
        result = h2jax.run(plan, args.steps, dataset=dataset, log_dir=str(out / "logs"),
                           on_step=bar, on_eval=bar.evaluated)
    step, loss = result.eval_losses[-1]
    print(f"trained {args.steps} steps: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
          f"eval loss {loss:.3f} (perplexity {2.718281828 ** loss:.1f}) at step {step}, "
          f"{result.tokens_per_s:,.0f} tokens/s  [{time.perf_counter() - t0:.0f} s]")
    png = plot_run(out / "logs")
    print(f"metrics: {out / 'logs' / 'metrics.jsonl'} (and TensorBoard files); loss plot: {png}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
