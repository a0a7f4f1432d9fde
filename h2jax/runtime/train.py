"""The training loop, the one for every transport: build the stages this process runs, step
them, report progress.

`h2jax.run(plan, steps=...)` is the Python entry point; `h2jax run` calls it. In one process
every stage runs here, wired by the local transport. Under `mpiexec` each rank runs its own
stage (`h2jax.runtime.ranks` configures it before JAX starts) through the MPI transport: the
same Trainer, the same loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from h2jax import names as N
from h2jax.config import ConfigError
from h2jax.data import TokenDataset, check_compatible, stdlib_corpus
from h2jax.plan import Plan, check_schedule_size, load_plan
from h2jax.runtime import hostmem, ranks
from h2jax.transport.base import Transport


@dataclasses.dataclass
class RunResult:
    losses: list[float]
    step_times_s: list[float]
    tokens_per_step: int
    n_chips: int
    params: dict | None = None  # flat {name: numpy array} of the stages this process ran
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    emulated: dict[str, float] = dataclasses.field(default_factory=dict)  # chip type -> slowdown
    transport: dict = dataclasses.field(default_factory=dict)  # what the transport reports
    reports: bool = True  # whether this process reports progress (rank 0 of an MPI job)
    eval_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, loss)
    learning_rates: list[float] = dataclasses.field(default_factory=list)
    checkpoint: object = None  # the path of the checkpoint the run ended with (--checkpoint-dir)

    @property
    def emulation_note(self) -> str:
        """'' for real chips; otherwise says which figures come from emulated chips."""
        if not self.emulated:
            return ""
        chips = ", ".join(f"{c} x{s:g} slowdown" for c, s in self.emulated.items())
        return f"EMULATED chips ({chips}; times are host CPU compute stretched by waiting)"

    @property
    def step_time_s(self) -> float:
        """Median step time after the first (compile) step."""
        times = self.step_times_s[1:] or self.step_times_s
        return float(np.median(times))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def tokens_per_chip_s(self) -> float:
        return self.tokens_per_s / self.n_chips

    def summary(self) -> dict:
        out = {
            N.LOSSES: self.losses,
            N.STEP_TIME_S: self.step_time_s,
            N.TOKENS_PER_S: self.tokens_per_s,
            N.TOKENS_PER_CHIP_PER_S: self.tokens_per_chip_s,
            N.GRAD_NORMS: self.grad_norms,
            "emulated": self.emulated,
        }
        if self.eval_losses:
            out[N.EVAL_LOSS] = [{N.STEP: s, N.LOSS: v} for s, v in self.eval_losses]
        return out


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one `Trainer.step` did: `step` is the number of optimizer steps taken so far."""

    step: int
    loss: float
    grad_norm: float
    step_time_s: float  # host wall time of the step, from dispatch to the loss on the host
    learning_rate: float  # the learning rate this step's update used

    def to_dict(self) -> dict:
        return {N.STEP: self.step, N.LOSS: self.loss, N.GRAD_NORM: self.grad_norm,
                N.STEP_TIME_S: self.step_time_s, N.LEARNING_RATE: self.learning_rate}


def default_dataset(plan: Plan) -> TokenDataset:
    return TokenDataset(stdlib_corpus(), plan.seq_len, seed=plan.seed)


def place_stages(plan: Plan, stages: list[int]) -> dict[int, list]:
    """Stage index -> its local devices, each stage on its chip type's platform (a plan may
    mix platforms: a `cuda` stage and a `cpu` stage in one process)."""
    from h2jax.backends import platform_devices, select_platforms
    from h2jax.runtime.devices import assign_devices

    backends = select_platforms(plan.stages[i].chip for i in stages)
    by_platform: dict[str, list[int]] = {}
    for i in stages:
        by_platform.setdefault(backends[plan.stages[i].chip].jax_platform, []).append(i)
    placement: dict[int, list] = {}
    for platform, idx in by_platform.items():
        backend = next(b for b in backends.values() if b.jax_platform == platform)
        sub = assign_devices(plan.with_stages([plan.stages[i] for i in idx]), platform_devices(backend))
        placement.update({i: sub[k] for k, i in enumerate(idx)})
    return placement


class Trainer:
    """The stages of `plan` this process runs, wired through `transport`: the object to write
    your own training loop with (`h2jax.Trainer`).

        trainer = h2jax.Trainer(plan, steps=1000)     # steps: the learning-rate schedule's length
        for n in range(1000):
            m = trainer.step(batch_for(n) if trainer.needs_tokens else None)
            print(m.loss, m.grad_norm, m.step_time_s, m.learning_rate)
        trainer.evaluate(val_batch)                      # mean loss, forwards only
        trainer.parameters("layer_003")                  # numpy arrays by global name
        trainer.save("ckpt"); trainer.restore("ckpt")

    The same script runs unchanged under `mpiexec`: every rank builds the Trainer, which runs
    only that rank's stage; `needs_tokens` is false on ranks of middle stages (pass None);
    every rank calls step/evaluate/save together; losses reach every rank.

    By default: in one process, every stage on its own local devices, through a
    LocalTransport; under `mpiexec`, this rank's stage (configured before JAX starts) through
    an MPITransport (`mpi_path`: auto, direct or staged; default $H2JAX_MPI_PATH, else auto).
    `emulate_time=False` runs emulated chip types at host speed (their precision policy and
    memory cap still apply), e.g. for numerics-only checks. `tracer`
    (h2jax.runtime.tracing.StepTracer) records every action of every `trace_every`-th step
    (the steps whose index, from 0, it divides)."""

    def __init__(
        self, plan: Plan, transport: Transport | None = None, stages: list[int] | None = None,
        devices=None, *, steps: int | None = None, lr_schedule=None, emulate_time: bool = True,
        mpi_path: str | None = None, tracer=None, trace_every: int = 1,
    ):
        from h2jax.cluster import load_chip
        from h2jax.runtime.emulation import ClockedTransport, StageClock
        from h2jax.runtime.devices import assign_devices
        from h2jax.runtime.pipeline import Pipeline
        from h2jax.runtime.stage import ChunkedStage, StageExecutor

        from h2jax.runtime.optim import learning_rate_schedule, with_schedule_length

        plan = with_schedule_length(plan, steps)
        self.plan = plan
        # Freed step and checkpoint buffers stay in the heap instead of going back to the
        # kernel and faulting in again (h2jax.runtime.hostmem; H2JAX_KEEP_FREED_MEMORY=0: off).
        hostmem.keep_freed_memory()
        # `lr_schedule`: your own (a traceable function of the update count), else the plan's.
        self.lr_schedule = lr_schedule or learning_rate_schedule(plan.optimizer, plan.train)
        self.step_count = 0  # optimizer steps taken (restored with a checkpoint)
        self.role = ranks.process_role(plan) if ranks.in_mpi_job() else None
        if self.role is not None and stages is None:
            transport, stages, devices = self._mpi_rank_setup(transport, mpi_path)
        elif transport is None:
            from h2jax.transport.local import LocalTransport

            transport = LocalTransport()
        self.transport = transport
        if self.role is None and stages is None and devices is None:
            from h2jax.runtime.jaxsetup import prepare_local_devices

            prepare_local_devices(plan)  # the host devices a CPU plan needs, if JAX has not started
        stages = list(range(plan.n_stages)) if stages is None else stages
        if devices is None:
            placement = place_stages(plan, stages)
        else:
            placement = assign_devices(plan, devices) if isinstance(devices, list) else devices
        chips = {i: load_chip(plan.stages[i].chip) for i in stages}
        self.emulated = {
            c.name: c.emulate.slowdown for c in chips.values() if c.is_emulated and emulate_time
        }
        self.clocks: dict[int, StageClock] = {}
        if self.emulated:
            # Every local stage gets a clock (slowdown 1 on a real chip) so that times compose;
            # a process that runs one stage waits right after each compute (see emulation.py).
            defer = len(stages) > 1
            self.clocks = {
                i: StageClock(c.emulate.slowdown if c.name in self.emulated else 1.0, defer, c.name in self.emulated)
                for i, c in chips.items()
            }
            self.transport = ClockedTransport(self.transport, self.clocks)
        # Interleaved 1F1B: a stage runs one compiled model slice per layer chunk (ChunkedStage).
        stage_class = StageExecutor if plan.virtual_stages == 1 else ChunkedStage
        self.executors = {
            i: stage_class(plan, i, placement[i], clock=self.clocks.get(i), lr_schedule=lr_schedule)
            for i in stages
        }
        self.tracer = tracer
        self.trace_every = trace_every  # trace the steps whose index (from 0) it divides
        self.pipeline = Pipeline(plan, self.transport, self.executors, tracer)

    def _mpi_rank_setup(self, transport, mpi_path):
        """(transport, stages, devices) of this rank: its own stage on its stage mesh."""
        import os

        from h2jax.runtime.jaxsetup import stage_mesh_devices

        if transport is None:
            from h2jax.transport.mpi import MPITransport

            path = mpi_path or os.environ.get("H2JAX_MPI_PATH", "auto")
            transport = MPITransport(ranks.plan_processes(self.plan), path=path)
        stage = self.plan.stages[self.role.stage]
        devices = list(stage_mesh_devices(stage.mesh.data, stage.mesh.tensor).reshape(-1))
        return transport, [self.role.stage], {self.role.stage: devices}

    @property
    def reports(self) -> bool:
        """Whether this process reports progress: the only process, or rank 0 of a job."""
        return self.role is None or self.role.rank == 0

    @property
    def last_grad_norm(self) -> float:
        return self.pipeline.last_grad_norm

    @property
    def needs_tokens(self) -> bool:
        """Whether this process reads batches: it runs the first stage (inputs) or the last
        (labels). Other processes pass None to step and evaluate."""
        return any(ex.is_first or ex.is_last for ex in self.executors.values())

    def step(self, tokens: np.ndarray | None) -> StepMetrics:
        """One optimizer step on `tokens` [global_batch, seq_len + 1] (int); returns its loss
        (the mean over micro-batches, on every process), the gradient norm over all stages,
        the step time and the learning rate it used."""
        from h2jax.runtime.optim import learning_rate_at

        from h2jax.runtime.pipeline import NonFiniteLossError

        if self.tracer is not None:  # an untraced step runs as it would without a tracer
            self.pipeline.tracer = self.tracer if self.step_count % self.trace_every == 0 else None
        t0 = time.perf_counter()
        try:
            loss = self.pipeline.step(tokens)
        except NonFiniteLossError as e:  # the step it happened in
            raise e.at_step(self.step_count + 1) from None
        for clock in self.clocks.values():  # the step ends when every emulated chip is done
            clock.wait()
        seconds = time.perf_counter() - t0
        lr = learning_rate_at(self.lr_schedule, self.step_count)
        self.step_count += 1
        return StepMetrics(self.step_count, loss, self.pipeline.last_grad_norm, seconds, lr)

    def evaluate(self, tokens: np.ndarray | None) -> float:
        """The mean loss on `tokens` [global_batch, seq_len + 1] with the current parameters
        (forwards only, no update), on every process."""
        loss = self.pipeline.evaluate(tokens)
        for clock in self.clocks.values():
            clock.wait()
        return loss

    def parameters(self, *prefixes: str, all_stages: bool = False) -> dict | None:
        """{global name: numpy array} of the parameters whose names start with one of
        `prefixes` (all when none: `embed/...`, `layer_003/...`, `head/...`), gathered off the
        devices. A process holds its own stages' layers; `all_stages=True` collects every
        stage's onto the job's first process (every process must call it; the others get None)."""
        params = self.params_numpy()
        if prefixes:
            params = {k: v for k, v in params.items() if k.startswith(prefixes)}
        if not all_stages:
            return params
        parts = self.transport.gather_to_first(params)
        if parts is None:
            return None
        return {k: v for part in parts for k, v in part.items()}

    def save(self, directory, *, dataset=None):
        """Write a checkpoint of every stage at `self.step_count` under `directory` (the
        checkpoint format of h2jax.runtime.checkpoint; every process calls it) and wait until
        it is committed; returns its path. `dataset` records which data (and tokenizer) it
        trained on, so that `restore` can refuse data made with another tokenizer."""
        from h2jax.runtime.checkpoint import RunCheckpoints

        checkpoints = RunCheckpoints(self, directory, dataset=dataset)  # the same writer as `h2jax run`'s
        path = checkpoints.finish(self.step_count)
        checkpoints.writer.world.all_done(True)  # collective: no process goes on before the commit
        return path

    def restore(self, directory, step: int | None = None, *, dataset=None) -> dict:
        """Load this process's stages (parameters, optimizer state) from the newest (or the
        given `step`) checkpoint in `directory`, written by any plan of the same model;
        continues from its step (batch `step` is the next: data resumes where it was).
        `dataset`, when given, must use the checkpoint's tokenizer. Returns its metadata."""
        from h2jax.runtime.checkpoint import open_checkpoint

        ckpt = open_checkpoint(directory, self.plan, step=step, stages=list(self.executors))
        if dataset is not None:
            check_compatible(dataset, self.plan.model.vocab_size, ckpt.meta["data"].get("tokenizer_sha256"))
        ckpt.restore_all(self.executors.values())  # one read per item for every stage here
        self.step_count = ckpt.step
        return ckpt.meta

    def params_numpy(self) -> dict:
        """{global parameter name: numpy array} of the stages this process runs; a stage that
        spans several processes gathers its shards over its own group first."""
        from h2jax.sharding import flatten_params

        out: dict = {}
        for ex in self.executors.values():
            params = flatten_params(ex.params)
            if self.role is not None and self.role.stage_size > 1:
                from jax.experimental import multihost_utils

                params = multihost_utils.process_allgather(params, tiled=True)
            out.update({k: np.asarray(v) for k, v in params.items()})
        return out

    def describe_transport(self) -> dict:
        describe = getattr(self.transport, "describe", None)
        return describe() if describe is not None else {}

    def close(self) -> None:
        """Finish every send and trace record, and release the transport."""
        self.transport.flush()
        if self.tracer is not None:
            self.tracer.close()
        self.transport.close()


class _Reference:
    """The unpipelined reference behind the Trainer's step/evaluate interface."""

    needs_tokens = True

    def __init__(self, plan: Plan):
        from h2jax.runtime.optim import learning_rate_schedule
        from h2jax.runtime.reference import ReferenceModel

        self.plan, self.model = plan, ReferenceModel(plan)
        self.lr_schedule = learning_rate_schedule(plan.optimizer, plan.train)
        self.step_count = 0

    def step(self, tokens: np.ndarray) -> StepMetrics:
        from h2jax.runtime.optim import learning_rate_at

        t0 = time.perf_counter()
        loss = self.model.step(tokens)
        seconds = time.perf_counter() - t0
        lr = learning_rate_at(self.lr_schedule, self.step_count)
        self.step_count += 1
        return StepMetrics(self.step_count, loss, self.model.last_grad_norm, seconds, lr)

    def evaluate(self, tokens: np.ndarray) -> float:
        return self.model.evaluate(tokens)


def _stage_figures(trainer: Trainer, seen: int, step_time_s: float) -> tuple[dict, int]:
    """Per stage (pipeline order, on the reporting process): the fraction of the last step
    each stage computed (from the tracer's events since index `seen`) and its compiled memory.
    A collective: every process calls it at the same steps."""
    busy: dict[int, float] = {}
    if trainer.tracer is not None:
        trainer.tracer.drain()
        events = trainer.tracer.events[seen:]
        seen += len(events)
        for e in events:
            if e.lane == "compute":
                busy[e.stage] = busy.get(e.stage, 0.0) + e.duration_s
    local = {i: (min(busy.get(i, 0.0) / step_time_s, 1.0) if trainer.tracer is not None else None,
                 ex.memory.needed_bytes if ex.memory is not None else None)
             for i, ex in trainer.executors.items()}
    parts = trainer.transport.gather_to_first(local)
    if parts is None:
        return {}, seen
    merged = {i: v for part in parts for i, v in part.items()}
    stages = range(trainer.plan.n_stages)
    out: dict = {N.STAGE_MEMORY_BYTES: [merged.get(i, (None, None))[1] for i in stages]}
    if trainer.tracer is not None:
        out[N.STAGE_BUSY_FRACTION] = [merged[i][0] for i in stages]
        out[N.STAGE_IDLE_FRACTION] = [1.0 - merged[i][0] for i in stages]
    return out, seen


def train(
    learner,
    plan: Plan,
    dataset,
    steps: int,
    start_step: int = 0,
    on_step: Callable[[int, float, float], None] | None = None,
    *,
    on_eval: Callable[[int, float], None] | None = None,
    writer=None,
    stage_figures: Callable[[float], dict] | None = None,
    n_chips: int | None = None,
    guard=None,
    checkpoints=None,
) -> tuple[list[float], list[float], list[float], list[float], list[tuple[int, float]]]:
    """The training loop: `learner` (a Trainer, or the reference) takes `steps` steps on
    batches `start_step`, ... of `dataset`; every `plan.train.eval_every` steps (and after the
    last) it evaluates `plan.train.eval_batches` validation batches; every
    `plan.train.log_every` steps (and after the last) `writer` (h2jax.metrics.MetricsWriter,
    on the reporting process only) gets a record. Every process runs the same iterations.
    Returns (losses, step times, grad norms, learning rates, [(step, eval loss)])."""
    from h2jax.metrics import perplexity, throughput

    losses, times, norms, lrs, evals = [], [], [], [], []
    t = plan.train
    for n in range(start_step, start_step + steps):
        tokens = dataset.batch(n, plan.global_batch) if learner.needs_tokens else None
        m = learner.step(tokens)  # returns once the loss is on the host: the step has finished
        losses.append(m.loss)
        times.append(m.step_time_s)
        norms.append(m.grad_norm)
        lrs.append(m.learning_rate)
        if on_step is not None:
            on_step(n, m.loss, m.step_time_s)
        if guard is not None:  # a non-finite loss, a stop signal, the MPI step watchdog's heartbeat
            guard.after_step(n + 1, m)
        if checkpoints is not None:  # h2jax.runtime.checkpoint.RunCheckpoints: every N steps, asynchronous
            checkpoints.after_step(n + 1)
        done, last = n + 1, n == start_step + steps - 1
        if t.eval_every and (done % t.eval_every == 0 or last):
            loss = float(np.mean([
                learner.evaluate(dataset.val_batch(i, plan.global_batch) if learner.needs_tokens else None)
                for i in range(t.eval_batches)
            ]))
            evals.append((done, loss))
            if on_eval is not None:
                on_eval(n, loss)
            if writer is not None:
                writer.write(done, {N.EVAL_LOSS: loss, N.EVAL_PERPLEXITY: perplexity(loss)})
        if done % t.log_every == 0 or last:
            record = stage_figures(m.step_time_s) if stage_figures is not None else {}
            if writer is not None:
                writer.write(done, {
                    N.LOSS: m.loss, N.GRAD_NORM: m.grad_norm, N.LEARNING_RATE: m.learning_rate,
                    N.STEP_TIME_S: m.step_time_s, **throughput(plan, m.step_time_s, n_chips),
                    N.TOKENS_SEEN: done * plan.tokens_per_step, **record,
                })
    return losses, times, norms, lrs, evals


def run(
    plan: Plan | str,
    steps: int = 10,
    *,
    dataset=None,
    transport: Transport | None = None,
    unpipelined: bool = False,
    on_step: Callable[[int, float, float], None] | None = None,
    on_eval: Callable[[int, float], None] | None = None,
    log_dir: str | None = None,
    return_params: bool = False,
    emulate_time: bool = True,
    mpi_path: str | None = None,
    trace: str | None = None,
    trace_every: int = 1,
    checkpoint_dir: str | None = None,
    save_every: int | None = None,
    keep: int | None = None,
    resume: bool | int = False,
) -> RunResult:
    """Train `plan` for `steps` optimizer steps and return what happened.

    In one process this sets up the host devices a CPU plan needs (when JAX has not started
    yet). Under `mpiexec` every rank calls it: each configures itself for its own stage and
    trains it with the others; any failure aborts the whole job. `unpipelined=True` runs the
    reference (one jitted function on one device). `trace` writes a Chrome/Perfetto trace of
    the run (under MPI every rank's events, gathered into one file by rank 0); `trace_every`
    k > 1 traces only every k-th step (the first included), so the others' step times are
    those of an untraced run (tracing costs each stage a watcher thread and a marker program
    per compute: 5-19 % of a step measured on 2 cores with 2-4 stages). `dataset`: a
    TokenDataset or PreparedDataset (h2jax.data.open_dataset), default the stdlib corpus;
    `plan.train` sets the learning-rate schedule, evaluation and logging; `log_dir` receives
    metrics (JSONL and TensorBoard, h2jax.metrics) from the reporting process.

    `checkpoint_dir` keeps checkpoints (h2jax.runtime.checkpoint): every `save_every` steps
    (asynchronously), at the end and on Ctrl-C/SIGTERM, the newest `keep`. `resume` (True: the
    newest, or a step number) continues from one written by any plan of the same model:
    `steps` more steps, from its data position; it is checked before anything compiles."""
    from h2jax.runtime.optim import learning_rate_schedule, with_schedule_length

    plan = load_plan(plan) if isinstance(plan, str) else plan
    check_schedule_size(plan)  # before any action list or batch is built
    if resume is not False and checkpoint_dir is not None:  # continue the checkpoint's schedule
        from h2jax.runtime.checkpoint import resumed_plan

        plan = resumed_plan(plan, checkpoint_dir, None if resume is True else int(resume))
    plan = with_schedule_length(plan, steps)
    learning_rate_schedule(plan.optimizer, plan.train)  # a bad schedule fails before JAX starts
    dataset = dataset or default_dataset(plan)
    check_compatible(dataset, plan.model.vocab_size)
    if plan.train.eval_every and not getattr(dataset, "has_val", False):
        raise ConfigError(
            f"train.eval_every ({plan.train.eval_every}) evaluates on a validation split, which this "
            "dataset lacks; give --data a directory from `h2jax data prepare` with --val-fraction > 0 "
            "(and a split of at least seq_len + 2 tokens), or set train.eval_every to 0"
        )
    if isinstance(trace_every, bool) or not isinstance(trace_every, int) or trace_every < 1:
        raise ConfigError(f"trace_every must be an integer >= 1 (trace every k-th step), got {trace_every!r}")
    if trace_every > 1 and (trace is None or log_dir is not None):
        raise ConfigError("trace_every > 1 needs a trace file and no log_dir (the logged stage figures "
                          "come from every step's trace)")
    if (resume is not False or save_every is not None or keep is not None) and checkpoint_dir is None:
        raise ConfigError("resume, save_every and keep need a checkpoint directory (--checkpoint-dir)")
    if unpipelined and checkpoint_dir is not None:
        raise ConfigError("--checkpoint-dir keeps checkpoints of the pipelined run; drop --unpipelined")
    args = (plan, steps, dataset, transport, on_step, on_eval, log_dir, return_params, emulate_time,
            mpi_path, (trace, trace_every), (checkpoint_dir, save_every, keep, resume))
    if not ranks.in_mpi_job():
        from h2jax.runtime.jaxsetup import prepare_local_devices

        if unpipelined:
            from h2jax.runtime.jaxsetup import force_cpu_devices, jax_backends_started

            if not jax_backends_started():
                force_cpu_devices(1)
        else:
            prepare_local_devices(plan)
        return _run(unpipelined, *args)
    if unpipelined:
        raise ConfigError("--unpipelined runs the whole model in one process; launch it without mpiexec")
    role = ranks.process_role(plan)
    with ranks.abort_on_failure(label=role.label):
        return _run(False, *args)


def _metrics_writer(log_dir, plan: Plan, dataset, n_chips: int, emulated: dict):
    if log_dir is None:
        return None
    from h2jax.metrics import MetricsWriter

    manifest = getattr(dataset, "manifest", None)
    info = {"plan": plan.to_dict(), "n_chips": n_chips, "emulated": emulated,
            "dataset": str(getattr(dataset, "directory", getattr(dataset, "path", ""))),
            "tokenizer": manifest.tokenizer if manifest is not None else {"spec": "bytes (raw token file)"}}
    return MetricsWriter(log_dir, info)


def _run(unpipelined, plan, steps, dataset, transport, on_step, on_eval, log_dir, return_params,
         emulate_time, mpi_path, tracing=(None, 1), checkpointing=(None, None, None, False)) -> RunResult:
    from h2jax.runtime.guard import RunGuard

    trace, trace_every = tracing
    if unpipelined:
        ref = _Reference(plan)
        writer = _metrics_writer(log_dir, plan, dataset, 1, {})
        guard = RunGuard(plan, ref)
        try:
            losses, times, norms, lrs, evals = train(ref, plan, dataset, steps, on_step=on_step,
                                                     on_eval=on_eval, writer=writer, n_chips=1, guard=guard)
        finally:
            guard.close()
            if writer is not None:
                writer.close()
        params = None
        if return_params:
            from h2jax.sharding import flatten_params

            params = flatten_params(ref.model.params_numpy())
        return RunResult(losses, times, plan.tokens_per_step, 1, params, norms,
                         eval_losses=evals, learning_rates=lrs)
    from h2jax.runtime.tracing import StepTracer

    from h2jax.runtime.signals import RunInterrupted

    checkpoint_dir, save_every, keep, resume = checkpointing
    checkpoint = None
    if resume is not False:  # every check before any stage compiles
        from h2jax.runtime.checkpoint import open_checkpoint

        mine = [ranks.process_role(plan).stage] if ranks.in_mpi_job() else None
        checkpoint = open_checkpoint(checkpoint_dir, plan, step=None if resume is True else int(resume), stages=mine)
        check_compatible(dataset, plan.model.vocab_size, checkpoint.meta["data"].get("tokenizer_sha256"))
    trainer = Trainer(plan, transport, emulate_time=emulate_time, mpi_path=mpi_path,
                      tracer=StepTracer() if trace or log_dir else None, trace_every=trace_every)
    start = 0
    if checkpoint is not None:
        checkpoint.restore_all(trainer.executors.values())  # one read per item for every stage here
        trainer.step_count = start = checkpoint.step
    checkpoints = None
    if checkpoint_dir is not None:
        from h2jax.runtime.checkpoint import RunCheckpoints

        checkpoints = RunCheckpoints(trainer, checkpoint_dir, save_every=save_every, keep=keep, dataset=dataset)
    writer = _metrics_writer(log_dir, plan, dataset, plan.n_devices, trainer.emulated) if trainer.reports else None
    seen = [0]

    def stage_figures(step_time_s: float) -> dict:
        out, seen[0] = _stage_figures(trainer, seen[0], step_time_s)
        return out

    guard = RunGuard(plan, trainer)
    try:
        losses, times, norms, lrs, evals = train(
            trainer, plan, dataset, steps, start, on_step=on_step if trainer.reports else None,
            on_eval=on_eval if trainer.reports else None, writer=writer,
            stage_figures=stage_figures if log_dir else None, guard=guard, checkpoints=checkpoints,
        )
        saved = checkpoints.finish(trainer.step_count) if checkpoints is not None else None
    except RunInterrupted as e:
        if checkpoints is None:
            raise
        # The step is whole on every process: save it, then stop with status 0.
        path = checkpoints.finish(trainer.step_count)
        stopped = RunInterrupted(e.signum, e.step, f"checkpoint of step {trainer.step_count} written to {path}; "
                                 f"continue with --resume")
        stopped.exit_code = 0
        raise stopped from None
    finally:
        guard.close()
        if writer is not None:
            writer.close()
    if trace:
        write_run_trace(trainer, trace)
    result = RunResult(
        losses, times, plan.tokens_per_step, plan.n_devices,
        trainer.params_numpy() if return_params else None, norms, trainer.emulated,
        trainer.describe_transport(), trainer.reports, evals, lrs,
    )
    result.checkpoint = saved
    trainer.close()
    return result


def write_run_trace(trainer: Trainer, path: str) -> None:
    """The measured trace of `trainer`'s steps, in the simulator's track layout; under MPI
    every rank's events, gathered by the transport into one file written by rank 0."""
    from h2jax.trace import write_trace

    events = trainer.tracer.relative_events(0.0)
    gathered = trainer.transport.gather_to_first(events)
    if gathered is None:
        return
    events = [e for part in gathered for e in part]
    origin = min((e.start_s for e in events), default=0.0)
    events = [e._replace(start_s=e.start_s - origin) for e in events]
    plan = trainer.plan
    labels = [f"stage {i} ({s.chip})" for i, s in enumerate(plan.stages)]
    write_trace(events, path, stage_names=labels, metadata={"source": "measured", "schedule": plan.schedule})
