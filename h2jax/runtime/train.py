"""Training loop: build the stages a process runs, step them, report progress.

`h2jax.run(plan, steps=...)` is the Python entry point; `h2jax run` calls it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from h2jax.data import TokenDataset, stdlib_corpus
from h2jax.plan import Plan, load_plan
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

    `emulate_time=False` runs emulated chip types at host speed (their precision policy and
    memory cap still apply), e.g. for numerics-only checks."""

    def __init__(
        self, plan: Plan, transport: Transport | None = None, stages: list[int] | None = None,
        devices=None, *, emulate_time: bool = True,
    ):
        from h2jax.cluster import load_chip
        from h2jax.runtime.emulation import ClockedTransport, StageClock
        from h2jax.runtime.devices import assign_devices
        from h2jax.runtime.pipeline import Pipeline
        from h2jax.runtime.stage import StageExecutor
        from h2jax.transport.local import LocalTransport

        self.plan = plan
        self.transport = transport or LocalTransport()
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
        self.pipeline = Pipeline(plan, self.transport, self.executors)

    def step(self, tokens: np.ndarray) -> float:
        loss = self.pipeline.step(tokens)
        for clock in self.clocks.values():  # the step ends when every emulated chip is done
            clock.wait()
        return loss

    def params_numpy(self) -> dict:
        from h2jax.sharding import flatten_params

        out: dict = {}
        for ex in self.executors.values():
            out.update(flatten_params(ex.params_numpy()))
        return out


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
) -> RunResult:
    """Train `plan` for `steps` optimizer steps; `unpipelined=True` runs the reference."""
    plan = load_plan(plan) if isinstance(plan, str) else plan
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
    trainer = Trainer(plan, transport, emulate_time=emulate_time)
    losses, times, norms = train(
        trainer.step, plan, dataset, steps, on_step=on_step,
        grad_norm=lambda: trainer.pipeline.last_grad_norm,
    )
    return RunResult(
        losses, times, plan.tokens_per_step, plan.n_devices,
        trainer.params_numpy() if return_params else None, norms, trainer.emulated,
    )
