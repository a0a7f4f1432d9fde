"""Residuals: what a forward keeps for its backward, apart from the parameters, and when the
backward may use it.

A `jax.vjp` closure is a pytree whose leaves are the residuals, and among them the parameters
themselves. Returned from a jitted forward, every leaf is a fresh output buffer: each
micro-batch in flight would hold a copy of the stage's parameters. So a forward returns only
the other leaves (`split_off`) and the backward, which has the parameters anyway, puts them
back (`join`). The model's blocks keep their residuals the same way, and tie them to the
incoming gradient (`after`) so their recomputation runs inside the backward."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the dropped leaves go: the closure's tree structure and, per leaf, None (kept)
    or the index of the parameter leaf it was."""

    treedef: Any
    where: tuple[int | None, ...]


def split_off(tree, params) -> tuple[list, Layout]:
    """(kept leaves, layout): the leaves of `tree` that are not (the very same traced value
    as) a leaf of `params`. Call inside the trace that produced `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    index = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    where = tuple(index.get(id(x)) for x in leaves)
    return [x for x, w in zip(leaves, where) if w is None], Layout(treedef, where)


def join(kept: list, layout: Layout, params):
    """The tree `split_off` took apart, with `params`' leaves back in their places."""
    p, rest = jax.tree.leaves(params), iter(kept)
    return jax.tree.unflatten(layout.treedef, [next(rest) if w is None else p[w] for w in layout.where])


def after(x: jax.Array, dependency) -> jax.Array:
    """x, made to depend on every array of `dependency` (an array or a tree): x + 0 * the sum
    of one element of each, equal to x for finite values. Whatever consumes the result runs
    after `dependency` exists, and is not merged with what consumed x: an order XLA keeps on
    every backend (XLA:CPU drops optimization barriers before it eliminates common
    subexpressions)."""
    # One element by index, not through reshape(-1): flattening an array split over a mesh
    # would gather all of it.
    tie = sum(leaf[(0,) * leaf.ndim].astype(x.dtype) for leaf in jax.tree.leaves(dependency))
    return x + jnp.zeros((), x.dtype) * tie
