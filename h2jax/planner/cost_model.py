"""The cost model: seconds per micro-batch of each pipeline stage, and the iteration time.

Notation (docs/planner.md has the same equations with the reasoning):

    d = d_model, h = n_heads, g = n_kv_heads, e = head_dim, F = d_ff, V = vocab, s = seq_len
    b = micro-batch (sequences, whole pipeline), D x T = a stage's (data, tensor) mesh
    n = (b / D) * s                     tokens per device per micro-batch
    P_mm = d*h*e + 2*d*g*e + h*e*d + 3*d*F   matmul parameters of one layer

Per layer and device, forward FLOPs are  n * (2*P_mm + 4*k*h*e) / T,  k the keys each query
is multiplied with by the chip's attention kernel (chip.attention_kernel): the full square
k = s for the explicit XLA path and the blocked kernel (a masked matmul computes every score),
k = causal_keys_per_query(s, 128) ~ (s + 128)/2 for cuDNN's flash kernel, which skips the
tiles above the diagonal. The matmuls' backward costs twice their forward, the attention
core's ATTENTION_BACKWARD[kernel] times its forward: 2 for XLA (four matmuls from the kept
probabilities), 2.5 for cuDNN (FlashAttention-2 recomputes QK^T: five) and for blocked (each
block's scores recomputed, then four). The weight-gradient share is n * 2*P_mm / T.
Recomputation adds work to the backward: `full` adds the forward but the MLP's down
projection (n * 2*d*F / T FLOPs: its output is not needed), `selective` (Korthikanti et al.
2022: the attention core only) SELECTIVE_RECOMPUTE[kernel] of the attention core's forward
(XLA: the scores' matmul and softmax). Kernels that put the scores in memory (XLA,
blocked) also move them through HBM: n*h*s*(8 + 2a)/T bytes per forward (f32 logits written
and read, probabilities in the compute dtype written and read), the backward the same
multiple of that as of the FLOPs, at the chip's HBM bandwidth (`hbm_gbps`; without it
peak / MACHINE_BALANCE). The layer's element-wise work (two RMSNorms, two residual adds,
rotary on q and k, the SwiGLU product) is memory-bound too:

    mem_s = n * a * (10*d + (2*(h+g)*e + 3*F)/T) / hbm      (memory_bound_bytes_per_token)

in the forward, MEMORY_BOUND_BACKWARD = 2 times it in the backward (plus one forward's
worth when the backward recomputes the whole forward).
Time = FLOPs / (peak * efficiency(n, d/T)) + score bytes / HBM + mem_s, with the chip's curve

    efficiency(n, w) = max * n/(n + half_tokens) * w/(w + half_width)

Small per-device matmuls (few tokens, or a layer width cut thin by tensor parallelism)
leave a chip's matrix units idle and become memory- and launch-bound; large ones approach
the 60-75% of dense peak that well-tuned LLM training reaches on every vendor's chip. The
default curve (a chip file's [efficiency] table overrides it) is a saturating fit with
max = 0.75 and half-efficiency at 256 tokens and width 256; a profile's fit replaces it
(profile.py), and a profile's measured layer times replace the whole per-layer formula.

Every stage compute (a micro-batch's forward, its backward, the step's update) pays a fixed
host cost, the chip's `dispatch_us` (default 50 us): fwd_end, bwd_end and tail_end each
carry one, so over (m + p - 1) slots of a uniform 1F1B pipeline the step grows by
(2*(m + p - 1) + 1) * dispatch.

Tensor parallelism (Megatron, no sequence parallelism): two all-reduces of n*d activations
per layer forward and two backward (one more if the backward recomputes the forward:
`tensor_all_reduces`; on XLA:CPU chips, whose compiler all-reduces each of the five
column-parallel input gradients on its own, five backward, six under `full`), as a
ring on intra-node bandwidth (if T exceeds chips_per_node: each chip's share of its node's
NICs, inter_node_share = min(inter_node_gbps, nics_per_node * inter_node_gbps / chips on
the node)):

    allreduce(bytes, k, bw) = 2*(k-1)/k * bytes/bw + 2*(k-1)*ALPHA

End stages: stage 0 holds the vocab-parallel embedding (one all-reduce forward), the last
stage the final norm and the vocab-parallel head: logits forward 2*n*d*V/T FLOPs, backward
twice that, one all-reduce backward, and the softmax cross-entropy over the vocabulary,
memory-bound: LOSS_BYTES_PER_LOGIT = 12 bytes per f32 logit forward and again backward,
n*V/T*12 / hbm each. The head's time (not its all-reduce) is multiplied by the chip's
`head_scale` (1 unless a calibrated profile fits it: h2jax.calibrate).

Stage-to-stage transfer (the MPI transport's topology-aware resharding): one micro-batch's
activation, b*s*d*bytes, crosses the link once; each receiving data-parallel group gets its
slice split over its tensor ranks, each sending group spreads its slice over its ranks, so

    send_s = max(bytes/(D_s*T_s*bw_s), bytes/(D_r*T_r*bw_r))

with bw the intra-node bandwidth when the two stages share a node (`same_node`: the same
chip type, and D_s*T_s + D_r*T_r <= chips_per_node), else each end's inter-node share
(all of a stage's chips on a node send at once). The activation gradient goes back with
the same bytes and time.

Once per iteration: the data-parallel all-reduce of the stage's f32 gradients over D chips
(ZeRO-1's reduce-scatter + all-gather move the same bytes), and the optimizer step, which is
memory-bound: 28 bytes per owned parameter for AdamW (read p, g, m, v; write p, m, v),
12 for SGD, at the chip's HBM bandwidth. The data-parallel ring runs at intra-node
bandwidth when D*T chips fit a node, else at the inter-node share. Tied embeddings
(model.tie_embeddings) add, on the first and last stage of a multi-stage pipeline, a
two-party all-reduce of the f32 V*d/T embedding-gradient shard at the stage's inter-node
share (`tied_embedding_s`).

Iteration time: each schedule's closed form (h2jax/schedules/, `ClosedForm`), over the
per-stage times above (t_i = f_i + b_i, w_i the weight-gradient part of b_i, c_i = send_i +
link latency, tail_i = dp_i + opt_i), e.g.

    1F1B:  sum_i t_i + 2*sum_i c_i + (m-1)*max(max_i t_i, max_i send_i) + max_i tail_i
    GPipe: sum_i (f_i + b_i) + 2*sum_i c_i + (m-1)*(max(max f, max send) + max(max b, max send))
           + max_i tail_i

For uniform stages without communication both reduce to (m + p - 1)*(f + b). Under
interleaved 1F1B the last stage also sends to the first (chunk c to chunk c + 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

from h2jax.cluster import MACHINE_BALANCE, ChipType, Cluster, EfficiencyCurve
from h2jax.config import CUDNN_TILE, ConfigError, ModelConfig, causal_keys_per_query
from h2jax.plan import Optimizer, Plan
from h2jax.planner import memory_model as mm
from h2jax.planner.profile import Profile
from h2jax.planner.stage_cost import StageCost
from h2jax.planner.stage_shape import StageShape
from h2jax.schedules import bubble_fraction as _bubble, get_schedule

DEFAULT_CURVE = EfficiencyCurve()
E_MAX = DEFAULT_CURVE.max
N_HALF = DEFAULT_CURVE.half_tokens  # tokens per device at which the token factor of efficiency is one half
W_HALF = DEFAULT_CURVE.half_width  # per-device layer width (d_model / tensor) at which the width factor is one half
ALPHA_S = 5e-6  # per-step latency of a ring collective
LINK_LATENCY_S = 1e-5  # fixed latency of one stage-to-stage send
MEMORY_BOUND_BACKWARD = 2.0  # backward HBM bytes of the element-wise work per forward byte
LOSS_BYTES_PER_LOGIT = 12.0  # f32 logits written, read by the log-softmax, read by the loss (forward);
#                              the backward reads them, writes the f32 gradient, the head reads it
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 28, "sgd": 12}
GRAD_BYTES = 4  # gradients accumulate in f32

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def dtype_bytes(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r} in a chip's [precision]; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def efficiency(tokens: float, width: float, curve: EfficiencyCurve = DEFAULT_CURVE) -> float:
    """Fraction of dense peak a layer's matmuls reach (the chip's curve); see the module docstring."""
    return curve.max * tokens / (tokens + curve.half_tokens) * width / (width + curve.half_width)


def memory_bound_bytes_per_token(model: ModelConfig, tensor: int, act_bytes: int) -> float:
    """HBM bytes one layer's element-wise work moves per token in its forward, per device:
    two RMSNorms (read and write d each, 4d), two residual adds (read 2d, write d each, 6d),
    both replicated over the tensor ranks; rotary on q and k (read and write (h+g)*e) and the
    SwiGLU product silu(gate)*up (read 2F, write F), split over them. The attention scores'
    softmax is counted with the attention core (attention_score_bytes_per_token)."""
    d, h, g, e, F = model.d_model, model.n_heads, model.n_kv_heads, model.head_dim, model.d_ff
    return act_bytes * (10.0 * d + (2.0 * (h + g) * e + 3.0 * F) / tensor)


def same_node(sender: ChipType, s_chips: int, receiver: ChipType, r_chips: int) -> bool:
    """Two adjacent stages share a node when they run on the same chip type and their chips
    fit in one node together (a node holds chips of one type; the launcher fills nodes in
    pipeline order)."""
    return sender.name == receiver.name and s_chips + r_chips <= sender.chips_per_node


def collective_gbps(chip: ChipType, chips: int) -> float:
    """GB/s per chip of a collective over `chips` chips of one stage: intra-node when they fit
    in one node, else each node's share of its NICs (chip.inter_node_share_gbps)."""
    if chips <= chip.chips_per_node:
        return chip.intra_node_gbps
    return chip.inter_node_share_gbps(chips)


def tied_embedding_s(model: ModelConfig, chip: ChipType, tensor: int, first: bool, last: bool) -> float:
    """Seconds of the tied embedding's extra gradient all-reduce on a first or last stage of a
    multi-stage pipeline (0 otherwise): after the data-parallel reduction each tensor rank
    exchanges its f32 shard of the V x d gradient with the other end, a two-party all-reduce
    at the stage's inter-node share (the two ends are taken to be on different nodes)."""
    if not model.tie_embeddings or first == last:
        return 0.0
    nbytes = GRAD_BYTES * model.vocab_size * model.d_model / tensor
    return allreduce_s(nbytes, 2, chip.inter_node_share_gbps(tensor))


def calibrated(chip: ChipType, profile: Profile | None) -> ChipType:
    """The chip with a profile's fitted figures (efficiency curve, dispatch, HBM, bandwidths)."""
    return profile.apply_fits(chip) if profile is not None else chip


def allreduce_s(nbytes: float, k: int, gbps: float) -> float:
    """Ring all-reduce of `nbytes` over `k` chips at `gbps` GB/s per chip."""
    if k <= 1:
        return 0.0
    return 2.0 * (k - 1) / k * nbytes / (gbps * 1e9) + 2.0 * (k - 1) * ALPHA_S


def matmul_params(model: ModelConfig) -> int:
    d, e = model.d_model, model.head_dim
    return d * model.n_heads * e + 2 * d * model.n_kv_heads * e + model.n_heads * e * d + 3 * d * model.d_ff


# Backward FLOPs of the attention core as a multiple of its forward, per attention kernel:
# XLA's four matmuls from the kept probabilities; cuDNN's FlashAttention-2 and the blocked
# kernel (each block a checkpoint) recompute the scores' matmul first: five.
ATTENTION_BACKWARD = {"xla": 2.0, "cudnn": 2.5, "blocked": 2.5}
# Under `selective` recomputation (the probabilities not kept), the share of the attention
# core's forward FLOPs the backward runs again: XLA the scores' matmul and softmax (the core's
# output is kept, so not the second matmul); cuDNN its whole kernel (it keeps its softmax
# statistics only inside the kernel's own residuals); the blocked kernel nothing more than its
# backward recomputes anyway.
SELECTIVE_RECOMPUTE = {"xla": 0.5, "cudnn": 1.0, "blocked": 0.0}


def tensor_all_reduces(recompute: str, platform: str) -> tuple[int, int]:
    """(forward, backward) all-reduces of one micro-batch's n x d activation per layer on a
    tensor-parallel stage of a chip on `platform` (Megatron, the residual stream replicated
    over `tensor`): forward the attention's and the MLP's output projections. Backward,
    Megatron's two, the input gradients of the q/k/v and of the gate/up projections, each
    summed before its all-reduce, plus under `full` recomputation the recomputed forward's
    attention projection (the MLP's is not recomputed: its output, the block's, is not needed
    for the gradients). XLA:CPU does not sum the five column-parallel input gradients (q, k,
    v, gate, up) before reducing them: it all-reduces each on its own, five backward (six
    under `full`), what `tests/test_tensor_parallel_collectives.py` counts in the compiled
    program. XLA's GPU compiler reassociates a sum of all-reduces into one
    (AllReduceReassociate), which leaves Megatron's two there: not counted, no GPU here."""
    if platform == "cpu":
        return 2, 6 if recompute == "full" else 5
    return 2, 3 if recompute == "full" else 2


def attention_flops_per_token(model: ModelConfig, seq_len: int, kernel: str = "xla") -> float:
    """Forward FLOPs of the attention core (QK^T and AV) per token, as `kernel` computes them;
    the default, the full square, is also the MFU convention."""
    keys = causal_keys_per_query(seq_len, CUDNN_TILE) if kernel == "cudnn" else seq_len
    return 4.0 * keys * model.n_heads * model.head_dim


def attention_score_bytes_per_token(model: ModelConfig, seq_len: int, kernel: str, act_bytes: int) -> float:
    """HBM bytes the attention core's forward moves for its scores per token: f32 logits and
    probabilities in the compute dtype, each written and read once; none for cuDNN's flash
    kernel, whose scores stay in on-chip memory."""
    if kernel == "cudnn":
        return 0.0
    return model.n_heads * seq_len * (8.0 + 2.0 * act_bytes)


def model_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recomputation): the MFU numerator."""
    per_layer = 2.0 * matmul_params(model) + attention_flops_per_token(model, seq_len)
    return 3.0 * (model.n_layers * per_layer + 2.0 * model.d_model * model.vocab_size)


@dataclasses.dataclass(frozen=True, slots=True)
class StageTerms:
    """A stage shape's costs as linear functions of its layer count l: x(l) = x_layer*l + x_end.

    The search evaluates thousands of layer splits with these; `stage_costs` turns them into
    a StageCost for a concrete plan, so both use the same numbers.
    """

    fwd_layer: float
    fwd_end: float
    bwd_layer: float
    bwd_end: float
    bwd_weight_layer: float
    bwd_weight_end: float
    tail_layer: float  # dp reduce + optimizer, per layer
    tail_end: float
    dp_layer: float
    dp_end: float
    mem: mm.StageMemoryTerms

    def fwd(self, n_layers: int) -> float:
        return self.fwd_layer * n_layers + self.fwd_end

    def bwd(self, n_layers: int) -> float:
        return self.bwd_layer * n_layers + self.bwd_end

    def tail(self, n_layers: int) -> float:
        return self.tail_layer * n_layers + self.tail_end


@dataclasses.dataclass(frozen=True, slots=True)
class CostOptions:
    """Modelling choices that are not in the plan file."""

    shard_optimizer: bool = True  # ZeRO-1: optimizer state sharded over `data`
    optimizer: str = "adamw"

    @classmethod
    def of(cls, plan: Plan) -> "CostOptions":
        """The choices a plan file records (its optimizer and whether its state is sharded)."""
        return cls.of_optimizer(plan.optimizer)

    @classmethod
    def of_optimizer(cls, optimizer: Optimizer) -> "CostOptions":
        return cls(shard_optimizer=optimizer.shard_over_data, optimizer=optimizer.name)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerWork:
    """One layer's work on a stage shape, one micro-batch, wherever the stage sits in the
    pipeline: its forward, backward and weight-gradient seconds, and what the stage's end
    terms take from the same chip and shape. It depends on the tokens a device sees, not on
    how the micro-batch and data size make them (`stage_terms`' callers may share it)."""

    tokens: float  # per device and micro-batch
    rate: float  # matmul FLOP/s at this shape's efficiency
    tp_ar: float  # seconds of one tensor-parallel all-reduce of the hidden state
    fwd_layer: float
    bwd_layer: float  # the whole backward (before a split schedule's B and W)
    bwd_weight_layer: float
    measured_act: int | None  # a profile entry's activation bytes, where it measured this recompute mode


def layer_work(model: ModelConfig, seq_len: int, tokens: float, chip: ChipType, tensor: int, recompute: str,
               profile: Profile | None = None) -> LayerWork:
    """A layer's `LayerWork` on a (calibrated) chip at `tokens` per device."""
    d = model.d_model
    act_bytes = dtype_bytes(chip.precision.compute_dtype)
    rate = chip.peak_tflops * 1e12 * efficiency(tokens, d / tensor, chip.efficiency)
    tp_ar = allreduce_s(tokens * d * act_bytes, tensor, collective_gbps(chip, tensor))

    kernel = chip.attention_kernel
    hbm = chip.hbm_bytes_per_s
    dispatch = chip.dispatch_s
    mem_s = tokens * memory_bound_bytes_per_token(model, tensor, act_bytes) / hbm
    mm_flops, attn_flops, recompute_flops = layer_flops(model, seq_len, tokens, tensor, recompute, kernel)
    score_s = tokens * attention_score_bytes_per_token(model, seq_len, kernel, act_bytes) / tensor / hbm
    attn_s = attn_flops / rate + score_s
    fwd_flops = mm_flops + attn_flops
    if recompute == "full":  # the forward again but the MLP's last matmul, whose output the backward never needs
        recompute_s = (mm_flops - down_projection_flops(model, tokens, tensor)) / rate + attn_s
    elif recompute == "selective":  # what the attention core recomputes once its probabilities are not kept
        recompute_s = recompute_flops / rate + (score_s if recompute_flops else 0.0)
    else:
        recompute_s = 0.0
    fwd_ar, bwd_ar = tensor_all_reduces(recompute, chip.platform)

    entry = profile.lookup(chip.name, tensor, int(round(tokens)), recompute) if profile else None
    measured_act: int | None = None
    if entry is not None:
        # An entry times a one-layer stage: one dispatch is inside it, the stage pays one.
        fwd_layer = per_layer_of_entry(entry.forward_s, dispatch)
        bwd_plain = per_layer_of_entry(entry.backward_s, dispatch)
        if entry.recompute != recompute:  # measured without it: add the recomputed forward share
            bwd_plain += fwd_layer * recompute_flops / fwd_flops
        bwd_layer = bwd_plain
        bwd_weight_layer = bwd_layer * _weight_share(mm_flops, attn_flops, recompute_flops)
        if entry.recompute == recompute:
            measured_act = entry.activation_bytes
    else:
        fwd_layer = mm_flops / rate + attn_s + mem_s + fwd_ar * tp_ar
        bwd_layer = (
            2.0 * mm_flops / rate + ATTENTION_BACKWARD[kernel] * attn_s + recompute_s
            + MEMORY_BOUND_BACKWARD * mem_s + (mem_s if recompute == "full" else 0.0)
            + bwd_ar * tp_ar
        )
        bwd_weight_layer = mm_flops / rate
    return LayerWork(tokens, rate, tp_ar, fwd_layer, bwd_layer, bwd_weight_layer, measured_act)


def stage_terms(
    shape: StageShape,
    first: bool,
    last: bool,
    in_flight: float,
    profile: Profile | None = None,
    options: CostOptions = CostOptions(),
    deferred: int = 0,
    splits_backward: bool = False,
    layer: LayerWork | None = None,
    layer_memory: mm.LayerMemory | None = None,
) -> StageTerms:
    """A stage shape's StageTerms; `splits_backward`: its schedule runs the backward as B and
    W (`split_backward_as_run`: what each of them runs). `layer` and `layer_memory`: this
    shape's `layer_work` and `memory_model.layer_memory`, where the caller has them (the same
    for every place of the stage; `layer_work` also for every micro-batch and data size that
    give a device as many tokens). The memory terms take the shape's own chip: a profile's fits
    replace no figure the memory model reads (`profile.FIT_FIELDS`)."""
    model, data, tensor = shape.model, shape.data, shape.tensor
    chip = calibrated(shape.chip, profile)
    d, V = model.d_model, model.vocab_size
    if layer is None:
        layer = layer_work(model, shape.seq_len, shape.tokens, chip, tensor, shape.recompute, profile)
    tokens, rate, tp_ar = layer.tokens, layer.rate, layer.tp_ar
    fwd_layer, bwd_layer, bwd_weight_layer = layer.fwd_layer, layer.bwd_layer, layer.bwd_weight_layer
    hbm, dispatch = chip.hbm_bytes_per_s, chip.dispatch_s

    # A fixed host cost per compute: each micro-batch's forward and backward on every stage.
    fwd_end, bwd_end, bwd_weight_end = dispatch, dispatch, 0.0
    if first:  # vocab-parallel embedding: a gather and one all-reduce
        fwd_end += tp_ar
    if last:  # final norm + vocab-parallel head + loss, times the chip's calibrated head_scale
        logit_flops = tokens * 2.0 * d * V / tensor
        loss_s = tokens * V / tensor * LOSS_BYTES_PER_LOGIT / hbm
        fwd_end += chip.head_scale * (logit_flops / rate + loss_s)
        bwd_end += chip.head_scale * (2.0 * logit_flops / rate + loss_s) + tp_ar
        bwd_weight_end += chip.head_scale * logit_flops / rate

    end_params = mm.end_params(model, first, last)
    dp_gbps = collective_gbps(chip, data * tensor)
    dp_layer = allreduce_s(GRAD_BYTES * model.layer_param_count() / tensor, data, dp_gbps) - (
        allreduce_s(0.0, data, dp_gbps)
    )
    dp_end = allreduce_s(GRAD_BYTES * end_params / tensor, data, dp_gbps)
    dp_end += tied_embedding_s(model, chip, tensor, first, last)
    owned = tensor * (data if options.shard_optimizer else 1)
    opt_per_param = OPTIMIZER_BYTES_PER_PARAM[options.optimizer] / hbm / owned
    tail_layer = dp_layer + opt_per_param * model.layer_param_count()
    tail_end = dp_end + opt_per_param * end_params + dispatch  # the update is one more program

    if splits_backward:
        (bwd_layer, bwd_weight_layer), (bwd_end, bwd_weight_end) = (
            split_backward_as_run(bwd_layer, bwd_weight_layer), split_backward_as_run(bwd_end, bwd_weight_end))

    mem = mm.stage_memory_terms(shape, first, last, in_flight, options.shard_optimizer, options.optimizer,
                                layer.measured_act, deferred, layer_memory)
    return StageTerms(
        fwd_layer, fwd_end, bwd_layer, bwd_end, bwd_weight_layer, bwd_weight_end,
        tail_layer, tail_end, dp_layer, dp_end, mem,
    )


def layer_flops(model: ModelConfig, seq_len: int, tokens: float, tensor: int, recompute: str,
                kernel: str) -> tuple[float, float, float]:
    """(matmul, attention core, recomputed) FLOPs of one layer's forward per device: `full`
    recomputes the forward but the MLP's down projection, whose output the backward never
    needs; `selective` SELECTIVE_RECOMPUTE[kernel] of the attention core (what it recomputes
    once its probabilities are not kept)."""
    mm = tokens * 2.0 * matmul_params(model) / tensor
    attn = tokens * attention_flops_per_token(model, seq_len, kernel) / tensor
    if recompute == "full":
        return mm, attn, mm + attn - down_projection_flops(model, tokens, tensor)
    if recompute == "selective":
        return mm, attn, SELECTIVE_RECOMPUTE[kernel] * attn
    return mm, attn, 0.0


def down_projection_flops(model: ModelConfig, tokens: float, tensor: int) -> float:
    """Forward FLOPs of one layer's MLP down projection per device."""
    return tokens * 2.0 * model.d_model * model.d_ff / tensor


def entry_weight_share(model: ModelConfig, seq_len: int, tokens: float, tensor: int, recompute: str,
                       kernel: str) -> float:
    """The weight-gradient part of a profile entry's measured whole backward (`_weight_share`
    of the layer's `layer_flops`)."""
    return _weight_share(*layer_flops(model, seq_len, tokens, tensor, recompute, kernel))


def _weight_share(mm: float, attn: float, again: float) -> float:
    """The matmuls' weight gradients' share of a backward's FLOPs: mm / (2 * forward + recomputed)."""
    return mm / (2.0 * (mm + attn) + again)


def split_backward_as_run(backward: float, weight: float) -> tuple[float, float]:
    """(B + W, W) of a split backward as the runtime runs it, from the whole backward b and
    its weight-gradient part w: B (the input-gradient chain) drops the weight-gradient
    matmuls, b - w; W takes each piece's output gradient and differentiates the piece for its
    parameters, which re-runs the piece's own input-gradient chain (the gradient reaches the
    first matmul's weights only through the later ones) and its recomputation: a whole
    backward, b, with its own dispatch (benchmarks/schedules.py measures B and W). ZB-H1
    (Qi et al.) assumes W = w alone, which needs each matmul's output gradient kept from
    B (a per-matmul split of the blocks' backward, not built): docs/schedules.md."""
    return 2.0 * backward - weight, backward


def whole_backward_of_split(split_s: float, weight_share: float) -> float:
    """The whole backward b whose `split_backward_as_run` B + W is `split_s`, w being
    `weight_share` of b (calibration from a split-backward run: its entries hold b)."""
    return split_s / (2.0 - weight_share)


def per_layer_of_entry(seconds: float, dispatch: float) -> float:
    """A profile entry's one-layer-stage time less the stage's dispatch, floored at a tenth of
    the entry (a dispatch figure larger than the measurement is taken to be wrong)."""
    return max(seconds - dispatch, 0.1 * seconds)


def send_terms(
    model: ModelConfig, seq_len: int, micro_batch: int,
    sender: ChipType, s_data: int, s_tensor: int,
    receiver: ChipType, r_data: int, r_tensor: int,
) -> tuple[float, int]:
    """(seconds, bytes) of one micro-batch's activation from one stage to the next: over the
    intra-node links when the two stages share a node (`same_node`), else each end's share
    of its node's NICs. From the chip files' bandwidths: the search prices sends without the
    profile, so predict must too (a profile's bandwidth fits would make them disagree)."""
    nbytes = micro_batch * seq_len * model.d_model * dtype_bytes(sender.precision.compute_dtype)
    s_chips, r_chips = s_data * s_tensor, r_data * r_tensor
    if same_node(sender, s_chips, receiver, r_chips):
        s_gbps, r_gbps = sender.intra_node_gbps, receiver.intra_node_gbps
    else:
        s_gbps, r_gbps = sender.inter_node_share_gbps(s_chips), receiver.inter_node_share_gbps(r_chips)
    seconds = max(nbytes / (s_chips * s_gbps * 1e9), nbytes / (r_chips * r_gbps * 1e9))
    return seconds, nbytes


def chips_by_name(
    cluster_or_chips: Cluster | Mapping[str, ChipType] | None, plan: Plan | None = None
) -> Mapping[str, ChipType]:
    """Chip types by name: a cluster's (with its overrides), a mapping, or (None) backends/ files."""
    if isinstance(cluster_or_chips, Cluster):
        return cluster_or_chips.chips
    if cluster_or_chips is None:
        from h2jax.cluster import load_chip

        return {s.chip: load_chip(s.chip) for s in (plan.stages if plan else ())}
    return cluster_or_chips


def virtual_stages(plan: Plan) -> int:
    return getattr(plan, "virtual_stages", 1)


def memory_holds(schedule: str, stage: int, n_stages: int, n_micro: int, v: int = 1) -> tuple[float, int]:
    """(in flight, deferred) for the memory model: the schedule's activations held at peak in
    whole-stage micro-batch units, and its micro-batches waiting for their weight gradient."""
    s = get_schedule(schedule)
    return s.memory_in_flight(stage, n_stages, n_micro, v), s.deferred(stage, n_stages, n_micro, v)


def plan_stage_terms(
    plan: Plan,
    cluster_or_chips: Cluster | Mapping[str, ChipType] | None,
    profile: Profile | None = None,
    options: CostOptions | None = None,
) -> list[StageTerms]:
    chips = chips_by_name(cluster_or_chips, plan)
    if profile is not None:
        profile.check_matches(plan.model, plan.seq_len)
    options = options or CostOptions.of(plan)
    p = plan.n_stages
    out = []
    for i, st in enumerate(plan.stages):
        if st.chip not in chips:
            raise ConfigError(
                f"stages[{i}].chip {st.chip!r} is not in the cluster; it has {', '.join(chips) or '(none)'}"
            )
        held, deferred = memory_holds(plan.schedule, i, p, plan.n_micro, virtual_stages(plan))
        shape = StageShape.of_stage(plan, i, chips[st.chip])
        out.append(stage_terms(shape, i == 0, i == p - 1, held, profile, options, deferred,
                               get_schedule(plan.schedule).splits_backward))
    return out


def stage_costs(
    plan: Plan,
    cluster_or_chips: Cluster | Mapping[str, ChipType] | None,
    profile: Profile | None = None,
    options: CostOptions | None = None,
) -> list[StageCost]:
    """Per-stage, per-micro-batch costs of an existing plan (what the simulator replays).

    `cluster_or_chips`: a Cluster, a mapping chip name -> ChipType, or None for the chip files.
    """
    chips = chips_by_name(cluster_or_chips, plan)
    terms = plan_stage_terms(plan, chips, profile, options)
    p = plan.n_stages
    costs = []
    for i, (st, t) in enumerate(zip(plan.stages, terms)):
        n = st.n_layers
        wraps = i == p - 1 and p > 1 and virtual_stages(plan) > 1  # chunk c -> chunk c + 1
        if i < p - 1 or wraps:
            nxt = plan.stages[(i + 1) % p]
            send_s, send_bytes = send_terms(
                plan.model, plan.seq_len, plan.micro_batch, chips[st.chip], st.mesh.data, st.mesh.tensor,
                chips[nxt.chip], nxt.mesh.data, nxt.mesh.tensor,
            )
            latency = LINK_LATENCY_S
        else:
            send_s, send_bytes, latency = 0.0, 0, 0.0
        costs.append(StageCost(
            forward_s=t.fwd(n),
            backward_s=t.bwd(n),
            backward_weight_s=t.bwd_weight_layer * n + t.bwd_weight_end,
            send_s=send_s,
            send_bytes=send_bytes,
            dp_reduce_s=t.dp_layer * n + t.dp_end,
            optimizer_s=t.tail(n) - (t.dp_layer * n + t.dp_end),
            activation_bytes=t.mem.activation_bytes(n),
            static_bytes=t.mem.static_bytes(n),
            link_latency_s=latency,
        ))
    return costs


def _check(costs: list[StageCost], n_micro: int) -> None:
    if not costs:
        raise ConfigError("iteration_time needs at least one stage")
    if n_micro < 1:
        raise ConfigError(f"n_micro must be >= 1, got {n_micro}")


def pipeline_time(
    costs: list[StageCost], n_micro: int, schedule: str = "1f1b", v: int = 1, *, closed_form: bool = False
) -> float:
    """Seconds of one step's pipeline phase (fill, steady state, drain): the schedule's
    `ClosedForm` (h2jax/schedules/), or, for a schedule whose closed form is not exact
    (ZB-H1) and unless `closed_form`, its order replayed by the simulator (first compute
    start to last compute end: the same phase, links included)."""
    _check(costs, n_micro)
    try:
        form = get_schedule(schedule).closed_form
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (form.exact or closed_form):
        return _replayed_pipeline_time(tuple(costs), n_micro, schedule, v)
    links = sum(c.send_s + c.link_latency_s for c in costs)
    return float(form.pipeline_time(
        [c.forward_s for c in costs], [c.backward_s for c in costs], [c.backward_weight_s for c in costs],
        links, max(c.send_s for c in costs), n_micro, v,
    ))


@functools.lru_cache(maxsize=64)
def _replayed_pipeline_time(costs: tuple[StageCost, ...], n_micro: int, schedule: str, v: int) -> float:
    """The schedule's order replayed by the simulator: its pipeline phase. Kept for the last
    few stage lists, since a plan's step time and its bubble fraction (asked for together by
    predict, calibrate, the simulator's report and the speedup) both need it, and a replay of
    thousands of micro-batches takes a while."""
    from h2jax import sim  # (sim imports this module)

    return float(sim.simulate(costs, n_micro, schedule, virtual_stages=v, global_clip=False).pipeline_s)


def iteration_time(
    costs: list[StageCost], n_micro: int, schedule: str = "1f1b", v: int = 1, *, closed_form: bool = False
) -> float:
    """Seconds of one optimizer step: the pipeline phase (`pipeline_time`), then the slowest
    stage's data-parallel reduction and optimizer step. `closed_form`: the schedule's closed
    form even where it is not exact (what the search optimises)."""
    tail = max(c.dp_reduce_s + c.optimizer_s for c in costs) if costs else 0.0
    return pipeline_time(costs, n_micro, schedule, v, closed_form=closed_form) + tail


def bubble_fraction(costs: list[StageCost], n_micro: int, schedule: str = "1f1b", v: int = 1) -> float:
    """The schedule's bubble fraction for these stages (h2jax.schedules.bubble_fraction over the
    pipeline phase, `pipeline_time`): (p-1)/(m+p-1) under 1F1B when uniform, 0 for one stage."""
    busy = [n_micro * (c.forward_s + c.backward_s) for c in costs]
    return _bubble(busy, pipeline_time(costs, n_micro, schedule, v))
