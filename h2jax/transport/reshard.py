"""Cross-stage resharding as data: which device sends which slice of a boundary array to whom.

`reshard_plan(src, dst, shape, itemsize)` is a pure function (no JAX, no MPI). The MPI
transport executes its transfers; tests execute them with numpy and compare with
`jax.device_put` to the receiver's sharding.

Topology-aware rule: every element crosses the slow inter-stage link exactly once per
receiving data-parallel group. With the boundary layout `P("data", None, "tensor")` each
receiving device gets only its own `[batch slice, :, d_model slice]` block, so a group's slice
is split across its tensor-parallel devices; the receiving stage's compiled step all-gathers
over `tensor` on its fast links. Where the sender holds an element on several devices
(replicas), the pieces are spread over those replicas, least-loaded first.

`broadcast_plan` is the naive alternative, kept only for comparison: one sender ships each
receiving device its data-parallel group's whole slice, and the device keeps its block. It
moves `tensor_dst` times the bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Sequence

Index = tuple[slice, ...]
AXES = ("data", "tensor")
BOUNDARY_SPEC = ("data", None, "tensor")


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """An array layout on a `(data, tensor)` mesh.

    `spec[d]` names the mesh axis (or tuple of axes, major first) dimension `d` is split
    over, or None when replicated, like a `PartitionSpec`. `owners[p]` labels the device at
    flat mesh position `p = data_index * tensor + tensor_index` (a device id, a rank, ...).
    """

    data: int
    tensor: int
    spec: tuple = BOUNDARY_SPEC
    owners: tuple[Hashable, ...] | None = None

    def __post_init__(self) -> None:
        if self.data < 1 or self.tensor < 1:
            raise ValueError(f"mesh sizes must be >= 1, got data={self.data}, tensor={self.tensor}")
        if self.owners is not None and len(self.owners) != self.size:
            raise ValueError(f"owners lists {len(self.owners)} devices but the mesh has {self.size}")
        for entry in self.spec:
            for axis in _axes(entry):
                if axis not in AXES:
                    raise ValueError(f"spec {self.spec!r} names mesh axis {axis!r}; known axes: {AXES}")

    @property
    def size(self) -> int:
        return self.data * self.tensor

    def owner(self, pos: int) -> Hashable:
        return pos if self.owners is None else self.owners[pos]

    def coords(self, pos: int) -> dict[str, int]:
        return {"data": pos // self.tensor, "tensor": pos % self.tensor}

    def block(self, pos: int, shape: Sequence[int]) -> Index:
        """The global index of the block the device at `pos` holds."""
        spec = tuple(self.spec) + (None,) * (len(shape) - len(self.spec))
        coords, sizes = self.coords(pos), {"data": self.data, "tensor": self.tensor}
        out = []
        for dim, (n, entry) in enumerate(zip(shape, spec)):
            parts, index = 1, 0
            for axis in _axes(entry):  # major axis first, as in a PartitionSpec tuple
                parts, index = parts * sizes[axis], index * sizes[axis] + coords[axis]
            if n % parts:
                raise ValueError(
                    f"dimension {dim} of shape {tuple(shape)} ({n}) is not divisible by the "
                    f"{parts} devices of mesh axis {entry!r}; pick sizes that divide it"
                )
            step = n // parts
            out.append(slice(index * step, (index + 1) * step))
        return tuple(out)

    @classmethod
    def from_sharding(cls, sharding, owner=None) -> "Layout":
        """The layout of a `NamedSharding` on a `("data", "tensor")` mesh; owners are
        `owner(device)` (default: the device's id)."""
        mesh = sharding.mesh
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"stage meshes have axes {AXES}, got {tuple(mesh.axis_names)}")
        devices = mesh.devices.reshape(-1)
        label = owner or (lambda d: d.id)
        spec = tuple(None if e is None else e for e in sharding.spec)
        return cls(int(mesh.shape["data"]), int(mesh.shape["tensor"]), spec, tuple(label(d) for d in devices))


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """One message across the boundary: the elements at global `index`, from the device at
    flat mesh position `src_pos` of the sender to `dst_pos` of the receiver."""

    src_pos: int
    dst_pos: int
    src: Hashable
    dst: Hashable
    index: Index
    nbytes: int


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _intersect(a: Index, b: Index) -> Index | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _count(index: Index) -> int:
    return math.prod(s.stop - s.start for s in index)


def _split(index: Index, parts: int) -> list[Index]:
    """Split `index` into up to `parts` near-equal pieces along its longest dimension."""
    dim = max(range(len(index)), key=lambda d: index[d].stop - index[d].start)
    lo, hi = index[dim].start, index[dim].stop
    parts = min(parts, hi - lo)
    cuts = [lo + (hi - lo) * k // parts for k in range(parts + 1)]
    return [index[:dim] + (slice(a, b),) + index[dim + 1 :] for a, b in zip(cuts, cuts[1:])]


def _source_regions(src: Layout, shape: Sequence[int]) -> list[tuple[Index, list[int]]]:
    """Distinct blocks of the sender, each with the positions that hold a replica of it."""
    regions: dict[tuple, tuple[Index, list[int]]] = {}
    for pos in range(src.size):
        block = src.block(pos, shape)
        key = tuple((s.start, s.stop) for s in block)  # slices are unhashable before 3.12
        regions.setdefault(key, (block, []))[1].append(pos)
    return list(regions.values())


def _wanted(dst: Layout, pos: int, shape: Sequence[int], broadcast: bool) -> Index:
    block = dst.block(pos, shape)
    if not broadcast:
        return block
    # The naive receiver takes its data-parallel group's slice whole: every dimension the
    # tensor axis splits arrives in full.
    spec = tuple(dst.spec) + (None,) * (len(shape) - len(dst.spec))
    return tuple(
        slice(0, n) if "tensor" in _axes(entry) else s for s, n, entry in zip(block, shape, spec)
    )


def _plan(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, broadcast: bool) -> list[Transfer]:
    shape = tuple(int(n) for n in shape)
    regions = _source_regions(src, shape)
    load = [0] * src.size  # bytes each sender has been given so far
    transfers = []
    for dst_pos in range(dst.size):
        want = _wanted(dst, dst_pos, shape, broadcast)
        for region, replicas in regions:
            piece = _intersect(want, region)
            if piece is None:
                continue
            if broadcast:  # one sender, no balancing
                assignments = [(piece, replicas[0])]
            else:
                chunks = _split(piece, len(replicas))
                order = sorted(replicas, key=lambda p: (load[p], p))
                assignments = list(zip(chunks, order))
            for chunk, src_pos in assignments:
                nbytes = _count(chunk) * itemsize
                load[src_pos] += nbytes
                transfers.append(
                    Transfer(src_pos, dst_pos, src.owner(src_pos), dst.owner(dst_pos), chunk, nbytes)
                )
    return transfers


def reshard_plan(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int) -> list[Transfer]:
    """Topology-aware transfers that move an array of `shape` from layout `src` to `dst`.

    Each receiving device gets exactly its own block, in pieces cut along the sender's block
    boundaries; replicated pieces are spread over the sender's replicas. Deterministic: both
    ends of a link compute the same list, in the same order."""
    return _plan(src, dst, shape, itemsize, broadcast=False)


def broadcast_plan(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int) -> list[Transfer]:
    """The naive alternative (comparison only): every receiving device gets its data-parallel
    group's whole slice from a single sender and keeps its block."""
    return _plan(src, dst, shape, itemsize, broadcast=True)


def total_bytes(transfers: Sequence[Transfer]) -> int:
    return sum(t.nbytes for t in transfers)


def bytes_per_dst_group(transfers: Sequence[Transfer], dst: Layout) -> dict[int, int]:
    """Bytes received by each receiving data-parallel group (keyed by its data index)."""
    out = {g: 0 for g in range(dst.data)}
    for t in transfers:
        out[dst.coords(t.dst_pos)["data"]] += t.nbytes
    return out


def relative(index: Index, within: Index) -> Index:
    """`index` (global) expressed relative to the block `within` that contains it."""
    return tuple(slice(s.start - w.start, s.stop - w.start) for s, w in zip(index, within))


def shape_of(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def apply_local(transfers: Sequence[Transfer], src: Layout, dst: Layout, src_blocks, shape, dtype):
    """Execute `transfers` with numpy in one process: `src_blocks[p]` is the block the sender
    holds at position p; returns the receiver's blocks by position. The reference executor
    for tests and for timing the copy pattern without MPI; the MPI transport does the same
    with messages."""
    import numpy as np

    out = {}
    for t in transfers:
        dst_block = dst.block(t.dst_pos, shape)
        if t.dst_pos not in out:
            out[t.dst_pos] = np.zeros(shape_of(dst_block), dtype)
        src_block = src.block(t.src_pos, shape)
        piece = np.asarray(src_blocks[t.src_pos])[relative(t.index, src_block)]
        target = _intersect(t.index, dst_block)  # broadcast pieces overhang the block
        if target is not None:
            out[t.dst_pos][relative(target, dst_block)] = piece[relative(target, t.index)]
    return out
