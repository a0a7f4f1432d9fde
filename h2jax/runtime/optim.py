"""Per-stage optax optimizers with gradient clipping by the norm over *all* stages.

Each stage steps its own optimizer, but clipping must see the whole model's gradient:
the stages' squared norms are summed across stages (one scalar all-reduce) and the global
norm enters every stage's update. The unpipelined reference calls the same functions, so
both clip identically (the formula is optax.clip_by_global_norm's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from h2jax.plan import Optimizer


def make_optimizer(opt: Optimizer) -> optax.GradientTransformation:
    if opt.name == "sgd":
        return optax.sgd(opt.learning_rate)
    return optax.adamw(
        opt.learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay
    )


def squared_norm(grads) -> jax.Array:
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))


def clip(grads, global_norm: jax.Array, max_norm: float | None):
    if max_norm is None:
        return grads
    return jax.tree.map(
        lambda g: jnp.where(global_norm < max_norm, g, (g / global_norm.astype(g.dtype)) * max_norm),
        grads,
    )


def apply_clipped_update(tx, params, opt_state, grads_f32, global_norm, max_norm):
    grads = clip(grads_f32, global_norm, max_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
