"""Precision alignment: the same model on the same data under each chip type's backend and
precision policy, and how far each loss curve strays from the first one's.

    error_c = mean over steps k of |loss_c[k] - loss_ref[k]| / |loss_ref[k]|

passes under 1.5%, the criterion of the H2 paper (arXiv 2505.17548) for training on
different chips to the same loss. Each chip type trains through the real runtime: a
one-stage plan on one device of its platform, its chip file's parameter dtype, compute dtype
and matmul precision. Emulated chips run at host speed here (their slowdown changes time,
not numerics).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from h2jax.config import ConfigError
from h2jax.plan import Mesh, Optimizer, Plan, Stage, validate

TOLERANCE = 0.015  # mean relative error of the loss curve (H2 paper)


@dataclasses.dataclass(frozen=True)
class CurveError:
    chip: str
    mean_relative_error: float
    worst_step: int
    worst_relative_error: float
    final_loss: float

    @property
    def passed(self) -> bool:
        return self.mean_relative_error < TOLERANCE


@dataclasses.dataclass(frozen=True)
class AlignResult:
    reference: str
    losses: dict[str, list[float]]
    errors: list[CurveError]  # one per chip after the first

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.errors)

    @property
    def worst(self) -> CurveError | None:
        return max(self.errors, key=lambda e: e.mean_relative_error, default=None)

    def failure_message(self) -> str:
        bad = [e for e in self.errors if not e.passed]
        return "; ".join(
            f"{e.chip}: mean relative error {e.mean_relative_error:.2%} >= {TOLERANCE:.1%}, worst at step "
            f"{e.worst_step} ({e.worst_relative_error:.2%}: loss {self.losses[e.chip][e.worst_step]:.4f} "
            f"vs {self.losses[self.reference][e.worst_step]:.4f} on {self.reference}"
            f"{'; the loss is not finite: training diverged' if not np.isfinite(self.losses[e.chip][e.worst_step]) else ''})"
            for e in bad
        )

    def to_dict(self) -> dict:
        return {
            "reference": self.reference,
            "tolerance": TOLERANCE,
            "passed": self.passed,
            "chips": {e.chip: dataclasses.asdict(e) | {"passed": e.passed} for e in self.errors},
        }


def curve_error(chip: str, losses: Sequence[float], reference: Sequence[float]) -> CurveError:
    got, want = np.asarray(losses, np.float64), np.asarray(reference, np.float64)
    rel = np.abs(got - want) / np.abs(want)
    if not np.all(np.isfinite(rel)):  # a diverged curve (nan/inf loss) is maximally wrong
        rel = np.where(np.isfinite(rel), rel, np.inf)
    worst = int(np.argmax(rel))
    return CurveError(chip, float(np.mean(rel)), worst, float(rel[worst]), float(got[-1]))


def alignment_plan(chip: str, model="tiny", seq_len: int = 32, batch: int = 8,
                   learning_rate: float = 3e-3, seed: int = 0) -> Plan:
    """The whole model as one stage on one device of `chip`'s platform."""
    from h2jax.config import get_config, preset_name

    cfg = get_config(model)
    plan = Plan(
        cfg, seq_len, batch, batch, (Stage(chip, Mesh(1, 1), (0, cfg.n_layers)),), seed=seed,
        optimizer=Optimizer(name="adamw", learning_rate=learning_rate, clip_norm=1.0),
        model_name=preset_name(cfg),
    )
    validate(plan)
    return plan


def _train_curve(plan: Plan, steps: int, dataset, callback) -> list[float]:
    """The loss of each step; a run the runtime stops on a non-finite loss (a precision
    policy that diverges) keeps its curve, NaN from the step that diverged on."""
    from h2jax.runtime.pipeline import NonFiniteLossError
    from h2jax.runtime.train import run

    seen: list[float] = []

    def record(step: int, loss: float, seconds: float) -> None:
        seen.append(loss)
        if callback is not None:
            callback(step, loss, seconds)

    try:
        return run(plan, steps, dataset=dataset, on_step=record, emulate_time=False).losses
    except NonFiniteLossError:
        return seen + [float("nan")] * (steps - len(seen))


def align(
    chips: Sequence[str],
    steps: int = 300,
    *,
    model="tiny",
    seq_len: int = 32,
    batch: int = 8,
    learning_rate: float = 3e-3,
    seed: int = 0,
    dataset=None,
    on_step: Callable[[str], Callable | None] | None = None,
) -> AlignResult:
    """Train one plan per chip type on identical data; compare each loss curve with the first."""
    from h2jax.backends import select_platforms
    from h2jax.runtime.train import default_dataset

    if len(chips) < 2:
        raise ConfigError("--chips needs at least two chip types: the first is the reference")
    if steps < 1:
        raise ConfigError("--steps must be >= 1")
    plans = {c: alignment_plan(c, model, seq_len, batch, learning_rate, seed) for c in chips}
    select_platforms(chips)  # every platform, before the first run initializes JAX
    dataset = dataset or default_dataset(plans[chips[0]])
    losses = {c: _train_curve(plan, steps, dataset, on_step(c) if on_step is not None else None)
              for c, plan in plans.items()}
    ref = chips[0]
    errors = [curve_error(c, losses[c], losses[ref]) for c in chips[1:]]
    return AlignResult(ref, losses, errors)
