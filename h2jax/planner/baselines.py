"""Homogeneous baselines and the HeteroSpeedupRatio.

A heterogeneous plan is only worth reporting next to what each chip type achieves alone *at
the same global batch*: ratio = N*TGS / sum_i N_i*TGS_i = tokens/s of the mixed cluster over
the sum of the tokens/s of each chip group planned alone. A chip type that cannot hold the
model alone contributes 0 (and says why). A baseline at a different, fixed batch (the H2
paper's way) can be computed too, and is always labelled `batch_matched: false`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from h2jax import names as N
from h2jax.cluster import Cluster
from h2jax.config import ConfigError, get_config


@dataclasses.dataclass(frozen=True, slots=True)
class Baseline:
    chip: str
    chips: int
    global_batch: int
    tokens_per_s: float  # 0 when the type cannot hold the model alone
    iteration_time_s: float | None
    plan: Any | None  # h2jax.plan.Plan
    reason: str | None = None  # why there is no plan

    @property
    def tgs(self) -> float:
        return self.tokens_per_s / self.chips

    def to_dict(self, batch_matched: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "chips": self.chips,
            "global_batch": self.global_batch,
            "batch_matched": batch_matched,
            N.TOKENS_PER_S: self.tokens_per_s,
            N.TOKENS_PER_CHIP_PER_S: self.tgs,
            N.STEP_TIME_S: self.iteration_time_s,
        }
        if self.plan is not None:
            out["stages"] = len(self.plan.stages)
            out["micro_batch"] = self.plan.micro_batch
            out["mesh"] = [[s.mesh.data, s.mesh.tensor] for s in self.plan.stages]
        if self.reason:
            out["reason"] = self.reason
        return out


def homogeneous_baselines(
    cluster: Cluster,
    model: Any,
    seq_len: int,
    global_batch: int,
    at_once: int = 1,
    **search_kwargs: Any,
) -> dict[str, Baseline]:
    """Each chip group of the cluster planned alone (same search, same cost model).
    `at_once` > 1: that many groups searched at once, each in a process of its own (and one
    process each: `search_kwargs`' workers are then not used), the same plans."""
    from h2jax.planner.search import candidate_plan  # late: search does not need baselines
    from h2jax.planner.workers import Pool

    model = get_config(model)
    schedule = search_kwargs.get("schedule", "1f1b")
    names = list(cluster.counts)
    if at_once > 1 and len(names) > 1:
        kwargs = {**search_kwargs, "workers": 1}
        with Pool(min(at_once, len(names)), "the baselines' search") as pool:
            found = pool.map(_alone, [(cluster.only(name), model, seq_len, global_batch, kwargs) for name in names])
    else:
        found = [_alone(cluster.only(name), model, seq_len, global_batch, search_kwargs) for name in names]
    out = {}
    for (name, count), best in zip(cluster.counts.items(), found):
        if isinstance(best, ConfigError):
            out[name] = Baseline(name, count, global_batch, 0.0, None, None, reason=str(best))
            continue
        tokens_per_s = global_batch * seq_len / best.time_s
        plan = candidate_plan(best, model, seq_len, global_batch, schedule)
        out[name] = Baseline(name, count, global_batch, tokens_per_s, best.time_s, plan)
    return out


def _alone(cluster: Cluster, model: Any, seq_len: int, global_batch: int, search_kwargs: dict) -> Any:
    """The best plan (search.Candidate) of a one-type cluster, or the ConfigError that says
    why it has none."""
    from h2jax.planner.search import top_k  # late: search does not need baselines

    try:
        (best,), _ = top_k(cluster, model, seq_len, global_batch, k=1, **search_kwargs)
    except ConfigError as e:
        return e
    return best


def hetero_speedup_ratio(tokens_per_s: float, baselines: Mapping[str, Baseline]) -> float | None:
    """N*TGS / sum_i N_i*TGS_i; None when no chip type can train the model alone."""
    alone = sum(b.tokens_per_s for b in baselines.values())
    return tokens_per_s / alone if alone > 0 else None
