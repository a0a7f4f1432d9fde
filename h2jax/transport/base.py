"""The transport interface: how activations and their gradients cross stage boundaries.

Two implementations: `LocalTransport` (all stages in one process, arrays moved between
disjoint device sets by `jax.device_put`) and the MPI transport (one or more processes per
stage). The pipeline driver only ever talks to this interface.

Layout rule (topology-aware resharding): at a boundary, an activation of global shape
`[micro_batch, seq, d_model]` is laid out on the *receiving* stage's mesh as
`P("data", None, "tensor")`: each receiving data-parallel group gets its batch slice, split
over its tensor-parallel devices along d_model, so every element crosses the slow link once.
The receiver's compiled step all-gathers over `tensor` on its fast links. Gradients going
back use the sending stage's layout in mirror.

Boundaries: boundary b lies between (virtual) stage b and b + 1. Without virtual stages these
are the physical stages; under interleaved 1F1B (v chunks per stage, p stages) virtual stage
c*p + i runs on stage i, so boundary b joins stage b % p to stage (b + 1) % p (the last stage
wraps back to the first for the next chunk). Transports know no plan: the caller gives them
each boundary's (stage before, stage after) at `connect`, and `endpoints` maps a tag to them.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Mapping

ACT, GRAD = "act", "grad"


@dataclasses.dataclass(frozen=True, slots=True)
class Tag:
    """One message: `kind` ACT flows from (virtual) stage `boundary` to `boundary + 1`, GRAD
    back; `src_stage`/`dst_stage` are those (virtual) stages, `endpoints` the physical ones."""

    kind: str
    boundary: int
    micro: int

    @property
    def src_stage(self) -> int:
        return self.boundary if self.kind == ACT else self.boundary + 1

    @property
    def dst_stage(self) -> int:
        return self.boundary + 1 if self.kind == ACT else self.boundary


Boundaries = Mapping[int, tuple[int, int]]  # boundary -> (stage before it, stage after it)


def chain(n_stages: int) -> dict[int, tuple[int, int]]:
    """The boundaries of a plain pipeline: b joins stage b to stage b + 1."""
    return {b: (b, b + 1) for b in range(n_stages - 1)}


def endpoints(tag: Tag, boundaries: Boundaries | None) -> tuple[int, int]:
    """(sending stage, receiving stage) of `tag` (`boundaries` None: the plain chain)."""
    before, after = (tag.boundary, tag.boundary + 1) if boundaries is None else boundaries[tag.boundary]
    return (before, after) if tag.kind == ACT else (after, before)


class Transport(abc.ABC):
    """Moves boundary arrays between stages. Sends never block; receives block until ready."""

    @abc.abstractmethod
    def connect(self, boundary_shape: tuple[int, ...], dtype, layouts: Mapping[int, object],
                boundaries: Boundaries | None = None) -> None:
        """Prepare to move arrays of `boundary_shape`/`dtype`. `layouts[i]` is the
        `jax.sharding.NamedSharding` a boundary array has on stage i, for the stages this
        process runs; `boundaries` maps each boundary to (stage before, stage after)
        (default: the plain chain of stages, `chain`)."""

    @abc.abstractmethod
    def send(self, tag: Tag, value) -> None:
        """Start moving `value` (a jax.Array on the sending stage's layout); returns at once."""

    @abc.abstractmethod
    def ready(self, tag: Tag) -> bool:
        """Whether `recv(tag)` would return without waiting."""

    @abc.abstractmethod
    def recv(self, tag: Tag):
        """The array sent under `tag`, on the receiving stage's layout (waits if needed)."""

    def prepost(self, tags: list[Tag]) -> None:
        """Hint: these receives will be needed soon (the MPI transport posts them now)."""

    @abc.abstractmethod
    def sum_across_stages(self, local: Mapping[int, float]) -> float:
        """Sum of one scalar per stage (e.g. squared grad norms), over all stages of the job;
        `local` holds the values of the stages this process leads."""

    @abc.abstractmethod
    def share_from_stage(self, stage: int, values: list[float] | None) -> list[float]:
        """`values` computed on `stage` (e.g. the last stage's losses) made known to every
        process; processes that do not run `stage` pass None."""

    def gather_to_first(self, value) -> list | None:
        """Every process's `value` (small, picklable), as a list on the job's first process
        and None on the others (one process: `[value]`)."""
        return [value]

    def describe(self) -> dict:
        """What the transport did (kind, path, counters), for logs and reports."""
        return {}

    def flush(self) -> None:
        """Wait until every send this process started has completed."""

    def close(self) -> None:
        """Release buffers and communicators."""
