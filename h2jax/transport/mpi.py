"""The MPI transport: each stage in its own process(es), boundary arrays moved by mpi4py.

It moves arrays and a few scalars, nothing else: which rank runs which stage, start-up and
failure handling live in `h2jax.runtime.ranks`.

- Zero-copy sends. Every addressable shard of a boundary array goes to MPI as a buffer without
  a copy: for host memory through a DLPack view (`np.from_dlpack`); for accelerator memory the
  device buffer itself when the MPI library reports support for that memory kind (CUDA-aware),
  else through a host copy. The path is `auto`, `direct` or `staged`, and `describe()` reports
  the one taken and why.
- Zero-copy receives. Messages land in 64-byte-aligned numpy buffers allocated when the receive
  is posted; JAX adopts them as device buffers without another copy where the backend allows
  (`jax.dlpack.from_dlpack(copy=False)`, or an aliasing `device_put` on CPU devices other than
  the first). `stats` counts adopted and copied buffers.
- Non-blocking. `send` queues the array and returns; the `Isend`s start as soon as its value is
  computed (checked on every transport call, never waiting on it), so the next compute overlaps
  the transfer. Receives are posted ahead with `prepost`. Messages are tagged with (micro-batch,
  direction, boundary); the pieces of one message between two ranks match in posting order.
- Topology-aware resharding (`reshard.reshard_plan`): each receiving device gets only its own
  block, pieces cut with MPI subarray datatypes straight out of the sender's shard and into the
  receiver's buffer.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Mapping, Sequence

import numpy as np

from h2jax.config import ConfigError
from h2jax.transport import reshard
from h2jax.transport.base import ACT, GRAD, Tag, Transport

PATHS = ("auto", "direct", "staged")
ALIGN = 64  # jax.dlpack.from_dlpack(copy=False) adopts only 64-byte aligned host buffers


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
        return "direct", "arrays live in host memory: DLPack views go to MPI without a copy"
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
    dims = [s.stop - s.start for s in index]
    k = next((d for d, n in enumerate(dims) if n != 1), len(dims))  # first non-unit dimension
    return all(dims[d] == shape[d] for d in range(k + 1, len(dims)))


def _flat_offset(index: reshard.Index, shape: Sequence[int]) -> int:
    return int(np.ravel_multi_index([s.start for s in index], shape)) if shape else 0


class _Region:
    """A piece of a buffer (host array, or device array on the direct path) as an MPI message,
    counted in bytes so any dtype (bfloat16 included) goes as is: a (count, displacement) run
    when the piece is contiguous, else an MPI subarray datatype. A strided piece of a host
    buffer can instead be `pack`ed by numpy into one contiguous message: MPICH's own packing of
    subarray datatypes on the send side measured 5-10x slower than a numpy copy
    (benchmarks/reshard.py); on the receive side its unpacking is fast and saves a copy."""

    def __init__(self, index: reshard.Index, shape: Sequence[int], dtype):
        from mpi4py import MPI

        itemsize = np.dtype(dtype).itemsize
        self.count = reshard._count(index)
        self.nbytes = self.count * itemsize
        self.whole = self.count == int(np.prod(shape, dtype=np.int64))
        self.contiguous = _is_contiguous(index, shape)
        self.offset = _flat_offset(index, shape) * itemsize
        self.index = index
        self.datatype = None
        if not self.contiguous:
            self.datatype = MPI.BYTE.Create_subarray(
                [*shape, itemsize], [s.stop - s.start for s in index] + [itemsize], [s.start for s in index] + [0]
            ).Commit()

    def message(self, buf):
        from mpi4py import MPI

        if self.whole:
            return [buf, self.nbytes, MPI.BYTE]
        if self.contiguous:
            return [buf, (self.nbytes, self.offset), MPI.BYTE]
        return [buf, 1, self.datatype]

    def pack(self, buf: np.ndarray) -> np.ndarray:
        """The piece as a contiguous copy (one memcpy at memory bandwidth)."""
        return np.ascontiguousarray(buf[self.index])

    def free(self) -> None:
        if self.datatype is not None:
            self.datatype.Free()
            self.datatype = None


class _BufferPool:
    """Aligned host receive buffers, reused once nothing else holds them.

    A buffer JAX adopted stays referenced (through DLPack, or the aliasing device_put) for
    as long as the jax.Array that uses it lives; when the pool holds the only references to
    the buffer and its memory, the array is gone and the buffer can take the next message,
    warm in memory instead of freshly page-faulted."""

    def __init__(self, per_shape: int = 16):
        self.per_shape = per_shape
        self.free: dict[tuple, list[np.ndarray]] = collections.defaultdict(list)

    def take(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        bufs = self.free[key]
        for i in range(len(bufs)):
            # Unused: the view is held only by the list, its memory only by the view (each
            # count includes getrefcount's own argument). No local name may bind them here.
            if sys.getrefcount(bufs[i]) == 2 and sys.getrefcount(bufs[i].base) == 2:
                return bufs[i]
        buf = aligned_empty(shape, dtype)
        if len(bufs) < self.per_shape:
            bufs.append(buf)
        return buf


# ----------------------------------------------------------------------------- the transport


class _Route:
    """How one (kind, boundary) message moves: the transfers this rank sends and receives."""

    def __init__(self, transfers, src, dst, src_ranks, dst_ranks, shape, dtype, me, broadcast):
        self.shape, self.dtype = shape, dtype
        self.src, self.dst = src, dst
        self.sends = []  # (src_pos, peer rank, _Region over the src block)
        self.recvs = []  # (dst_pos, peer rank, _Region over the receive buffer)
        self.recv_shapes: dict[int, tuple[reshard.Index, reshard.Index]] = {}  # pos: (buffer, block)
        for t in transfers:
            if src_ranks[t.src_pos] == me:
                block = src.block(t.src_pos, shape)
                self.sends.append(
                    (t.src_pos, dst_ranks[t.dst_pos], _Region(reshard.relative(t.index, block), reshard.shape_of(block), dtype))
                )
            if dst_ranks[t.dst_pos] == me:
                block = dst.block(t.dst_pos, shape)
                buffer = reshard._wanted(dst, t.dst_pos, shape, broadcast)
                self.recv_shapes[t.dst_pos] = (buffer, block)
                self.recvs.append(
                    (t.dst_pos, src_ranks[t.src_pos], _Region(reshard.relative(t.index, buffer), reshard.shape_of(buffer), dtype))
                )
        self.nbytes_sent = sum(r.count for _, _, r in self.sends) * np.dtype(dtype).itemsize
        self.nbytes_received = sum(r.count for _, _, r in self.recvs) * np.dtype(dtype).itemsize

    def free(self) -> None:
        for _, _, region in self.sends + self.recvs:
            region.free()


class MPITransport(Transport):
    """Moves boundary arrays between stages that live in different MPI processes.

    `processes[i]` is how many ranks stage i has; stage i owns the `processes[i]` ranks after
    those of stages < i. `path` picks zero-copy (`direct`), host staging (`staged`) or the
    best the backend and MPI allow (`auto`). `reshard_mode="broadcast"` swaps in the naive
    plan, for benchmarks only. Construction is collective (all ranks), as is `connect`.
    """

    def __init__(self, processes: Sequence[int], *, path: str = "auto", comm=None,
                 reshard_mode: str = "topology"):
        if path not in PATHS:
            raise ConfigError(f"transport path {path!r} is unknown; use one of {', '.join(PATHS)}")
        if reshard_mode not in ("topology", "broadcast"):
            raise ValueError(f"reshard_mode must be 'topology' or 'broadcast', got {reshard_mode!r}")
        from mpi4py import MPI

        self._MPI = MPI
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
        self._shardings: dict[int, object] = {}
        self._pending_sends: list[tuple[Tag, object]] = []  # queued until the value is computed
        self._inflight: collections.deque = collections.deque()  # (requests, value, buffers)
        self._pool = _BufferPool()
        self._posted: dict[Tag, tuple[list, dict[int, np.ndarray]]] = {}
        self.stats = {"sends": 0, "recvs": 0, "bytes_sent": 0, "bytes_received": 0,
                      "send_buffers_zero_copy": 0, "send_buffers_copied": 0, "send_pieces_packed": 0,
                      "recv_buffers_adopted": 0, "recv_buffers_copied": 0}

    # -- set-up

    def connect(self, boundary_shape, dtype, layouts: Mapping[int, object]) -> None:
        import jax

        shape = tuple(int(n) for n in boundary_shape)
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
        self.path, self.path_reason = choose_path(self.requested_path, platform, mpi_memory_kinds(self.comm))
        self._shardings = {self.stage: sharding}
        self._devices = list(sharding.mesh.devices.reshape(-1))
        self._me_process = jax.process_index()
        self.shape, self.dtype = shape, dtype
        self._free_routes()
        plan_fn = reshard.broadcast_plan if self.reshard_mode == "broadcast" else reshard.reshard_plan
        for b in range(self.n_stages - 1):
            for kind, (s, d) in ((ACT, (b, b + 1)), (GRAD, (b + 1, b))):
                if self.stage not in (s, d):
                    continue
                src, dst = layouts_by_stage[s], layouts_by_stage[d]
                transfers = plan_fn(src, dst, shape, dtype.itemsize)
                self._routes[(kind, b)] = _Route(
                    transfers, src, dst, src.owners, dst.owners, shape, dtype, self.rank,
                    self.reshard_mode == "broadcast",
                )

    def describe(self) -> dict:
        """The path taken and why, for logs and benchmark reports."""
        return {"transport": "mpi", "path": self.path, "requested": self.requested_path,
                "why": self.path_reason, "reshard": self.reshard_mode, "rank": self.rank,
                "stage": self.stage, **self.stats}

    def _tag(self, tag: Tag) -> int:
        n_b = max(self.n_stages - 1, 1)
        code = (tag.micro * 2 + (tag.kind == GRAD)) * n_b + tag.boundary
        if code > self.tag_ub:
            raise ValueError(
                f"micro-batch {tag.micro} does not fit the MPI tag space (TAG_UB={self.tag_ub}); "
                "use fewer micro-batches per step"
            )
        return code

    def _route(self, tag: Tag) -> _Route:
        try:
            return self._routes[(tag.kind, tag.boundary)]
        except KeyError:
            raise ValueError(
                f"rank {self.rank} (stage {self.stage}) takes no part in {tag}; call connect() "
                "first, and move only messages of the process's own stage"
            ) from None

    # -- sends

    def send(self, tag: Tag, value) -> None:
        if tag.src_stage != self.stage:
            raise ValueError(f"{tag} is sent by stage {tag.src_stage}, not by this process's stage {self.stage}")
        self._route(tag)
        self._pending_sends.append((tag, value))
        self._progress()

    def _host_buffer(self, shard_data, device) -> np.ndarray:
        if self.path == "direct":
            if device.platform == "cpu":
                self.stats["send_buffers_zero_copy"] += 1
                return _host_view(shard_data)
            self.stats["send_buffers_zero_copy"] += 1
            return shard_data  # a device buffer: mpi4py reads it through DLPack
        self.stats["send_buffers_copied"] += 1
        host = aligned_empty(shard_data.shape, shard_data.dtype)
        np.copyto(host, np.asarray(shard_data))
        return host

    def _start_send(self, tag: Tag, value) -> None:
        route = self._route(tag)
        code = self._tag(tag)
        by_device = {s.device: s.data for s in value.addressable_shards}
        buffers: dict[int, np.ndarray] = {}
        packed: list[np.ndarray] = []
        requests = []
        for src_pos, peer, region in route.sends:
            if src_pos not in buffers:
                device = self._devices[src_pos]
                buffers[src_pos] = self._host_buffer(by_device[device], device)
            buf = buffers[src_pos]
            if not region.contiguous and isinstance(buf, np.ndarray):
                packed.append(region.pack(buf))
                message = [packed[-1], region.nbytes, self._MPI.BYTE]
                self.stats["send_pieces_packed"] += 1
            else:
                message = region.message(buf)
            requests.append(self.comm.Isend(message, dest=peer, tag=code))
        self.stats["sends"] += 1
        self.stats["bytes_sent"] += route.nbytes_sent
        # The value and its views stay referenced until MPI is done with them.
        self._inflight.append((requests, value, list(buffers.values()) + packed))

    def _progress(self, block: bool = False) -> None:
        """Start the Isends of queued values that are computed (all of them if `block`), and
        drop the references of sends that completed."""
        still = []
        for tag, value in self._pending_sends:
            if not block and (still or not value.is_ready()):  # keep the send order
                still.append((tag, value))
                continue
            if block:
                value.block_until_ready()
            self._start_send(tag, value)
        self._pending_sends = still
        # Sends complete roughly in order: test from the oldest and stop at the first one
        # still moving (testing them all would make a long stream quadratic).
        while self._inflight and self._MPI.Request.Testall(self._inflight[0][0]):
            self._inflight.popleft()

    def flush(self) -> None:
        self._progress(block=True)
        for requests, _, _ in self._inflight:
            self._MPI.Request.Waitall(requests)
        self._inflight.clear()

    # -- receives

    def prepost(self, tags: list[Tag]) -> None:
        for tag in tags:
            if tag not in self._posted:
                self._post(tag)
        self._progress()

    def _post(self, tag: Tag) -> None:
        if tag.dst_stage != self.stage:
            raise ValueError(f"{tag} is received by stage {tag.dst_stage}, not by this process's stage {self.stage}")
        route = self._route(tag)
        code = self._tag(tag)
        buffers = {pos: self._recv_buffer(reshard.shape_of(buf), route.dtype, self._devices[pos])
                   for pos, (buf, _) in route.recv_shapes.items()}
        requests = [self.comm.Irecv(region.message(buffers[pos]), source=peer, tag=code)
                    for pos, peer, region in route.recvs]
        self._posted[tag] = (requests, buffers)

    def _recv_buffer(self, shape, dtype, device):
        """Where a message lands: device memory on the direct path to an accelerator (MPI
        writes into a fresh, unaliased JAX buffer through DLPack), else aligned host memory."""
        if self.path == "direct" and device.platform != "cpu":
            import jax.numpy as jnp

            return jnp.zeros(shape, dtype, device=device)
        return self._pool.take(shape, dtype)

    def ready(self, tag: Tag) -> bool:
        if tag not in self._posted:
            self._post(tag)
        self._progress()
        return bool(self._MPI.Request.Testall(self._posted[tag][0]))

    def recv(self, tag: Tag):
        import jax

        if tag not in self._posted:
            self._post(tag)
        requests, buffers = self._posted.pop(tag)
        # Our own queued sends only wait for local compute; start them so that no peer
        # waits on us while we wait on it.
        self._progress(block=True)
        self._MPI.Request.Waitall(requests)
        route = self._route(tag)
        sharding = self._shardings[self.stage]
        arrays = []
        for pos, device in enumerate(self._devices):
            if device.process_index != self._me_process:
                continue
            buffer, block = route.recv_shapes[pos]
            received = buffers[pos]
            if buffer != block:  # naive broadcast: the device keeps only its block
                received = received[reshard.relative(block, buffer)]
                if isinstance(received, np.ndarray):
                    received = _aligned_copy(received)
            arrays.append(received if not isinstance(received, np.ndarray) else self._adopt(received, device))
        self.stats["recvs"] += 1
        self.stats["bytes_received"] += route.nbytes_received
        return jax.make_array_from_single_device_arrays(self.shape, sharding, arrays)

    def _adopt(self, host: np.ndarray, device):
        """`host` as a JAX buffer on `device`, without a copy where the backend allows."""
        import jax

        if self.path == "staged" or device.platform != "cpu":
            array = jax.device_put(host, device, may_alias=False)
            self.stats["recv_buffers_copied"] += 1
            return array
        try:
            array = jax.dlpack.from_dlpack(host, device=device, copy=False)
        except (ValueError, RuntimeError, BufferError, TypeError):  # not the first CPU device,
            # or a dtype DLPack lacks (bfloat16): let PJRT alias the aligned buffer instead
            array = jax.device_put(host, device, may_alias=True)
        adopted = array.unsafe_buffer_pointer() == host.ctypes.data
        self.stats["recv_buffers_adopted" if adopted else "recv_buffers_copied"] += 1
        return array

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
        for route in self._routes.values():
            route.free()
        self._routes = {}

    def close(self) -> None:
        self.flush()
        for requests, _ in self._posted.values():
            for r in requests:
                r.Cancel()
                r.Wait()
        self._posted = {}
        self._free_routes()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def _host_view(array) -> np.ndarray:
    """A zero-copy numpy view of a single-device CPU jax.Array: through DLPack, or for dtypes
    DLPack does not carry (bfloat16) through the buffer's address, as same-width integers
    (MPI moves bytes; the caller keeps `array` alive while the view is in use)."""
    try:
        return np.from_dlpack(array)
    except (RuntimeError, BufferError, TypeError, ValueError):
        from mpi4py import MPI

        raw = MPI.buffer.fromaddress(array.unsafe_buffer_pointer(), array.nbytes, readonly=True)
        return np.frombuffer(raw, dtype=f"u{array.dtype.itemsize}").reshape(array.shape)


def _aligned_copy(host: np.ndarray) -> np.ndarray:
    out = aligned_empty(host.shape, host.dtype)
    np.copyto(out, host)
    return out


__all__ = ["MPITransport", "choose_path", "aligned_empty", "first_ranks"]
