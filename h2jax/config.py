"""Model configuration: one frozen, validated dataclass and the named presets.

This module imports nothing from JAX so the planner can read model shapes in
microseconds. The math of the model lives in `h2jax.model`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration or plan field is wrong. The message names the field and the fix."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """A LLaMA-style decoder-only transformer.

    `n_kv_heads < n_heads` gives grouped-query attention. The input embedding and
    the output head are separate (untied) matrices unless `tie_embeddings`: then the head is
    the embedding's transpose (one V x d matrix; the planner prices it, docs/planner.md).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                f"({self.n_heads}); choose n_heads among the divisors of d_model"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model head_dim = d_model / n_heads = {self.head_dim} must be even for "
                "rotary embeddings; change d_model or n_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def layer_param_count(self) -> int:
        """Parameters of one transformer block (attention, SwiGLU MLP, two RMSNorms)."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        mlp = 3 * d * self.d_ff
        return attn + mlp + 2 * d

    def param_count(self) -> int:
        """All parameters: embedding, blocks, final norm and output head (none when tied)."""
        return (
            self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
            + self.n_layers * self.layer_param_count()
            + self.d_model
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_tensor_parallel(self, tensor: int, where: str) -> None:
        """Raise unless Megatron-style sharding over `tensor` devices divides every split axis."""
        for name, size in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads), ("d_ff", self.d_ff)):
            if size % tensor:
                raise ConfigError(
                    f"{where}: model.{name} ({size}) is not divisible by mesh.tensor ({tensor}); "
                    f"use a tensor size that divides {size}"
                )


# Attention kernels a stage may run (chosen per chip type, see h2jax.cluster):
#   "xla"     the explicit path: the s x s scores are materialized and the probabilities saved
#             for the backward (h*s values per token per layer);
#   "cudnn"   cuDNN's flash-attention kernel through jax.nn.dot_product_attention (CUDA,
#             bf16/fp16 compute): tiles in on-chip memory, causal tiles skipped, the backward
#             recomputes the scores from the saved output and log-sum-exp;
#   "blocked" jax.nn.dot_product_attention's XLA path run one block of queries at a time, each
#             block recomputed in the backward (memory-efficient attention, Rabe & Staats
#             2021): one block's scores alive at a time, nothing of them kept for the backward.
ATTENTION_KERNELS = ("xla", "cudnn", "blocked")
ATTENTION_BLOCK = 512  # query rows per block of the "blocked" kernel
CUDNN_TILE = 128  # query/key tile of cuDNN's flash kernel (FlashAttention-2's 128), for counting


@functools.lru_cache(maxsize=256)
def causal_keys_per_query(seq_len: int, tile: int) -> float:
    """Mean keys a query is multiplied with when causal attention skips every key tile after its
    query tile (the FLOPs of such a kernel per token scale with this; a full square: seq_len)."""
    bounds = [(start, min(start + tile, seq_len)) for start in range(0, seq_len, tile)]
    return sum((end - start) * end for start, end in bounds) / seq_len


PRESETS: dict[str, ModelConfig] = {
    # Compiles in seconds on a laptop CPU; used by tests.
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128),
    # The demo model: byte-level, a few million parameters, trains visibly in a minute on CPU.
    "small": ModelConfig(vocab_size=256, d_model=128, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=384),
    # Shape-only presets for planning (never instantiated on a test machine).
    "llama-7b": ModelConfig(
        vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11_008
    ),
    "llama-70b": ModelConfig(
        vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28_672
    ),
    # About 100B parameters: the H2 paper's model size.
    "llama-100b": ModelConfig(
        vocab_size=128_256, d_model=10_240, n_layers=88, n_heads=80, n_kv_heads=8, d_ff=28_672
    ),
}


def get_config(spec: str | Mapping[str, Any] | ModelConfig, where: str = "model") -> ModelConfig:
    """A preset name, a full config mapping, or a ModelConfig -> ModelConfig."""
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(
                f"{where}: unknown model preset {spec!r}; known presets: {', '.join(PRESETS)} "
                "(or give a full config object)"
            )
        return PRESETS[spec]
    if isinstance(spec, Mapping):
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise ConfigError(f"{where}: unknown model field(s) {unknown}; known fields: {sorted(fields)}")
        required = {
            f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING
        }
        missing = sorted(required - set(spec))
        if missing:
            raise ConfigError(f"{where}: missing model field(s) {missing}")
        return ModelConfig(**spec)
    raise ConfigError(f"{where}: expected a preset name or a config object, got {type(spec).__name__}")


def preset_name(config: ModelConfig) -> str | None:
    for name, preset in PRESETS.items():
        if preset == config:
            return name
    return None
