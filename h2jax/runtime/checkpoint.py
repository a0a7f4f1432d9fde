"""Checkpoints by global layer: written asynchronously and atomically, read by any plan.

Layout of a checkpoint directory D:

    D/step_000006/checkpoint.json        step, data position, RNG seed, the learning-rate
                                         schedule's length, model config, the plan that wrote
                                         it, and which items hold each layer group
    D/step_000006/layers_000-003/p0.bin  one item per writing unit (the stages one process
                                         runs, or one stage spanning processes), one file
                                         per process of the unit: its groups' arrays, group
                                         after group, each array's bytes ALIGN-aligned
    D/step_000006/layers_000-003.manifest  where each array lies in p0.bin (each group's
                                         [offset, length], each array's pieces), the file's
                                         size and CRC-32C; process k of a unit records its
                                         own file in layers_000-003.p<k>.layout
    D/step_000009.pending/               a checkpoint being written: never read

A group (`embed`, `layer_000`, ..., `head`) holds one layer's parameters and its optimizer
state (the moments of that layer's parameters; `opt_shared` repeats the optimizer's scalars,
e.g. AdamW's step count), so a stage of any other plan -- other split, meshes, chip types,
schedule, process count -- reads just its own groups' bytes (one read each) and lays each
array out on the stage's mesh (ZeRO-1 moments land split over the new `data` axis).

A process that holds a whole stage (the usual case) writes whole arrays; each process of a
multi-process stage writes the shards of replica 0 on its devices, so every shard is
written once, by one process, and a reader puts the pieces back together.

Written directly, not through orbax (format 3): each array's bytes are copied from its device
buffer (on the CPU backend, a view of it) into one staging buffer, the CRC-32C computed from
it, and it goes to the disk with O_DIRECT (no page cache to copy into and write back later;
plain writes and an fsync where the file system refuses it). Through orbax (format 2, still read)
each save first packed every group into one byte array (one array per parameter had cost
~1 ms each in orbax), then tensorstore copied it again in threads of its own: about twice
the writer's CPU time, which is what saving every step costs training on a host whose cores
the step keeps busy.

Atomic: every process writes its item into `step_N.pending/`; when every process reports its
item finished, the primary process writes checkpoint.json and renames the directory to
`step_N` -- one rename, so a checkpoint is visible only when complete and a crash mid-write
leaves the previous one intact. Asynchronous: `save` returns at once, holding the stages'
arrays as they are (no copy on the training thread); a background thread copies them into
its staging buffer, which frees them for the stages' next update to overwrite in place as
usual (if the copy is not done by then, that update writes to fresh buffers instead, without
waiting), then writes the copy while training goes on; the
primary's commit runs in a thread too (the writer starts both once and keeps them). The
writer runs at a lower CPU priority than training (`lower_thread_priority`, on Linux; the
idle class in a one-process run): on cores training keeps busy, the write takes the idle
time.

Everything a resume needs is checked by `open_checkpoint` before any stage compiles: the
format, the model config, the data settings, that each needed item exists, and the size and
CRC-32C of every file of the items the process will read. Any failure is one `CheckpointError`
that names the file and the cause.
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import mmap
import os
import queue
import re
import shutil
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

import crc32c
import jax
import numpy as np

from h2jax.config import ConfigError
from h2jax.plan import Plan, plan_from_dict

# 3: each writing process's part of an item in one file of its own, written directly.
# 2: one orbax item per writing unit, a packed byte array per group (still read).
# 1: one orbax array per parameter (read no more).
FORMAT = 3
READ_FORMATS = (2, 3)
META = "checkpoint.json"
PENDING = ".pending"
DELETING = ".deleting"
MANIFEST = ".manifest"
ALIGN = 64  # each array's offset in its group's bytes: any dtype can be viewed in place
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message names the file and the cause."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def item_name(plan: Plan, stages: Iterable[int]) -> str:
    """The name of what `stages` (the stages one writing unit runs) write, after their layers."""
    stages = list(stages)
    start, end = plan.stages[min(stages)].layers[0], plan.stages[max(stages)].layers[1]
    return f"layers_{start:03d}-{end - 1:03d}"


def group_index(plan: Plan, units: Iterable[tuple[list[int], int]]) -> dict[str, list[str]]:
    """{group: [the item holding it]} when each unit (stages, processes) writes one item."""
    return {g: [item_name(plan, stages)] for stages, _ in units for i in stages for g in stage_groups(plan, i)}


# ----------------------------------------------------------------------------- state <-> groups


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unexpected pytree key {key!r}")


def _group_position(path, groups) -> int | None:
    for j, key in enumerate(path):
        if isinstance(key, jax.tree_util.DictKey) and key.key in groups:
            return j
    return None


def _set(tree: dict, keys: list[str], value) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _get(tree: Mapping, keys: list[str]):
    for k in keys:
        tree = tree[k]
    return tree


def _opt_location(path, groups) -> tuple[str | None, list[str]]:
    """Where an optimizer-state leaf lives in the group trees: (group, keys inside it), or
    (None, keys) for a leaf no parameter owns (a step count, shared by every group)."""
    j = _group_position(path, groups)
    if j is None:
        return None, ["opt_shared", "_".join(_key_name(k) for k in path) or "root"]
    prefix = "_".join(_key_name(k) for k in path[:j]) or "root"
    return path[j].key, ["opt", prefix] + [_key_name(k) for k in path[j + 1:]]


_OPT_LOCATIONS: dict = {}  # (optimizer state structure, groups) -> [_opt_location of each leaf]


def _opt_locations(treedef, groups: frozenset) -> list[tuple[str | None, list[str]]]:
    """Where each leaf of optimizer states of structure `treedef` goes (`_opt_location`), in
    leaf order. The same for every save of a stage, so worked out once: naming the paths of
    every leaf on every save took most of the training thread's part of a save
    (benchmarks/checkpoint.py on the `small` model: 1.5-1.8 ms a save before, 1.2-1.4 after)."""
    key = (treedef, groups)
    got = _OPT_LOCATIONS.get(key)
    if got is None:
        dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
        got = _OPT_LOCATIONS[key] = [
            _opt_location(path, groups) for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
    return got


def group_trees(params: Mapping[str, Any], opt_state) -> dict[str, dict]:
    """A stage's parameters and optimizer state regrouped by global group name:
    {group: {"params": ..., "opt": {<state path>: moments shaped like params}, "opt_shared": ...}}."""
    out: dict[str, dict] = {g: {"params": params[g]} for g in params}
    shared: dict[str, Any] = {}
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    for leaf, (group, keys) in zip(leaves, _opt_locations(treedef, frozenset(params))):
        if group is None:
            shared[keys[1]] = leaf
        else:
            _set(out[group], keys, leaf)
    if shared:
        for g in out:
            out[g]["opt_shared"] = dict(shared)
    return out


def opt_state_from_groups(abstract_opt_state, loaded: Mapping[str, Mapping]) -> Any:
    """The inverse of group_trees for the optimizer state: `abstract_opt_state` gives the
    structure; the leaves come from `loaded` (group trees, as restored)."""
    groups = set(loaded)
    first = next(iter(sorted(loaded)))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_opt_state)
    leaves = []
    for path, _ in flat:
        group, keys = _opt_location(path, groups)
        leaves.append(_get(loaded[first if group is None else group], keys))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- one group, one array


def _path_name(path) -> str:
    return "/".join(_key_name(k) for k in path)


def _parts(x) -> list[tuple[list[list[int]], int | None]]:
    """The parts of array `x` this process writes, as ([[start, stop] per dimension], k): the
    whole array (k None) when one device's buffer holds all of it (one device, or replicated
    on this process's devices), else its shards of replica 0, each a piece of its own, k the
    shard's index (`x.addressable_data(k)`; each shard of a multi-process stage lies on
    exactly one process as replica 0). A shard's piece is written from its device buffer (on
    the CPU backend, a view of it): assembling a sharded array first (numpy's view of a
    jax.Array) allocated a fresh array every save and copied it."""
    if not isinstance(x, jax.Array) or (x.is_fully_addressable and (len(x.devices()) == 1 or x.is_fully_replicated)):
        return [([[0, d] for d in np.shape(x)], None)]
    return [(box, k) for k, box in _replica0_shards(x.sharding, x.shape, x)]


_REPLICA0: dict = {}  # (sharding, shape) -> [(k, box)]: which shards _parts takes, by sharding


def _replica0_shards(sharding, shape, x) -> list[tuple[int, list[list[int]]]]:
    """[(k, box)] of the shards of replica 0 among this process's shards of arrays of `shape`
    laid out by `sharding`: x.addressable_data(k) is that shard. The same for every array of
    that sharding and shape, so worked out once (x.addressable_shards builds a Shard object a
    device each time: ~50 us an array)."""
    key = (sharding, tuple(shape))
    got = _REPLICA0.get(key)
    if got is None:
        got = _REPLICA0[key] = [
            (k, [[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(shard.index, shape)])
            for k, shard in enumerate(x.addressable_shards) if shard.replica_id == 0]
    return got


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


_ZEROS = np.zeros(ALIGN, np.uint8)  # alignment padding
_LAYOUTS: dict = {}  # group structure -> (entries, pieces, length): _group_layout's, by structure


def _group_layout(tree) -> tuple[list, tuple[list[dict], list[tuple[int, int | None, int]], int]]:
    """The group's leaves, and where its arrays (this process's parts of them) lie in its
    bytes: the layout entries [{path, dtype, shape, pieces: [[box, offset], ...]}] in the
    tree's leaf order (offsets from the group's first byte, each ALIGN-aligned), the pieces
    to write in that order as (leaf index, shard index or None for the whole array, bytes),
    and the group's length. The layout is the same for every save of one stage (leaf shapes,
    dtypes and shardings), so worked out once per structure: a save then only views and
    writes the buffers."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    key = (treedef, tuple((np.shape(x), np.dtype(x.dtype), getattr(x, "sharding", None)) for x in leaves))
    got = _LAYOUTS.get(key)
    if got is None:
        entries, pieces, offset = [], [], 0
        for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            boxes = []
            for box, shard in _parts(x):
                nbytes = math.prod(b - a for a, b in box) * np.dtype(x.dtype).itemsize
                boxes.append([box, offset])
                pieces.append((i, shard, nbytes))
                offset += _aligned(nbytes)
            entries.append({"path": _path_name(path), "dtype": np.dtype(x.dtype).name, "shape": list(x.shape),
                            "pieces": boxes})
        got = _LAYOUTS[key] = (entries, pieces, offset)
    return leaves, got


def write_data_file(path: Path, snapshot: Mapping[str, Any], *, copied: threading.Event | None = None
                    ) -> tuple[dict, dict, list[int]]:
    """Write this process's part of `snapshot` ({group: tree of arrays}) to the file `path`,
    group after group, each array's bytes (or each of its replica-0 shards') taken from its
    buffer (on the CPU backend a view of the device buffer), ALIGN-aligned so any dtype
    views in place; on disk when it returns. Returns ({group: layout entries}, {group: [first
    byte, length]}, [size, CRC-32C]).

    First every byte is copied into one page-aligned staging buffer (`_stage`), and `copied`
    is set: from then on the snapshot's arrays are not read again, so the stages' next
    update may overwrite them in place (`StageExecutor.share_state`). Then the checksum of
    the staged bytes, and the write: through O_DIRECT where the file system takes it
    (`_write_direct`: no page cache to copy into and write back), else plain writes and an
    fsync. Either way about half the CPU time orbax took to write the same groups packed
    (measured on the `small` model: the packing copy, tensorstore's copies and threads), the
    CPU that saving every step takes from training."""
    groups = [(g, *_group_layout(tree)) for g, tree in snapshot.items()]
    layout, spans, size = {}, {}, 0
    for g, _, (entries, _, length) in groups:
        layout[g], spans[g] = entries, [size, length]
        size += length
    staging = _stage(_file_bytes(groups), size)
    del groups  # the arrays: not read again
    try:
        if copied is not None:
            copied.set()
        data = memoryview(staging)
        crc = crc32c.crc32c(data[:size])
        if not _write_direct(path, data, size):
            _write_plain(path, data[:size])
        del data
    finally:
        with _STAGING_LOCK:
            _STAGING.append(staging)
    return layout, spans, [size, crc]


def _file_bytes(groups: list[tuple[str, list, tuple]]) -> Iterable[np.ndarray]:
    """The file's bytes in order, as uint8 arrays: each piece of each (group, leaves, layout)
    of `_group_layout`, then its alignment padding. Each piece is viewed (or copied to the
    host, off the CPU backend) only when its turn comes."""
    for g, leaves, (_, pieces, _) in groups:
        for i, shard, nbytes in pieces:
            x = leaves[i]
            data = _host_view(x if shard is None else x.addressable_data(shard)).reshape(-1).view(np.uint8)
            if data.nbytes != nbytes:  # cannot happen for arrays of the structure cached
                raise AssertionError(f"{g}: {nbytes} bytes expected, the buffer has {data.nbytes}")
            yield data
            if _aligned(nbytes) > nbytes:
                yield _ZEROS[:_aligned(nbytes) - nbytes]


# The staging buffer: one checkpoint's bytes of this process, page-aligned (an anonymous map),
# which O_DIRECT needs (buffer, length and file offset multiples of the device's block size;
# 4096 covers the usual ones). Copying into it is the write's one pass over the arrays: after
# it the stages' state is free to be overwritten, while the checksum and the disk write run
# from the copy. Kept for the next save: a process holds one checkpoint's bytes of host
# memory from its first save on (reused, never grown while the state's size stays).
DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT write
DIRECT_BLOCK = 4096
_STAGING: list = []  # free staging buffers (anonymous maps), reused save after save
_STAGING_LOCK = threading.Lock()


def _stage(data: Iterable[np.ndarray], size: int) -> mmap.mmap:
    """A staging buffer holding the `size` bytes of `data`, zero up to the next DIRECT_BLOCK.
    Every view of the arrays is dropped when it returns."""
    whole = max(DIRECT_BLOCK, -(-size // DIRECT_BLOCK) * DIRECT_BLOCK)
    with _STAGING_LOCK:
        fits = [b for b in _STAGING if len(b) >= whole]
        buffer = min(fits, key=len) if fits else None
        if buffer is not None:
            _STAGING.remove(buffer)
        elif _STAGING:  # smaller than this state: unmapped, one of the right size made instead
            _STAGING.pop()
    if buffer is None:
        buffer = mmap.mmap(-1, whole)
    staged, fill = np.frombuffer(buffer, np.uint8), 0
    try:
        for piece in data:
            staged[fill:fill + piece.size] = piece
            fill += piece.size
        piece = None  # noqa: F841  (the last view of an array)
        if fill != size:  # cannot happen for arrays of the structure cached
            raise AssertionError(f"{size} bytes expected, {fill} staged")
        staged[fill:whole] = 0
    except BaseException:
        with _STAGING_LOCK:
            _STAGING.append(buffer)
        raise
    finally:
        del staged
    return buffer


def _write_plain(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_direct(path: Path, staged: memoryview, size: int) -> bool:
    """Write the file (the first `size` of the `staged` bytes, a staging buffer's) through
    O_DIRECT; False where the platform or the file system refuses O_DIRECT (nothing usable
    written then). Whole blocks are written, the last one's padding cut off after."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:  # e.g. tmpfs: EINVAL
        return False
    whole = -(-size // DIRECT_BLOCK) * DIRECT_BLOCK
    try:
        for start in range(0, whole, DIRECT_CHUNK):
            _write_all(fd, staged[start:min(whole, start + DIRECT_CHUNK)])
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False  # a file system that opens O_DIRECT but refuses its writes: written again plainly
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])


def _host_view(x) -> np.ndarray:
    """`x` as a C-contiguous numpy array: without a copy when its values lie whole in one
    host-memory buffer (an array on one CPU device, or replicated over CPU devices: numpy
    then views the device buffer, 4 us an array, where DLPack took 15)."""
    if isinstance(x, jax.Array) and len(x.devices()) > 1 and x.is_fully_replicated:
        x = x.addressable_data(0)
    return np.ascontiguousarray(x)


def unpack_leaf(path: str, want, found: list[tuple[dict, np.ndarray]], where: str) -> np.ndarray:
    """Array `path` of a group, shaped like `want` (shape, dtype), from its layouts and packed
    bytes in every item holding a part of it (`found`): a view when one item holds it whole."""
    import jax.numpy as jnp

    shape, dtype = tuple(want.shape), jnp.dtype(want.dtype)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    pieces = []
    for layout, packed in found:
        entry = next((e for e in layout if e["path"] == path), None)
        if entry is None:
            continue
        if tuple(entry["shape"]) != shape or entry["dtype"] != dtype.name:
            raise CheckpointError(f"{where}: {path} is {entry['dtype']}{entry['shape']} there, the plan needs "
                                  f"{dtype.name}{list(shape)}")
        pieces += [(box, offset, packed) for box, offset in entry["pieces"]]
    if not pieces:
        raise CheckpointError(f"{where}: holds no {path} (an optimizer state of another structure?)")
    out, covered = None, 0
    for box, offset, packed in pieces:
        dims = tuple(b - a for a, b in box)
        n = math.prod(dims) * dtype.itemsize
        if offset + n > packed.nbytes:
            raise CheckpointError(f"{where}: {path} lies past the end of its packed bytes (truncated item?)")
        values = packed[offset:offset + n].view(dtype).reshape(dims)
        if len(pieces) == 1 and dims == shape:
            return values
        if out is None:
            out = np.empty(shape, dtype)
        out[tuple(slice(a, b) for a, b in box)] = values
        covered += math.prod(dims)
    if covered != math.prod(shape):
        raise CheckpointError(f"{where}: the parts of {path} cover {covered} of its {math.prod(shape)} elements")
    return out


# ----------------------------------------------------------------------------- file checks


# The checksum of every file of an item, by the name its manifest records it under. CRC-32C
# (hardware instructions where the CPU has them: ~2 ms for the `small` model's 18.8 MiB, where
# zlib's CRC-32 took ~10 ms of the writer's CPU a save); CRC-32 is read for the checkpoints
# written before (their manifests name no checksum).
CHECKSUM = "crc32c"
_CHECKSUMS = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}


def _checksum(path: Path, kind: str = CHECKSUM) -> int:
    # Over a memory map of the file: no copy of its bytes (half the CPU of reading it in chunks).
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return _CHECKSUMS[kind](b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _CHECKSUMS[kind](m)


def _write_json(path: Path, obj, *, indent: int | None = 1) -> None:
    """Write-then-rename, fsynced: a reader sees the old file, the new file, or none.
    (indent=None: the C encoder; with an indent json encodes in Python, which for a
    manifest's hundreds of layout entries cost several ms of the writer's CPU.)"""
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(obj, indent=indent, sort_keys=True, separators=None if indent else (",", ":"))
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({what})")
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated ({what}): {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object ({what})")
    return obj


# ----------------------------------------------------------------------------- writing


class World(Protocol):
    """The processes of one job, as the commit needs them."""

    is_primary: bool  # the one process that writes checkpoint.json and renames
    # Whether the writer may run in the idle scheduling class (lower_thread_priority): not
    # where peers of the job busy-wait on the same cores (MPI ranks).
    writer_idle_class: bool

    def units(self, plan: Plan) -> list[tuple[list[int], int]]:
        """The writing units of `plan`: (the stages a unit runs, how many processes run them)."""

    def all_done(self, local_done: bool) -> bool:
        """Collective: whether every process's writes are finished."""


class LocalWorld:
    """One process runs every stage."""

    is_primary = True
    writer_idle_class = True

    def units(self, plan: Plan) -> list[tuple[list[int], int]]:
        return [(list(range(plan.n_stages)), 1)]

    def all_done(self, local_done: bool) -> bool:
        return local_done


class TransportWorld:
    """Processes joined by a transport (MPI), one stage per group of processes: agreement
    through the transport's sum over every process, to which each brings whether its item
    is written."""

    writer_idle_class = False  # MPI's waits busy-poll: ranks sharing a host's cores would starve it

    def __init__(self, transport, executors: Mapping[int, Any], plan: Plan):
        self.transport, self.n_processes = transport, plan.n_processes
        self.is_primary = 0 in executors and all(ex.is_stage_leader for ex in executors.values())

    def units(self, plan: Plan) -> list[tuple[list[int], int]]:
        return [([i], s.processes) for i, s in enumerate(plan.stages)]

    def all_done(self, local_done: bool) -> bool:
        return self.transport.sum_across_stages({0: float(local_done)}) >= self.n_processes


def _format2_checkpointer():
    """orbax, for this process alone, to read the items of format-2 checkpoints (one packed
    byte array per group)."""
    import orbax.checkpoint as ocp

    me = jax.process_index()
    processes = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler()), (jax.Array, ocp.type_handlers.ArrayHandler()))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, type_handler_registry=registry,
                                          multiprocessing_options=processes)
    return ocp.Checkpointer(handler, multiprocessing_options=processes)


def _data_file(process: int) -> str:
    """The file of an item that process `process` of its writing unit writes."""
    return f"p{process}.bin"


def _layout_file(item: Path, process: int) -> Path:
    return item.with_name(f"{item.name}.p{process}.layout")


class _ItemWrite:
    """This process's part of one checkpoint, written by the writer's background thread
    (`_Worker`).

    The training thread only hands over the stages' arrays by group (StageExecutor.share_state:
    no copy); writing them (`write_data_file`) and the layout run off the training thread.
    `copied` is set once the write has copied every byte of them: the stages' next update
    may overwrite them from then on (a failed write never sets it; that update then keeps
    them, as it does when the copy has not finished by then).

    Each process of a writing unit writes its own file of the item (`p<k>.bin`, k its index
    among the unit's processes: one stage spanning processes writes one item, each process
    the shards of replica 0 on its devices) and records where each array lies in it, with the
    file's size and CRC-32C: process 0 in the item's manifest, process k in
    `<item>.p<k>.layout`. No process waits for another: the commit does."""

    def __init__(self, pending: Path, name: str, snapshot: dict, copied: threading.Event):
        self.path, self.snapshot, self.copied = pending / name, snapshot, copied
        self.error: BaseException | None = None
        self.seconds: float | None = None  # how long the write took, once done
        self.cpu_seconds: float | None = None  # the CPU time of this thread's part of it
        self.done = threading.Event()

    def write(self) -> None:
        """Run in the writer's thread; sets `done` (and `error`, on failure) when finished."""
        start = time.perf_counter()
        cpu_start = time.thread_time()
        snapshot, self.snapshot = self.snapshot, None  # the stages' old state goes as soon as it is written
        try:
            me = jax.process_index()
            self.path.mkdir(parents=True, exist_ok=True)
            layout, spans, size_crc = write_data_file(self.path / _data_file(me), snapshot, copied=self.copied)
            del snapshot
            record = {"groups": layout, "spans": spans, "files": {_data_file(me): size_crc}}
            if me == 0:
                _write_json(self.path.with_name(self.path.name + MANIFEST),
                            {"processes": jax.process_count(), "checksum": CHECKSUM, **record}, indent=None)
            else:
                _write_json(_layout_file(self.path, me), record, indent=None)
        except BaseException as e:  # surfaced in the training thread by CheckpointWriter
            self.error = e
        finally:
            self.seconds = time.perf_counter() - start
            self.cpu_seconds = time.thread_time() - cpu_start
            self.done.set()

    def wait(self) -> None:
        """Until written (or failed)."""
        self.done.wait()


class _Worker:
    """A background thread that runs the jobs it is given, one after another: a
    CheckpointWriter's writes in one (its priority lowered, `lower_thread_priority`), its
    commits in another. Started once and kept, so a save or a commit hands its work over
    without starting a thread: `Thread.start` waits until the new thread has taken the
    interpreter lock, which cost the training thread about half a millisecond a save.

    A daemon; with `finish_at_exit` an exiting interpreter first runs the jobs already given
    (a commit: its checkpoint is written and agreed, and nothing written is lost). A write
    is not finished: a process that dies mid-write leaves a pending directory, never a
    checkpoint."""

    def __init__(self, name: str, *, lower: bool = False, idle_class: bool = False, finish_at_exit: bool = False):
        self.lower, self.idle_class = lower, idle_class
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._at_exit = finish_at_exit
        if finish_at_exit:
            atexit.register(self.stop)

    def _run(self) -> None:
        if self.lower:
            lower_thread_priority(threading.get_native_id(), idle_class=self.idle_class)
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """After the jobs given so far; returns once the thread has ended."""
        if self._at_exit:
            atexit.unregister(self.stop)
            self._at_exit = False
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


# How much lower than training the checkpoint writer runs (Linux niceness, added to the
# process's): the write takes the CPU training leaves idle and yields it back when training
# wants it, instead of taking an equal share of the cores XLA's step runs on.
BACKGROUND_NICENESS = 10


def lower_thread_priority(tid: int, *, idle_class: bool = False) -> None:
    """Thread `tid` of this process at BACKGROUND_NICENESS below the process, and with
    `idle_class` in Linux's SCHED_IDLE class: it runs only on a core no other thread wants
    (niceness +10 still takes about a tenth of a core training wants; XLA's parallel loops
    wait for their slowest thread, so that tenth costs the step more than its CPU time:
    saving every step on the `small` model, measured side by side, +15% with niceness alone,
    +10% with SCHED_IDLE). Not where peers busy-wait on the same cores (MPI ranks of one
    host): behind them an idle-class writer could wait indefinitely. Lowering is one-way for
    an unprivileged process. On Linux priority is per thread; where not available or not
    permitted, nothing changes."""
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + BACKGROUND_NICENESS)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        if idle_class and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, ended meanwhile, or not permitted
        pass


class CheckpointWriter:
    """Saves the stages this process runs into `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, *, keep: int | None = None, world: World | None = None):
        if keep is not None and keep < 1:
            raise CheckpointError(f"--keep must be >= 1, got {keep}")
        self.directory = Path(directory).absolute()
        self.keep, self.world = keep, world or LocalWorld()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory (checkpoint directory expected)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: tuple[int, dict, list[_ItemWrite]] | None = None
        # The primary's commit of an agreed checkpoint (checkpoint.json, rename, fsyncs,
        # pruning: ~10 ms of file-system waits) runs here, off the training thread.
        self._committing: threading.Event | None = None  # set when the commit in flight is done
        self._commit_error: tuple[Path, BaseException] | None = None
        self._writer: _Worker | None = None  # the write thread, from the first save on
        self._committer: _Worker | None = None  # the commit thread, from the first commit on
        self.last_committed: Path | None = None
        if self.world.is_primary:
            # Left by a crash: never complete, never read. (Other processes start writing only
            # after the first training step, whose collectives order them after this.)
            for p in self.directory.iterdir():
                if p.name.endswith(PENDING) or p.name.endswith(DELETING):
                    shutil.rmtree(p, ignore_errors=True)

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending[0]

    def save(self, step: int, executors: Mapping[int, Any], meta: dict) -> None:
        """Start writing checkpoint `step` of `executors`' state (returns once the previous
        checkpoint is written and the stages' arrays are handed to the writer). `meta` (see
        checkpoint_meta) is written by the primary."""
        self.settle()  # one checkpoint in flight at a time
        if not executors:
            raise ValueError("nothing to save: no stages")
        plan = next(iter(executors.values())).plan
        mine = sorted(executors)
        units = self.world.units(plan)
        unit = next((u for u in units if u[0] == mine), None)
        if unit is None:
            raise ValueError(f"this process runs stages {mine}, not one of the writing units "
                             f"{[u[0] for u in units]} of its world")
        meta = {**meta, "groups": group_index(plan, units)}
        pending = self.directory / (step_dir(self.directory, step).name + PENDING)
        pending.mkdir(parents=True, exist_ok=True)  # from now on a crash leaves it, never a checkpoint
        # The stages' own arrays, which their next update leaves in place until the writer
        # has copied them (share_state): no copy here. (Packing each group on the devices
        # instead cost the CPU backend twice the host packing's time: XLA's byte-wise
        # concatenation and the gather of its pieces.) Regrouped here, not in the writer:
        # Python work in a low-priority thread holds the interpreter lock the training thread
        # waits for while that thread waits for a core.
        snapshot: dict = {}
        copied = threading.Event()
        for i in mine:  # every layer chunk of an interleaved stage
            for ex in getattr(executors[i], "chunks", None) or [executors[i]]:
                snapshot.update(group_trees(*ex.share_state(until=copied)))
        write = _ItemWrite(pending, item_name(plan, mine), snapshot, copied)
        if self._writer is None:
            self._writer = _Worker("h2jax-ckpt-write", lower=True, idle_class=self.world.writer_idle_class)
        self._pending = (step, meta, [write])
        self._writer.submit(write.write)

    def _local_done(self) -> bool:
        step, _, writes = self._pending
        for w in writes:
            if w.done.is_set() and w.error is not None:
                w.wait()
                raise CheckpointError(
                    f"writing checkpoint step {step} to {w.path} failed: {w.error!r}"
                ) from w.error
        return all(w.done.is_set() for w in writes)

    def poll(self) -> Path | None:
        """Start committing the checkpoint in flight if every process has finished writing it
        (never waits: the primary commits in a background thread, which the next `save` or
        `wait` joins). Call it on every process at the same points (after each step)."""
        if self._pending is None:
            return None
        if self.world.all_done(self._local_done()):
            return self._commit(background=True)
        return None

    def wait(self) -> Path | None:
        """Block until the checkpoint in flight is written and committed; its path (None if
        none was in flight)."""
        path = self.settle(background=False)
        self._join_commit()
        return path

    def settle(self, *, background: bool = True) -> Path | None:
        """Wait until the checkpoint in flight is written by every process, then commit it
        (with `background`, in the commit thread: returns before it is renamed); its path, or
        None if none was in flight. Every process calls it at the same point."""
        if self._pending is None:
            return None
        for w in self._pending[2]:
            w.wait()
        self.world.all_done(self._local_done())  # every process reaches this point
        return self._commit(background)

    def _commit(self, background: bool) -> Path:
        self._join_commit()  # the previous checkpoint's commit comes first
        step, meta, writes = self._pending
        self._pending = None
        final = step_dir(self.directory, step)
        if not self.world.is_primary:
            self.last_committed = final
        elif background:
            # An interpreter that exits meanwhile finishes the commit first (finish_at_exit).
            if self._committer is None:
                self._committer = _Worker("h2jax-ckpt-commit", finish_at_exit=True)
            done = self._committing = threading.Event()

            def commit() -> None:
                try:
                    self._commit_files(final, meta, in_thread=True)
                finally:
                    done.set()

            self._committer.submit(commit)
        else:
            self._commit_files(final, meta)
        return final

    def _commit_files(self, final: Path, meta: dict, in_thread: bool = False) -> None:
        try:
            pending = final.with_name(final.name + PENDING)
            _write_json(pending / META, meta)
            if final.exists():  # an older run's checkpoint of the same step number
                _remove(final)
            os.rename(pending, final)  # the commit: atomic on POSIX file systems
            _fsync_dir(self.directory)
            self._prune()
            self.last_committed = final
        except BaseException as e:
            if not in_thread:
                raise
            self._commit_error = (final, e)  # raised by _join_commit, in the training thread

    def _join_commit(self) -> None:
        if self._committing is not None:
            self._committing.wait()
            self._committing = None
        if self._commit_error is not None:
            final, e = self._commit_error
            self._commit_error = None
            raise CheckpointError(f"committing checkpoint {final} failed: {e!r}") from e

    def _prune(self) -> None:
        if self.keep is None:
            return
        for step in complete_steps(self.directory)[: -self.keep]:
            _remove(step_dir(self.directory, step))

    def close(self) -> Path | None:
        """`wait`, then end the writer's threads."""
        try:
            return self.wait()
        finally:
            for worker in (self._writer, self._committer):
                if worker is not None:
                    worker.stop()
            self._writer = self._committer = None


def _remove(path: Path) -> None:
    # Renamed first: a crash mid-delete never leaves a half-deleted step_N behind.
    doomed = path.with_name(path.name + DELETING)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_meta(plan: Plan, step: int, *, data_path: str | None = None) -> dict:
    """What checkpoint.json records besides the arrays."""
    return {
        "format": FORMAT,
        "step": step,
        # Batch n is a pure function of (seed, n) (h2jax.data): the next batch to train on
        # and the seed are the whole data position and RNG state.
        "data": {"position": step, "seed": plan.seed, "path": data_path,
                 "seq_len": plan.seq_len, "global_batch": plan.global_batch},
        "rng": {"seed": plan.seed},
        # The learning-rate schedule's length (warm-up included; None: no schedule): a resumed
        # run continues the same curve unless told another length (resumed_plan).
        "lr_schedule_steps": plan.train.decay_steps,
        "model": plan.model.to_dict(),
        "plan": plan.to_dict(),
        # "groups" ({group: [items]}) is added by CheckpointWriter.save, which knows the items
    }


def stage_groups(plan: Plan, stage: int) -> list[str]:
    """The global group names stage `stage` of `plan` holds, as its parameter tree keys."""
    from h2jax.model import layer_name

    ranges = plan.stages[stage].layer_ranges  # every layer chunk under interleaved 1F1B
    out = ["embed"] if ranges[0][0] == 0 and stage == 0 else []
    out += [layer_name(i) for start, end in ranges for i in range(start, end)]
    if ranges[-1][1] == plan.model.n_layers and stage == plan.n_stages - 1:
        out.append("head")
    return out


# ----------------------------------------------------------------------------- reading


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the committed checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for p in directory.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass
class Checkpoint:
    """A committed checkpoint, checked against the plan that will resume it."""

    path: Path
    meta: dict
    # item -> {"files": {file: [size, checksum]}, "checksum": its kind, "layouts": [each writing process's {group: layout}]},
    # for the items read
    manifests: dict[str, dict]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def plan(self) -> Plan:
        """The plan that wrote it."""
        return plan_from_dict(self.meta["plan"])

    def restore(self, executor) -> None:
        """Load `executor`'s groups onto its shardings: its parameters and optimizer state
        (each chunk's, for an interleaved stage)."""
        self.restore_all([executor])

    def restore_all(self, executors: Iterable[Any]) -> None:
        """Load every executor's groups (each chunk's, for an interleaved stage): each group's
        bytes read once from each file holding a part of it, the arrays viewed in them, then
        one transfer onto the stages' shardings."""
        stages = [c for ex in executors for c in (getattr(ex, "chunks", None) or [ex])]
        wanted = [group_trees(*ex._abstract_state[:2]) for ex in stages]
        found = self._read({g for groups in wanted for g in groups})
        hosts, targets = [], []
        for groups in wanted:
            for g, tree in groups.items():
                where = str(self.path / (self.meta["groups"][g][0] + MANIFEST))
                for path, want in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    hosts.append(unpack_leaf(_path_name(path), want, found[g], where))
                    targets.append(want)
        if all(t.sharding.is_fully_addressable for t in targets):
            arrays = iter(jax.device_put(hosts, [t.sharding for t in targets]))
        else:  # a stage spanning processes: each builds its own shards
            arrays = iter([jax.make_array_from_callback(t.shape, t.sharding, lambda i, h=h: h[i])
                           for h, t in zip(hosts, targets)])
        for ex, groups in zip(stages, wanted):
            loaded = {g: jax.tree.unflatten(jax.tree.structure(tree), [next(arrays) for _ in jax.tree.leaves(tree)])
                      for g, tree in groups.items()}
            abstract_params, abstract_opt, _ = ex._abstract_state
            ex.params = {g: loaded[g]["params"] for g in abstract_params}
            ex.opt_state = opt_state_from_groups(abstract_opt, loaded)

    def _read(self, groups: set[str]) -> dict[str, list[tuple[list[dict], np.ndarray]]]:
        """{group: [(layout, bytes) of each writing process's part of it]}."""
        by_item: dict[str, list[str]] = {}
        for g in sorted(groups):
            by_item.setdefault(self.meta["groups"][g][0], []).append(g)
        if self.meta["format"] == 2:
            return self._read_format2(by_item)
        out: dict[str, list] = {g: [] for g in groups}
        for item, names in sorted(by_item.items()):
            manifest = self.manifests[item]
            for k, (layout, spans) in enumerate(zip(manifest["layouts"], manifest["spans"])):
                mine = sorted((spans[g][0], spans[g][1], g) for g in names if g in layout)
                if not mine:
                    continue
                path = self.path / item / _data_file(k)
                try:
                    with open(path, "rb", buffering=0) as f:
                        for offset, length, g in mine:
                            data = np.empty(length, np.uint8)
                            f.seek(offset)
                            if f.readinto(data) != length:
                                raise CheckpointError(f"{path}: ends before {g}'s bytes do (truncated?)")
                            out[g].append((layout[g], data))
                except OSError as e:
                    raise CheckpointError(f"{path}: cannot be read: {e}") from None
        return out

    def _read_format2(self, by_item: dict[str, list[str]]) -> dict[str, list[tuple[list[dict], np.ndarray]]]:
        """The same from a format-2 checkpoint: one orbax item per writing unit, each group a
        [processes, row] byte array whose row k process k packed."""
        import orbax.checkpoint as ocp

        out = {}
        checkpointer = _format2_checkpointer()
        try:
            for item, names in sorted(by_item.items()):
                path = self.path.absolute() / item
                tree = {g: np.zeros(0, np.uint8) for g in names}
                try:
                    packed = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                        item=tree, restore_args={g: ocp.RestoreArgs(restore_type=np.ndarray) for g in names},
                        partial_restore=True))
                except Exception as e:  # noqa: BLE001 -- one clear error for any storage failure
                    raise CheckpointError(f"{path}: cannot be read: {type(e).__name__}: {e}") from e
                for g in names:
                    rows = packed[g].reshape(-1, packed[g].shape[-1])  # one per writing process
                    out[g] = [(layout[g], rows[k]) for k, layout in enumerate(self.manifests[item]["layouts"])
                              if g in layout]
        finally:
            checkpointer.close()
        return out


def read_checkpoint(directory: str | Path, step: int | None = None) -> tuple[Path, dict]:
    """(path, metadata) of the newest (or the given `step`) committed checkpoint in
    `directory`, its metadata checked for shape; CheckpointError if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    steps = complete_steps(directory)
    if not steps:
        pending = sorted(p.name for p in directory.iterdir() if p.name.endswith(PENDING))
        cause = (f"only unfinished writes ({', '.join(pending)}): no save completed"
                 if pending else "no step_NNNNNN/ checkpoints in it")
        raise CheckpointError(f"{directory}: not an h2jax checkpoint directory ({cause})")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(
            f"{step_dir(directory, step)}: no checkpoint of step {step}; this directory holds steps "
            f"{', '.join(map(str, steps))}"
        )
    path = step_dir(directory, step)
    meta = _read_json(path / META, "the checkpoint's metadata")
    where = path / META
    if meta.get("format") not in READ_FORMATS:
        raise CheckpointError(f"{where}: checkpoint format {meta.get('format')!r}, this h2jax reads "
                              f"{' and '.join(map(str, READ_FORMATS))}")
    for key in ("step", "model", "plan", "groups", "data"):
        if key not in meta:
            raise CheckpointError(f"{where}: field {key!r} missing")
    if meta["step"] != step:
        raise CheckpointError(f"{where}: records step {meta['step']} but lies in the directory of step {step}")
    try:
        plan_from_dict(meta["plan"])
    except ConfigError as e:
        raise CheckpointError(f"{where}: the plan it records is invalid: {e}") from None
    return path, meta


def open_checkpoint(
    directory: str | Path, plan: Plan, *, step: int | None = None, stages: Iterable[int] | None = None,
    verify: bool = True,
) -> Checkpoint:
    """The newest (or the given `step`) committed checkpoint in `directory`, checked for
    resuming `plan`'s `stages` (default all): raises CheckpointError on anything wrong,
    before the caller compiles anything."""
    path, meta = read_checkpoint(directory, step)
    _check_meta(path / META, meta, plan)
    stages = range(plan.n_stages) if stages is None else stages
    needed = [g for i in stages for g in stage_groups(plan, i)]
    items = sorted({item for g in needed for item in meta["groups"][g]})
    manifests = {}
    for item in items:
        if not (path / item).is_dir():
            holds = sorted(g for g, its in meta["groups"].items() if item in its)
            raise CheckpointError(f"{path / item}: missing (it holds {', '.join(holds)})")
        manifests[item] = _read_manifest(path / item, meta["format"])
    absent = sorted(g for g in set(needed) if not any(g in layout for layout in manifests[meta["groups"][g][0]]["layouts"]))
    if absent:
        where = ", ".join(str(path / (item + MANIFEST)) for item in sorted({meta["groups"][g][0] for g in absent}))
        raise CheckpointError(f"{where}: holds no {', '.join(absent)}, which {path / META} places there")
    if verify:
        for item in items:
            _verify_item(path / item, manifests[item]["files"], manifests[item]["checksum"])
    return Checkpoint(path, meta, manifests)


def resumed_plan(plan: Plan, directory: str | Path, step: int | None = None) -> Plan:
    """`plan` to resume the checkpoint in `directory` (the newest, or `step`) with: when the
    plan does not fix its learning-rate schedule's length (train.decay_steps), the length the
    checkpoint's run had, so the resumed run continues the same curve rather than starting a
    schedule as long as its own --steps."""
    import dataclasses

    if plan.train.decay_steps is not None or (plan.train.lr_schedule == "constant" and plan.train.warmup_steps == 0):
        return plan
    _, meta = read_checkpoint(directory, step)
    length = meta.get("lr_schedule_steps")
    if length is None:
        return plan
    return dataclasses.replace(plan, train=dataclasses.replace(plan.train, decay_steps=int(length)))


def _read_manifest(item: Path, version: int) -> dict:
    """An item's file sums, and the layout (and, from format 3, the groups' spans in its
    file) each writing process recorded; `version`: the checkpoint's format."""
    manifest_file = item.with_name(item.name + MANIFEST)
    manifest = _read_json(manifest_file, f"the layout and checksums of {item.name}")
    processes = manifest.get("processes")
    if not isinstance(manifest.get("groups"), dict) or not isinstance(manifest.get("files"), dict) \
            or not isinstance(processes, int) or processes < 1:
        raise CheckpointError(f"{manifest_file}: fields 'processes', 'groups' and 'files' expected")
    checksum = manifest.get("checksum", "crc32")  # written before CRC-32C: CRC-32
    if checksum not in _CHECKSUMS:
        raise CheckpointError(f"{manifest_file}: checksum {checksum!r} unknown (one of {sorted(_CHECKSUMS)}): "
                              f"written by a newer h2jax?")
    records = [(manifest_file, manifest)]
    for k in range(1, processes):
        layout_file = _layout_file(item, k)
        layout = _read_json(layout_file, f"the layout process {k} of {item.name}'s stage wrote")
        if not isinstance(layout.get("groups"), dict):
            raise CheckpointError(f"{layout_file}: field 'groups' expected")
        records.append((layout_file, layout))
    files, spans = {}, []
    for where, record in records:
        files.update(record.get("files", {}))  # format 2: the manifest's alone, of the whole item
        if version >= 3:  # each process's groups in a file of its own
            if not isinstance(record.get("spans"), dict) or set(record["spans"]) != set(record["groups"]):
                raise CheckpointError(f"{where}: field 'spans' expected, one [offset, length] per group")
            spans.append(record["spans"])
    return {"files": files, "checksum": checksum, "layouts": [r["groups"] for _, r in records], "spans": spans}


def _check_meta(where: Path, meta: dict, plan: Plan) -> None:
    """Whether `plan` can resume the checkpoint `meta` describes."""
    have = plan.model.to_dict()
    if meta["model"] != have:
        diff = {k: (meta["model"].get(k), v) for k, v in have.items() if meta["model"].get(k) != v}
        raise CheckpointError(
            f"{where}: written for another model config ({'; '.join(f'{k}: checkpoint {a!r}, plan {b!r}' for k, (a, b) in diff.items())}); "
            "resume it with a plan of the same model"
        )
    data = meta["data"]
    for field, value in (("seq_len", plan.seq_len), ("global_batch", plan.global_batch), ("seed", plan.seed)):
        if data.get(field) != value:
            raise CheckpointError(
                f"{where}: data {field} is {data.get(field)!r} in the checkpoint but {value!r} in the plan; "
                f"set plan.{field} to {data.get(field)!r} (h2jax replan keeps it) so the run continues "
                "on the same batches"
            )
    written = meta["plan"].get("optimizer", {}).get("name")
    if written != plan.optimizer.name:
        raise CheckpointError(
            f"{where}: optimizer state of {written!r}, but the plan uses {plan.optimizer.name!r}; "
            "use the same optimizer to resume"
        )
    missing = [g for i in range(plan.n_stages) for g in stage_groups(plan, i) if g not in meta["groups"]]
    if missing:
        raise CheckpointError(f"{where}: holds no {', '.join(missing)}")


def _verify_item(item_dir: Path, sums: dict[str, list[int]], checksum: str = CHECKSUM) -> None:
    """Size and checksum of every file of an item, against those recorded when it was written."""
    for rel, (size, crc) in sorted(sums.items()):
        p = item_dir / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: missing")
        actual = p.stat().st_size
        if actual != size:
            raise CheckpointError(f"{p}: truncated or overwritten: {actual} bytes, {size} when written")
        if _checksum(p, checksum) != crc:
            raise CheckpointError(f"{p}: corrupted: its {checksum.upper()} differs from the one recorded when written")


# ----------------------------------------------------------------------------- a training run's checkpoints


class RunCheckpoints:
    """The checkpoints of one training run (`h2jax run --checkpoint-dir D --save-every N
    --keep K`): `after_step(step)` on every process after every step starts an asynchronous
    save every `save_every` steps and otherwise commits the one in flight once written;
    `finish(step)` saves `step` unless it is already saved, waits for the commit and ends the
    writer's threads."""

    def __init__(self, trainer, directory, *, save_every: int | None = None, keep: int | None = None,
                 dataset=None):
        if save_every is not None and save_every < 1:
            raise CheckpointError(f"--save-every must be >= 1, got {save_every}")
        plan = trainer.plan
        world = (LocalWorld() if getattr(trainer, "role", None) is None
                 else TransportWorld(trainer.transport, trainer.executors, plan))
        self.trainer, self.save_every, self.dataset = trainer, save_every, dataset
        self.writer = CheckpointWriter(directory, keep=keep, world=world)
        self.saved_step: int | None = None

    def meta(self, step: int) -> dict:
        where = getattr(self.dataset, "directory", getattr(self.dataset, "path", None))
        meta = checkpoint_meta(self.trainer.plan, step, data_path=None if where is None else str(where))
        meta["data"]["tokenizer_sha256"] = getattr(self.dataset, "tokenizer_sha256", None)
        return meta

    def save(self, step: int) -> None:
        self.writer.save(step, self.trainer.executors, self.meta(step))
        self.saved_step = step

    def after_step(self, step: int) -> None:
        if self.save_every and step % self.save_every == 0:
            self.save(step)
        else:
            self.writer.poll()

    def finish(self, step: int) -> Path:
        if self.saved_step != step:
            self.save(step)
        path = self.writer.close()  # its threads end; a later save starts them again
        return path if path is not None else step_dir(self.writer.directory, step)
