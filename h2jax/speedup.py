"""HeteroSpeedupRatio, measured the honest way: plan and simulate a mixed cluster and each of its
chip types alone, at the same global batch.

    HeteroSpeedupRatio = tokens/s of the mixed cluster / sum over chip types of the tokens/s
                         that type's chips reach alone

(the H2 paper's N*TGS / sum N_i*TGS_i with TGS per chip of the cluster, so chips a plan leaves
idle count against it; `h2jax.planner.hetero_speedup_ratio` is the one definition, and a chip
type that cannot hold the model alone counts 0). Each side is the planner's best plan (its
homogeneous baselines for the chip types alone), timed by the simulator.

The paper compared mixed runs at 6-8M-token global batches with homogeneous baselines at 2M
tokens. A larger batch means more micro-batches per step, a smaller pipeline bubble and a
cheaper per-token gradient reduction, so part of its "superlinear" gain is the batch size,
not the mixing. `compare` reports both: baselines at the same batch (the default) and, labelled
as the paper's method, at a fixed baseline batch.
"""

from __future__ import annotations

import dataclasses
import fractions
import re
from typing import Any, Mapping

from h2jax import names as N
from h2jax.cluster import Cluster
from h2jax.config import ConfigError, ModelConfig, get_config
from h2jax.plan import Plan
from h2jax.planner.profile import Profile

_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_tokens(text: str | int, flag: str = "token count") -> int:
    """'4M' -> 4 * 2**20 tokens (binary suffixes K, M, G, as batch sizes are quoted); '4194304' ok.
    `flag` names the option in errors."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]?)i?\s*", str(text), re.IGNORECASE)
        if not m:
            raise ConfigError(f"{flag} {text!r} is not a number like 4194304 or 4M")
        # Exact arithmetic: a float would round counts beyond 2**53.
        value = fractions.Fraction(m.group(1)) * _SUFFIX[m.group(2).upper()]
        if value.denominator != 1:
            raise ConfigError(f"{flag} {text!r} must be a positive whole number of tokens")
        value = int(value)
    if value < 1:
        raise ConfigError(f"{flag} {text!r} must be a positive whole number of tokens")
    return value


def sequences(tokens: int, seq_len: int) -> int:
    if tokens % seq_len:
        raise ConfigError(
            f"global batch of {tokens} tokens is not a whole number of {seq_len}-token sequences; "
            f"use a multiple of {seq_len} (e.g. {max(1, round(tokens / seq_len)) * seq_len})"
        )
    return tokens // seq_len


@dataclasses.dataclass(frozen=True)
class Run:
    """One planned and simulated configuration."""

    label: str  # "mixed" or the chip type
    cluster_chips: int  # chips of the (sub-)cluster, idle ones included
    global_batch_tokens: int
    plan: Plan | None
    predicted_s: float | None  # the cost model's step (cost_model.iteration_time)
    simulated_s: float | None
    error: str | None = None  # why no plan exists (e.g. the model does not fit)
    bubble_fraction: float | None = None  # the schedule's (h2jax.schedules), as `h2jax plan` prints it

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.simulated_s is None else self.global_batch_tokens / self.simulated_s

    @property
    def tgs(self) -> float | None:
        """Tokens per second per chip of the (sub-)cluster."""
        t = self.tokens_per_s
        return None if t is None else t / self.cluster_chips

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "label": self.label,
            "cluster_chips": self.cluster_chips,
            "chips_used": None if p is None else p.n_devices,
            "global_batch_tokens": self.global_batch_tokens,
            "stages": None if p is None else p.n_stages,
            "micro_batch": None if p is None else p.micro_batch,
            "n_micro": None if p is None else p.n_micro,
            "schedule": None if p is None else p.schedule,
            N.PREDICTED: {N.STEP_TIME_S: self.predicted_s, N.BUBBLE_FRACTION: self.bubble_fraction},
            N.SIMULATED: {N.STEP_TIME_S: self.simulated_s, N.TOKENS_PER_S: self.tokens_per_s,
                          N.TOKENS_PER_CHIP_PER_S: self.tgs},
            "error": self.error,
        }


def _simulated(plan: Plan, cluster: Cluster, profile: Profile | None) -> tuple[float, float, float]:
    """(the cost model's seconds, simulated seconds, bubble fraction) per step of a plan: the
    cost model's are its closed form, or a ZB-H1 plan's order replayed (cost_model.pipeline_time)."""
    from h2jax.planner import cost_model
    from h2jax.sim_plans import simulate_plan

    costs = cost_model.stage_costs(plan, cluster, profile)
    predicted = cost_model.iteration_time(costs, plan.n_micro, plan.schedule, plan.virtual_stages)
    bubble = cost_model.bubble_fraction(costs, plan.n_micro, plan.schedule, plan.virtual_stages)
    return predicted, simulate_plan(plan, costs).iteration_s, bubble


def plan_mixed(
    cluster: Cluster,
    model: ModelConfig | str,
    seq_len: int,
    global_batch_tokens: int,
    schedule: str = "auto",
    profile: Profile | None = None,
    time_limit_s: float | None = None,
) -> Run:
    """The planner's best plan for the whole cluster, timed by the simulator. With
    `time_limit_s`, the best plan the search found in that time (see predicted.proved_optimal)."""
    from h2jax.planner import PlannerError, plan_cluster

    batch = sequences(global_batch_tokens, seq_len)
    try:
        result = plan_cluster(
            cluster, model, seq_len, batch, schedule, profile=profile, baselines=False, time_limit_s=time_limit_s
        )
    except PlannerError as e:
        return Run("mixed", cluster.n_chips, global_batch_tokens, None, None, None, str(e))
    predicted, sim, bubble = _simulated(result.plan, cluster, profile)
    return Run("mixed", cluster.n_chips, global_batch_tokens, result.plan, predicted, sim, bubble_fraction=bubble)


def plan_alone(
    cluster: Cluster,
    model: ModelConfig | str,
    seq_len: int,
    global_batch_tokens: int,
    schedule: str = "auto",
    profile: Profile | None = None,
) -> dict[str, Run]:
    """Each chip type of the cluster planned alone (the planner's homogeneous baselines), each
    timed by the simulator. A type that cannot hold the model alone has no plan and counts 0."""
    from h2jax.planner import homogeneous_baselines

    batch = sequences(global_batch_tokens, seq_len)
    out = {}
    for chip, b in homogeneous_baselines(cluster, get_config(model), seq_len, batch,
                                         schedule=schedule, profile=profile, mixed_shapes=True).items():
        if b.plan is None:
            out[chip] = Run(chip, b.chips, global_batch_tokens, None, None, None, b.reason)
            continue
        predicted, sim, bubble = _simulated(b.plan, cluster.only(chip), profile)
        out[chip] = Run(chip, b.chips, global_batch_tokens, b.plan, predicted, sim, bubble_fraction=bubble)
    return out


@dataclasses.dataclass(frozen=True)
class Comparison:
    cluster: str
    mixed: Run
    same_batch: Mapping[str, Run]  # per chip type, at the mixed run's global batch
    fixed_batch: Mapping[str, Run] | None  # per chip type, at the baseline batch (paper's method)
    baseline_global_batch_tokens: int | None

    @staticmethod
    def _ratio(mixed: Run, baselines: Mapping[str, Run] | None, simulated: bool = True) -> float | None:
        """The planner's N*TGS / sum N_i*TGS_i, with simulated (or the cost model's) step times."""
        from h2jax.planner import Baseline, hetero_speedup_ratio

        if baselines is None or mixed.simulated_s is None:
            return None

        def rate(r: Run) -> float:
            t = r.simulated_s if simulated else r.predicted_s
            return 0.0 if t is None else r.global_batch_tokens / t

        alone = {c: Baseline(c, r.cluster_chips, r.global_batch_tokens, rate(r), None, r.plan, r.error)
                 for c, r in baselines.items()}
        return hetero_speedup_ratio(rate(mixed), alone)

    @property
    def ratio_same_batch(self) -> float | None:
        """HeteroSpeedupRatio against baselines at the same global batch: the honest number."""
        return self._ratio(self.mixed, self.same_batch)

    @property
    def ratio_fixed_batch(self) -> float | None:
        """The paper's method: baselines at a fixed (smaller) global batch."""
        return self._ratio(self.mixed, self.fixed_batch)

    @property
    def batch_size_effect(self) -> float | None:
        """How much of the paper-method ratio is the batch size, not the mixing."""
        a, b = self.ratio_fixed_batch, self.ratio_same_batch
        return None if a is None or b is None else a - b

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "global_batch_tokens": self.mixed.global_batch_tokens,
            "baseline_global_batch_tokens": self.baseline_global_batch_tokens,
            "hetero_speedup_ratio": self.ratio_same_batch,
            "hetero_speedup_ratio_cost_model": self._ratio(self.mixed, self.same_batch, simulated=False),
            "hetero_speedup_ratio_paper_method": self.ratio_fixed_batch,
            "batch_size_effect": self.batch_size_effect,
            "mixed": self.mixed.to_dict(),
            "baselines_same_batch": {k: v.to_dict() for k, v in self.same_batch.items()},
            "baselines_fixed_batch": None if self.fixed_batch is None
            else {k: v.to_dict() for k, v in self.fixed_batch.items()},
        }


def compare(
    cluster: Cluster,
    model: ModelConfig | str,
    seq_len: int,
    global_batch_tokens: int,
    baseline_global_batch_tokens: int | None = None,
    schedule: str = "auto",
    profile: Profile | None = None,
    cache: dict[tuple[str, int], dict[str, Run]] | None = None,
    time_limit_s: float | None = None,
) -> Comparison:
    """Plan and simulate the mixed cluster and each chip type alone; see the module docstring.

    `cache` (keyed by ("alone", tokens)) lets a study reuse baselines across batch sizes.
    """
    cache = {} if cache is None else cache

    def alone(tokens: int) -> dict[str, Run]:
        key = ("alone", tokens)
        if key not in cache:
            cache[key] = plan_alone(cluster, model, seq_len, tokens, schedule, profile)
        return cache[key]

    mixed = plan_mixed(cluster, model, seq_len, global_batch_tokens, schedule, profile, time_limit_s)
    fixed = None if baseline_global_batch_tokens is None else alone(baseline_global_batch_tokens)
    return Comparison(cluster.name, mixed, alone(global_batch_tokens), fixed, baseline_global_batch_tokens)
