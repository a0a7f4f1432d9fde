"""All stages in one process, each on its own devices: boundary arrays hand over device to device.

`send` returns at once, before the sender's value is computed. The receiver's blocks are cut
from the sender's shards and copied to the receiving devices by the same topology-aware plan
the MPI transport executes (`reshard.reshard_plan`): each piece is a single-device
`device_put` (device to device, asynchronous), pieces of one block are joined on the
receiving device by a small jitted program, and the blocks become one `jax.Array` on the
receiver's sharding with `jax.make_array_from_single_device_arrays`. Nothing waits for the
producer and nothing goes through the host, so stages on disjoint devices compute
concurrently: the receiver's next program is queued behind the transfer by JAX itself.

`handoff="sync"` keeps the old behaviour, a whole-array `jax.device_put` to the receiver's
sharding. Across two meshes JAX takes a slow path there that waits for the producer and
copies through host memory; it is kept only to measure the difference
(`benchmarks/pipeline_overhead.py`).
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np

from h2jax.transport import reshard
from h2jax.transport.base import Tag, Transport, endpoints

HANDOFFS = ("async", "sync")


class _Handoff:
    """How a boundary array moves from one stage's layout to another's: for each receiving
    device, the pieces of the sender's shards it takes and how to join them."""

    def __init__(self, src_sharding, dst_sharding, shape, dtype):
        src = reshard.Layout.from_sharding(src_sharding)
        dst = reshard.Layout.from_sharding(dst_sharding)
        self.shape, self.sharding = tuple(shape), dst_sharding
        self.src_devices = list(src_sharding.mesh.devices.reshape(-1))
        self.dst_devices = list(dst_sharding.mesh.devices.reshape(-1))
        transfers = reshard.reshard_plan(src, dst, self.shape, np.dtype(dtype).itemsize)
        self.nbytes = reshard.total_bytes(transfers)
        # pieces[p]: (sender position, the piece within the sender's shard, its place in
        # the receiver's block) for the receiving device at position p
        self.pieces: list[list[tuple[int, reshard.Index, reshard.Index]]] = [[] for _ in self.dst_devices]
        for t in transfers:
            self.pieces[t.dst_pos].append((
                t.src_pos,
                reshard.relative(t.index, src.block(t.src_pos, self.shape)),
                reshard.relative(t.index, dst.block(t.dst_pos, self.shape)),
            ))
        self.joins = [
            None if len(pieces) == 1
            else _joiner(reshard.shape_of(dst.block(pos, self.shape)), dtype, [at for _, _, at in pieces])
            for pos, pieces in enumerate(self.pieces)
        ]

    def move(self, value: jax.Array) -> jax.Array:
        shards = {s.device: s.data for s in value.addressable_shards}
        blocks = []
        for pos, device in enumerate(self.dst_devices):
            parts = []
            for src_pos, index, _ in self.pieces[pos]:
                shard = shards[self.src_devices[src_pos]]
                whole = all(s.start == 0 and s.stop == n for s, n in zip(index, shard.shape))
                parts.append(jax.device_put(shard if whole else shard[index], device))
            blocks.append(parts[0] if self.joins[pos] is None else self.joins[pos](*parts))
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, blocks)


def _joiner(shape, dtype, placed: list[reshard.Index]):
    """A jitted program that lays `len(placed)` pieces into one block of `shape` (it runs on
    the pieces' device: they are committed there)."""

    def join(*parts):
        block = jax.numpy.zeros(shape, dtype)
        for index, part in zip(placed, parts):
            block = jax.lax.dynamic_update_slice(block, part, [s.start for s in index])
        return block

    return jax.jit(join)


class LocalTransport(Transport):
    def __init__(self, handoff: str = "async") -> None:
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {HANDOFFS}, got {handoff!r}")
        self.handoff = handoff
        self._layouts: dict[int, object] = {}
        self._mailbox: dict[Tag, jax.Array] = {}
        self._routes: dict[tuple[int, int], _Handoff] = {}
        self._boundaries = None
        self.bytes_moved = 0

    def connect(self, boundary_shape, dtype, layouts: Mapping[int, object], boundaries=None) -> None:
        self._layouts = dict(layouts)
        self._boundaries = None if boundaries is None else dict(boundaries)
        self._shape, self._dtype = tuple(boundary_shape), np.dtype(dtype)
        self._routes = {}

    def _route(self, tag: Tag) -> _Handoff:
        key = endpoints(tag, self._boundaries)
        if key not in self._routes:
            self._routes[key] = _Handoff(self._layouts[key[0]], self._layouts[key[1]], self._shape, self._dtype)
        return self._routes[key]

    def send(self, tag: Tag, value) -> None:
        if tag in self._mailbox:
            raise RuntimeError(f"{tag} sent twice; the schedule sends each message once")
        if self.handoff == "sync":
            self._mailbox[tag] = jax.device_put(value, self._layouts[endpoints(tag, self._boundaries)[1]])
            self.bytes_moved += value.nbytes
            return
        route = self._route(tag)
        self._mailbox[tag] = route.move(value)
        self.bytes_moved += route.nbytes

    def ready(self, tag: Tag) -> bool:
        return tag in self._mailbox

    def recv(self, tag: Tag):
        if tag not in self._mailbox:
            raise RuntimeError(
                f"nothing was sent under {tag} and no other stage can run: the schedule deadlocks"
            )
        return self._mailbox.pop(tag)

    def sum_across_stages(self, local: Mapping[int, float]) -> float:
        return float(sum(local.values()))

    def share_from_stage(self, stage: int, values):
        return list(values)

    def describe(self) -> dict:
        return {"transport": "local", "handoff": self.handoff, "bytes_moved": self.bytes_moved}
