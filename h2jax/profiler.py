"""Measure per-layer forward and backward time and memory on a real backend: the profile file
the planner reads in place of its analytical figures (format: h2jax.planner.profile).

One measurement is one transformer layer as a middle pipeline stage (no embedding, no head)
on a `(data=1, tensor=T)` mesh of the chip's platform, compiled exactly as the runtime
compiles it (h2jax.runtime.stage), so tensor-parallel collectives are inside the time.
Times are medians of repeated samples after warm-up (each sample as many calls as span
`MIN_SAMPLE_S`, so a sub-millisecond call is timed above the clock's resolution), sampled
until the median is stable (`stable_median`: at least `repeats` samples, then batches of more
until the median moves by less than 1%, at most `max_repeats`); each time's spread
(interquartile range / median) is reported, and a profile with a spread above `max_spread`
is refused (`SpreadError`: measure on a quieter machine, take more samples, or relax
--max-spread). `activation_bytes` is what
the layer keeps per micro-batch between its forward and backward, from XLA's memory analysis.

Per chip type the profile also gets fits (h2jax.planner.fit): the per-micro-batch overhead
(intercept of forward time against tokens), the matmul efficiency curve against size, and the
memory-bound throughput, timed on an AdamW-like update of `HBM_PARAMS` f32 parameters (28
bytes each).

An emulated chip type runs on the host CPU: its times are the host's, stretched by its
`slowdown` (what the runtime's emulation does), and its entries are labelled so. Chip types
with the same platform and precision policy share one measurement.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from h2jax.cluster import ChipType, load_chip
from h2jax.config import ConfigError, ModelConfig, get_config, preset_name
from h2jax.plan import Mesh, Plan, Stage
from h2jax.planner.profile import Profile, ProfileEntry, load_profile
from h2jax.runtime.memory import GIB


class SpreadError(ConfigError):
    """Measurements too noisy to write: the message names the worst shape and the fixes."""


@dataclasses.dataclass(frozen=True, slots=True)
class Timing:
    median: float
    spread: float  # interquartile range / median
    samples: int


def spread_of(times: Sequence[float]) -> float:
    """Interquartile range over median (0 for fewer than 2 samples)."""
    if len(times) < 2:
        return 0.0
    q1, q2, q3 = np.percentile(np.asarray(times, float), [25, 50, 75])
    return float((q3 - q1) / q2) if q2 > 0 else math.inf


def stable_median(sample: Callable[[], float], repeats: int, max_repeats: int, rel_tol: float = 0.01) -> Timing:
    """Call `sample` until its median is stable: `repeats` samples, then batches of
    max(2, repeats // 2) more until the median moves by less than `rel_tol`, or `max_repeats`."""
    times = [sample() for _ in range(repeats)]
    med = statistics.median(times)
    while len(times) < max_repeats:
        times += [sample() for _ in range(min(max(2, repeats // 2), max_repeats - len(times)))]
        new = statistics.median(times)
        moved = abs(new - med) / med if med > 0 else 0.0
        med = new
        if moved < rel_tol:
            break
    return Timing(med, spread_of(times), len(times))


def check_spread(measured: Sequence[tuple[str, "Measurement"]], max_spread: float) -> None:
    """Refuse measurements whose forward or backward spread exceeds `max_spread`."""
    worst = max(((max(m.forward_spread, m.backward_spread), c, m) for c, m in measured),
                key=lambda x: x[0], default=None)
    if worst is not None and worst[0] > max_spread:
        spread, chip, m = worst
        raise SpreadError(
            f"{chip} tensor={m.tensor} micro-batch={m.micro_batch}: the times vary by {spread:.0%} "
            f"(interquartile range / median) over {m.samples} samples, more than --max-spread "
            f"{max_spread:.0%}; the profile was not written. Measure on a quieter machine, raise "
            f"--repeats/--max-repeats, or relax --max-spread"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """One layer on one (tensor, micro-batch) shape, on the host backend, unstretched."""

    tensor: int
    micro_batch: int
    tokens: int
    forward_s: float
    backward_s: float
    activation_bytes: int | None  # kept per micro-batch between forward and backward
    needed_bytes: int | None  # the one-layer stage's peak per device (h2jax.runtime.memory)
    recompute: str = "none"
    forward_spread: float = 0.0  # interquartile range / median
    backward_spread: float = 0.0
    samples: int = 0  # timed samples behind each median (the larger of the two)


def one_layer_plan(chip: str, model: ModelConfig, seq_len: int, tensor: int, micro_batch: int, recompute: str) -> Plan:
    """A 3-stage plan whose middle stage is one layer on a (1, tensor) mesh: a pure layer."""
    if model.n_layers < 3:
        raise ConfigError(
            f"h2jax profile measures one middle layer and needs a model with >= 3 layers; "
            f"this one has {model.n_layers}"
        )
    model.check_tensor_parallel(tensor, "profile --tensor")
    stages = (
        Stage(chip, Mesh(1, 1), (0, 1)),
        Stage(chip, Mesh(1, tensor), (1, 2), recompute),
        Stage(chip, Mesh(1, 1), (2, model.n_layers)),
    )
    return Plan(model, seq_len, micro_batch, micro_batch, stages, model_name=preset_name(model))


MIN_SAMPLE_S = 0.05  # one timed sample spans at least this long (`calls_per_sample`)
MAX_CALLS_PER_SAMPLE = 1000


def calls_per_sample(fn: Callable[[], object]) -> int:
    """How many calls one timed sample makes so that it spans `MIN_SAMPLE_S`: a process's CPU
    clock counts another thread's time only when that thread is descheduled or the kernel
    ticks (every few ms), so one sub-millisecond call's worker CPU time reads 0 as often as
    not (measured: medians of 0.00 ms on a shared host); a sample of many calls spans
    several ticks. From one wall-clock call, after warm-up."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    took = time.perf_counter() - t0
    return max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(MIN_SAMPLE_S / max(took, 1e-9))))


def _call_seconds(fn: Callable[[], object], emulated: bool, calls: int = 1) -> float:
    """Seconds per call over `calls` calls, each run to completion: on an emulated chip its
    compute as the runtime's emulation measures it (h2jax.runtime.emulation.measure_call:
    worker CPU seconds per device, before the slowdown), on a real chip wall-clock time."""
    import jax

    def run():
        out = None
        for _ in range(calls):
            out = jax.block_until_ready(fn())
        return out

    if emulated:
        from h2jax.runtime.emulation import measure_call

        return measure_call(run)[2] / calls
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) / calls


def _median_time(fn: Callable[[], object], repeats: int, warmup: int, emulated: bool = False,
                 max_repeats: int | None = None) -> Timing:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    calls = calls_per_sample(fn)
    return stable_median(lambda: _call_seconds(fn, emulated, calls), repeats, max_repeats or repeats)


def measure_layer(
    chip: ChipType, model: ModelConfig, seq_len: int, tensor: int, micro_batch: int,
    devices: list, recompute: str = "none", repeats: int = 5, warmup: int = 2,
    max_repeats: int | None = None,
) -> Measurement:
    """Time one layer's forward and backward (stable medians, `stable_median`, after `warmup`)."""
    import jax

    from h2jax.runtime.stage import StageExecutor

    plan = one_layer_plan(chip.name, model, seq_len, tensor, micro_batch, recompute)
    ex = StageExecutor(plan, 1, devices[:tensor], check_memory=False)
    rng = np.random.default_rng(0)
    shape = (micro_batch, seq_len, model.d_model)
    x = jax.device_put(rng.normal(size=shape).astype(ex.boundary_dtype), ex.input_sharding)
    dy = jax.device_put(rng.normal(size=shape).astype(ex.boundary_dtype), ex.boundary_sharding)
    forward = _median_time(lambda: ex.forward(x), repeats, warmup, chip.is_emulated, max_repeats)

    _, saved = ex.forward(x)  # backward keeps its inputs: every call can reuse them
    jax.block_until_ready(saved)
    backward = _median_time(lambda: ex.backward(saved, dy), repeats, warmup, chip.is_emulated, max_repeats)
    mem = ex.memory
    return Measurement(
        tensor, micro_batch, micro_batch * seq_len, forward.median, backward.median,
        None if mem is None else mem.per_micro_batch_bytes,
        None if mem is None else mem.needed_bytes, recompute,
        forward.spread, backward.spread, max(forward.samples, backward.samples),
    )


HBM_PARAMS = 1 << 22  # parameters of the memory-bound probe (16 MiB of f32 per array)


def measure_hbm_gbps(device, emulated: bool, repeats: int, warmup: int, max_repeats: int | None = None) -> Timing:
    """Memory-bound throughput (GB/s, as the median of a Timing): an AdamW-like update of
    HBM_PARAMS f32 parameters (read p, g, m, v; write p, m, v: 28 bytes each) on `device`,
    timed like a layer (on an emulated chip: before its slowdown)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def update(p, g, m, v):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    arrays = [jax.device_put(jnp.full((HBM_PARAMS,), 0.5, jnp.float32), device) for _ in range(4)]
    t = _median_time(lambda: update(*arrays), repeats, warmup, emulated, max_repeats)
    gbps = 28 * HBM_PARAMS / t.median / 1e9 if t.median > 0 else math.nan  # nan: not resolved
    return Timing(gbps, t.spread, t.samples)


def refusal(chip: ChipType, m: Measurement) -> str | None:
    """Why one layer of this shape cannot run on `chip` (its memory), or None."""
    capacity = int(chip.usable_memory_gib * GIB)
    if m.needed_bytes is None or m.needed_bytes <= capacity:
        return None
    return (f"one layer at tensor={m.tensor}, micro-batch {m.micro_batch} needs {m.needed_bytes:,} bytes "
            f"per device; {chip.name} has {capacity:,}")


def _policy_key(chip: ChipType) -> tuple:
    """Emulated chip types with one precision policy are the same host computation."""
    return (chip.platform, dataclasses.astuple(chip.precision), None if chip.is_emulated else chip.name)


def profile_chips(
    chip_names: Sequence[str],
    model: str | ModelConfig,
    seq_len: int,
    tensors: Iterable[int] = (1,),
    micro_batches: Iterable[int] = (1,),
    recompute: Iterable[str] = ("none",),
    repeats: int = 5,
    warmup: int = 2,
    on_measure: Callable[[str, Measurement, str | None], None] | None = None,
    max_repeats: int | None = None,
    max_spread: float = math.inf,
) -> tuple[Profile, dict[str, list[Measurement]]]:
    """Measure every (tensor, micro-batch, recompute) for each chip type -> (profile, raw).

    Emulated entries are the host measurement times the chip's slowdown. A shape whose one
    layer does not fit the chip's memory gets no entry (`on_measure` is told why). Raises
    SpreadError when a kept measurement's spread exceeds `max_spread`. Each chip type's
    fits (module docstring) go to the profile's `fits`."""
    from h2jax.planner.fit import chip_fits
    from h2jax.backends import platform_devices, resolve_all, select_platforms

    cfg = get_config(model)
    chips = [load_chip(n) for n in chip_names]
    backends = resolve_all(c.name for c in chips)
    select_platforms(c.name for c in chips)
    cache: dict[tuple, Measurement] = {}
    hbm_cache: dict[tuple, Timing] = {}
    raw: dict[str, list[Measurement]] = {}
    entries: dict[str, list[ProfileEntry]] = {}
    fits: dict[str, dict] = {}
    for chip in chips:
        devices = platform_devices(backends[chip.name])
        for t in tensors:
            if t > len(devices):
                raise ConfigError(
                    f"--tensor {t} needs {t} {chip.platform} devices but {len(devices)} exist here"
                )
            for b in micro_batches:
                for r in recompute:
                    key = (_policy_key(chip), t, b, r)
                    if key not in cache:
                        cache[key] = measure_layer(chip, cfg, seq_len, t, b, devices, r, repeats, warmup,
                                                   max_repeats)
                    m = cache[key]
                    raw.setdefault(chip.name, []).append(m)
                    why = refusal(chip, m)
                    if on_measure is not None:
                        on_measure(chip.name, m, why)
                    if why:
                        continue
                    s = chip.emulate.slowdown if chip.is_emulated else 1.0
                    entries.setdefault(chip.name, []).append(
                        ProfileEntry(t, m.tokens, m.forward_s * s, m.backward_s * s, r, m.activation_bytes)
                    )
        hkey = ("hbm", _policy_key(chip))
        if hkey not in hbm_cache:
            hbm_cache[hkey] = measure_hbm_gbps(devices[0], chip.is_emulated, repeats, warmup, max_repeats)
        hbm = hbm_cache[hkey]
        slowdown = chip.emulate.slowdown if chip.is_emulated else 1.0
        points = [(e.tensor, e.tokens, e.forward_s) for e in entries.get(chip.name, ()) if e.recompute == "none"]
        measured_hbm = hbm.median / slowdown if math.isfinite(hbm.median) else None
        fits[chip.name] = chip_fits(chip, cfg, seq_len, points, measured_hbm)
    check_spread([(c, m) for c, ms in raw.items() for m in ms
                  if refusal(next(x for x in chips if x.name == c), m) is None], max_spread)
    emulated = [c.name for c in chips if c.is_emulated]
    source = (f"h2jax profile, {time.strftime('%Y-%m-%d %H:%M')}, stable medians of >= {repeats} runs "
              f"after {warmup} warm-up")
    if emulated:
        source += f"; EMULATED (host CPU times x slowdown): {', '.join(emulated)}"
    profile = Profile(cfg, seq_len, {c: tuple(e) for c, e in entries.items()}, source, preset_name(cfg),
                      {c: f for c, f in fits.items() if f})
    return profile, raw


def merge_into(profile: Profile, path) -> Profile:
    """`profile`'s chip types replace theirs in an existing file for the same model and
    sequence length (profile each chip type on its own machine, then plan with one file)."""
    from pathlib import Path

    if not Path(path).is_file():
        return profile
    try:
        old = load_profile(path)
    except ConfigError as e:
        raise ConfigError(f"{path} exists and is not a profile this h2jax reads ({e}); write to a new file") from None
    if old.model != profile.model or old.seq_len != profile.seq_len:
        raise ConfigError(
            f"{path} holds a profile of another model or sequence length (seq_len {old.seq_len}); "
            "write to a new file"
        )
    chips = {**old.chips, **profile.chips}
    fits = {**old.fits, **profile.fits}
    return dataclasses.replace(profile, chips=chips, fits=fits, source=f"{old.source}; {profile.source}")
