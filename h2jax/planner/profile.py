"""Measured per-layer costs: the profile file that `h2jax profile` writes and the cost model reads.

When a profile has an entry for a chip type, the cost model uses its measured per-layer
forward and backward seconds instead of FLOPs / (peak x efficiency); tensor-parallel
all-reduces are *inside* the measurement (the profiler times the compiled stage step), so
the cost model does not add them again. Everything else (stage-to-stage sends, data-parallel
reduction, optimizer, end-stage embedding and logits) stays analytical.

File format (JSON, `format_version` 1)::

    {
      "format_version": 1,
      "model": "llama-7b",            # preset name or full config object, as in a plan
      "seq_len": 4096,
      "source": "h2jax profile on host x, 2026-11-02",
      "chips": {
        "nvidia-h100": [
          {"tensor": 1, "tokens": 4096, "recompute": "none",
           "forward_s": 0.0123, "backward_s": 0.0251,
           "activation_bytes": 1234567890},
          ...
        ]
      },
      "fits": {                        # optional: figures fitted per chip type
        "nvidia-h100": {"peak_tflops": 900.0, "hbm_gbps": 2900.0, "dispatch_us": 40.0,
                        "efficiency": {"max": 0.7, "half_tokens": 300.0, "half_width": 200.0},
                        "head_scale": 1.3}
      }
    }

`fits` replaces the chip file's figures of the same names for that chip type, everywhere
the cost model reads them (`Profile.apply_fits`): `h2jax profile` fits the matmul
efficiency curve against size, the per-micro-batch dispatch overhead and the memory-bound
throughput; `h2jax calibrate` fits an effective peak, the memory-bound throughput and the
last stage's head (`head_scale`) from a run (h2jax.calibrate). Link bandwidths are not
fitted: the search prices stage-to-stage sends from the chip files.

One entry is one transformer layer of the model on one device of a `(data, tensor)` mesh,
timed as a one-layer stage (so one stage dispatch is inside it; the cost model subtracts the
chip's dispatch per layer and adds one per stage):

- `tensor`: the mesh's tensor-parallel size.
- `tokens`: micro-batch tokens per device, i.e. (micro_batch / data) * seq_len.
- `recompute` (optional, default "none"): the policy the backward ran with.
- `forward_s`, `backward_s`: seconds for one layer's forward and whole backward
  (recomputation included), medians of repeated runs, tensor-parallel collectives included.
- `activation_bytes` (optional): bytes one layer keeps per device for one micro-batch between
  its forward and backward under that policy; when absent the analytical formula is used.

Lookup (see `ProfileEntry` / `Profile.layer_times`): an exact (tensor, tokens, recompute)
entry wins. Otherwise entries of the same tensor and recompute are interpolated linearly
in `tokens` (extrapolated proportionally to tokens beyond the measured range). If the
policy was not measured, the "none" measurement is used and the recomputed forward work is
added analytically (full: + forward; selective: + the attention-score share of forward).
A chip type or tensor size the profile lacks falls back to the analytical model.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from h2jax.cluster import ChipType, EfficiencyCurve
from h2jax.config import ConfigError, ModelConfig, get_config, preset_name

PROFILE_FORMAT_VERSION = 1
_POLICIES = ("none", "selective", "full")
# Chip-file figures a profile's `fits` may replace (positive numbers; efficiency a table).
FIT_FIELDS = ("peak_tflops", "hbm_gbps", "dispatch_us", "efficiency", "head_scale")


class ProfileError(ConfigError):
    """A profile file or entry is wrong; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileEntry:
    tensor: int
    tokens: int
    forward_s: float
    backward_s: float
    recompute: str = "none"
    activation_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.activation_bytes is None:
            del out["activation_bytes"]
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    model: ModelConfig
    seq_len: int
    chips: Mapping[str, tuple[ProfileEntry, ...]]
    source: str = ""
    model_name: str | None = None
    fits: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def apply_fits(self, chip: ChipType) -> ChipType:
        """`chip` with this profile's fitted figures for its type (unchanged if none)."""
        fit = self.fits.get(chip.name)
        if not fit:
            return chip
        values = dict(fit)
        if "efficiency" in values:
            values["efficiency"] = EfficiencyCurve(**values["efficiency"])
        return dataclasses.replace(chip, **values)

    def entries(self, chip: str, tensor: int, recompute: str) -> list[ProfileEntry]:
        """Entries for one (chip, tensor, recompute), sorted by tokens."""
        return sorted(
            (e for e in self.chips.get(chip, ()) if e.tensor == tensor and e.recompute == recompute),
            key=lambda e: e.tokens,
        )

    def lookup(self, chip: str, tensor: int, tokens: int, recompute: str) -> ProfileEntry | None:
        """The measured (or interpolated) entry for this shape, or None if the profile lacks it.

        The returned entry's `recompute` says which policy was measured: the caller adds
        analytical recomputation when it differs from the one asked for.
        """
        for policy in (recompute, "none"):
            found = self.entries(chip, tensor, policy)
            if found:
                return _interpolate(found, tokens)
        return None

    def check_matches(self, model: ModelConfig, seq_len: int) -> None:
        if model != self.model or seq_len != self.seq_len:
            raise ProfileError(
                f"the profile was measured for model {self.model_name or 'custom'} at seq_len "
                f"{self.seq_len}, but the plan is for {preset_name(model) or 'a custom model'} at "
                f"seq_len {seq_len}; re-run `h2jax profile` for this model and sequence length"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": PROFILE_FORMAT_VERSION,
            "model": self.model_name or preset_name(self.model) or self.model.to_dict(),
            "seq_len": self.seq_len,
            "source": self.source,
            "chips": {c: [e.to_dict() for e in es] for c, es in self.chips.items()},
            **({"fits": {c: dict(f) for c, f in self.fits.items()}} if self.fits else {}),
        }


def _interpolate(entries: list[ProfileEntry], tokens: int) -> ProfileEntry:
    keys = [e.tokens for e in entries]
    i = bisect.bisect_left(keys, tokens)
    if i < len(keys) and keys[i] == tokens:
        return entries[i]
    if len(entries) == 1 or i == 0 or i == len(entries):
        # Outside the measured range: scale the nearest point by tokens (time ~ work).
        near = entries[0] if i == 0 else entries[-1]
        r = tokens / near.tokens
        act = None if near.activation_bytes is None else int(round(near.activation_bytes * r))
        return ProfileEntry(near.tensor, tokens, near.forward_s * r, near.backward_s * r, near.recompute, act)
    lo, hi = entries[i - 1], entries[i]
    w = (tokens - lo.tokens) / (hi.tokens - lo.tokens)

    def lerp(a: float, b: float) -> float:
        return a + (b - a) * w

    act = None
    if lo.activation_bytes is not None and hi.activation_bytes is not None:
        act = int(round(lerp(lo.activation_bytes, hi.activation_bytes)))
    return ProfileEntry(
        lo.tensor, tokens, lerp(lo.forward_s, hi.forward_s), lerp(lo.backward_s, hi.backward_s), lo.recompute, act
    )


def _entry_from_dict(raw: Any, where: str) -> ProfileEntry:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where} must be an object with tensor, tokens, forward_s, backward_s")
    known = {"tensor", "tokens", "recompute", "forward_s", "backward_s", "activation_bytes"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    for key in ("tensor", "tokens"):
        v = raw.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ProfileError(f"{where}.{key} must be an integer >= 1, got {v!r}")
    for key in ("forward_s", "backward_s"):
        v = raw.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ProfileError(f"{where}.{key} must be a positive number of seconds, got {v!r}")
    policy = raw.get("recompute", "none")
    if policy not in _POLICIES:
        raise ProfileError(f"{where}.recompute {policy!r} is unknown; use one of {', '.join(_POLICIES)}")
    act = raw.get("activation_bytes")
    if act is not None and (not isinstance(act, int) or isinstance(act, bool) or act < 0):
        raise ProfileError(f"{where}.activation_bytes must be an integer >= 0, got {act!r}")
    return ProfileEntry(
        int(raw["tensor"]), int(raw["tokens"]), float(raw["forward_s"]), float(raw["backward_s"]), policy, act
    )


def _fit_from_dict(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where} must be an object with some of {', '.join(FIT_FIELDS)}")
    unknown = sorted(set(raw) - set(FIT_FIELDS))
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {unknown}; known fields: {list(FIT_FIELDS)}")
    out: dict[str, Any] = {}
    for key, v in raw.items():
        if key == "efficiency":
            curve_keys = ("max", "half_tokens", "half_width")
            if not isinstance(v, Mapping) or set(v) != set(curve_keys):
                raise ProfileError(f"{where}.efficiency must be an object with exactly {', '.join(curve_keys)}")
            for k in curve_keys:
                x = v[k]
                if not isinstance(x, (int, float)) or isinstance(x, bool) or not x > 0 or (k == "max" and x > 1):
                    raise ProfileError(f"{where}.efficiency.{k} must be a positive number"
                                       f"{' <= 1' if k == 'max' else ''}, got {x!r}")
            out[key] = {k: float(v[k]) for k in curve_keys}
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 or (key == "dispatch_us" and v == 0)):
            raise ProfileError(f"{where}.{key} must be a positive number, got {v!r}")
        else:
            out[key] = float(v)
    return out


def profile_from_dict(raw: Mapping[str, Any]) -> Profile:
    if not isinstance(raw, Mapping):
        raise ProfileError("a profile must be a JSON object")
    if raw.get("format_version") != PROFILE_FORMAT_VERSION:
        raise ProfileError(
            f"profile format_version is {raw.get('format_version')!r}; this h2jax reads "
            f"{PROFILE_FORMAT_VERSION} (re-run `h2jax profile`)"
        )
    if "model" not in raw:
        raise ProfileError("profile.model is missing; give the preset name or config it was measured for")
    model = get_config(raw["model"], where="profile.model")
    seq_len = raw.get("seq_len")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ProfileError(f"profile.seq_len must be an integer >= 1, got {seq_len!r}")
    chips_raw = raw.get("chips")
    if not isinstance(chips_raw, Mapping):
        raise ProfileError("profile.chips must map chip-type names to lists of entries")
    chips = {}
    for chip, entries in chips_raw.items():
        if not isinstance(entries, list):
            raise ProfileError(f"profile.chips[{chip!r}] must be a list of entries")
        chips[str(chip)] = tuple(
            _entry_from_dict(e, f"profile.chips[{chip!r}][{i}]") for i, e in enumerate(entries)
        )
    fits_raw = raw.get("fits", {})
    if not isinstance(fits_raw, Mapping):
        raise ProfileError("profile.fits must map chip-type names to fitted figures")
    fits = {str(c): _fit_from_dict(f, f"profile.fits[{c!r}]") for c, f in fits_raw.items()}
    return Profile(
        model=model,
        seq_len=seq_len,
        chips=chips,
        source=str(raw.get("source", "")),
        model_name=raw["model"] if isinstance(raw["model"], str) else None,
        fits=fits,
    )


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile file {path} does not exist; write one with `h2jax profile`")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile file {path} is not valid JSON: {e}") from None
    return profile_from_dict(raw)


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written profile."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    tmp.replace(path)
