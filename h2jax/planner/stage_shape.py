"""A stage's shape: what the cost and memory models need to know of a stage wherever it sits in
the pipeline — the model, sequence length, micro-batch, chip type, (data, tensor) mesh and
recompute mode (`cost_model.stage_terms`, `memory_model.stage_memory_terms` and
`memory_model.layer_memory` take it first, then the stage's place)."""

from __future__ import annotations

import dataclasses

from h2jax.cluster import ChipType
from h2jax.config import ModelConfig
from h2jax.plan import Plan


@dataclasses.dataclass(frozen=True, slots=True)
class StageShape:
    model: ModelConfig
    seq_len: int
    micro_batch: int  # sequences per micro-batch, whole pipeline
    chip: ChipType  # as the cluster has it (the cost model applies a profile's fits itself)
    data: int
    tensor: int
    recompute: str  # "none", "selective" or "full"

    @property
    def tokens(self) -> float:
        """Tokens a device sees per micro-batch: micro_batch / data * seq_len."""
        return self.micro_batch / self.data * self.seq_len

    @classmethod
    def of_stage(cls, plan: Plan, i: int, chip: ChipType) -> "StageShape":
        """The shape of the plan's stage i, on `chip` (its chip type's figures)."""
        st = plan.stages[i]
        return cls(plan.model, plan.seq_len, plan.micro_batch, chip, st.mesh.data, st.mesh.tensor, st.recompute)
