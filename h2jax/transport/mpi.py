"""The MPI transport: each stage in its own process(es), boundary arrays moved by mpi4py.

It moves arrays and a few scalars, nothing else: which rank runs which stage, start-up and
failure handling live in `h2jax.runtime.ranks`.

- Zero-copy sends. Every piece of a boundary array goes to MPI straight out of the JAX
  buffer: host memory by its address, accelerator memory as the device buffer itself when the
  MPI library reports support for that memory kind (CUDA-aware), else through one host copy.
  A strided piece (a column block of the sender's shard, when the receiver splits d_model
  finer) goes as an MPI derived datatype of contiguous runs, never packed by a copy. The path
  is `auto`, `direct` or `staged`; `describe()` reports the one taken, why, and the counters
  (`send_pieces_strided`, `send_copy_bytes`, ...).
- Zero-copy receives. Messages land in 64-byte-aligned numpy buffers taken from a pool when
  the receive is posted; one call per message turns them into the receiving stage's jax.Array,
  which adopts them without a copy where the backend allows (PJRT's zero-copy host buffers on
  CPU). The staged path copies each buffer once, on each end.
- Non-blocking. `send` queues the array and returns; the `Isend`s start as soon as its value is
  computed (checked on every transport call, never waiting on it), so the next compute overlaps
  the transfer. Receives are posted ahead with `prepost`. A receive whose message has arrived is
  handed over at once, whatever compute this rank's own queued sends still wait for. Messages
  are tagged with (micro-batch, direction, boundary); the pieces of one message between two
  ranks match in posting order.
- Topology-aware resharding (`reshard.reshard_plan`): each receiving device gets only its own
  block, pieces cut by MPI datatypes straight out of the sender's shard and into the
  receiver's buffer. `bytes_received` counts what MPI reports it delivered.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Mapping, Sequence

import numpy as np

from h2jax.config import ConfigError
from h2jax.transport import reshard
from h2jax.transport.base import ACT, GRAD, Tag, Transport, chain, endpoints

PATHS = ("auto", "direct", "staged")
ALIGN = 64  # PJRT adopts host buffers without a copy only when they are 64-byte aligned


# ----------------------------------------------------------------------------- ranks


def first_ranks(processes: Sequence[int]) -> tuple[int, ...]:
    """The first rank of each stage when stage i owns `processes[i]` consecutive ranks (the
    job's rank order: `mpiexec` ranks fill stages in pipeline order)."""
    out, r = [], 0
    for p in processes:
        out.append(r)
        r += p
    return tuple(out)


def comm_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


# ----------------------------------------------------------------------------- path selection


def mpi_memory_kinds(comm=None) -> set[str]:
    """Memory kinds the MPI library accepts in messages (MPI 4.1 `mpi_memory_alloc_kinds`,
    e.g. {'mpi', 'system', 'cuda'}); $H2JAX_MPI_MEMORY_KINDS adds kinds by hand."""
    kinds: set[str] = set()
    comm = comm or comm_world()
    try:
        info = comm.Get_info()
        value = info.Get("mpi_memory_alloc_kinds") or ""
        info.Free()
    except Exception:  # noqa: BLE001 - MPI older than 4.1: no report
        value = ""
    value += "," + os.environ.get("H2JAX_MPI_MEMORY_KINDS", "")
    for item in value.split(","):
        if item.strip():
            kinds.add(item.strip().split(":")[0].lower())
    return kinds


_GPU_KIND = {"cuda": "cuda", "gpu": "cuda", "rocm": "rocm"}


def choose_path(requested: str, platform: str, kinds: set[str]) -> tuple[str, str]:
    """(`direct` or `staged`, the reason), for arrays on `platform`."""
    if requested not in PATHS:
        raise ConfigError(f"transport path {requested!r} is unknown; use one of {', '.join(PATHS)}")
    if platform == "cpu":
        if requested == "staged":
            return "staged", "requested: host arrays copied into separate buffers on both ends"
        return "direct", "arrays live in host memory: MPI reads and writes JAX's buffers in place"
    kind = _GPU_KIND.get(platform)
    aware = kind is not None and kind in kinds
    if requested == "direct" and not aware:
        raise ConfigError(
            f"transport path 'direct' needs an MPI library that accepts {platform} device memory, "
            f"but MPI reports memory kinds {sorted(kinds) or 'none'}; use a {platform}-aware MPI "
            "build, set H2JAX_MPI_MEMORY_KINDS if it is aware but does not say so, or use 'auto'"
        )
    if requested == "staged" or not aware:
        why = "requested" if requested == "staged" else f"MPI reports no {platform} support ({sorted(kinds)})"
        return "staged", f"{why}: device buffers copied through host memory"
    return "direct", f"MPI accepts {platform} memory: device buffers go to MPI directly"


# ----------------------------------------------------------------------------- buffers


def aligned_empty(shape: Sequence[int], dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialized array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _is_contiguous(index: reshard.Index, shape: Sequence[int]) -> bool:
    """Whether `index` selects one contiguous run of a C-ordered array of `shape`."""
    return not _runs(index, shape, 1)[2]


def _flat_offset(index: reshard.Index, shape: Sequence[int]) -> int:
    return int(np.ravel_multi_index([s.start for s in index], shape)) if shape else 0


def _runs(index: reshard.Index, shape: Sequence[int], itemsize: int) -> tuple[int, int, list[tuple[int, int]]]:
    """`index` of a C-ordered array of `shape` as contiguous byte runs: (byte offset of its
    first element, bytes per run, [(count, byte stride), ...] of the dimensions that repeat
    the run, innermost first). Trailing dimensions taken whole lengthen the run, and so does
    the first one taken in part; outer dimensions whose strides line up are merged."""
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    run, d = itemsize, len(shape) - 1
    while d >= 0:
        n = index[d].stop - index[d].start
        run *= n
        d -= 1
        if n != shape[d + 1]:
            break
    repeats: list[tuple[int, int]] = []
    for d in range(d, -1, -1):
        n = index[d].stop - index[d].start
        if n == 1:
            continue
        if repeats and repeats[-1][0] * repeats[-1][1] == strides[d]:
            repeats[-1] = (repeats[-1][0] * n, repeats[-1][1])
        else:
            repeats.append((n, strides[d]))
    return _flat_offset(index, shape) * itemsize, run, repeats


class _Region:
    """A piece of a buffer (host array, or device array on the direct path) as one MPI
    message, counted in bytes so any dtype (bfloat16 included) goes as is: the whole buffer,
    or one derived datatype placed at the piece's offset. A strided piece (the columns of a
    row-major block that a receiver splitting d_model finer takes) is a vector of contiguous
    runs, which MPI reads straight out of the sender's buffer and writes straight into the
    receiver's: no packing copy. (A subarray datatype over single bytes, the obvious
    alternative, made MPICH move one byte at a time: 10-20x slower.)"""

    __slots__ = ("nbytes", "whole", "strided", "datatype", "_byte")

    def __init__(self, index: reshard.Index, shape: Sequence[int], dtype):
        from mpi4py import MPI

        itemsize = np.dtype(dtype).itemsize
        offset, run, repeats = _runs(index, shape, itemsize)
        self._byte = MPI.BYTE
        self.strided = bool(repeats)
        self.whole = not repeats and run == int(np.prod(shape, dtype=np.int64)) * itemsize
        self.datatype = None
        self.nbytes = run
        if not self.whole:
            kind = MPI.BYTE.Create_contiguous(run)
            for count, stride in repeats:
                outer = kind.Create_hvector(count, 1, stride)
                kind.Free()
                kind = outer
            self.datatype = kind.Create_hindexed_block(1, [offset]).Commit()
            kind.Free()
            self.nbytes = self.datatype.Get_size()  # MPI's own count of the bytes it moves

    def message(self, buf):
        if self.datatype is None:
            return [buf, self.nbytes, self._byte]
        return [buf, 1, self.datatype]

    def free(self) -> None:
        if self.datatype is not None:
            self.datatype.Free()
            self.datatype = None


class _BufferPool:
    """Aligned host buffers, reused once nothing else holds them.

    A receive buffer JAX adopted stays referenced for as long as the jax.Array that uses it
    lives (a staging buffer, until its send completes); when the pool holds the only
    references to the buffer and its memory, it can take the next message, warm in memory
    instead of freshly page-faulted."""

    def __init__(self, per_shape: int = 16):
        self.per_shape = per_shape
        self.free: dict[tuple, list[np.ndarray]] = collections.defaultdict(list)
        self.next: dict[tuple, int] = collections.defaultdict(int)

    @staticmethod
    def key(shape, dtype) -> tuple:
        return tuple(int(n) for n in shape), np.dtype(dtype)  # the dtype itself: bfloat16's .str is '<V2'

    def take(self, shape, dtype) -> np.ndarray:
        return self.take_key(self.key(shape, dtype))

    def take_key(self, key: tuple) -> np.ndarray:
        bufs = self.free[key]
        n = len(bufs)
        # Buffers come back in about the order they went out: start after the last one taken.
        start = self.next[key]
        for i in range(start, start + n):
            i %= n
            # Unused: the view is held only by the list, its memory only by the view (each
            # count includes getrefcount's own argument). No local name may bind them here.
            if sys.getrefcount(bufs[i]) == 2 and sys.getrefcount(bufs[i].base) == 2:
                self.next[key] = i + 1
                return bufs[i]
        buf = aligned_empty(*key)
        if n < self.per_shape:
            bufs.append(buf)
            self.next[key] = n + 1
        return buf


def _batched_put(shape, dtype, sharding, devices, copy: bool):
    """A function of per-device host buffers (in `devices` order) that returns them as one
    jax.Array of `sharding`, in one PJRT call that adopts aligned host memory without a copy
    (with `copy`: copies each buffer once). `jax.make_array_from_callback` and
    `jax.device_put` end in the same call after ~20 us of Python checks per array, which is
    what a message cannot afford. None where this JAX lacks it; `connect` checks it before
    relying on it."""
    try:
        from jax._src import core
        from jax._src.lib import xla_client

        put = xla_client.batched_device_put
        aval = core.ShapedArray(shape, dtype)
        if hasattr(core, "update_aval_with_sharding"):
            aval = core.update_aval_with_sharding(aval, sharding)
    except (ImportError, AttributeError, TypeError):
        return None
    devices = list(devices)
    return lambda arrays: put(aval, sharding, arrays, devices, True, copy)


# ----------------------------------------------------------------------------- the transport


class _Route:
    """How one (kind, boundary) message moves between this rank and its peers.

    On the sending side: which of this process's shards (by index into the array's
    addressable shards) go to which rank, cut by which `_Region`. On the receiving side: one
    pooled buffer per device of this process (in the order the stage's jax.Array keeps its
    shards) and the pieces that fill it. Counters are per route, kept as plain integers:
    every message of a route moves the same pieces."""

    def __init__(self, transfers, src, dst, shape, dtype, me, broadcast, local_positions, code_base):
        from mpi4py import MPI

        self.shape, self.dtype, self.code_base = shape, dtype, code_base
        shard = {p: i for i, p in enumerate(local_positions)}
        self.sends = []  # (shard index, peer rank, _Region over that shard)
        self.recvs = []  # (buffer index, peer rank, _Region over that buffer)
        self.buffers: dict[int, tuple[reshard.Index, reshard.Index]] = {}  # position: (buffer, block)
        for t in transfers:
            if src.owners[t.src_pos] == me:
                block = src.block(t.src_pos, shape)
                self.sends.append((shard[t.src_pos], dst.owners[t.dst_pos],
                                   _Region(reshard.relative(t.index, block), reshard.shape_of(block), dtype)))
            if dst.owners[t.dst_pos] == me:
                block = dst.block(t.dst_pos, shape)
                buffer = reshard._wanted(dst, t.dst_pos, shape, broadcast)
                self.buffers[t.dst_pos] = (buffer, block)
                self.recvs.append((shard[t.dst_pos], src.owners[t.src_pos],
                                   _Region(reshard.relative(t.index, buffer), reshard.shape_of(buffer), dtype)))
        self.send_shards = sorted({i for i, _, _ in self.sends})
        # What Isend and Irecv take besides the buffer: (count, datatype) of each piece.
        self.send_messages = [(i, peer, *region.message(None)[1:]) for i, peer, region in self.sends]
        self.recv_messages = [(i, peer, *region.message(None)[1:]) for i, peer, region in self.recvs]
        # Receive buffers, one per device of this process, in shard order.
        self.recv_keys = [_BufferPool.key(reshard.shape_of(self.buffers[p][0]), dtype)
                          for p in local_positions if p in self.buffers]
        self.trims = [reshard.relative(self.buffers[p][1], self.buffers[p][0])
                      for p in local_positions if p in self.buffers]
        self.broadcast = any(b != k for b, k in self.buffers.values())  # buffers larger than blocks
        self.nbytes_sent = sum(r.nbytes for _, _, r in self.sends)
        self.strided_sends = sum(r.strided for _, _, r in self.sends)
        self.strided_recvs = sum(r.strided for _, _, r in self.recvs)
        self.sent = 0  # messages
        self.received = 0
        self.bytes_received = 0  # as MPI reports it delivered them
        # Filled by each completed Testall/Waitall of this route's receives and read at once.
        self.statuses = [MPI.Status() for _ in self.recvs]
        self._byte = MPI.BYTE

    def delivered(self) -> int:
        """Bytes MPI reports the receives it just completed delivered."""
        byte = self._byte
        return sum([s.Get_elements(byte) for s in self.statuses])

    def free(self) -> None:
        for _, _, region in self.sends + self.recvs:
            region.free()


class MPITransport(Transport):
    """Moves boundary arrays between stages that live in different MPI processes.

    `processes[i]` is how many ranks stage i has; stage i owns the `processes[i]` ranks after
    those of stages < i. `path` picks zero-copy (`direct`), host staging (`staged`) or the
    best the backend and MPI allow (`auto`). `reshard_mode="broadcast"` swaps in the naive
    plan, for benchmarks only. Construction is collective (all ranks), as is `connect`.

    A value given to `send` is read by MPI in place until its sends complete (`flush`, or any
    later call that finds them done): it must not be donated to a computation before then.
    """

    # A receive that must wait while this rank's own queued sends wait for their compute
    # polls both, sleeping between polls from the first value up to the second (seconds).
    POLL_S = (20e-6, 1e-3)

    def __init__(self, processes: Sequence[int], *, path: str = "auto", comm=None,
                 reshard_mode: str = "topology"):
        if path not in PATHS:
            raise ConfigError(f"transport path {path!r} is unknown; use one of {', '.join(PATHS)}")
        if reshard_mode not in ("topology", "broadcast"):
            raise ValueError(f"reshard_mode must be 'topology' or 'broadcast', got {reshard_mode!r}")
        from mpi4py import MPI

        self._MPI = MPI
        self._testall, self._byte = MPI.Request.Testall, MPI.BYTE
        world = comm or MPI.COMM_WORLD
        processes = list(processes)
        if sum(processes) != world.size:
            raise ValueError(f"stages with {processes} processes need {sum(processes)} ranks, not {world.size}")
        self.first_rank = first_ranks(processes)
        self.rank = world.rank
        self.stage = max(i for i, r in enumerate(self.first_rank) if r <= world.rank and processes[i] > 0)
        self.n_stages = len(processes)
        self.comm = world.Dup()  # our own context: no clash with anyone else's messages
        self.requested_path, self.path, self.path_reason = path, None, None
        self.reshard_mode = reshard_mode
        self.tag_ub = int(self.comm.Get_attr(MPI.TAG_UB))
        self._routes: dict[tuple[str, int], _Route] = {}
        self._sending: dict[tuple[str, int], _Route] = {}  # the routes this rank sends on
        self._receiving: dict[tuple[str, int], _Route] = {}
        self._pending_sends: list[tuple[_Route, int, object, bool]] = []  # queued until computed
        self._inflight: collections.deque = collections.deque()  # (requests, value, buffers)
        self._pool = _BufferPool()  # receive buffers
        self._send_pool = _BufferPool()  # staging buffers of the staged path on host arrays
        # Posted receives: [route, requests, buffers, bytes MPI delivered once complete].
        self._posted: dict[tuple, list] = {}  # keyed (kind, boundary, micro): hashed in C
        self._sleep = time.sleep
        self._put = self._zero_copy_put = None
        self._adopts = 0
        self.assembly = None  # how received buffers become a jax.Array (describe())
        self._counts = {"send_buffers_copied": 0, "send_copy_bytes": 0, "recv_buffers_copied": 0,
                        "recv_copy_bytes": 0, "recvs_waited": 0}
        self._closed_stats: dict[str, int] = {}

    # -- set-up

    def connect(self, boundary_shape, dtype, layouts: Mapping[int, object], boundaries=None) -> None:
        shape = tuple(int(n) for n in boundary_shape)
        # boundary -> (stage before, stage after): virtual boundaries under interleaved 1F1B
        self._boundaries = dict(chain(self.n_stages) if boundaries is None else boundaries)
        dtype = np.dtype(dtype)
        if self.stage not in layouts:
            raise ValueError(f"connect() on rank {self.rank} needs the layout of its stage {self.stage}")
        sharding = layouts[self.stage]
        first = self.first_rank[self.stage]
        mine = reshard.Layout.from_sharding(sharding, owner=lambda d: first + d.process_index)
        platform = next(iter(sharding.mesh.devices.flat)).platform
        gathered = self.comm.allgather((self.stage, shape, dtype.str, mine, platform))
        layouts_by_stage: dict[int, reshard.Layout] = {}
        for stage, their_shape, their_dtype, layout, _ in gathered:
            if (their_shape, their_dtype) != (shape, dtype.str):
                raise ValueError(
                    f"stage {stage} connects boundary arrays of shape {their_shape} {their_dtype} but "
                    f"stage {self.stage} uses {shape} {dtype.str}; every stage must use the plan's "
                    "[micro_batch, seq_len, d_model] and activation dtype"
                )
            layouts_by_stage[stage] = layout
        missing = [i for i in range(self.n_stages) if i not in layouts_by_stage]
        if missing:
            raise ValueError(f"no process connected stage(s) {missing}")
        self.flush()
        self._free_routes()
        self.path, self.path_reason = choose_path(self.requested_path, platform, mpi_memory_kinds(self.comm))
        self.shape, self.dtype = shape, dtype
        self._sharding = sharding
        self._host_memory = platform == "cpu"
        self._host_buffers = self._host_memory or self.path == "staged"  # where messages land
        devices = list(sharding.mesh.devices.reshape(-1))
        # This process's devices in the order a jax.Array of `sharding` keeps its shards
        # (`addressable_data(i)`) and PJRT assembles them.
        self._local = list(sharding.addressable_devices_indices_map(shape))
        local_positions = [devices.index(d) for d in self._local]
        # A fully replicated array hands out its first shard for every index: look up by device.
        self._by_device = sharding.is_fully_replicated and len(self._local) > 1
        self._block_shape = tuple(sharding.shard_shape(shape))
        self._block_nbytes = int(np.prod(self._block_shape, dtype=np.int64)) * dtype.itemsize
        n_b = max(len(self._boundaries), 1)
        self._code_stride = 2 * n_b  # tag = micro * stride + (kind is GRAD) * n_b + boundary
        self._max_micro = (self.tag_ub - self._code_stride + 1) // self._code_stride
        plan_fn = reshard.broadcast_plan if self.reshard_mode == "broadcast" else reshard.reshard_plan
        for b, (before, after) in sorted(self._boundaries.items()):
            for kind, (s, d) in ((ACT, (before, after)), (GRAD, (after, before))):
                if self.stage not in (s, d):
                    continue
                src, dst = layouts_by_stage[s], layouts_by_stage[d]
                route = _Route(plan_fn(src, dst, shape, dtype.itemsize), src, dst, shape, dtype, self.rank,
                               self.reshard_mode == "broadcast", local_positions, (kind == GRAD) * n_b + b)
                self._routes[(kind, b)] = route
                (self._sending if s == self.stage else self._receiving)[(kind, b)] = route
        self._setup_assembly()

    def _setup_assembly(self) -> None:
        """Pick how received buffers become the stage's jax.Array, and find out (once, on
        buffers from the pool, as every message will use) which devices adopt them without a
        copy: `recv_buffers_adopted` counts from that."""
        self._put = self._zero_copy_put = None
        if not self._host_memory and self.path == "direct":
            self.assembly = "make_array_from_single_device_arrays"  # MPI wrote device buffers
            self._adopts = len(self._local)
            return
        copy = self.path == "staged"
        probe = [self._pool.take(self._block_shape, self.dtype) for _ in self._local]
        pointers = [b.ctypes.data for b in probe]
        for i, buf in enumerate(probe):
            buf.view(np.uint8).reshape(-1)[:] = (np.arange(buf.nbytes) * (i + 1) % 251).astype(np.uint8)
        want = [b.view(np.uint8).tobytes() for b in probe]
        put = _batched_put(self.shape, self.dtype, self._sharding, self._local, copy)
        if put is not None:
            try:
                array = put(probe)
                if array.sharding == self._sharding and [
                    np.asarray(s).view(np.uint8).tobytes() for s in self._shards(array)
                ] == want:
                    self._put, self.assembly = put, "xla_client.batched_device_put"
            except Exception:  # noqa: BLE001 - this JAX changed the call: use the public one
                pass
        if self._put is None:
            self.assembly = "make_array_from_callback"
            array = self._assemble_public(probe, copy)
        elif self._host_memory and not copy:
            self._zero_copy_put = self._put  # what `recv` calls itself
        self._adopts = 0 if copy or not self._host_memory else sum(
            s.unsafe_buffer_pointer() == p for s, p in zip(self._shards(array), pointers))

    def _shards(self, array) -> list:
        """`array`'s single-device arrays, one per device of this process, in `_local` order."""
        data = {s.device: s.data for s in array.addressable_shards}
        return [data[d] for d in self._local]

    def _assemble_public(self, arrays, copy: bool):
        """`_batched_put` through public JAX: the same adoption, ~20 us slower per array."""
        import jax

        def key(index):
            return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, self.shape))

        index_of = {key(idx): i for i, idx in enumerate(self._sharding.addressable_devices_indices_map(self.shape).values())}
        if copy and self._host_memory:  # an accelerator's device_put is the one copy
            arrays = [_aligned_copy(a) for a in arrays]
        return jax.make_array_from_callback(self.shape, self._sharding, lambda idx: arrays[index_of[key(idx)]])

    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction: messages and bytes (received bytes as MPI reported
        them), buffers handed over without a copy, strided pieces, copies and their bytes."""
        out = dict(self._closed_stats) or {k: 0 for k in (
            "sends", "recvs", "bytes_sent", "bytes_received", "send_buffers_zero_copy",
            "send_pieces_strided", "recv_buffers_adopted", "recv_pieces_strided")}
        direct = self.path == "direct"
        for route in self._routes.values():
            out["sends"] += route.sent
            out["bytes_sent"] += route.sent * route.nbytes_sent
            out["send_buffers_zero_copy"] += route.sent * len(route.send_shards) * direct
            out["send_pieces_strided"] += route.sent * route.strided_sends
            out["recvs"] += route.received
            out["bytes_received"] += route.bytes_received
            out["recv_buffers_adopted"] += route.received * self._adopts
            out["recv_pieces_strided"] += route.received * route.strided_recvs
        for k, v in self._counts.items():
            out[k] = v
        return out

    def describe(self) -> dict:
        """The path taken and why, for logs and benchmark reports."""
        return {"transport": "mpi", "path": self.path, "requested": self.requested_path,
                "why": self.path_reason, "reshard": self.reshard_mode, "assembly": self.assembly,
                "rank": self.rank, "stage": self.stage, **self.stats}

    def _code(self, tag: Tag, route: _Route) -> int:
        if tag.micro > self._max_micro:
            raise ValueError(
                f"micro-batch {tag.micro} does not fit the MPI tag space (TAG_UB={self.tag_ub}); "
                "use fewer micro-batches per step"
            )
        return tag.micro * self._code_stride + route.code_base

    def _no_route(self, tag: Tag, role: str) -> ValueError:
        boundaries = getattr(self, "_boundaries", None)
        if boundaries is not None and tag.boundary not in boundaries:
            return ValueError(f"{tag} names no boundary of this job (it has boundaries 0..{len(boundaries) - 1})")
        src, dst = endpoints(tag, boundaries)
        stage = src if role == "sent" else dst
        if stage != self.stage:
            return ValueError(f"{tag} is {role} by stage {stage}, not by this process's stage {self.stage}")
        return ValueError(
            f"rank {self.rank} (stage {self.stage}) takes no part in {tag}; call connect() "
            "first, and move only messages of the process's own stage"
        )

    # -- sends

    def send(self, tag: Tag, value) -> None:
        route = self._sending.get((tag.kind, tag.boundary))
        if route is None:
            raise self._no_route(tag, "sent")
        code = self._code(tag, route)
        by_device = self._by_device
        if value.sharding != self._sharding or value.shape != self.shape or value.dtype != self.dtype:
            # MPI reads the shards by address: anything but the connected layout would be read wrong.
            if value.shape != self.shape or value.dtype != self.dtype or not value.sharding.is_equivalent_to(
                    self._sharding, len(self.shape)):
                raise ValueError(
                    f"{tag}: the value is {value.dtype}{list(value.shape)} on {value.sharding}, but this "
                    f"transport was connected for {self.dtype}{list(self.shape)} on {self._sharding}; send "
                    "arrays on the layout given to connect()"
                )
            by_device = True  # an equivalent layout may order its devices differently
        if self.path == "staged" and not self._host_memory:
            value.copy_to_host_async()  # the one device-to-host copy starts once it is computed
        self._pending_sends.append((route, code, value, by_device))
        self._progress()

    def _send_buffer(self, data):
        """MPI's view of one shard: the JAX buffer itself on the direct path, else one copy."""
        if self.path == "direct":
            if self._host_memory:
                return self._MPI.buffer.fromaddress(data.unsafe_buffer_pointer(), self._block_nbytes, readonly=True)
            return data  # a device buffer: mpi4py reads it through DLPack
        self._counts["send_buffers_copied"] += 1
        self._counts["send_copy_bytes"] += self._block_nbytes
        unsigned = f"u{self.dtype.itemsize}"  # MPI moves bytes; any dtype (bfloat16) as is
        if self._host_memory:
            host = self._send_pool.take(self._block_shape, unsigned)
            np.copyto(host, _host_view(data))
            return host
        return np.asarray(data).view(unsigned)  # the copy copy_to_host_async started

    def _start_send(self, route: _Route, code: int, value, by_device: bool) -> None:
        if by_device:
            data = {s.device: s.data for s in value.addressable_shards}
            shards = [data[d] for d in self._local]
            buffers = {i: self._send_buffer(shards[i]) for i in route.send_shards}
        else:
            buffers = {i: self._send_buffer(value.addressable_data(i)) for i in route.send_shards}
        isend = self.comm.Isend
        requests = [isend([buffers[i], count, kind], peer, code) for i, peer, count, kind in route.send_messages]
        route.sent += 1
        # The value and its views stay referenced until MPI is done with them.
        self._inflight.append((requests, value, buffers))

    def _progress(self, block: bool = False) -> None:
        """Start the Isends of queued values that are computed (all of them if `block`), and
        drop the references of sends that completed."""
        if self._pending_sends:
            still = []
            for item in self._pending_sends:
                if not block and (still or not item[2].is_ready()):  # keep the send order
                    still.append(item)
                    continue
                if block:
                    item[2].block_until_ready()
                self._start_send(*item)
            self._pending_sends = still
        # Sends complete roughly in order: test from the oldest and stop at the first one
        # still moving (testing them all would make a long stream quadratic).
        inflight = self._inflight
        while inflight and self._MPI.Request.Testall(inflight[0][0]):
            inflight.popleft()

    def flush(self) -> None:
        self._progress(block=True)
        for requests, _, _ in self._inflight:
            self._MPI.Request.Waitall(requests)
        self._inflight.clear()

    # -- receives

    def prepost(self, tags: list[Tag]) -> None:
        posted = self._posted
        for tag in tags:
            key = (tag.kind, tag.boundary, tag.micro)
            if key not in posted:
                posted[key] = self._post(tag)
        if self._pending_sends or self._inflight:
            self._progress()

    def _post(self, tag: Tag) -> list:
        route = self._receiving.get((tag.kind, tag.boundary))
        if route is None:
            raise self._no_route(tag, "received")
        code = tag.micro * self._code_stride + route.code_base if tag.micro <= self._max_micro else self._code(tag, route)
        if self._host_buffers:
            take = self._pool.take_key
            buffers = [take(key) for key in route.recv_keys]
        else:  # CUDA-aware MPI writes into fresh, unaliased device buffers through DLPack
            import jax.numpy as jnp

            buffers = [jnp.zeros(key[0], self.dtype, device=d) for key, d in zip(route.recv_keys, self._local)]
        irecv = self.comm.Irecv
        requests = [irecv([buffers[i], count, kind], peer, code) for i, peer, count, kind in route.recv_messages]
        return [route, requests, buffers, None]

    def ready(self, tag: Tag) -> bool:
        key = (tag.kind, tag.boundary, tag.micro)
        posted = self._posted.get(key)
        if posted is None:
            posted = self._posted[key] = self._post(tag)
        self._progress()
        if posted[3] is None and self._testall(posted[1], posted[0].statuses):
            posted[3] = posted[0].delivered()
        return posted[3] is not None

    def recv(self, tag: Tag):
        posted = self._posted.pop((tag.kind, tag.boundary, tag.micro), None)
        if posted is None:
            posted = self._post(tag)
        route, requests, buffers, delivered = posted
        if delivered is None:
            if not self._testall(requests, route.statuses):
                self._wait(requests, route.statuses)
            delivered = route.delivered()
        if self._pending_sends or self._inflight:
            self._progress()
        route.received += 1
        route.bytes_received += delivered
        if self._zero_copy_put is None or route.broadcast:
            return self._assemble(route, buffers)
        return self._zero_copy_put(buffers)

    def _wait(self, requests, statuses) -> None:
        """Wait for a message that has not arrived. While this rank still has queued sends
        (values whose compute has not finished), poll both: start each send the moment its
        value is ready, take the message the moment it arrives, and sleep briefly between
        polls; once no send is queued, wait in MPI.

        Deadlock-free: a peer may hold back the message we wait for until it has received one
        of our queued sends, so those must start before we block indefinitely; they do, since
        we block in MPI only once none is queued, and a queued value always becomes ready by
        itself (its compute was dispatched with inputs that are complete: no JAX computation
        waits on a future message). Until then nothing here blocks, so a message that arrives
        is never held back by compute it does not depend on (`recv` of a message that has
        already arrived does not come here at all)."""
        self._counts["recvs_waited"] += 1
        testall = self._MPI.Request.Testall
        nap, longest = self.POLL_S
        while self._pending_sends:
            self._progress()
            if testall(requests, statuses):
                return
            if self._pending_sends:
                self._sleep(nap)
                nap = min(2 * nap, longest)
        self._MPI.Request.Waitall(requests, statuses)

    def _assemble(self, route: _Route, buffers: list):
        """The received buffers as one jax.Array on this stage's layout (every path but the
        zero-copy one into host memory, which `recv` takes itself)."""
        import jax

        if not self._host_memory and self.path == "direct":
            if route.broadcast:  # naive broadcast: each device keeps its block (a device copy)
                buffers = [b[trim] for b, trim in zip(buffers, route.trims)]
            return jax.make_array_from_single_device_arrays(self.shape, self._sharding, buffers)
        copy = self.path == "staged"
        if route.broadcast:  # naive broadcast (benchmarks only): each device keeps its block
            buffers = [_aligned_copy(b[trim]) for b, trim in zip(buffers, route.trims)]
            self._counts["recv_copy_bytes"] += len(buffers) * self._block_nbytes
        if copy:
            self._counts["recv_buffers_copied"] += len(buffers)
            self._counts["recv_copy_bytes"] += len(buffers) * self._block_nbytes
        if self._put is not None:
            return self._put(buffers)
        return self._assemble_public(buffers, copy)

    # -- cross-stage scalars

    def sum_across_stages(self, local: Mapping[int, float]) -> float:
        from mpi4py import MPI

        self._progress(block=True)
        return float(self.comm.allreduce(float(sum(local.values())), op=MPI.SUM))

    def share_from_stage(self, stage: int, values: list[float] | None) -> list[float]:
        self._progress(block=True)
        root = self.first_rank[stage]
        if self.comm.rank == root and values is None:
            raise ValueError(f"rank {root} leads stage {stage} and must pass its values")
        return list(self.comm.bcast(values if self.comm.rank == root else None, root=root))

    def gather_to_first(self, value) -> list | None:
        self._progress(block=True)
        return self.comm.gather(value, root=0)

    def barrier(self) -> None:
        self._progress(block=True)
        self.comm.Barrier()

    # -- teardown

    def _free_routes(self) -> None:
        if self._routes:
            self._closed_stats = {k: v for k, v in self.stats.items() if k not in self._counts}
        for route in self._routes.values():
            route.free()
        self._routes, self._sending, self._receiving = {}, {}, {}

    def close(self) -> None:
        self.flush()
        for posted in self._posted.values():
            for r in posted[1]:
                r.Cancel()
                r.Wait()
        self._posted = {}
        self._free_routes()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def _host_view(array) -> np.ndarray:
    """A zero-copy numpy view of a computed single-device CPU jax.Array, through the buffer's
    address, as same-width unsigned integers (MPI moves bytes; any dtype, bfloat16 included).
    The caller keeps `array` alive while the view is in use."""
    from mpi4py import MPI

    raw = MPI.buffer.fromaddress(array.unsafe_buffer_pointer(), array.nbytes, readonly=True)
    return np.frombuffer(raw, dtype=f"u{array.dtype.itemsize}").reshape(array.shape)


def _aligned_copy(host: np.ndarray) -> np.ndarray:
    out = aligned_empty(host.shape, host.dtype)
    np.copyto(out, host)
    return out


__all__ = ["MPITransport", "choose_path", "aligned_empty", "first_ranks"]
