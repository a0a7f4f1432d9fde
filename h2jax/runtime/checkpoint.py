"""Checkpoints by global layer: written asynchronously and atomically, read by any plan.

Layout of a checkpoint directory D:

    D/step_000006/checkpoint.json       step, data position, RNG seed, model config, the plan
                                        that wrote it, and which item holds each layer group
    D/step_000006/layers_000-003/       one orbax PyTree item per writing process (under MPI: per
    D/step_000006/layers_000-003.sums   stage); its top-level keys are global group names
                                        (`embed`, `layer_000`, ..., `head`), each {params, opt,
                                        opt_shared}; .sums: each file's size and CRC-32
    D/step_000009.pending/              a checkpoint being written: never read

A group holds one layer's parameters and its optimizer state (the moments of that layer's
parameters; `opt_shared` repeats the optimizer's scalars, e.g. AdamW's step count), so a stage
of any other plan -- other split, meshes, chip types, schedule, process count -- reads just
its own groups and orbax lays each array out on the stage's mesh (`restore` passes the
stage's target shardings; ZeRO-1 moments land split over the new `data` axis).

Atomic: every process writes its item into `step_N.pending/` (orbax: each process
writes only its own shards, once per shard); when every stage reports its item finished, the
primary process writes checkpoint.json and renames the directory to `step_N` -- one rename, so
a checkpoint is visible only when complete and a crash mid-write leaves the previous one
intact. Asynchronous: `save` returns once the state is copied on its devices (one compiled
program: the next update donates the live buffers); orbax copies it to the host and writes the
files in a background thread while training goes on.

Everything a resume needs is checked by `open_checkpoint` before any stage compiles: the
format, the model config, the data settings, that each needed item exists, and the size and
CRC-32 of every file of the items the process will read. Any failure is one `CheckpointError` that names
the file and the cause.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import jax

from h2jax.config import ConfigError
from h2jax.plan import Plan, plan_from_dict

FORMAT = 1
META = "checkpoint.json"
PENDING = ".pending"
DELETING = ".deleting"
SUMS = ".sums"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message names the file and the cause."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def item_name(plan: Plan, stages: Iterable[int]) -> str:
    """Directory of the item holding `stages` (the stages one process writes), named for
    their layers."""
    stages = list(stages)
    start, end = plan.stages[min(stages)].layers[0], plan.stages[max(stages)].layers[1]
    return f"layers_{start:03d}-{end - 1:03d}"


def group_index(plan: Plan, stage_sets: Iterable[Iterable[int]]) -> dict[str, str]:
    """{group: item that holds it} when each of `stage_sets` is written as one item."""
    return {g: item_name(plan, stages) for stages in stage_sets for i in stages for g in stage_groups(plan, i)}


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


def group_trees(params: Mapping[str, Any], opt_state) -> dict[str, dict]:
    """A stage's parameters and optimizer state regrouped by global group name:
    {group: {"params": ..., "opt": {<state path>: moments shaped like params}, "opt_shared": ...}}."""
    groups = set(params)
    out: dict[str, dict] = {g: {"params": params[g]} for g in params}
    shared: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        group, keys = _opt_location(path, groups)
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


# ----------------------------------------------------------------------------- file checks


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_sums(item_dir: Path) -> dict[str, list[int]]:
    """{path relative to the item: [size, crc32]} for every file of an orbax item."""
    out = {}
    for root, _, files in os.walk(item_dir):
        for f in files:
            p = Path(root) / f
            out[str(p.relative_to(item_dir))] = [p.stat().st_size, _crc32(p)]
    return out


def _write_json(path: Path, obj) -> None:
    """Write-then-rename, fsynced: a reader sees the old file, the new file, or none."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
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

    def stage_sets(self, plan: Plan) -> list[list[int]]:
        """The stages of `plan` each process (or multi-process stage) writes as one item."""

    def all_done(self, local_done: bool) -> bool:
        """Collective: whether every process's writes are finished."""


class LocalWorld:
    """One process runs every stage."""

    is_primary = True

    def stage_sets(self, plan: Plan) -> list[list[int]]:
        return [list(range(plan.n_stages))]

    def all_done(self, local_done: bool) -> bool:
        return local_done


class TransportWorld:
    """Processes joined by a transport (MPI): agreement through its cross-stage sum, to which
    each stage's leader brings whether its item is written."""

    def __init__(self, transport, executors: Mapping[int, Any], n_stages: int):
        self.transport, self.n_stages = transport, n_stages
        self.led = [i for i, ex in executors.items() if ex.is_stage_leader]
        self.is_primary = 0 in self.led

    def stage_sets(self, plan: Plan) -> list[list[int]]:
        return [[i] for i in range(plan.n_stages)]  # one stage per process group

    def all_done(self, local_done: bool) -> bool:
        done = self.transport.sum_across_stages({i: float(local_done) for i in self.led})
        return done >= self.n_stages


def _processes():
    """orbax's options naming every process of this JAX world: its barriers then go through
    the jax.distributed client. By default it would run them as JAX collectives over the
    devices, which from the writing thread could interleave with the training step's own
    collectives (gloo on CPU refuses the mismatch)."""
    import orbax.checkpoint as ocp

    return ocp.options.MultiprocessingOptions(active_processes=set(range(jax.process_count())))


def _handler():
    import orbax.checkpoint as ocp

    # OCDBT: the arrays of an item go into a few large files (one zarr directory per array
    # made ~40x more files and was slower to write and read); each array is still its own
    # key, so a stage reads only its groups. No compression: parameters do not compress.
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False,
                                       multiprocessing_options=_processes())


class _ItemWrite:
    """This process's item of one checkpoint, written by orbax in a background thread.

    The training thread only snapshots the state (a device-side copy: the next update
    donates the live buffers); orbax's own blocking part -- per-array metadata, the copy to
    the host -- and the file writes all run off the training thread."""

    def __init__(self, pending: Path, name: str, snapshot: dict, leader: bool):
        self.path, self.leader = pending / name, leader
        self.error: BaseException | None = None
        self.done = threading.Event()
        # One orbax save at a time per process: its operation ids are process-global.
        threading.Thread(target=self._write, args=(snapshot,), name=f"h2jax-ckpt-{name}", daemon=True).start()

    def _write(self, tree: dict) -> None:
        try:
            import orbax.checkpoint as ocp

            checkpointer = ocp.AsyncCheckpointer(_handler(), multiprocessing_options=_processes())
            try:
                checkpointer.save(self.path, args=ocp.args.PyTreeSave(tree), force=True)
                checkpointer.wait_until_finished()
            finally:
                checkpointer.close()
            if self.leader:
                _write_json(self.path.with_name(self.path.name + SUMS), file_sums(self.path))
        except BaseException as e:  # surfaced in the training thread by CheckpointWriter
            self.error = e
        finally:
            self.done.set()


_SNAPSHOT: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # executor -> compiled copy


class CheckpointWriter:
    """Saves the stages this process runs into `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, *, keep: int | None = None, world: World | None = None):
        if keep is not None and keep < 1:
            raise CheckpointError(f"--keep must be >= 1, got {keep}")
        self.directory = Path(directory).absolute()  # orbax wants absolute paths
        self.keep, self.world = keep, world or LocalWorld()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory (checkpoint directory expected)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: tuple[int, dict, list[_ItemWrite]] | None = None
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
        """Start writing checkpoint `step` of `executors`' state (returns once it is
        snapshotted on the devices). `meta` (see checkpoint_meta) is written by the primary."""
        self.wait()  # one checkpoint in flight at a time
        if not executors:
            raise ValueError("nothing to save: no stages")
        plan = next(iter(executors.values())).plan
        mine = sorted(executors)
        if mine not in self.world.stage_sets(plan):
            raise ValueError(f"this process runs stages {mine}, not one of the writing units "
                             f"{self.world.stage_sets(plan)} of its world")
        meta = {**meta, "groups": group_index(plan, self.world.stage_sets(plan))}
        pending = self.directory / (step_dir(self.directory, step).name + PENDING)
        pending.mkdir(parents=True, exist_ok=True)
        snapshot: dict = {}
        for i in mine:  # every layer chunk of an interleaved stage
            for ex in getattr(executors[i], "chunks", None) or [executors[i]]:
                snapshot.update(self._snapshot(ex))
        leader = all(ex.is_stage_leader for ex in executors.values())
        self._pending = (step, meta, [_ItemWrite(pending, item_name(plan, mine), snapshot, leader)])

    def _snapshot(self, ex) -> dict:
        """A copy of the stage's state on its devices, in one compiled program (the next
        update donates the live buffers)."""
        if ex not in _SNAPSHOT:
            shardings = group_trees(ex.param_sharding, ex.opt_sharding)
            _SNAPSHOT[ex] = jax.jit(lambda t: jax.tree.map(lambda x: x.copy(), t), out_shardings=shardings)
        return _SNAPSHOT[ex](group_trees(ex.params, ex.opt_state))

    def _local_done(self) -> bool:
        step, _, writes = self._pending
        for w in writes:
            if w.done.is_set() and w.error is not None:
                raise CheckpointError(
                    f"writing checkpoint step {step} to {w.path} failed: {w.error!r}"
                ) from w.error
        return all(w.done.is_set() for w in writes)

    def poll(self) -> Path | None:
        """Commit the checkpoint in flight if every process has finished writing it (never
        waits). Call it on every process at the same points (after each step)."""
        if self._pending is None:
            return None
        if self.world.all_done(self._local_done()):
            return self._commit()
        return None

    def wait(self) -> Path | None:
        """Block until the checkpoint in flight is written and committed; its path."""
        if self._pending is None:
            return None
        for w in self._pending[2]:
            w.done.wait()
        self.world.all_done(self._local_done())  # every process reaches this point
        return self._commit()

    def _commit(self) -> Path:
        step, meta, writes = self._pending
        self._pending = None
        final = step_dir(self.directory, step)
        if self.world.is_primary:
            pending = final.with_name(final.name + PENDING)
            _write_json(pending / META, meta)
            if final.exists():  # an older run's checkpoint of the same step number
                _remove(final)
            os.rename(pending, final)  # the commit: atomic on POSIX file systems
            _fsync_dir(self.directory)
            self._prune()
        self.last_committed = final
        return final

    def _prune(self) -> None:
        if self.keep is None:
            return
        for step in complete_steps(self.directory)[: -self.keep]:
            _remove(step_dir(self.directory, step))

    def close(self) -> Path | None:
        return self.wait()


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
        "model": plan.model.to_dict(),
        "plan": plan.to_dict(),
        # "groups" ({group: item}) is added by CheckpointWriter.save, which knows the items
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
    sums: dict[str, dict[str, list[int]]]  # item -> file -> [size, crc32], for the items read

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
        import orbax.checkpoint as ocp

        for chunk in getattr(executor, "chunks", None) or []:
            self.restore(chunk)
        if getattr(executor, "chunks", None):
            return

        abstract_params, abstract_opt, _ = executor._abstract_state
        wanted = group_trees(abstract_params, abstract_opt)
        by_item: dict[str, dict] = {}
        for g, tree in wanted.items():
            by_item.setdefault(self.meta["groups"][g], {})[g] = tree
        loaded: dict[str, dict] = {}
        checkpointer = ocp.Checkpointer(_handler(), multiprocessing_options=_processes())
        for item, item_tree in sorted(by_item.items()):
            path = self.path.absolute() / item
            try:
                got = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                    item=item_tree,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(item_tree),
                    partial_restore=True,
                ))
            except Exception as e:  # noqa: BLE001 -- one clear error for any storage failure
                raise CheckpointError(f"{path}: cannot be read: {type(e).__name__}: {e}") from e
            loaded.update({g: got[g] for g in item_tree})
        checkpointer.close()
        executor.params = {g: loaded[g]["params"] for g in abstract_params}
        executor.opt_state = opt_state_from_groups(abstract_opt, loaded)


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
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}: checkpoint format {meta.get('format')!r}, this h2jax reads {FORMAT}")
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
    items = sorted({meta["groups"][g] for g in needed})
    sums = {}
    for item in items:
        if not (path / item).is_dir():
            holds = sorted(g for g, it in meta["groups"].items() if it == item)
            raise CheckpointError(f"{path / item}: missing (it holds {', '.join(holds)})")
        sums[item] = _read_json(path / (item + SUMS), f"file sizes and checksums of {item}")
    if verify:
        for item in items:
            _verify_item(path / item, sums[item])
    return Checkpoint(path, meta, sums)


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


def _verify_item(item_dir: Path, sums: dict[str, list[int]]) -> None:
    """Size and CRC-32 of every file of an item, against those recorded when it was written."""
    for rel, (size, crc) in sorted(sums.items()):
        p = item_dir / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: missing")
        actual = p.stat().st_size
        if actual != size:
            raise CheckpointError(f"{p}: truncated or overwritten: {actual} bytes, {size} when written")
        if _crc32(p) != crc:
            raise CheckpointError(f"{p}: corrupted: CRC-32 differs from the one recorded when written")


# ----------------------------------------------------------------------------- a training run's checkpoints


class RunCheckpoints:
    """The checkpoints of one training run (`h2jax run --checkpoint-dir D --save-every N
    --keep K`): `after_step(step)` on every process after every step starts an asynchronous
    save every `save_every` steps and otherwise commits the one in flight once written;
    `finish(step)` saves `step` unless it is already saved and waits for the commit."""

    def __init__(self, trainer, directory, *, save_every: int | None = None, keep: int | None = None,
                 dataset=None):
        if save_every is not None and save_every < 1:
            raise CheckpointError(f"--save-every must be >= 1, got {save_every}")
        plan = trainer.plan
        world = (LocalWorld() if getattr(trainer, "role", None) is None
                 else TransportWorld(trainer.transport, trainer.executors, plan.n_stages))
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
        path = self.writer.wait()
        return path if path is not None else step_dir(self.writer.directory, step)
