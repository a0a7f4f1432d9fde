"""Per-stage optax optimizers, learning-rate schedules, and gradient clipping by the norm
over *all* stages.

Each stage steps its own optimizer, but clipping must see the whole model's gradient:
the stages' squared norms are summed across stages (one scalar all-reduce) and the global
norm enters every stage's update. The unpipelined reference calls the same functions, so
both clip identically (the formula is optax.clip_by_global_norm's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from h2jax.plan import Optimizer, Plan, PlanError, Train


def learning_rate_schedule(opt: Optimizer, train: Train | None = None, steps: int | None = None):
    """The learning rate of optimizer update `n` (0-based): a float when it is constant, else
    an optax schedule. Its peak is `opt.learning_rate`; a linear warm-up from 0 over
    `train.warmup_steps`, then constant, linear or cosine decay to `final_lr_fraction` of the
    peak at `train.decay_steps` (default `steps`, the run's length). The optimizer's own update
    count drives it, so a run resumed with its optimizer state continues the same curve."""
    train = train or Train()
    peak = opt.learning_rate
    warmup = train.warmup_steps
    if train.lr_schedule == "constant" and warmup == 0:
        return peak
    horizon = train.decay_steps or steps
    if train.lr_schedule != "constant":
        if horizon is None:
            raise PlanError(
                f"train.lr_schedule {train.lr_schedule!r} needs its length: set train.decay_steps, or give "
                "the run's steps (h2jax.Trainer(plan, steps=N))"
            )
        if horizon <= warmup:
            raise PlanError(
                f"train.warmup_steps ({warmup}) must be less than the schedule's length ({horizon} steps: "
                "train.decay_steps, or the run's steps); shorten the warm-up or lengthen the run"
            )
    end = peak * train.final_lr_fraction
    if train.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, horizon, end)
    after = (optax.constant_schedule(peak) if train.lr_schedule == "constant"
             else optax.linear_schedule(peak, end, horizon - warmup))
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def with_schedule_length(plan: Plan, steps: int | None) -> Plan:
    """`plan` with its learning-rate schedule's length fixed: `train.decay_steps`, or else the
    run's `steps` (a run of N steps decays over N unless the plan says otherwise)."""
    if steps is None or plan.train.decay_steps is not None:
        return plan
    if plan.train.lr_schedule == "constant" and plan.train.warmup_steps == 0:
        return plan
    return dataclasses.replace(plan, train=dataclasses.replace(plan.train, decay_steps=steps))


def learning_rate_at(schedule, n: int) -> float:
    """The learning rate of update `n` under `schedule` (a float or an optax schedule)."""
    return float(schedule(n)) if callable(schedule) else float(schedule)


def make_optimizer(opt: Optimizer, train: Train | None = None, schedule=None) -> optax.GradientTransformation:
    """`opt`'s optax optimizer, its learning rate following `train`'s schedule (whose length
    must be known: `train.decay_steps`, see `with_schedule_length`), or `schedule` (a
    traceable function of the update count, e.g. an optax schedule) when given."""
    lr = learning_rate_schedule(opt, train) if schedule is None else schedule
    if opt.name == "sgd":
        return optax.sgd(lr)
    return optax.adamw(lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)


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
