"""The memory model: bytes per device of one pipeline stage, as a linear function of its layers.

Per device of a stage with l layers on a (D, T) mesh, micro-batch b, n = (b/D)*s tokens:

    params      = l * P_layer/T * param_bytes            (+ embedding V*d/T on stage 0,
    grads       = l * P_layer/T * 4                         head V*d/T + d on the last stage)
    optimizer   = l * P_layer/T * 8 / (D if sharded)     AdamW m and v in f32 (ZeRO-1 shards over D)
    activations = in_flight * l * A(n)                   in_flight: the schedule's rule (h2jax.schedules;
                                                         1F1B: min(p - i, m); GPipe: m), in whole-stage units
    deferred    = deferred * l * n*d*a                   split-backward schedules (ZB-H1): each micro-batch
                                                         between its B and its W keeps every layer's output
                                                         gradient for the W
    head        = in_flight * (n*V/T*4*2 + n*d*a)        last stage: each micro-batch in flight keeps its
                                                         f32 logits and log-probabilities and the final
                                                         norm's output
    working     = one layer's backward: the gradients of its activations, A_none(n), and its
                  weight gradient in the compute dtype, P_layer/T*a (`layer_backward_bytes`;
                  a = 4 on XLA:CPU, which computes 16-bit math in f32);
                  + the layer's recomputed activations, A_none(n), if the stage recomputes;
                  + f32 logits and their gradient, n*V/T*4*2, on the last stage
    reserve     = RESERVE_FRACTION of the chip's memory (runtime, XLA workspace, fragmentation)

A(n), the bytes one layer keeps from forward to backward per device, adapts Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Eq. 1-2, no
sequence parallelism) to a SwiGLU MLP, grouped-query attention and no dropout, with a =
activation bytes (the chip's compute dtype):

    none:       n*a*(4d + ((h + 2g)*e + d + 3F + h*s)/T)   norm inputs/outputs (replicated over T),
                                                           Q/K/V, attention output, gate/up/SiLU,
                                                           softmax probabilities (h*s per token)
    selective:  n*a*(4d + ((h + 2g)*e + d + 3F)/T)         the attention core is recomputed
    full:       n*a*d                                      only the layer input is kept

The h*s term is the explicit XLA attention's (chip.attention_kernel "xla"). A fused kernel
never keeps the scores: under "none" the cuDNN flash kernel keeps one f32 log-sum-exp per
head and token, n*4*h/T, instead of n*a*h*s/T; the blocked XLA kernel keeps nothing beyond
q, k, v (already counted) and its working memory gains one block's f32 scores and
probabilities, n*min(C, s)*h*8/T (C = config.ATTENTION_BLOCK query rows).

A measured profile's `activation_bytes` replaces A(n) when it has the shape and policy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from h2jax.config import ATTENTION_BLOCK, ModelConfig
from h2jax.planner.stage_shape import StageShape

GIB = 1024**3
RESERVE_FRACTION = 0.10
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 0}
GRAD_BYTES = 4

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def end_params(model: ModelConfig, first: bool, last: bool) -> int:
    """Parameters outside the transformer blocks that a stage holds: the embedding on the
    first stage, the final norm and head on the last. Tied embeddings are held once when the
    first stage is also the last, else one copy on each end."""
    table = model.vocab_size * model.d_model
    if model.tie_embeddings and first and last:
        return table + model.d_model
    return (table if first else 0) + (table + model.d_model if last else 0)


def layer_activation_bytes(
    model: ModelConfig, seq_len: int, tokens: float, tensor: int, recompute: str, act_bytes: int,
    attention: str = "xla",
) -> float:
    """A(n): bytes one layer keeps per device for one micro-batch under the attention kernel
    `attention` (config.ATTENTION_KERNELS); see the module docstring."""
    d, h, g, e, F = model.d_model, model.n_heads, model.n_kv_heads, model.head_dim, model.d_ff
    if recompute == "full":
        return tokens * act_bytes * d
    sharded = (h + 2 * g) * e + d + 3 * F
    if recompute == "none" and attention == "xla":
        sharded += h * seq_len
    kept = tokens * act_bytes * (4 * d + sharded / tensor)
    if recompute == "none" and attention == "cudnn":
        kept += tokens * 4 * h / tensor
    return kept


def layer_backward_bytes(model: ModelConfig, tensor: int, a: int, layer_none: float) -> float:
    """One layer's backward, beyond what it keeps: the gradients of its activations (as large
    as the activations it keeps without recomputation) and its weight gradient in the
    compute dtype, before it is added to the f32 accumulator."""
    return layer_none + model.layer_param_count() / tensor * a


def attention_working_bytes(model: ModelConfig, seq_len: int, tokens: float, tensor: int, attention: str) -> float:
    """Transient bytes of the attention kernel beyond what a layer keeps: one block's f32 scores
    and probabilities for the blocked kernel, else 0 (see the module docstring)."""
    if attention != "blocked":
        return 0.0
    return tokens * min(ATTENTION_BLOCK, seq_len) * model.n_heads * 8 / tensor


@dataclasses.dataclass(frozen=True, slots=True)
class StageMemoryTerms:
    """Bytes per device as linear functions of the stage's layer count l."""

    layer_static: float  # params + grads + optimizer state of one layer
    layer_activation: float  # one layer, one micro-batch
    in_flight: float  # micro-batches (whole-stage units) whose activations the stage holds at peak
    params_end: float  # embedding / head: params + grads + optimizer state
    working: float
    reserve: float
    capacity: float  # the chip's usable memory
    deferred: int = 0  # micro-batches waiting for their weight gradient (W) at peak
    layer_deferred: float = 0.0  # one layer's output gradient kept for the W, one micro-batch
    end_activation: float = 0.0  # the head's and loss's residuals, one micro-batch (last stage)

    @property
    def per_layer(self) -> float:
        """Bytes per layer: static, in-flight activations and deferred-W gradients."""
        return self._per_layer(self.in_flight, self.deferred)

    def _per_layer(self, in_flight, deferred):
        return self.layer_static + in_flight * self.layer_activation + deferred * self.layer_deferred

    def activation_bytes(self, n_layers: int) -> int:
        """One micro-batch's residuals: its layers' and, on the last stage, the head's."""
        return int(self.layer_activation * n_layers + self.end_activation)

    def static_bytes(self, n_layers: int) -> int:
        """Everything but the in-flight activations (working buffers and reserve included)."""
        return int(self.layer_static * n_layers + self.params_end + self.working + self.reserve)

    def total_bytes(self, n_layers: int) -> float:
        return self.per_layer * n_layers + self._fixed()

    def _fixed(self, in_flight=None):
        """The bytes that do not grow with the stage's layers."""
        in_flight = self.in_flight if in_flight is None else in_flight
        return self.params_end + in_flight * self.end_activation + self.working + self.reserve

    def fits(self, n_layers):
        """THE fit test, the one the search, the exhaustive reference and `predict` share: the
        stage's bytes with n_layers layers within the chip's capacity (elementwise for arrays)."""
        return self._within(n_layers, self.per_layer, self._fixed())

    def _within(self, n_layers, per_layer, fixed):
        return per_layer * n_layers + fixed <= self.capacity

    def max_layers(self, in_flight=None, deferred=None):
        """Most layers that pass `fits` (may be <= 0: not even one layer fits), with this
        stage's in-flight micro-batches and deferred gradients, or the `in_flight` / `deferred`
        given (the same terms at another pipeline position, without building them); elementwise
        (an int64 array) when `in_flight` is an array, e.g. one value per pipeline position.
        The quotient room / per_layer is within one of it; `fits`' bytes decide the last layer."""
        in_flight = self.in_flight if in_flight is None else in_flight
        per_layer = self._per_layer(in_flight, self.deferred if deferred is None else deferred)
        fixed = self._fixed(in_flight)
        room = self.capacity - fixed
        if np.ndim(room) == 0 and per_layer > 0:  # one stage: the same arithmetic on Python floats
            room, per_layer = float(room), float(per_layer)
            n = math.floor(max(room, 0.0) / per_layer)
            for _ in range(2):
                n = n if self._within(n, per_layer, fixed) else n - 1
            for _ in range(2):
                n = n + 1 if self._within(n + 1, per_layer, fixed) else n
            return -1 if room < 0 else int(n)
        n = np.floor(np.maximum(room, 0.0) / per_layer)
        for _ in range(2):
            n = np.where(self._within(n, per_layer, fixed), n, n - 1)
        for _ in range(2):
            n = np.where(self._within(n + 1, per_layer, fixed), n + 1, n)
        n = np.where(room < 0, -1, n).astype(np.int64)
        return int(n) if n.ndim == 0 else n

    @staticmethod
    def stacked(terms: "Sequence[StageMemoryTerms]") -> "StageMemoryTerms":
        """Several stages' terms as one, each field a column (n, 1): its `max_layers(in_flight)`
        for a row of in-flight counts (1, J) is every stage's at every count, (n, J), by the
        same arithmetic elementwise."""
        return StageMemoryTerms(**{
            f.name: np.array([getattr(t, f.name) for t in terms], dtype=float)[:, None]
            for f in dataclasses.fields(StageMemoryTerms)
        })

    def breakdown(self, n_layers: int) -> dict[str, float]:
        """GiB per category, for reports."""
        static = self.layer_static * n_layers + self.params_end
        return {
            "params_grads_optimizer": static / GIB,
            "activations": self.in_flight * (self.layer_activation * n_layers + self.end_activation) / GIB,
            "deferred_weight_gradients": self.deferred * self.layer_deferred * n_layers / GIB,
            "working": self.working / GIB,
            "reserve": self.reserve / GIB,
            "total": self.total_bytes(n_layers) / GIB,
            "capacity": self.capacity / GIB,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class LayerMemory:
    """Per device, one layer of a stage shape: what it holds and works in wherever the stage
    sits in the pipeline (`stage_memory_terms` adds the ends')."""

    per_param: float  # bytes per parameter: its copy, its gradient and its share of the optimizer state
    layer_static: float
    layer_activation: float
    working: float  # the backward's and the attention kernel's working bytes (no head)
    layer_deferred: float


def layer_memory(
    shape: StageShape,
    shard_optimizer: bool = True,
    optimizer: str = "adamw",
    measured_activation: int | None = None,
) -> LayerMemory:
    """A stage shape's `LayerMemory`."""
    model, seq_len, chip, data, tensor, recompute = (
        shape.model, shape.seq_len, shape.chip, shape.data, shape.tensor, shape.recompute)
    tokens = shape.tokens
    a = _DTYPE_BYTES[chip.precision.compute_dtype]
    per_param = (
        _DTYPE_BYTES[chip.precision.param_dtype]
        + GRAD_BYTES
        + OPTIMIZER_STATE_BYTES[optimizer] / (data if shard_optimizer else 1)
    )
    kernel = chip.attention_kernel
    if measured_activation is not None:
        layer_act = float(measured_activation)
    else:
        layer_act = layer_activation_bytes(model, seq_len, tokens, tensor, recompute, a, kernel)
    # XLA:CPU has no 16-bit arithmetic: it computes bf16/f16 math in f32, so a backward's
    # temporaries there take 4 bytes a value whatever the compute dtype (measured).
    w = 4 if chip.platform == "cpu" else a
    layer_none = layer_activation_bytes(model, seq_len, tokens, tensor, "none", w, kernel)
    working = attention_working_bytes(model, seq_len, tokens, tensor, kernel) + layer_backward_bytes(
        model, tensor, w, layer_none)
    if recompute != "none":  # the recomputed layer's activations, beside their gradients
        working += layer_none
    return LayerMemory(per_param, model.layer_param_count() / tensor * per_param, layer_act, working,
                       tokens * model.d_model * a)


def stage_memory_terms(
    shape: StageShape,
    first: bool,
    last: bool,
    in_flight: float,
    shard_optimizer: bool = True,
    optimizer: str = "adamw",
    measured_activation: int | None = None,
    deferred: int = 0,
    layer: LayerMemory | None = None,
) -> StageMemoryTerms:
    """A stage's StageMemoryTerms; `layer`: its shape's `layer_memory`, where the caller has it
    (the same for every place of the stage)."""
    if layer is None:
        layer = layer_memory(shape, shard_optimizer, optimizer, measured_activation)
    model, chip, tensor = shape.model, shape.chip, shape.tensor
    tokens = shape.tokens
    a = _DTYPE_BYTES[chip.precision.compute_dtype]
    params_end = end_params(model, first, last) / tensor * layer.per_param
    working = layer.working
    logits = tokens * model.vocab_size / tensor * 4 * 2  # f32 logits and their gradient / log-probabilities
    if last:
        working += logits
    capacity = chip.usable_memory_gib * GIB
    return StageMemoryTerms(
        layer_static=layer.layer_static,
        layer_activation=layer.layer_activation,
        in_flight=in_flight,
        params_end=params_end,
        working=working,
        reserve=RESERVE_FRACTION * capacity,
        capacity=capacity,
        deferred=deferred,
        layer_deferred=layer.layer_deferred,
        end_activation=(logits + tokens * model.d_model * a) if last else 0.0,
    )
