"""The plan file: dataclasses, JSON load/save, and validation with errors that name the field.

A plan is the single interface between the planner and the runtime. Everything the runtime
needs is here; nothing the plan records is re-derived elsewhere. No JAX import: validation
runs before any backend starts, so bad input never reaches a compile or an allocation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from h2jax.cluster import check_chip_name, load_chip
from h2jax.config import ConfigError, ModelConfig, get_config, preset_name
from h2jax.schedules import NAMES, get_schedule

FORMAT_VERSION = 1
SCHEDULES = NAMES  # h2jax/schedules/: one module per schedule
RECOMPUTE_POLICIES = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "sgd")
# numpy's and JAX's seeds both take an unsigned 32-bit integer without loss.
MAX_SEED = 2**32 - 1
LR_SCHEDULES = ("constant", "linear", "cosine")


class PlanError(ConfigError):
    """A plan field is wrong; the message names it and says how to fix it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Mesh:
    data: int = 1
    tensor: int = 1

    @property
    def size(self) -> int:
        return self.data * self.tensor


@dataclasses.dataclass(frozen=True, slots=True)
class HostSlot:
    """One process of a stage: the host it runs on and that host's chips (local ids) it gets."""

    host: str
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    """A contiguous layer range `[layers[0], layers[1])` on chips of one type, on one mesh.
    Under interleaved 1F1B (plan.virtual_stages = v > 1) the stage holds v such ranges,
    `chunks`, one per virtual stage (`layers` is then its first chunk)."""

    chip: str
    mesh: Mesh
    layers: tuple[int, int]
    recompute: str = "none"
    devices: tuple[int, ...] | None = None  # local device ids (single-process runs)
    processes: int = 1  # MPI processes this stage spans
    hosts: tuple[HostSlot, ...] | None = None  # one per process, in rank order (`h2jax launch`)
    chunks: tuple[tuple[int, int], ...] | None = None  # interleaved: one layer range per chunk

    @property
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        return self.chunks if self.chunks is not None else (self.layers,)

    @property
    def n_layers(self) -> int:
        return sum(end - start for start, end in self.layer_ranges)


@dataclasses.dataclass(frozen=True, slots=True)
class Optimizer:
    """Per-stage optax optimizer settings; `clip_norm` clips by the norm over *all* stages."""

    name: str = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    # ZeRO-1: each stage's optimizer state (AdamW's moments) split over its `data` axis, as
    # the planner's memory model assumes; parameters and gradients stay replicated over it.
    shard_over_data: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Train:
    """How a run trains beyond one step: the learning-rate schedule (its peak is
    optimizer.learning_rate), evaluation on the validation split, the logging interval."""

    lr_schedule: str = "constant"  # constant | linear | cosine (decay after a linear warm-up)
    warmup_steps: int = 0
    decay_steps: int | None = None  # the schedule's length, warm-up included; None: the run's steps
    final_lr_fraction: float = 0.1  # learning rate at the end of decay, as a fraction of the peak
    eval_every: int = 0  # evaluate every N steps (and after the last); 0: never
    eval_batches: int = 4  # validation batches (of global_batch sequences) per evaluation
    log_every: int = 1  # write a metrics record every N steps


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per micro-batch (the whole pipeline's; split over each stage's data axis)
    stages: tuple[Stage, ...]
    schedule: str = "1f1b"
    seed: int = 0
    virtual_stages: int = 1  # layer chunks per stage (interleaved-1f1b: v >= 2)
    optimizer: Optimizer = Optimizer()
    train: Train = Train()
    predicted: Mapping[str, Any] | None = None
    model_name: str | None = None  # the preset name when the model is a preset

    @property
    def n_micro(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def n_devices(self) -> int:
        return sum(s.mesh.size for s in self.stages)

    @property
    def n_processes(self) -> int:
        return sum(s.processes for s in self.stages)

    def with_stages(self, stages: list[Stage] | tuple[Stage, ...]) -> "Plan":
        return dataclasses.replace(self, stages=tuple(stages))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "model": self.model_name or preset_name(self.model) or self.model.to_dict(),
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "schedule": self.schedule,
            **({"virtual_stages": self.virtual_stages} if self.virtual_stages != 1 else {}),
            "seed": self.seed,
            "optimizer": dataclasses.asdict(self.optimizer),
            **({"train": dataclasses.asdict(self.train)} if self.train != Train() else {}),
            "stages": [_stage_to_dict(s) for s in self.stages],
        }
        if self.predicted is not None:
            out["predicted"] = dict(self.predicted)
        return out


def _stage_to_dict(stage: Stage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "chip": stage.chip,
        "mesh": {"data": stage.mesh.data, "tensor": stage.mesh.tensor},
        "layers": list(stage.layers) if stage.chunks is None else [list(c) for c in stage.chunks],
        "recompute": stage.recompute,
    }
    if stage.devices is not None:
        out["devices"] = list(stage.devices)
    if stage.processes != 1:
        out["processes"] = stage.processes
    if stage.hosts is not None:
        out["hosts"] = [{"host": h.host, "devices": list(h.devices)} for h in stage.hosts]
    return out


# ----------------------------------------------------------------------------- parsing


def _int_field(raw: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    if key not in raw:
        raise PlanError(f"{where}.{key} is missing; add an integer >= {minimum}")
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _layer_range(raw: Any, where: str, empty: bool) -> tuple[int, int]:
    if (
        not isinstance(raw, (list, tuple))
        or len(raw) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
    ):
        raise PlanError(f"{where} must be [start, end) as two integers, got {raw!r}")
    if raw[0] < 0 or raw[1] < raw[0] or (raw[1] == raw[0] and not empty):
        raise PlanError(f"{where} {list(raw)} must satisfy 0 <= start < end")
    return raw[0], raw[1]


def _parse_stage(raw: Any, i: int, v: int = 1) -> Stage:
    where = f"stages[{i}]"
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where} must be an object with chip, mesh, layers")
    known = {"chip", "mesh", "layers", "recompute", "devices", "processes", "hosts"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    if "chip" not in raw:
        raise PlanError(f"{where}.chip is missing; name a chip type from backends/, e.g. \"cpu\"")
    check_chip_name(raw["chip"], f"{where}.chip")
    mesh_raw = raw.get("mesh", {"data": 1, "tensor": 1})
    if not isinstance(mesh_raw, Mapping) or set(mesh_raw) - {"data", "tensor"}:
        raise PlanError(f"{where}.mesh must be an object {{\"data\": d, \"tensor\": t}}, got {mesh_raw!r}")
    mesh = Mesh(
        data=_int_field({"data": mesh_raw.get("data", 1)}, "data", f"{where}.mesh"),
        tensor=_int_field({"tensor": mesh_raw.get("tensor", 1)}, "tensor", f"{where}.mesh"),
    )
    layers = raw.get("layers")
    chunks = None
    if v > 1:
        if not isinstance(layers, (list, tuple)) or len(layers) != v:
            raise PlanError(
                f"{where}.layers must list the stage's {v} chunks (virtual_stages) as [start, end) "
                f"pairs in chunk order, e.g. [[0, 2], [8, 10]], got {layers!r}"
            )
        chunks = tuple(_layer_range(c, f"{where}.layers[{c_i}]", empty=True) for c_i, c in enumerate(layers))
        layers = chunks[0]
    else:
        layers = _layer_range(layers, f"{where}.layers", empty=False)
    recompute = raw.get("recompute", "none")
    if recompute not in RECOMPUTE_POLICIES:
        raise PlanError(
            f"{where}.recompute {recompute!r} is unknown; use one of {', '.join(RECOMPUTE_POLICIES)}"
        )
    devices = raw.get("devices")
    if devices is not None:
        if not isinstance(devices, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices
        ):
            raise PlanError(f"{where}.devices must be a list of device ids >= 0, got {devices!r}")
        if len(devices) != mesh.size:
            raise PlanError(
                f"{where}.devices lists {len(devices)} device(s) but mesh data*tensor = {mesh.size}; "
                "list exactly one device per mesh position or drop the field"
            )
        if len(set(devices)) != len(devices):
            raise PlanError(f"{where}.devices repeats a device id: {list(devices)}")
        devices = tuple(devices)
    processes = _int_field({"processes": raw.get("processes", 1)}, "processes", where)
    if mesh.size % processes:
        raise PlanError(
            f"{where}.processes ({processes}) must divide the stage's device count "
            f"data*tensor = {mesh.size}, so every process holds the same number of devices"
        )
    return Stage(
        chip=str(raw["chip"]),
        mesh=mesh,
        chunks=chunks,
        layers=(layers[0], layers[1]),
        recompute=recompute,
        devices=devices,
        processes=processes,
        hosts=_parse_hosts(raw.get("hosts"), where, mesh.size, processes),
    )


def _parse_hosts(raw: Any, where: str, size: int, processes: int) -> tuple[HostSlot, ...] | None:
    """`hosts`: one {"host", "devices"} per process, each with the stage's share of chips."""
    if raw is None:
        return None
    fix = "(written by `h2jax plan` from a cluster file whose groups list hosts)"
    if not isinstance(raw, (list, tuple)) or len(raw) != processes:
        raise PlanError(
            f"{where}.hosts must list one {{\"host\", \"devices\"}} per process ({processes}), "
            f"got {raw!r} {fix}"
        )
    per = size // processes
    slots = []
    for j, slot in enumerate(raw):
        w = f"{where}.hosts[{j}]"
        if not isinstance(slot, Mapping) or set(slot) != {"host", "devices"}:
            raise PlanError(f"{w} must be an object {{\"host\": name, \"devices\": [ids]}}, got {slot!r}")
        host, ids = slot["host"], slot["devices"]
        if not isinstance(host, str) or not host.strip():
            raise PlanError(f"{w}.host must be a host name, got {host!r}")
        if (
            not isinstance(ids, (list, tuple)) or len(ids) != per or len(set(ids)) != len(ids)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ids)
        ):
            raise PlanError(
                f"{w}.devices must list {per} distinct chip ids >= 0 on {host} (data*tensor / processes), "
                f"got {ids!r}"
            )
        slots.append(HostSlot(host, tuple(ids)))
    return tuple(slots)


def _check_number(value: Any, field: str) -> None:
    """A finite JSON number: refuses strings, booleans, NaN and infinity by name."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise PlanError(f"{field} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise PlanError(f"{field} must be a finite number, got {value!r}")


def _parse_optimizer(raw: Any) -> Optimizer:
    if raw is None:
        return Optimizer()
    if not isinstance(raw, Mapping):
        raise PlanError("optimizer must be an object, e.g. {\"name\": \"adamw\", \"learning_rate\": 1e-3}")
    fields = {f.name for f in dataclasses.fields(Optimizer)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise PlanError(f"optimizer: unknown field(s) {unknown}; known fields: {sorted(fields)}")
    for key in ("learning_rate", "weight_decay", "b1", "b2", "eps", "clip_norm"):
        if key in raw and not (key == "clip_norm" and raw[key] is None):
            _check_number(raw[key], f"optimizer.{key}")
    opt = Optimizer(**raw)
    if not isinstance(opt.name, str) or opt.name not in OPTIMIZERS:
        raise PlanError(f"optimizer.name {opt.name!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    if not opt.learning_rate > 0:
        raise PlanError(f"optimizer.learning_rate must be positive, got {opt.learning_rate!r}")
    if opt.clip_norm is not None and not opt.clip_norm > 0:
        raise PlanError("optimizer.clip_norm must be positive, or null to disable clipping")
    for key in ("b1", "b2"):
        if not 0 <= getattr(opt, key) < 1:
            raise PlanError(f"optimizer.{key} must be in [0, 1) (a moment's decay rate), got {getattr(opt, key)!r}")
    for key in ("eps", "weight_decay"):
        if getattr(opt, key) < 0:
            raise PlanError(f"optimizer.{key} must be >= 0, got {getattr(opt, key)!r}")
    if not isinstance(opt.shard_over_data, bool):
        raise PlanError(f"optimizer.shard_over_data must be true or false, got {opt.shard_over_data!r}")
    return opt


def parse_train(raw: Any, where: str = "train") -> Train:
    """The `train` section (or CLI overrides merged into it); errors name the field."""
    if raw is None:
        return Train()
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where} must be an object, e.g. {{\"lr_schedule\": \"cosine\", \"warmup_steps\": 10}}")
    fields = {f.name for f in dataclasses.fields(Train)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(fields)}")
    train = Train(**raw)
    if train.lr_schedule not in LR_SCHEDULES:
        raise PlanError(f"{where}.lr_schedule {train.lr_schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}")
    for key, minimum in (("warmup_steps", 0), ("eval_every", 0), ("eval_batches", 1), ("log_every", 1)):
        _int_field({key: getattr(train, key)}, key, where, minimum)
    if train.decay_steps is not None:
        _int_field({"decay_steps": train.decay_steps}, "decay_steps", where, 1)
    frac = train.final_lr_fraction
    if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 <= frac <= 1:
        raise PlanError(f"{where}.final_lr_fraction must be in [0, 1], got {train.final_lr_fraction!r}")
    return train


def _check_predicted(predicted: Any, n_stages: int) -> None:
    """The planner's figures that tools read back: per-stage lists with one number per stage."""
    if not isinstance(predicted, Mapping):
        raise PlanError("predicted must be an object (written by `h2jax plan`); drop the field to re-plan")
    for key in ("memory_gib", "memory_capacity_gib"):
        values = predicted.get(key)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)) or len(values) != n_stages:
            raise PlanError(
                f"predicted.{key} must be a list of {n_stages} numbers (one per stage), got {values!r}; "
                "drop the field or re-plan with `h2jax plan`"
            )
        for i, v in enumerate(values):
            _check_number(v, f"predicted.{key}[{i}]")


def plan_from_dict(raw: Mapping[str, Any]) -> Plan:
    """Parse and validate a plan; every error names the field and the fix."""
    if not isinstance(raw, Mapping):
        raise PlanError("a plan must be a JSON object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise PlanError(
            f"format_version is {version!r} but this h2jax reads format_version {FORMAT_VERSION}; "
            f"set \"format_version\": {FORMAT_VERSION} (or re-plan with `h2jax plan`)"
        )
    known = {
        "format_version", "model", "seq_len", "global_batch", "micro_batch", "schedule",
        "virtual_stages", "seed", "optimizer", "train", "stages", "predicted", "search",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PlanError(f"unknown top-level field(s) {unknown}; known fields: {sorted(known)}")
    if "model" not in raw:
        raise PlanError("model is missing; give a preset name such as \"tiny\" or a full config object")
    model = get_config(raw["model"], where="model")
    model_name = raw["model"] if isinstance(raw["model"], str) else None
    seq_len = _int_field(raw, "seq_len", "plan")
    global_batch = _int_field(raw, "global_batch", "plan")
    micro_batch = _int_field(raw, "micro_batch", "plan")
    schedule = raw.get("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    v = _int_field({"virtual_stages": raw.get("virtual_stages", 1)}, "virtual_stages", "plan")
    try:
        get_schedule(schedule).check_v(v)
    except ValueError as e:
        raise PlanError(str(e)) from None
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise PlanError(f"seed must be an integer in [0, 2**32 - 1], got {seed!r}")
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, (list, tuple)) or not stages_raw:
        raise PlanError("stages must be a non-empty list of stages in pipeline order")
    stages = tuple(_parse_stage(s, i, v) for i, s in enumerate(stages_raw))
    predicted = raw.get("predicted")
    if predicted is not None:
        _check_predicted(predicted, len(stages))
    plan = Plan(
        model=model,
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch=micro_batch,
        stages=stages,
        schedule=schedule,
        virtual_stages=v,
        seed=seed,
        optimizer=_parse_optimizer(raw.get("optimizer")),
        train=parse_train(raw.get("train")),
        predicted=predicted,
        model_name=model_name,
    )
    validate(plan)
    return plan


def validate(plan: Plan) -> None:
    """Cross-field checks: batch divisibility, layer coverage, tensor-parallel divisibility."""
    if plan.global_batch % plan.micro_batch:
        raise PlanError(
            f"global_batch ({plan.global_batch}) is not divisible by micro_batch "
            f"({plan.micro_batch}); choose a micro_batch among the divisors of {plan.global_batch}"
        )
    v = plan.virtual_stages
    if any(len(s.layer_ranges) != v for s in plan.stages):
        raise PlanError(f"every stage must hold virtual_stages = {v} layer chunk(s); give each stage {v} ranges")
    try:
        get_schedule(plan.schedule).check(plan.n_stages, plan.n_micro, v)
    except ValueError as e:
        raise PlanError(str(e)) from None
    # The chunks, in pipeline order (chunk c of stage i is virtual stage c*p + i), cover the
    # model exactly once.
    expected = 0
    for c in range(v):
        for i, stage in enumerate(plan.stages):
            where = f"stages[{i}].layers" + (f"[{c}]" if v > 1 else "")
            start, end = stage.layer_ranges[c]
            prev = "previous stage" if v == 1 else "previous virtual stage"
            if start < expected:
                raise PlanError(
                    f"{where} {[start, end]} overlaps the {prev}, which ends at "
                    f"layer {expected}; start this stage at {expected}"
                )
            if start > expected:
                raise PlanError(
                    f"{where} {[start, end]} leaves layers [{expected}, {start}) uncovered; "
                    f"start this stage at {expected}"
                )
            expected = end
    for i, stage in enumerate(plan.stages):
        where = f"stages[{i}]"
        if plan.micro_batch % stage.mesh.data:
            raise PlanError(
                f"micro_batch ({plan.micro_batch}) is not divisible by {where}.mesh.data "
                f"({stage.mesh.data}); make micro_batch a multiple of every stage's data size"
            )
        plan.model.check_tensor_parallel(stage.mesh.tensor, where)
        load_chip(stage.chip)  # unknown chip types list the known ones
    if expected != plan.model.n_layers:
        raise PlanError(
            f"stages cover layers [0, {expected}) but the model has {plan.model.n_layers} layers; "
            f"the last stage must end at layer {plan.model.n_layers}"
        )
    with_hosts = [s.hosts is not None for s in plan.stages]
    if any(with_hosts) and not all(with_hosts):
        missing = [i for i, h in enumerate(with_hosts) if not h]
        raise PlanError(
            f"stages {missing} record no hosts but the others do; give every stage its hosts "
            "(re-plan with a cluster file whose groups all list hosts) or none"
        )
    on_host: dict[tuple[str, int], int] = {}
    for i, stage in enumerate(plan.stages):
        for slot in stage.hosts or ():
            for d in slot.devices:
                if (slot.host, d) in on_host:
                    raise PlanError(
                        f"stages[{i}].hosts gives chip {d} of {slot.host} to a process, but "
                        f"stages[{on_host[slot.host, d]}] already has it; give each process its own chips"
                    )
                on_host[slot.host, d] = i
    used: dict[int, int] = {}
    for i, stage in enumerate(plan.stages):
        for d in stage.devices or ():
            if d in used:
                raise PlanError(
                    f"stages[{i}].devices uses device {d}, already used by stages[{used[d]}]; "
                    "stages must run on disjoint devices"
                )
            used[d] = i


# The action lists a simulation replays or a run executes hold a few actions per stage and
# micro-batch, about 1 KiB each once replayed (measured: 3 stages x 10**6 micro-batches took
# 2.9 GB and 200 s): beyond this many stage x micro-batch slots a command refuses up front.
MAX_SCHEDULE_SLOTS = 1_000_000


def check_schedule_size(plan: Plan, source: str = "the plan") -> None:
    """Refuse a schedule whose action lists would take gigabytes before the first action."""
    slots = plan.n_stages * plan.n_micro
    if slots > MAX_SCHEDULE_SLOTS:
        raise PlanError(
            f"{source}: {plan.n_stages} stage(s) x {plan.n_micro:,} micro-batches = {slots:,} schedule slots, "
            f"about {slots * 1024 / 2**30:,.1f} GiB of action lists; at most {MAX_SCHEDULE_SLOTS:,}: "
            f"use at most {max(1, MAX_SCHEDULE_SLOTS // plan.n_stages):,} micro-batches (a larger micro_batch "
            "or a smaller global_batch)"
        )


def check_devices(plan: Plan, available: int, backend: str = "cpu") -> None:
    """Refuse a plan that asks for more devices than the process can see."""
    if plan.n_devices > available:
        raise PlanError(
            f"the plan's stages need {plan.n_devices} devices (sum of data*tensor) but only "
            f"{available} {backend} device(s) exist; shrink the meshes, or on CPU raise "
            "the forced host device count"
        )
    for i, stage in enumerate(plan.stages):
        for d in stage.devices or ():
            if d >= available:
                raise PlanError(
                    f"stages[{i}].devices names device {d} but only devices 0..{available - 1} exist"
                )


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan file {path} does not exist")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PlanError(f"plan file {path} is not UTF-8 text (byte {e.start}): write it as UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"plan file {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise PlanError(f"plan file {path} nests JSON too deeply to be a plan; a plan is at most a few levels deep") from None
    try:
        return plan_from_dict(raw)
    except TypeError as e:  # e.g. a wrong keyword inside a nested object
        raise PlanError(f"plan file {path}: {e}") from None


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written plan, and concurrent writers each
    write their own uniquely named temporary file (the last rename wins). A missing parent
    directory is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(plan.to_dict(), indent=2) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the plan from the other ranks' users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
