"""Logical axis names -> the mesh axes ("data", "tensor"): the one rules table.

Megatron-style tensor parallelism: attention heads and the MLP's hidden dimension split over
`tensor` (column-parallel in, row-parallel out), the vocabulary of the embedding and head
too; the batch splits over `data`. Every other axis is replicated.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "tensor")

RULES: dict[str, str | None] = {
    "batch": "data",
    "seq": None,
    "embed": None,
    "act_embed": "tensor",  # an activation crossing a stage boundary: d_model split over tensor
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
}

# A boundary activation [B, S, D] as it crosses stages (see h2jax.transport.base).
BOUNDARY_AXES = ("batch", "seq", "act_embed")
# The same activation inside a stage's step, gathered over tensor.
HIDDEN_AXES = ("batch", "seq", "embed")
TOKENS_AXES = ("batch", "seq")


def logical_to_spec(axes: tuple[str, ...]) -> P:
    unknown = [a for a in axes if a not in RULES]
    if unknown:
        raise KeyError(f"logical axis {unknown} has no rule; add it to h2jax.sharding.RULES")
    return P(*(RULES[a] for a in axes))


def make_mesh(devices: list, data: int, tensor: int) -> Mesh:
    return Mesh(np.asarray(devices, dtype=object).reshape(data, tensor), MESH_AXES)


def named(mesh: Mesh, axes: tuple[str, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes))


def _pure(tree: Any, leaf_fn) -> Any:
    """An nnx.State of Variables -> a plain nested dict with leaf_fn(variable) at the leaves."""
    if isinstance(tree, nnx.Variable):
        return leaf_fn(tree)
    return {k: _pure(v, leaf_fn) for k, v in tree.items()}


def logical_axes_tree(state: nnx.State) -> dict:
    return _pure(state, lambda v: tuple(v.get_metadata()["logical_axes"]))


def param_shardings(state: nnx.State, mesh: Mesh) -> dict:
    """NamedSharding for each parameter, as a plain dict shaped like nnx.to_pure_dict(state)."""
    return _pure(state, lambda v: NamedSharding(mesh, logical_to_spec(v.get_metadata()["logical_axes"])))


def over_data(sharding: NamedSharding, shape: tuple[int, ...], axis: str = "data") -> NamedSharding:
    """ZeRO-1's layout for an optimizer moment: its parameter's sharding with, in addition, the
    first dimension that is not sharded yet and divides evenly split over `axis`; unchanged
    where the mesh has no such axis of size > 1 or no dimension qualifies."""
    size = dict(sharding.mesh.shape).get(axis, 1)
    if size <= 1 or not shape:
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for i, (dim, entry) in enumerate(zip(shape, spec)):
        if entry is None and dim % size == 0:
            spec[i] = axis
            return NamedSharding(sharding.mesh, P(*spec))
    return sharding


def shape_tree(state: nnx.State) -> dict:
    return _pure(state, lambda v: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype))


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'layer_000': {'attn': {...}}} -> {'layer_000/attn/...': leaf}; stage trees merge by key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_params(v, key + "/"))
        else:
            out[key] = v
    return out
