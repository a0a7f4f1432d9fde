"""`h2jax plot LOGDIR`: the loss (and evaluation loss) and throughput curves of a run, as PNG."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot a run's loss and throughput curves to PNG", description=__doc__)
    p.add_argument("log_dir", metavar="LOGDIR", help="the --log-dir of a run")
    p.add_argument("--out", help="PNG file (default LOGDIR/curves.png)")
    p.set_defaults(func=main)


def plot_run(log_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from h2jax import names as N
    from h2jax.metrics import read_metrics, series

    records = read_metrics(log_dir)
    out = Path(out) if out else Path(log_dir) / "curves.png"
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(*series(records, N.LOSS), label="train loss")
    steps, evals = series(records, N.EVAL_LOSS)
    if steps:
        ax_loss.plot(steps, evals, "o-", label="eval loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    steps, tps = series(records, N.TOKENS_PER_S)
    ax_tput.plot(steps, tps, label="tokens/s")
    ax_tput.set_xlabel("step")
    ax_tput.set_ylabel("tokens/s")
    steps, tgs = series(records, N.TOKENS_PER_CHIP_PER_S)
    if steps:
        ax2 = ax_tput.twinx()
        ax2.plot(steps, tgs, color="tab:orange", alpha=0.6, label="tokens/chip/s")
        ax2.set_ylabel("tokens/chip/s")
    ax_tput.grid(alpha=0.3)
    fig.suptitle(str(log_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(args: argparse.Namespace) -> int:
    print(plot_run(args.log_dir, args.out))
    return 0
