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

from h2jax.data import TokenDataset, stdlib_corpus
from h2jax.config import ConfigError
from h2jax.plan import Plan, load_plan
from h2jax.runtime import ranks
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
        return {
            "losses": self.losses,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_chip_per_s": self.tokens_per_chip_s,
            "grad_norms": self.grad_norms,
            "emulated": self.emulated,
        }


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
    """The stages of `plan` this process runs, wired through `transport`.

    By default: in one process, every stage on its own local devices, through a
    LocalTransport; under `mpiexec`, this rank's stage (configured before JAX starts) through
    an MPITransport (`mpi_path`: auto, direct or staged; default $H2JAX_MPI_PATH, else auto).
    `emulate_time=False` runs emulated chip types at host speed (their precision policy and
    memory cap still apply), e.g. for numerics-only checks. `tracer`
    (h2jax.runtime.tracing.StepTracer) records every action of every step."""

    def __init__(
        self, plan: Plan, transport: Transport | None = None, stages: list[int] | None = None,
        devices=None, *, emulate_time: bool = True, mpi_path: str | None = None, tracer=None,
    ):
        from h2jax.cluster import load_chip
        from h2jax.runtime.emulation import ClockedTransport, StageClock
        from h2jax.runtime.devices import assign_devices
        from h2jax.runtime.pipeline import Pipeline
        from h2jax.runtime.stage import StageExecutor

        self.plan = plan
        self.role = ranks.process_role(plan) if ranks.in_mpi_job() else None
        if self.role is not None and stages is None:
            transport, stages, devices = self._mpi_rank_setup(transport, mpi_path)
        elif transport is None:
            from h2jax.transport.local import LocalTransport

            transport = LocalTransport()
        self.transport = transport
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
                i: StageClock(c.emulate.slowdown if c.name in self.emulated else 1.0, defer)
                for i, c in chips.items()
            }
            self.transport = ClockedTransport(self.transport, self.clocks)
        self.executors = {
            i: StageExecutor(plan, i, placement[i], clock=self.clocks.get(i)) for i in stages
        }
        self.tracer = tracer
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

    def step(self, tokens: np.ndarray) -> float:
        loss = self.pipeline.step(tokens)
        for clock in self.clocks.values():  # the step ends when every emulated chip is done
            clock.wait()
        return loss

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


def train(
    step_fn: Callable[[np.ndarray], float],
    plan: Plan,
    dataset: TokenDataset,
    steps: int,
    start_step: int = 0,
    on_step: Callable[[int, float, float], None] | None = None,
    grad_norm: Callable[[], float] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    losses, times, norms = [], [], []
    for n in range(start_step, start_step + steps):
        tokens = dataset.batch(n, plan.global_batch)
        t0 = time.perf_counter()
        loss = step_fn(tokens)  # returns a Python float: the step has finished
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if grad_norm is not None:
            norms.append(grad_norm())
        if on_step is not None:
            on_step(n, loss, times[-1])
    return losses, times, norms


def run(
    plan: Plan | str,
    steps: int = 10,
    *,
    dataset: TokenDataset | None = None,
    transport: Transport | None = None,
    unpipelined: bool = False,
    on_step: Callable[[int, float, float], None] | None = None,
    return_params: bool = False,
    emulate_time: bool = True,
    mpi_path: str | None = None,
    trace: str | None = None,
) -> RunResult:
    """Train `plan` for `steps` optimizer steps and return what happened.

    In one process this sets up the host devices a CPU plan needs (when JAX has not started
    yet). Under `mpiexec` every rank calls it: each configures itself for its own stage and
    trains it with the others; any failure aborts the whole job. `unpipelined=True` runs the
    reference (one jitted function on one device). `trace` writes a Chrome/Perfetto trace of
    the run (under MPI every rank's events, gathered into one file by rank 0)."""
    plan = load_plan(plan) if isinstance(plan, str) else plan
    if not ranks.in_mpi_job():
        from h2jax.runtime.jaxsetup import prepare_local_devices

        if unpipelined:
            from h2jax.runtime.jaxsetup import force_cpu_devices, jax_backends_started

            if not jax_backends_started():
                force_cpu_devices(1)
        else:
            prepare_local_devices(plan)
        return _run(plan, steps, dataset, transport, unpipelined, on_step, return_params,
                    emulate_time, mpi_path, trace)
    if unpipelined:
        raise ConfigError("--unpipelined runs the whole model in one process; launch it without mpiexec")
    role = ranks.process_role(plan)
    with ranks.abort_on_failure(label=role.label):
        return _run(plan, steps, dataset, transport, False, on_step, return_params, emulate_time,
                    mpi_path, trace)


def _run(plan, steps, dataset, transport, unpipelined, on_step, return_params, emulate_time,
         mpi_path, trace) -> RunResult:
    dataset = dataset or default_dataset(plan)
    if unpipelined:
        from h2jax.runtime.reference import ReferenceModel

        model = ReferenceModel(plan)
        losses, times, norms = train(
            model.step, plan, dataset, steps, on_step=on_step, grad_norm=lambda: model.last_grad_norm
        )
        params = None
        if return_params:
            from h2jax.sharding import flatten_params

            params = flatten_params(model.params_numpy())
        return RunResult(losses, times, plan.tokens_per_step, 1, params, norms)
    from h2jax.runtime.tracing import StepTracer

    trainer = Trainer(plan, transport, emulate_time=emulate_time, mpi_path=mpi_path,
                      tracer=StepTracer() if trace else None)
    losses, times, norms = train(
        trainer.step, plan, dataset, steps, on_step=on_step if trainer.reports else None,
        grad_norm=lambda: trainer.last_grad_norm,
    )
    if trace:
        write_run_trace(trainer, trace)
    result = RunResult(
        losses, times, plan.tokens_per_step, plan.n_devices,
        trainer.params_numpy() if return_params else None, norms, trainer.emulated,
        trainer.describe_transport(), trainer.reports,
    )
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
