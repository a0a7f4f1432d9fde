"""`h2jax profile --chip NAME --model PRESET --tensor 1,2 --micro-batch 1,2,4 --out FILE`:
measure per-layer forward and backward time and memory on the chip's backend and write the
profile file that `h2jax plan --profile FILE` uses in place of its analytical figures."""

from __future__ import annotations

import argparse
import math

from rich.table import Table

from h2jax.cli.console import make_console

from h2jax.runtime.jaxsetup import force_cpu_devices
from h2jax.cli.options import output_path, positive_int
from h2jax.cluster import load_chip
from h2jax.config import ConfigError, get_config


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1, e.g. 1,2,4")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure per-layer costs of a chip type for the planner",
                       description=__doc__)
    p.add_argument("--chips", "--chip", dest="chips", required=True,
                   help="chip type(s), comma-separated (backends/<name>.toml)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--seq-len", type=positive_int, default=64, help="sequence length (default 64)")
    p.add_argument("--tensor", type=int_list, default=[1], help="tensor-parallel sizes, e.g. 1,2")
    p.add_argument("--micro-batch", type=int_list, default=[1, 2, 4], help="micro-batch sizes, e.g. 1,2,4")
    p.add_argument("--recompute", default="none", help="recompute policies, comma-separated (default none)")
    p.add_argument("--repeats", type=int, default=9,
                   help="timed runs per shape at least (default 9); more until the median is stable")
    p.add_argument("--max-repeats", type=int, default=None,
                   help="timed runs per shape at most (default 4 x --repeats)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--max-spread", type=float, default=0.25,
                   help="refuse to write the profile when a time's interquartile range / median exceeds "
                        "this (default 0.25; raise it to accept a noisy machine's figures)")
    p.add_argument("--out", required=True, help="profile file to write (merged if it exists for this model)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    chips = [load_chip(c.strip()) for c in args.chips.split(",") if c.strip()]
    if not chips:
        raise ConfigError("--chips names no chip type; give e.g. --chips emu-fast,emu-slow")
    model = get_config(args.model, where="--model")
    policies = [r.strip() for r in args.recompute.split(",") if r.strip()]
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    max_repeats = 4 * args.repeats if args.max_repeats is None else args.max_repeats
    if max_repeats < args.repeats:
        raise ConfigError(f"--max-repeats ({max_repeats}) must be >= --repeats ({args.repeats})")
    if not args.max_spread > 0:
        raise ConfigError(f"--max-spread must be a positive fraction (e.g. 0.25), got {args.max_spread}")
    if any(c.platform == "cpu" for c in chips):
        force_cpu_devices(max(args.tensor))

    from h2jax.planner.profile import save_profile
    from h2jax.profiler import merge_into, profile_chips

    console = make_console()
    table = Table(title=f"per-layer costs: model {args.model}, seq_len {args.seq_len}")
    for col in ("chip", "tensor", "micro-batch", "tokens", "forward ms", "backward ms", "spread", "samples",
                "activations KiB", "note"):
        table.add_column(col)

    def on_measure(chip_name, m, refused) -> None:
        chip = next(c for c in chips if c.name == chip_name)
        s = chip.emulate.slowdown if chip.is_emulated else 1.0
        note = refused or (f"EMULATED: host x{s:g}" if chip.is_emulated else "")
        fwd = "-" if refused else f"{m.forward_s * s * 1e3:.2f}"
        bwd = "-" if refused else f"{m.backward_s * s * 1e3:.2f}"
        act = "-" if m.activation_bytes is None else f"{m.activation_bytes / 1024:,.0f}"
        spread = f"{max(m.forward_spread, m.backward_spread):.1%}"
        table.add_row(chip_name, str(m.tensor), str(m.micro_batch), str(m.tokens), fwd, bwd, spread,
                      str(m.samples), act, note)
        console.print(f"  measured {chip_name} tensor={m.tensor} micro-batch={m.micro_batch}", highlight=False)

    profile, raw = profile_chips(
        [c.name for c in chips], model, args.seq_len, args.tensor, args.micro_batch, policies,
        args.repeats, args.warmup, on_measure, max_repeats, math.inf,
    )
    console.print(table)
    from h2jax.profiler import check_spread, refusal

    by_name = {c.name: c for c in chips}
    check_spread([(c, m) for c, ms in raw.items() for m in ms if refusal(by_name[c], m) is None],
                 args.max_spread)  # before writing
    for chip, fit in profile.fits.items():
        console.print(f"  fitted {chip}: " + ", ".join(
            f"{k} {v if not isinstance(v, float) else f'{v:.4g}'}" for k, v in fit.items()), highlight=False)
    profile = merge_into(profile, args.out)
    save_profile(profile, output_path(args.out))
    console.print(f"wrote {args.out}; plan with it: h2jax plan --profile {args.out} ...")
    return 0
