"""The pipeline driver: runs each local stage's schedule actions through a transport.

The schedule (h2jax.schedules) decides the order; this module only executes it. Stages this
process runs are interleaved: a stage runs while its next action is ready and yields at a
receive whose message has not arrived. JAX dispatch is asynchronous, so stages on disjoint
devices compute concurrently. When no local stage can move, the driver blocks on the first
pending receive (under MPI the peer will deliver it; locally it means a deadlock, reported).
"""

from __future__ import annotations

import numpy as np

from h2jax import schedules as sched
from h2jax.config import ConfigError
from h2jax.plan import Plan
from h2jax.runtime.stage import StageExecutor, chunk_executors
from h2jax.transport.base import ACT, GRAD, Tag, Transport


class NonFiniteLossError(ConfigError):
    """A step produced a non-finite loss or gradient; says in which step and stage it first
    appeared. Raised before that step's update, so the parameters are the previous step's."""

    def __init__(self, what: str, stage: int | None, where: str, plan: Plan | None = None,
                 step: int | None = None, updated: bool = False):
        self.what, self.stage, self.where, self.plan, self.step = what, stage, where, plan, step
        self.updated = updated
        super().__init__(self._message())

    def at_step(self, step: int) -> "NonFiniteLossError":
        return NonFiniteLossError(self.what, self.stage, self.where, self.plan, step, self.updated)

    def _message(self) -> str:
        when = f"step {self.step}" if self.step is not None else "a step"
        if self.stage is not None:
            chip = f" ({self.plan.stages[self.stage].chip})" if self.plan is not None else ""
            where = f"it first appeared in stage {self.stage}{chip}'s {self.where}"
        else:
            where = self.where or "the job's first process names the stage"
        kept = "" if self.updated else (
            f" with the parameters as they were after step {self.step - 1}" if self.step is not None else "")
        return (f"{when}: {self.what} ({where}); training stopped{kept}. Lower optimizer.learning_rate, "
                "set optimizer.clip_norm, or check that the data's token ids are below model.vocab_size")


def _all_finite(x, so_far):
    """On the device, without waiting: whether `x` is all finite (and `so_far`, when given)."""
    global _finite_fns
    if _finite_fns is None:
        import jax
        import jax.numpy as jnp

        _finite_fns = (jax.jit(lambda a: jnp.isfinite(a).all()),
                       jax.jit(lambda a, f: jnp.logical_and(jnp.isfinite(a).all(), f)))
    return _finite_fns[0](x) if so_far is None else _finite_fns[1](x, so_far)


_finite_fns = None


class _StageRun:
    """One stage's progress through its action list within one step. `ex` is the stage
    (a StageExecutor, or under interleaved 1F1B a ChunkedStage); `chunks[c]` runs the
    actions of chunk c. Arrays are keyed by (micro-batch, chunk)."""

    def __init__(self, ex, actions: list[sched.Action], training: bool = True):
        self.ex, self.actions, self.pos, self.training = ex, actions, 0, training
        self.chunks: list[StageExecutor] = chunk_executors(ex)
        self.n_stages = ex.plan.n_stages
        self.inbox: dict[tuple[str, int, int], object] = {}  # (ACT|GRAD, micro, chunk) -> received array
        self.outbox: dict[tuple[str, int, int], object] = {}  # (ACT|GRAD, micro, chunk) -> array to send
        self.saved: dict[tuple[int, int], object] = {}  # (micro, chunk) -> residuals for the backward
        self.deferred: dict[tuple[int, int], object] = {}  # (micro, chunk) -> what its W needs (split backward)
        self.losses: dict[int, object] = {}  # micro -> loss (the last virtual stage)
        self.finite = None  # on the device: every forward output of this step so far is finite

    @property
    def done(self) -> bool:
        return self.pos == len(self.actions)

    def pending_tag(self) -> Tag | None:
        """The receive this stage waits on, if its next action is a receive."""
        return None if self.done else receive_tag(self.ex.index, self.actions[self.pos], self.n_stages)

    def receive_tags(self) -> list[Tag]:
        """Every message this stage receives in the step, in the order it needs them."""
        return [t for a in self.actions if (t := receive_tag(self.ex.index, a, self.n_stages)) is not None]


def receive_tag(stage: int, action: sched.Action, n_stages: int = 1) -> Tag | None:
    """The message a receive action of `stage` takes; None for other actions. Boundaries are
    virtual: chunk c of stage i is virtual stage c * n_stages + i (transport.base)."""
    vs = action.chunk * n_stages + stage
    if action.kind == sched.RECV_ACT:
        return Tag(ACT, vs - 1, action.micro)
    if action.kind == sched.RECV_GRAD:
        return Tag(GRAD, vs, action.micro)
    return None


def send_tag(stage: int, action: sched.Action, n_stages: int = 1) -> Tag:
    """The message a send action of `stage` makes (virtual boundaries, as receive_tag)."""
    vs = action.chunk * n_stages + stage
    return Tag(ACT, vs, action.micro) if action.kind == sched.SEND_ACT else Tag(GRAD, vs - 1, action.micro)


def virtual_boundaries(plan: Plan) -> dict[int, tuple[int, int]] | None:
    """Under interleaved 1F1B, each virtual boundary's (stage before, stage after): boundary
    b joins stage b % p to stage (b + 1) % p (the last stage wraps to the first for the
    next chunk); None for a plain pipeline (the transports' default chain)."""
    p, v = plan.n_stages, plan.virtual_stages
    if v == 1:
        return None
    return {b: (b % p, (b + 1) % p) for b in range(p * v - 1)}


class Pipeline:
    """`tracer` (h2jax.runtime.tracing.StepTracer), when given, records every action."""

    def __init__(self, plan: Plan, transport: Transport, executors: dict, tracer=None):
        self.plan, self.transport, self.executors, self.tracer = plan, transport, executors, tracer
        self.schedule = sched.get_schedule(plan.schedule).build(plan.n_stages, plan.n_micro, plan.virtual_stages)
        first = next(iter(executors.values()))
        shape = (plan.micro_batch, plan.seq_len, plan.model.d_model)
        layouts = {i: ex.boundary_sharding for i, ex in executors.items()}
        boundaries = virtual_boundaries(plan)
        if boundaries is None:
            transport.connect(shape, first.boundary_dtype, layouts)
        else:
            transport.connect(shape, first.boundary_dtype, layouts, boundaries)

    def step(self, tokens: np.ndarray | None) -> float:
        """One optimizer step on a global batch `tokens` [global_batch, seq_len + 1];
        returns the mean loss (known on every process). A process that runs neither the
        first nor the last stage reads no tokens: it may pass None."""
        runs = [_StageRun(ex, self.schedule[i]) for i, ex in sorted(self.executors.items())]
        self._drive(runs, tokens)
        return self._finish(runs)

    def evaluate(self, tokens: np.ndarray | None) -> float:
        """The mean loss of `tokens` under the current parameters: forwards only (every
        micro-batch through every stage in order), no gradients, no update."""
        runs = [_StageRun(ex, self._forward_only(i), training=False) for i, ex in sorted(self.executors.items())]
        self._drive(runs, tokens)
        return self._mean_loss(runs)

    def _forward_only(self, stage: int) -> list[sched.Action]:
        p, v = self.plan.n_stages, self.plan.virtual_stages
        actions = []
        for k in range(self.plan.n_micro):
            for c in range(v):
                first, last = stage == 0 and c == 0, stage == p - 1 and c == v - 1
                actions += ([] if first else [sched.Action(sched.RECV_ACT, k, c)]) + [sched.Action(sched.F, k, c)]
                actions += [] if last else [sched.Action(sched.SEND_ACT, k, c)]
        return actions

    def _drive(self, runs: list[_StageRun], tokens: np.ndarray | None) -> None:
        plan = self.plan
        mb = plan.micro_batch
        inputs = labels = None
        if tokens is not None:
            inputs = [tokens[k * mb:(k + 1) * mb, :-1] for k in range(plan.n_micro)]
            labels = [tokens[k * mb:(k + 1) * mb, 1:] for k in range(plan.n_micro)]
        elif any(ex.is_first or ex.is_last for ex in self.executors.values()):
            raise ValueError("this process runs the first or the last stage: it needs the batch's tokens")
        self.transport.prepost([t for r in runs for t in r.receive_tags()])
        while not all(r.done for r in runs):
            progressed = False
            for run in runs:
                while not run.done:
                    tag = run.pending_tag()
                    if tag is not None and not self.transport.ready(tag):
                        break
                    self._execute(run, inputs, labels)
                    progressed = True
            if not progressed:
                # Blocks until the peer delivers (MPI), or reports a deadlock (local).
                self._execute(next(r for r in runs if not r.done), inputs, labels)
        self.transport.flush()

    @property
    def _loss_cotangent(self) -> np.float32:
        """d(step loss)/d(micro-batch loss): the step's loss is the mean over micro-batches."""
        return np.float32(1.0 / self.plan.n_micro)

    @staticmethod
    def _backward_follows(run: _StageRun) -> bool:
        """The last (virtual) stage's forward k is immediately followed by its backward k."""
        ex = run.chunks[run.actions[run.pos].chunk]
        return ex.is_last and sched.backward_follows(run.actions, run.pos)

    def _execute(self, run: _StageRun, inputs, labels) -> None:
        if self.tracer is None:
            self._run_action(run, inputs, labels)
            return
        a, t0 = run.actions[run.pos], self.tracer.now()
        computed = self._run_action(run, inputs, labels)
        ex, args = run.chunks[a.chunk], {"micro": a.micro}
        if a.chunk:
            args["chunk"] = a.chunk
        if computed is not None:
            interval = ex.clock.last_interval if ex.clock is not None else None
            self.tracer.compute(ex.index, computed[0], t0, computed[1], args, interval)
        elif a.kind in (sched.RECV_ACT, sched.RECV_GRAD):
            self.tracer.comm(ex.index, repr(a), t0, self.tracer.now(), args)
        else:
            self.tracer.comm(ex.index, repr(a), t0, t0, args)

    def _run_action(self, run: _StageRun, inputs, labels):
        """Runs the stage's next action; for a compute returns (its name in a trace, the
        arrays it produced), else None. Names carry the chunk as the simulator's do (F3c1)."""
        a = run.actions[run.pos]
        c, k = a.chunk, a.micro
        ex, mc, n = run.chunks[c], (a.micro, a.chunk), f"{a.micro}" + (f"c{a.chunk}" if a.chunk else "")
        computed = None
        if a.kind == sched.F and self._backward_follows(run):
            x = ex.put_input(inputs[k]) if ex.is_first else run.inbox.pop((ACT, k, c))
            run.losses[k], dx = ex.forward_backward(x, ex.put_labels(labels[k]), self._loss_cotangent)
            if not ex.is_first:
                run.outbox[GRAD, k, c] = dx
            computed = (f"F{n}+B{n}", (run.losses[k], dx, ex.grad_acc))
            run.pos += 1  # the B action just ran too
        elif a.kind == sched.F:
            x = ex.put_input(inputs[k]) if ex.is_first else run.inbox.pop((ACT, k, c))
            y = ex.put_labels(labels[k]) if ex.is_last else None
            out, saved = ex.forward(x, y)
            if run.training:
                run.saved[mc] = saved
            computed = (f"F{n}", out)
            run.finite = _all_finite(out, run.finite)
            if ex.is_last:
                run.losses[k] = out
            else:
                run.outbox[ACT, k, c] = out
        elif a.kind == sched.B:
            dy = self._loss_cotangent if ex.is_last else run.inbox.pop((GRAD, k, c))
            if ex.split_backward:  # the input gradient now, the weight gradient at its W
                dx, run.deferred[mc] = ex.backward_input(run.saved.pop(mc), dy)
                computed = (f"B{n}", (dx, run.deferred[mc][1]))
            else:
                dx = ex.backward(run.saved.pop(mc), dy)
                computed = (f"B{n}", (dx, ex.grad_acc))
            if not ex.is_first:
                run.outbox[GRAD, k, c] = dx
        elif a.kind == sched.W:
            ex.backward_weight(run.deferred.pop(mc))
            computed = (f"W{n}", ex.grad_acc)
        elif a.kind == sched.SEND_ACT:
            self.transport.send(send_tag(ex.index, a, run.n_stages), run.outbox.pop((ACT, k, c)))
        elif a.kind == sched.SEND_GRAD:
            self.transport.send(send_tag(ex.index, a, run.n_stages), run.outbox.pop((GRAD, k, c)))
        elif a.kind in (sched.RECV_ACT, sched.RECV_GRAD):
            tag = run.pending_tag()
            run.inbox[tag.kind, k, c] = self.transport.recv(tag)
        run.pos += 1
        return computed

    def _non_finite(self, runs: list[_StageRun], sq: dict, global_norm: float) -> "NonFiniteLossError":
        """Where a non-finite value first appeared, in pipeline order: the first stage whose
        forward output (activation, or the last stage's loss) was not finite, else the last stage
        whose gradient is not (the backward runs last to first). Every process calls this; the
        job's first process gets the answer (the others wait for its abort of the job)."""
        forward, backward = [], [i for i, v in sq.items() if not np.isfinite(v)]
        for r in runs:
            losses = [r.losses[k] for k in sorted(r.losses)]
            if (r.finite is not None and not bool(r.finite)) or not np.isfinite(np.asarray(losses, float)).all():
                forward.append(r.ex.index)
        parts = self.transport.gather_to_first((forward, backward))
        if parts is None:  # not the job's first process: it names the stage and aborts the job
            import time

            time.sleep(30)
            return NonFiniteLossError(f"the gradient norm is {global_norm}", None, "")
        forward = sorted(i for f, _ in parts for i in f)
        backward = sorted(i for _, b in parts for i in b)
        if forward:
            stage, where = forward[0], "forward output" if forward[0] < self.plan.n_stages - 1 else "loss"
        else:
            stage, where = (backward[-1], "gradient") if backward else (None, "")
        return NonFiniteLossError(f"the gradient norm is {global_norm}", stage, where, self.plan)

    def _finish(self, runs: list[_StageRun]) -> float:
        # All processes of a stage compute its norm (a collective over the stage's mesh); only
        # the stage's leader contributes it to the cross-stage sum.
        sq = {}
        for r in runs:
            t0 = self.tracer.now() if self.tracer is not None else 0.0
            norm = r.ex.grad_squared_norm()  # (a data-parallel stage's one gradient reduction of the step)
            if self.tracer is not None and getattr(r.ex, "reduces_gradients", False):
                interval = r.ex.clock.last_interval if r.ex.clock is not None else None
                self.tracer.compute(r.ex.index, "dp reduce", t0, r.ex.params, None, interval)  # (done: the norm is on the host)
            if r.ex.is_stage_leader:
                sq[r.ex.index] = norm
        global_norm = float(np.sqrt(self.transport.sum_across_stages(sq)))
        if not np.isfinite(global_norm):  # before the update: the parameters stay good
            raise self._non_finite(runs, sq, global_norm)
        for r in runs:
            t0 = self.tracer.now() if self.tracer is not None else 0.0
            r.ex.update(global_norm)
            if self.tracer is not None:
                interval = r.ex.clock.last_interval if r.ex.clock is not None else None
                self.tracer.compute(r.ex.index, "optimizer", t0, r.ex.params, None, interval)
        self.last_grad_norm = global_norm
        return self._mean_loss(runs)

    def _mean_loss(self, runs: list[_StageRun]) -> float:
        """The mean of the last stage's micro-batch losses, shared with every process."""
        last = self.plan.n_stages - 1
        local_losses = None
        for r in runs:
            if r.ex.is_last:
                local_losses = [float(r.losses[k]) for k in range(self.plan.n_micro)]
        return float(np.mean(self.transport.share_from_stage(last, local_losses)))
