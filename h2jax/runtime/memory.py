"""A stage's memory per device, from XLA's analysis of its compiled steps, against its chip.

Before a stage allocates anything, its forward, backward and update are compiled for the
exact input layouts and `compiled.memory_analysis()` is read (sizes are per device of the
stage's mesh). What one device must hold at the stage's peak:

    persistent   parameters + optimizer state + f32 gradient accumulators (the update's
                 arguments)
    in flight    the schedule's most micro-batches whose forward ran and whose backward has
                 not (1F1B: p - i on stage i; GPipe: all m), times what each keeps: the
                 residuals the forward returns (what each block's recompute mode keeps)
    deferred W   under a split backward (ZB-H1), the schedule's most micro-batches between
                 their B and their W, times the per-piece output gradients B hands to W
    working      the largest micro-batch step's scratch (temp) plus the fresh outputs it
                 writes (outputs that alias donated inputs are not new)
    update       the optimizer update's scratch and fresh outputs: it runs once the last
                 backward is done, when nothing is in flight, so it takes the place of the
                 three terms above, not their sum

    needed = persistent + max(in flight + deferred W + working, update)

A stage that needs more than its chip's capacity (`[emulate] memory_gib` for an emulated
chip, else `memory_gib`) fails before running, naming the stage and both byte counts.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from h2jax.config import ConfigError

GIB = 2**30


class StageMemoryError(ConfigError):
    """A stage does not fit its chip; carries the figures for callers that re-plan."""

    def __init__(self, message: str, stage: int, chip: str, needed_bytes: int, capacity_bytes: int):
        super().__init__(message)
        self.stage, self.chip = stage, chip
        self.needed_bytes, self.capacity_bytes = needed_bytes, capacity_bytes


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs (or arrays) with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.shape
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _working(analysis) -> int:
    fresh_outputs = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return analysis.temp_size_in_bytes + max(fresh_outputs, 0) + analysis.generated_code_size_in_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class StageMemory:
    persistent_bytes: int
    per_micro_batch_bytes: int
    in_flight: int
    working_bytes: int
    capacity_bytes: int
    deferred: int = 0
    per_deferred_bytes: int = 0
    update_bytes: int = 0

    @property
    def step_bytes(self) -> int:
        """Beyond the persistent state, at the micro-batch steps' peak."""
        return self.in_flight * self.per_micro_batch_bytes + self.deferred * self.per_deferred_bytes + self.working_bytes

    @property
    def needed_bytes(self) -> int:
        return self.persistent_bytes + max(self.step_bytes, self.update_bytes)

    @classmethod
    def of(cls, executor, update, steps, held, in_flight: int, forward=None, deferred: int = 0,
           deferred_held=(), accumulators: int = 0) -> "StageMemory | None":
        """From a StageExecutor's compiled programs: `update`, the per-micro-batch `steps`,
        what each in-flight micro-batch keeps (`held`, a tree with shardings) and how many
        are in flight; `forward` is the step whose outputs include `held`, if any; `deferred`
        micro-batches each keeping `deferred_held` between B and W; `accumulators`: bytes per
        device the stage holds outside the update, over its arguments (a data-parallel
        stage's per-rank gradient accumulators less the reduced gradients that take their
        place at the update). None where the backend reports no memory analysis."""
        analyses = [c.memory_analysis() for c in (update, *steps)]
        if any(a is None for a in analyses):
            return None
        held_bytes = per_device_bytes(held)
        working = [_working(a) for a in analyses[1:]] or [0]
        if forward is not None:  # its outputs include the residuals counted as in flight
            f = forward.memory_analysis()
            working.append(max(_working(f) - held_bytes, f.temp_size_in_bytes))
            working.remove(_working(f))
        return cls(
            persistent_bytes=analyses[0].argument_size_in_bytes + accumulators,
            per_micro_batch_bytes=held_bytes,
            in_flight=in_flight,
            working_bytes=max(working),
            capacity_bytes=int(executor.chip.usable_memory_gib * GIB),
            deferred=deferred,
            per_deferred_bytes=per_device_bytes(deferred_held),
            update_bytes=_working(analyses[0]),
        )

    def check(self, executor) -> None:
        if self.needed_bytes <= self.capacity_bytes:
            return
        chip = executor.chip
        stage = executor.stage
        cap = f"emulated cap [emulate] memory_gib = {chip.emulate.memory_gib}" if chip.is_emulated else (
            f"memory_gib = {chip.memory_gib}"
        )
        raise StageMemoryError(
            f"stages[{executor.index}] (chip {chip.name}, layers {list(stage.layers)}, mesh "
            f"data={stage.mesh.data} tensor={stage.mesh.tensor}, recompute={stage.recompute}) needs "
            f"{self.needed_bytes:,} bytes per device but chip {chip.name} has {self.capacity_bytes:,} bytes "
            f"({cap} in backends/{chip.name}.toml): parameters, gradients and optimizer state "
            f"{self.persistent_bytes:,} B + {self.in_flight} micro-batch(es) in flight x "
            f"{self.per_micro_batch_bytes:,} B + "
            + (f"{self.deferred} deferred weight gradient(s) x {self.per_deferred_bytes:,} B + " if self.deferred else "")
            + f"working memory {self.working_bytes:,} B"
            + (f" (the optimizer update's {self.update_bytes:,} B, larger, counted instead)"
               if self.update_bytes > self.step_bytes else "") + ". "
            "Give the stage fewer layers, recompute=\"full\", a smaller micro_batch, more data "
            "or tensor parallelism, or a chip with more memory",
            executor.index, chip.name, self.needed_bytes, self.capacity_bytes,
        )
