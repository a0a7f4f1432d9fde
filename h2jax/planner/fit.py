"""Fitting a chip type's cost-model figures to measured one-layer times (`h2jax profile`):
the per-micro-batch overhead (dispatch), the matmul efficiency curve against size, and the
figures a profile's `fits` carry (planner/profile.py). Pure functions of the measurements.

- Overhead: per (tensor, recompute "none"), a least-squares line through forward seconds
  against tokens; its intercept is the fixed cost of one stage compute (clamped at >= 0);
  the median over tensor sizes. Needs two token counts.
- Efficiency: each measurement's matmul and attention FLOPs over the forward's compute
  seconds (forward less the overhead, the element-wise and attention-score HBM time at the
  fitted HBM bandwidth, and the tensor all-reduces) give the efficiency reached; the curve
  eff(n, w) = max * n/(n + half_tokens) * w/(w + half_width) is fitted by least squares in
  log space over a grid of half points (max in closed form). A half point the data cannot
  resolve (one token count, or one width) keeps the chip's. A fitted max above 1 means the
  chip file's peak is low (an emulated chip's nominal peak): the fit then sets max 1 and
  raises `peak_tflops` by that factor.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import numpy as np

from h2jax.cluster import ChipType, EfficiencyCurve
from h2jax.config import ModelConfig
from h2jax.planner import cost_model as cm

_GRID = np.geomspace(4.0, 65536.0, 97)


def fit_overhead(points: Sequence[tuple[int, int, float]]) -> float | None:
    """Seconds of fixed cost per stage compute from (tensor, tokens, forward_s) points (module
    docstring); None when no tensor size has two token counts."""
    by_tensor: dict[int, list[tuple[int, float]]] = {}
    for tensor, tokens, seconds in points:
        by_tensor.setdefault(tensor, []).append((tokens, seconds))
    intercepts = []
    for pts in by_tensor.values():
        if len({t for t, _ in pts}) < 2:
            continue
        x = np.array([t for t, _ in pts], float)
        y = np.array([s for _, s in pts], float)
        slope, intercept = np.polyfit(x, y, 1)
        intercepts.append(max(float(intercept), 0.0))
    return statistics.median(intercepts) if intercepts else None


def achieved_efficiency(
    model: ModelConfig, seq_len: int, chip: ChipType, tensor: int, tokens: float, forward_s: float,
) -> float | None:
    """Fraction of `chip.peak_tflops` a layer's forward reached (module docstring); None when
    the non-matmul terms leave no compute time."""
    a = cm.dtype_bytes(chip.precision.compute_dtype)
    kernel = chip.attention_kernel
    hbm = chip.hbm_bytes_per_s
    other = (
        chip.dispatch_s
        + tokens * cm.memory_bound_bytes_per_token(model, tensor, a) / hbm
        + tokens * cm.attention_score_bytes_per_token(model, seq_len, kernel, a) / tensor / hbm
        + 2 * cm.allreduce_s(tokens * model.d_model * a, tensor, cm.collective_gbps(chip, tensor))
    )
    compute = forward_s - other
    if compute <= 0:
        return None
    flops = tokens * (2.0 * cm.matmul_params(model) + cm.attention_flops_per_token(model, seq_len, kernel)) / tensor
    return flops / (compute * chip.peak_tflops * 1e12)


def fit_curve(points: Sequence[tuple[float, float, float]], prior: EfficiencyCurve) -> EfficiencyCurve:
    """The curve through (tokens, width, efficiency) points: least squares on log efficiency;
    half points the data cannot resolve keep `prior`'s. `max` may exceed 1 here (see
    `chip_fits`)."""
    n = np.array([p[0] for p in points], float)
    w = np.array([p[1] for p in points], float)
    y = np.log(np.array([p[2] for p in points], float))
    nh_grid = _GRID if len(set(n)) > 1 else np.array([prior.half_tokens])
    wh_grid = _GRID if len(set(w)) > 1 else np.array([prior.half_width])
    best = None
    for nh in nh_grid:
        for wh in wh_grid:
            shape = np.log(n / (n + nh)) + np.log(w / (w + wh))
            log_max = float(np.mean(y - shape))
            err = float(np.sum((y - shape - log_max) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, math.exp(log_max), float(nh), float(wh))
    _, e_max, nh, wh = best
    return EfficiencyCurve(e_max, nh, wh)


def chip_fits(
    chip: ChipType, model: ModelConfig, seq_len: int, points: Sequence[tuple[int, int, float]],
    hbm_gbps: float | None = None,
) -> dict[str, Any]:
    """A profile's `fits` for one chip type from (tensor, tokens, forward_s) points of
    recompute "none" (seconds as the profile stores them) and a measured HBM bandwidth."""
    import dataclasses

    fits: dict[str, Any] = {}
    if hbm_gbps is not None:
        fits["hbm_gbps"] = float(hbm_gbps)
    overhead = fit_overhead(points)
    if overhead is not None:
        fits["dispatch_us"] = overhead * 1e6
    fitted = dataclasses.replace(chip, **{k: v for k, v in fits.items()})
    effs = []
    for tensor, tokens, seconds in points:
        e = achieved_efficiency(model, seq_len, fitted, tensor, tokens, seconds)
        if e is not None and e > 0:
            effs.append((float(tokens), model.d_model / tensor, e))
    if effs:
        curve = fit_curve(effs, chip.efficiency)
        if curve.max > 1.0:
            fits["peak_tflops"] = chip.peak_tflops * curve.max
            curve = EfficiencyCurve(1.0, curve.half_tokens, curve.half_width)
        fits["efficiency"] = {"max": curve.max, "half_tokens": curve.half_tokens, "half_width": curve.half_width}
    return fits
