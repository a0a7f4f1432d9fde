"""An independent numpy (float64) implementation of the decoder: the reference that
h2jax.model is checked against (tests/test_references.py).

It shares no code with h2jax.model: written from the textbook definitions (LLaMA's RMSNorm,
rotary embeddings on the two halves of each head, grouped-query causal attention, SwiGLU,
mean next-token cross-entropy). Parameters are plain numpy arrays keyed by the names of the
model's flat parameter tree ("layer_000/attn/wq_DHE", ...), so one set of weights feeds both.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x, scale, eps):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * scale


def rope(x, theta):
    """Rotary embedding of x [B, S, N, E]: the pair (x[i], x[i + E/2]) at position p turns by
    p * theta^(-2i/E), i = 0 .. E/2 - 1."""
    _, S, _, E = x.shape
    half = E // 2
    out = np.empty_like(x)
    for p in range(S):
        for i in range(half):
            angle = p * theta ** (-2.0 * i / E)
            c, s = np.cos(angle), np.sin(angle)
            a, b = x[:, p, :, i], x[:, p, :, i + half]
            out[:, p, :, i] = a * c - b * s
            out[:, p, :, i + half] = b * c + a * s
    return out


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def attention(x, wq, wk, wv, wo, theta):
    """Causal grouped-query attention, one head at a time: query head h reads kv head
    h // (H / K)."""
    B, S, _ = x.shape
    H, K, E = wq.shape[1], wk.shape[1], wq.shape[2]
    q = rope(np.einsum("bsd,dhe->bshe", x, wq), theta)
    k = rope(np.einsum("bsd,dke->bske", x, wk), theta)
    v = np.einsum("bsd,dke->bske", x, wv)
    heads = np.zeros((B, S, H, E))
    for h in range(H):
        kv = h // (H // K)
        for b in range(B):
            scores = q[b, :, h, :] @ k[b, :, kv, :].T / np.sqrt(E)  # [S, T]
            scores[np.triu_indices(S, 1)] = -np.inf  # position s sees positions t <= s
            heads[b, :, h, :] = softmax(scores) @ v[b, :, kv, :]
    return np.einsum("bshe,hed->bsd", heads, wo)


def silu(z):
    return z / (1.0 + np.exp(-z))


def swiglu(x, w_gate, w_up, w_down):
    return (silu(x @ w_gate) * (x @ w_up)) @ w_down


def block(x, p, prefix, cfg):
    """One pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.))."""
    g = lambda name: np.asarray(p[f"{prefix}/{name}"], np.float64)
    h = x + attention(
        rms_norm(x, g("attn_norm/scale"), cfg.norm_eps),
        g("attn/wq_DHE"), g("attn/wk_DKE"), g("attn/wv_DKE"), g("attn/wo_HED"), cfg.rope_theta,
    )
    return h + swiglu(rms_norm(h, g("mlp_norm/scale"), cfg.norm_eps), g("mlp/w_gate_DF"), g("mlp/w_up_DF"),
                      g("mlp/w_down_FD"))


def cross_entropy(logits, labels):
    """Mean over every position of -log softmax(logits)[label]."""
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -np.mean(np.take_along_axis(logp, labels[..., None], axis=-1))


def stage_forward(p, cfg, start, end, x, labels=None):
    """Layers [start, end): tokens in on the first stage (else hidden [B, S, D]); the mean
    loss out on the last stage given labels (else hidden)."""
    if start == 0:
        x = np.asarray(p["embed/table_VD"], np.float64)[x]
    x = np.asarray(x, np.float64)
    for i in range(start, end):
        x = block(x, p, f"layer_{i:03d}", cfg)
    if end < cfg.n_layers:
        return x
    logits = rms_norm(x, np.asarray(p["head/norm/scale"], np.float64), cfg.norm_eps) @ np.asarray(
        p["head/w_DV"], np.float64
    )
    return cross_entropy(logits, labels)
