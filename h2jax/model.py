"""A LLaMA-style decoder-only transformer in Flax NNX, and stage slices of it.

Only math lives here. Every parameter carries logical axis names (`logical_axes`
metadata); `h2jax.sharding` maps them onto a stage's ("data", "tensor") mesh.
Tensor names carry their shapes: B batch, S sequence, D d_model, H query heads,
K kv heads, G query heads per kv head, E head_dim, F d_ff, V vocab.

Layer `i` is initialized from `fold_in(seed, i)`, the embedding from
`fold_in(seed, n_layers)` and the final norm and head from `fold_in(seed, n_layers + 1)`,
so a stage that builds layers [start, end) gets bit-identical parameters to the whole model.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from h2jax.config import ATTENTION_BLOCK, ATTENTION_KERNELS, ConfigError, ModelConfig
from h2jax.residuals import after, join, split_off


# What a block keeps for its backward, by name (`saved`), as the memory model counts it
# (Korthikanti et al. 2022, no dropout): both norms' inputs and outputs, the q/k/v projections,
# the attention output, the MLP's gate, up and gated product, and the attention probabilities
# (explicit XLA kernel only). Everything else (rsqrt, rotary, masks, SiLU's sigmoid) is
# recomputed in the backward from these; without a policy JAX would keep about twice as much.
SAVED_NONE = ("norm_in", "norm_out", "qkv", "attn_out", "mlp", "probs")
# Selective recomputation keeps the same but the s x s probabilities, recomputing the attention
# core: most of the memory saving of full recompute for a fraction of its compute.
SAVED_SELECTIVE = tuple(n for n in SAVED_NONE if n != "probs")
RECOMPUTE_MODES = ("none", "selective", "full")


def saved(x: jax.Array, name: str) -> jax.Array:
    """x, named for the recompute policies (SAVED_NONE)."""
    return checkpoint_name(x, name)


def layer_name(i: int) -> str:
    """Parameter-tree key of global layer i; stage trees merge into the whole model's tree."""
    return f"layer_{i:03d}"


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((d,), param_dtype), logical_axes=("embed",))
        self.eps = eps

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x32 = x_BSD.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * self.scale[...].astype(jnp.float32)).astype(x_BSD.dtype)


def rotary(x_BSNE: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding over the last axis (pairs of halves)."""
    S, E = x_BSNE.shape[1], x_BSNE.shape[-1]
    freq_E2 = 1.0 / theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E)
    angle_SE2 = jnp.arange(S, dtype=jnp.float32)[:, None] * freq_E2[None, :]
    sin, cos = jnp.sin(angle_SE2)[None, :, None, :], jnp.cos(angle_SE2)[None, :, None, :]
    x1, x2 = jnp.split(x_BSNE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNE.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _kept_softmax(logits: jax.Array, dtype) -> jax.Array:
    """softmax(logits) over the last axis in `dtype`, differentiated from the probabilities it
    returns (named "probs": what SAVED_NONE keeps), not from the logits: jax.nn.softmax's own
    rule recomputes its output from its input, so a backward keeping the probabilities would
    still recompute the scores' matmul and softmax."""
    return jax.nn.softmax(logits, axis=-1).astype(dtype)


def _kept_softmax_fwd(logits, dtype):
    probs = saved(jax.nn.softmax(logits, axis=-1).astype(dtype), "probs")
    return probs, probs


def _kept_softmax_bwd(dtype, probs, g):
    p, g = probs.astype(jnp.float32), g.astype(jnp.float32)
    return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


_kept_softmax.defvjp(_kept_softmax_fwd, _kept_softmax_bwd)


def _xla_attention(q_BSHE, k_BSKE, v_BSKE, precision) -> jax.Array:
    """The explicit path: the full s x s scores in f32, masked, softmax, probabilities kept."""
    B, S, H, E = q_BSHE.shape
    K = k_BSKE.shape[2]
    q_BSKGE = q_BSHE.reshape(B, S, K, H // K, E)
    logits_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BSKE, precision=precision) / jnp.sqrt(
        jnp.float32(E)
    ).astype(q_BSHE.dtype)
    causal_ST = jnp.tril(jnp.ones((S, S), dtype=bool))
    logits_BKGST = jnp.where(causal_ST, logits_BKGST.astype(jnp.float32), -jnp.inf)
    probs_BKGST = _kept_softmax(logits_BKGST, q_BSHE.dtype)
    out_BSKGE = jnp.einsum("bkgst,btke->bskge", probs_BKGST, v_BSKE, precision=precision)
    return out_BSKGE.reshape(B, S, H, E)


def _blocked_attention(q_BSHE, k_BSKE, v_BSKE) -> jax.Array:
    """jax.nn.dot_product_attention's XLA path one block of ATTENTION_BLOCK queries at a time,
    in a loop (so blocks run one after another), each block a checkpoint whose scores are
    recomputed in the backward: at most one block's scores are ever alive, and the backward
    keeps only q, k and v. Blocks see every key under the causal mask (full-square FLOPs)."""
    B, S, H, E = q_BSHE.shape
    C = min(ATTENTION_BLOCK, S)
    N = -(-S // C)
    # Padded query rows (past S) see every key, stay finite, and are dropped below.
    q_NBCHE = jnp.pad(q_BSHE, ((0, 0), (0, N * C - S), (0, 0), (0, 0))).reshape(B, N, C, H, E).swapaxes(0, 1)

    @jax.checkpoint
    def block(q_BCHE, start):
        mask_CS = (start + jnp.arange(C))[:, None] >= jnp.arange(S)[None, :]
        return jax.nn.dot_product_attention(q_BCHE, k_BSKE, v_BSKE, mask=mask_CS[None, None], implementation="xla")

    out_NBCHE = jax.lax.map(lambda args: block(*args), (q_NBCHE, jnp.arange(N) * C))
    return out_NBCHE.swapaxes(0, 1).reshape(B, N * C, H, E)[:, :S]


_PRECISION_NAMES = {
    jax.lax.Precision.DEFAULT: "default", jax.lax.Precision.HIGH: "high", jax.lax.Precision.HIGHEST: "highest"
}


def causal_attention(q_BSHE, k_BSKE, v_BSKE, kernel: str = "xla", precision=None) -> jax.Array:
    """Causal grouped-query attention of rotated q, k and v by `kernel` (config.ATTENTION_KERNELS);
    every kernel computes the same function, they differ in memory and speed."""
    if kernel == "xla":
        return _xla_attention(q_BSHE, k_BSKE, v_BSKE, precision)
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is unknown; use one of {', '.join(ATTENTION_KERNELS)}")
    # jax.nn.dot_product_attention takes no precision argument: the stage's matmul precision
    # reaches its dots as the default precision of this trace.
    name = _PRECISION_NAMES.get(precision, precision)
    with jax.default_matmul_precision(name) if name is not None else contextlib.nullcontext():
        if kernel == "cudnn":
            return jax.nn.dot_product_attention(q_BSHE, k_BSKE, v_BSKE, is_causal=True, implementation="cudnn")
        return _blocked_attention(q_BSHE, k_BSKE, v_BSKE)


class Attention(nnx.Module):
    """Causal grouped-query attention; heads split over `tensor` (Megatron column/row)."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, precision=None, kernel: str = "xla"):
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {kernel!r} is unknown; use one of {', '.join(ATTENTION_KERNELS)}")
        D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        std = cfg.init_std
        self.wq_DHE = nnx.Param(_normal(kq, (D, H, E), std, dtype), logical_axes=("embed", "heads", "head_dim"))
        self.wk_DKE = nnx.Param(_normal(kk, (D, K, E), std, dtype), logical_axes=("embed", "kv_heads", "head_dim"))
        self.wv_DKE = nnx.Param(_normal(kv, (D, K, E), std, dtype), logical_axes=("embed", "kv_heads", "head_dim"))
        self.wo_HED = nnx.Param(_normal(ko, (H, E, D), std, dtype), logical_axes=("heads", "head_dim", "embed"))
        self.theta, self.precision, self.kernel = cfg.rope_theta, precision, kernel

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        p = self.precision
        # q and k are kept rotated (the same bytes): the attention's backward needs them so, and
        # the projections' backward needs neither, so nothing recomputes the rotation.
        q_BSHE = saved(rotary(jnp.einsum("bsd,dhe->bshe", x_BSD, self.wq_DHE[...], precision=p), self.theta), "qkv")
        k_BSKE = saved(rotary(jnp.einsum("bsd,dke->bske", x_BSD, self.wk_DKE[...], precision=p), self.theta), "qkv")
        v_BSKE = saved(jnp.einsum("bsd,dke->bske", x_BSD, self.wv_DKE[...], precision=p), "qkv")
        out_BSHE = saved(causal_attention(q_BSHE, k_BSKE, v_BSKE, self.kernel, p), "attn_out")
        return jnp.einsum("bshe,hed->bsd", out_BSHE, self.wo_HED[...], precision=p)


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, precision=None):
        D, F = cfg.d_model, cfg.d_ff
        kg, ku, kd = jax.random.split(key, 3)
        std = cfg.init_std
        self.w_gate_DF = nnx.Param(_normal(kg, (D, F), std, dtype), logical_axes=("embed", "mlp"))
        self.w_up_DF = nnx.Param(_normal(ku, (D, F), std, dtype), logical_axes=("embed", "mlp"))
        self.w_down_FD = nnx.Param(_normal(kd, (F, D), std, dtype), logical_axes=("mlp", "embed"))
        self.precision = precision

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        p = self.precision
        gate_BSF = saved(jnp.einsum("bsd,df->bsf", x_BSD, self.w_gate_DF[...], precision=p), "mlp")
        up_BSF = saved(jnp.einsum("bsd,df->bsf", x_BSD, self.w_up_DF[...], precision=p), "mlp")
        hidden_BSF = saved(jax.nn.silu(gate_BSF) * up_BSF, "mlp")
        return jnp.einsum("bsf,fd->bsd", hidden_BSF, self.w_down_FD[...], precision=p)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, precision=None, attention: str = "xla"):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.attn = Attention(cfg, ka, dtype, precision, attention)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.mlp = SwiGLU(cfg, km, dtype, precision)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = x_BSD + self.attn(saved(self.attn_norm(x_BSD), "norm_out"))
        x_BSD = saved(x_BSD, "norm_in")
        return x_BSD + self.mlp(saved(self.mlp_norm(x_BSD), "norm_out"))


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype=jnp.float32):
        self.table_VD = nnx.Param(
            _normal(key, (cfg.vocab_size, cfg.d_model), 1.0, dtype), logical_axes=("vocab", "embed")
        )

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        return jnp.take(self.table_VD[...], tokens_BS, axis=0)


class Head(nnx.Module):
    """Final RMSNorm and the untied output projection."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, precision=None):
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.w_DV = nnx.Param(
            _normal(key, (cfg.d_model, cfg.vocab_size), cfg.init_std, dtype), logical_axes=("embed", "vocab")
        )
        self.precision = precision

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return jnp.einsum("bsd,dv->bsv", self.norm(x_BSD), self.w_DV[...], precision=self.precision)


def cross_entropy(logits_BSV: jax.Array, labels_BS: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in f32."""
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp_BSV, labels_BS[..., None], axis=-1))


def block_runner(recompute: str):
    """`run(block, x)` for a recompute mode: the block as a checkpoint keeping the values
    SAVED_NONE ("none") or SAVED_SELECTIVE ("selective") name, or only its input ("full");
    everything else is recomputed inside the block's own backward (`checkpointed`)."""
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute = {recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}")
    policies = jax.checkpoint_policies
    return checkpointed({
        "none": policies.save_only_these_names(*SAVED_NONE),
        "selective": policies.save_only_these_names(*SAVED_SELECTIVE),
        "full": policies.nothing_saveable,
    }[recompute])


def checkpointed(policy):
    """`run(block, x)`: block(x), keeping for the backward what `policy` saves (and the block's
    parameters, which are not copied); the backward recomputes the rest just before it
    differentiates the block, so one block's recomputed values are alive at a time.

    `jax.checkpoint` alone means the same, but XLA:CPU drops its optimization barrier before
    common subexpression elimination, which then merges the recomputation back into the
    forward, or runs every block's recomputation first: no memory saved. Here the saved values
    are tied to the incoming gradient (`after`), so the recomputation can neither be merged
    with the forward nor run before that gradient exists, on every backend."""

    def run(block: nnx.Module, x: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(block)

        def apply(s, h):
            return nnx.merge(graphdef, s)(h)

        layout = []

        @jax.custom_vjp
        def checkpoint(s, h):
            return apply(s, h)

        def forward(s, h):
            out, vjp = jax.vjp(jax.checkpoint(apply, policy=policy), s, h)
            kept, where = split_off(vjp, s)
            layout.append(where)
            return out, (s, kept)

        def backward(saved, g):
            s, kept = saved
            return join([after(k, g) for k in kept], layout[-1], s)(g)

        checkpoint.defvjp(forward, backward)
        return checkpoint(state, x)

    return run


class StageModel(nnx.Module):
    """Layers [start, end) of the model, plus the embedding on the first stage and the final
    norm, head and loss on the last. The whole model is the stage [0, n_layers)."""

    def __init__(
        self,
        cfg: ModelConfig,
        start: int,
        end: int,
        seed: int,
        *,
        dtype=jnp.float32,
        precision=None,
        recompute: str = "none",
        attention: str = "xla",
        first: bool | None = None,
        last: bool | None = None,
    ):
        """`attention`: the attention kernel every block runs (config.ATTENTION_KERNELS);
        `recompute`: what each block keeps for the backward (`block_runner`). Parameters and
        the function computed depend on neither. `first` / `last`: whether the slice holds
        the embedding / the head (default: it starts at layer 0 / ends at the last layer; an
        interleaved plan's empty chunk [n_layers, n_layers] before the last one holds neither)."""
        if cfg.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings: the planner prices tied embeddings, but this model keeps a "
                "separate embedding and output head (training them tied across stages is not built); "
                "train with tie_embeddings false"
            )
        root = jax.random.key(seed)
        self.run_block = block_runner(recompute)
        self.is_first = start == 0 if first is None else first
        self.is_last = end == cfg.n_layers if last is None else last
        self.layer_names = [layer_name(i) for i in range(start, end)]
        if self.is_first:
            self.embed = Embed(cfg, jax.random.fold_in(root, cfg.n_layers), dtype)
        for i, name in zip(range(start, end), self.layer_names):
            setattr(self, name, Block(cfg, jax.random.fold_in(root, i), dtype, precision, attention))
        if self.is_last:
            self.head = Head(cfg, jax.random.fold_in(root, cfg.n_layers + 1), dtype, precision)

    def __call__(self, x: jax.Array, labels_BS: jax.Array | None = None) -> jax.Array:
        """First stage: x is tokens [B, S]; otherwise hidden [B, S, D]. Last stage returns the
        mean loss given labels, otherwise the hidden state [B, S, D]."""
        x_BSD = self.embed(x) if self.is_first else x
        for name in self.layer_names:
            x_BSD = self.run_block(getattr(self, name), x_BSD)
        if not self.is_last:
            return x_BSD
        return cross_entropy(self.head(x_BSD), labels_BS)
