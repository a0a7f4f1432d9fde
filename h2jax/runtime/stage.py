"""One pipeline stage on its own device mesh: its parameters, optimizer, and compiled steps.

Each stage jits its forward, backward and optimizer update once, with explicit shardings on
its mesh. The forward runs piece by piece (embedding, each block, head and loss), keeping one
vjp closure per piece: per block what its recompute mode keeps (model.block_runner: named
activations, or under `recompute = "full"` only the block's input), never a copy of the
parameters (h2jax.residuals). The backward consumes those residuals piece by piece, adding
each piece's weight gradient to the f32 accumulators before the next piece starts.

Under a split-backward schedule (ZB-H1) the backward is two programs over the residuals:
B (`backward_input`) runs the input-gradient chain and returns each piece's output gradient;
W (`backward_weight`, deferred by the schedule) turns those into the pieces' weight
gradients. XLA drops the weight-gradient matmuls from B and the input-gradient ones from W,
so together they cost one backward.

Data parallelism: each micro-batch's gradients stay unreduced, one f32 accumulator per data
rank (a leading axis of size `data`, split over it), and are reduced once per step
(`reduce_gradients`: their sum onto the optimizer state's ZeRO-1 layout, each rank
keeping its slice -- a reduce-scatter's worth of traffic -- or whole without ZeRO-1), not
once per micro-batch. A data-parallel stage's programs run on
its rank's share of the micro-batch (`jax.vmap` over the ranks' shares, the vmapped axis
split over `data`), so no program but the reduction sums over the ranks: a gradient whose
accumulator were replicated over `data` would be all-reduced inside every backward, m times
the bytes of one reduction per step (the cost model's).
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from h2jax import schedules as sched
from h2jax.model import StageModel, cross_entropy, layer_name
from h2jax.cluster import ChipType, load_chip
from h2jax.config import ConfigError
from h2jax.plan import Plan
from h2jax.runtime.emulation import StageClock
from h2jax.runtime.memory import StageMemory, per_device_bytes
from h2jax.residuals import after, join, split_off
from h2jax.runtime.optim import apply_clipped_update, make_optimizer, squared_norm
from h2jax.sharding import (
    BOUNDARY_AXES,
    HIDDEN_AXES,
    TOKENS_AXES,
    make_mesh,
    named,
    over_data,
    param_shardings,
    shape_tree,
)


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype(name: str):
    return DTYPES[name]


def _zeros_f32(tree, ranks: int = 1):
    """f32 zeros shaped like `tree`'s leaves, with a leading axis of `ranks` where it is > 1."""
    lead = (ranks,) if ranks > 1 else ()
    return jax.tree.map(lambda x: jnp.zeros(lead + tuple(x.shape), jnp.float32), tree)


def _without_data(sharding: NamedSharding) -> NamedSharding:
    """The sharding with its `data` entries dropped: an activation's layout inside a program
    that runs on one data rank's share (vmapped over the ranks, which adds `data` back)."""
    spec = [None if e == "data" else e for e in sharding.spec]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _cast_floats(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def boundary_dtype(plan: Plan) -> str:
    """Dtype of activations crossing stage boundaries: the chips' common compute dtype, or
    float32 when their policies differ (both sides cast; one dtype for every transport)."""
    dtypes = {load_chip(s.chip).precision.compute_dtype for s in plan.stages}
    return dtypes.pop() if len(dtypes) == 1 else "float32"


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class StageExecutor:
    """Runs stage `index` of `plan` on `devices` (a list of jax devices, data-major)."""

    def __init__(
        self, plan: Plan, index: int, devices: list, *, precision=None, param_dtype=None,
        compute_dtype=None, clock: StageClock | None = None, check_memory: bool = True,
        attention: str | None = None, lr_schedule=None, chunk: int = 0,
    ):
        """Numerics default to the stage chip's [precision] policy and the attention kernel to
        its [kernels] choice (`attention`: one of h2jax.config.ATTENTION_KERNELS); `clock` (see
        h2jax.runtime.emulation) times each compute. The steps are compiled before anything
        is allocated and, with `check_memory`, a stage that does not fit its chip is refused.
        `lr_schedule` (a function of the update count) replaces the plan's schedule.
        `chunk`: under interleaved 1F1B, which of the stage's layer chunks this executor runs
        (virtual stage chunk * n_stages + index; `ChunkedStage` holds one per chunk)."""
        stage = plan.stages[index]
        self.plan, self.index, self.stage = plan, index, stage
        self.chip: ChipType = load_chip(stage.chip)
        numerics = self.chip.precision
        precision = numerics.matmul_precision if precision is None else precision
        self.param_dtype = _dtype(param_dtype or numerics.param_dtype)
        self.compute_dtype = _dtype(compute_dtype or numerics.compute_dtype)
        self.attention = attention or self.chip.attention_kernel
        head_dim = plan.model.head_dim
        if self.attention == "cudnn" and (head_dim % 8 or head_dim > 256):
            # cuDNN's flash kernel takes head dims that are multiples of 8 up to 256 (128 before Hopper)
            raise ConfigError(
                f"stages[{index}] (chip {stage.chip}): cuDNN's fused attention needs a head dim "
                f"(d_model / n_heads = {head_dim}) that is a multiple of 8 and at most 256; set "
                f"[kernels] attention = \"xla\" in the chip file {stage.chip}.toml or change the model"
            )
        self.boundary_dtype = _dtype(boundary_dtype(plan))
        self.clock = clock
        v = plan.virtual_stages
        if not 0 <= chunk < v:
            raise ValueError(f"chunk {chunk} is not one of stage {index}'s {v} layer chunks")
        self.chunk = chunk
        # the first and last virtual stage: stage 0's chunk 0, the last stage's last chunk
        self.is_first = index == 0 and chunk == 0
        self.is_last = index == plan.n_stages - 1 and chunk == v - 1
        self.schedule = sched.get_schedule(plan.schedule)
        self.actions = [a for a in self.schedule.stage_actions(index, plan.n_stages, plan.n_micro, v)
                        if a.chunk == chunk]
        self.split_backward = self.schedule.splits_backward
        self.mesh = make_mesh(devices, stage.mesh.data, stage.mesh.tensor)
        self.ranks = stage.mesh.data  # data-parallel ranks: > 1, gradients kept per rank until the step's reduction
        cfg = plan.model
        start, end = stage.layer_ranges[chunk]
        # what makes this stage's programs one computation with another executor's, whichever
        # layers of the model they hold (the end stages' embedding and head aside)
        self.program_identity = (
            cfg, plan.seq_len, plan.micro_batch, plan.optimizer, stage.chip, stage.mesh, stage.recompute,
            end - start, self.is_first, self.is_last, self.attention, str(self.param_dtype),
            str(self.compute_dtype), str(precision), self.split_backward,
        )

        def build() -> StageModel:
            return StageModel(
                cfg, start, end, plan.seed,
                dtype=self.param_dtype, precision=precision, recompute=stage.recompute,
                attention=self.attention, first=self.is_first, last=self.is_last,
            )

        self.graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
        self.param_sharding = param_shardings(abstract_state, self.mesh)
        self.tx = make_optimizer(plan.optimizer, plan.train, lr_schedule)
        # Optimizer moments take their parameter's layout, split over `data` as well under
        # ZeRO-1 (plan.optimizer.shard_over_data: the update takes each rank's slice of the
        # reduced gradients and XLA all-gathers the new parameters); scalars (step counts) are replicated on
        # the stage mesh. Every step's outputs are pinned to these layouts.
        replicated = NamedSharding(self.mesh, PartitionSpec())
        zero1 = plan.optimizer.shard_over_data
        self.opt_sharding = optax.tree_map_params(
            self.tx,
            lambda leaf, sharding: over_data(sharding, leaf.shape) if zero1 else sharding,
            jax.eval_shape(self.tx.init, shape_tree(abstract_state)),
            self.param_sharding,
            transform_non_params=lambda _: replicated,
        )

        def init():
            params = nnx.to_pure_dict(nnx.state(build()))
            return params, self.tx.init(params), _zeros_f32(params, self.ranks)

        # In a stage spanning several processes (one jax.distributed group per stage) only
        # the group's first process speaks for the stage in cross-stage collectives.
        self.is_stage_leader = jax.process_index() == 0

        self.input_sharding = named(self.mesh, TOKENS_AXES if self.is_first else BOUNDARY_AXES)
        self.labels_sharding = named(self.mesh, TOKENS_AXES)
        self.boundary_sharding = named(self.mesh, BOUNDARY_AXES)
        self._hidden_sharding = named(self.mesh, HIDDEN_AXES)
        # Per data rank: a leading axis of the ranks, split over `data` (the accumulators),
        # the activations' layouts inside a rank's program (`_without_data`), and the
        # reduced gradients' layout (the optimizer state's: each rank its ZeRO-1 slice).
        abstract_params = shape_tree(abstract_state)
        if self.ranks > 1:
            self.acc_sharding = jax.tree.map(
                lambda sh: NamedSharding(self.mesh, PartitionSpec("data", *sh.spec)), self.param_sharding)
            self._inner_hidden = _without_data(self._hidden_sharding)
            self._inner_boundary = _without_data(self.boundary_sharding)
        else:
            self.acc_sharding = self.param_sharding
            self._inner_hidden, self._inner_boundary = self._hidden_sharding, self.boundary_sharding
        self.grad_sharding = jax.tree.map(
            lambda sh, x: over_data(sh, x.shape) if zero1 else sh, self.param_sharding, abstract_params)
        self._grads = None  # the step's reduced gradients, between reduce_gradients and update
        # share_state's `until` while it holds the current state (see update), else None
        self._state_shared: threading.Event | None = None
        self._piece_order = (["embed"] if self.is_first else []) + [layer_name(i) for i in range(start, end)] + (
            ["head"] if self.is_last else [])
        self._compile()

        init_jit = jax.jit(init, out_shardings=(self.param_sharding, self.opt_sharding, self.acc_sharding))
        self._abstract_state = _abstract(
            jax.eval_shape(init_jit), (self.param_sharding, self.opt_sharding, self.acc_sharding)
        )
        self.memory = self.compiled_memory()
        if check_memory and self.memory is not None:
            self.memory.check(self)
        # Shape first, then one compiled init straight into the sharded layout: no stage
        # ever materializes a parameter on a single device.
        self.params, self.opt_state, self.grad_acc = init_jit()

    # ------------------------------------------------------------------ compiled steps

    def _f32_gradient(self, g):
        """A parameter gradient (in the compute dtype) rounded to the parameter dtype, as the
        cast's own vjp would, and widened to the f32 accumulator's."""
        return g.astype(self.param_dtype).astype(jnp.float32)

    def _kept_residuals(self, vjps, cast):
        """The residuals a jitted forward returns: all but the parameters (h2jax.residuals)."""
        kept, self._residual_layout = split_off(vjps, cast)
        return kept

    def _joined(self, params, kept):
        """The vjp closures `_kept_residuals` came from, with the parameters back in."""
        return join(kept, self._residual_layout, _cast_floats(params, self.compute_dtype))

    # ------------------------------------------------------------ forward and backward

    def _pieces(self) -> list[str]:
        """The stage's parameter groups in the order its forward applies them."""
        return self._piece_order

    def _piece(self, model, name: str, h, labels):
        if name == "embed":
            return model.embed(h)
        if name == "head":
            return cross_entropy(model.head(h), labels)
        return model.run_block(getattr(model, name), h)  # as StageModel runs its blocks: its recompute mode

    def _piece_vjps(self, params, x, labels):
        """(output, one vjp closure per piece): the stage's forward, piece by piece; each vjp
        takes the piece's output gradient and returns (its parameters' gradient, its input's),
        the first stage's embedding only the former; and the compute-dtype parameters. The
        boundary casts ride on the first and last pieces so the input gradient comes back in
        the boundary layout."""
        cast = _cast_floats(params, self.compute_dtype)
        names = self._pieces()
        if not names:  # an empty layer chunk of an interleaved plan: the activation passes on
            return jax.lax.with_sharding_constraint(x.astype(self.boundary_dtype), self._inner_boundary), [], cast
        vjps, h = [], x
        for j, name in enumerate(names):
            def f(p_sub, h_in, name=name, j=j):
                model = nnx.merge(self.graphdef, {**cast, name: p_sub})
                if j == 0 and not self.is_first:
                    h_in = jax.lax.with_sharding_constraint(h_in, self._inner_hidden).astype(self.compute_dtype)
                out = self._piece(model, name, h_in, labels)
                if j < len(names) - 1 or not self.is_last:
                    # the residual stream replicated over tensor (Megatron): left to itself,
                    # XLA spreads the boundary's split over tensor back into the blocks and
                    # pays an all-gather before each matmul and a sum per norm
                    out = jax.lax.with_sharding_constraint(out, self._inner_hidden)
                if j == len(names) - 1 and not self.is_last:
                    out = jax.lax.with_sharding_constraint(out.astype(self.boundary_dtype), self._inner_boundary)
                return out
            if j == 0 and self.is_first:  # integer tokens have no gradient
                h, vjp = jax.vjp(lambda p, f=f: f(p, x), cast[name])
            else:
                h, vjp = jax.vjp(f, cast[name], h)
            vjps.append(vjp)
        return h, vjps, cast

    def _input_gradient(self, vjps, dy):
        """B: (input gradient, each piece's output gradient) from the pieces' residuals."""
        g, cots = dy, [None] * len(vjps)
        for j in range(len(vjps) - 1, -1, -1):
            cots[j] = g
            if j == 0 and self.is_first:
                break
            g = vjps[j](g)[1]
        return self._boundary_gradient(g), cots

    def _boundary_gradient(self, g):
        return None if self.is_first else jax.lax.with_sharding_constraint(g, self._inner_boundary)

    def _add(self, acc, name, grad):
        return jax.tree.map(lambda a, x: a + self._f32_gradient(x), acc[name], grad)

    def _weight_gradient(self, acc, vjps, cots):
        """W: each piece's parameter gradient from its residuals and output gradient, added to
        the f32 accumulators, one piece at a time (each piece's output gradient is tied to the
        previous piece's sum: its recomputation and gradient wait until that is done)."""
        acc, previous = dict(acc), None
        for name, vjp, g in reversed(list(zip(self._pieces(), vjps, cots))):
            if previous is not None:
                g = after(g, previous)
            acc[name] = previous = self._add(acc, name, vjp(g)[0])
        return acc

    def _backward_pieces(self, acc, vjps, dy):
        """B and W together: (accumulators, input gradient). Each piece's gradient is added to
        its accumulator before the next piece's backward starts (`after`), so one piece's
        weight gradient is alive at a time."""
        acc, g = dict(acc), dy
        for j in range(len(vjps) - 1, -1, -1):
            name = self._pieces()[j]
            if j == 0 and self.is_first:  # the embedding: integer tokens have no gradient
                (grad,) = vjps[j](g)
            else:
                grad, g = vjps[j](g)
            acc[name] = self._add(acc, name, grad)
            g = after(g, acc[name])
        return acc, self._boundary_gradient(g)

    def _over_ranks(self, fn, in_axes):
        """`fn` on each data rank's share at once (its arguments' leading axis: the ranks,
        split over `data`; None: the same for every rank, the parameters)."""
        return jax.vmap(fn, in_axes=in_axes, spmd_axis_name="data")

    def _shares(self, x):
        """A micro-batch's array (batch first, split over `data`) as the ranks' shares: (ranks,
        batch / ranks, ...); None stays None."""
        return None if x is None else x.reshape((self.ranks, x.shape[0] // self.ranks) + x.shape[1:])

    def _output(self, h):
        """The ranks' outputs as the stage's: the micro-batch's mean loss on the last stage
        (the ranks' shares are equal), else their shares back as one boundary activation."""
        return jnp.mean(h) if self.is_last else self._input_gradient_out(h)

    def _input_gradient_out(self, x):
        """The ranks' shares of a boundary array (an input gradient, an output) back as one,
        in the boundary layout; None stays None (the first stage's input gradient)."""
        return None if x is None else jax.lax.with_sharding_constraint(
            x.reshape((-1,) + x.shape[2:]), self.boundary_sharding)

    def _dy_shares(self, dy):
        """The output gradient per rank: the loss's cotangent over the ranks (the loss is their
        mean) on the last stage, else its shares."""
        if self.is_last:
            return jnp.broadcast_to(dy / self.ranks, (self.ranks,))
        return self._shares(dy)

    def _compile(self) -> None:
        labels_sh = self.labels_sharding if self.is_last else None
        in_sh = (self.param_sharding, self.input_sharding, labels_sh)
        grad_out_sh = (self.acc_sharding, None if self.is_first else self.boundary_sharding)
        dx_sh = None if self.is_first else self.boundary_sharding

        # The forward returns the pieces' residuals but the parameters (a `jax.vjp` closure
        # is a pytree, so it leaves one jitted function and enters another): per block what
        # its recompute mode keeps (model.block_runner).
        def forward_one(params, x, labels):
            h, vjps, cast = self._piece_vjps(params, x, labels)
            return h, self._kept_residuals(vjps, cast)

        def input_gradient_one(params, kept, dy):
            return self._input_gradient(self._joined(params, kept), dy)

        def weight_gradient_one(acc, params, kept, cots):
            return self._weight_gradient(acc, self._joined(params, kept), cots)

        def backward_one(acc, params, kept, dy):
            return self._backward_pieces(acc, self._joined(params, kept), dy)

        def forward_backward_one(acc, params, x, labels, dy):
            out, vjps, _ = self._piece_vjps(params, x, labels)
            acc, dx = self._backward_pieces(acc, vjps, dy)
            return out, acc, dx

        if self.ranks == 1:
            forward, input_gradient, weight_gradient = forward_one, input_gradient_one, weight_gradient_one
            backward, forward_backward = backward_one, forward_backward_one
        else:  # each data rank's share in one program, its gradients its own (module docstring)
            def forward(params, x, labels):
                h, kept = self._over_ranks(forward_one, (None, 0, 0))(params, self._shares(x), self._shares(labels))
                return self._output(h), kept

            def input_gradient(params, kept, dy):
                dx, cots = self._over_ranks(input_gradient_one, (None, 0, 0))(params, kept, self._dy_shares(dy))
                return self._input_gradient_out(dx), cots

            def weight_gradient(acc, params, kept, cots):
                return self._over_ranks(weight_gradient_one, (0, None, 0, 0))(acc, params, kept, cots)

            def backward(acc, params, kept, dy):
                acc, dx = self._over_ranks(backward_one, (0, None, 0, 0))(acc, params, kept, self._dy_shares(dy))
                return acc, self._input_gradient_out(dx)

            def forward_backward(acc, params, x, labels, dy):
                out, acc, dx = self._over_ranks(forward_backward_one, (0, None, 0, 0, 0))(
                    acc, params, self._shares(x), self._shares(labels), self._dy_shares(dy))
                return self._output(out), acc, self._input_gradient_out(dx)

        self._forward = jax.jit(forward, in_shardings=in_sh)
        if self.split_backward:
            self._backward_input = jax.jit(input_gradient, out_shardings=(dx_sh, None))
            self._backward_weight = jax.jit(weight_gradient, donate_argnums=(0,), out_shardings=self.acc_sharding)
        else:
            self._backward = jax.jit(backward, donate_argnums=(0,), out_shardings=grad_out_sh)

        # When the schedule runs a micro-batch's backward right after its forward (the last
        # stage under 1F1B), one program does both: no residuals round-trip through memory.
        self._forward_backward = jax.jit(
            forward_backward,
            in_shardings=(self.acc_sharding,) + in_sh + (None,),
            donate_argnums=(0,),
            out_shardings=(None,) + grad_out_sh,
        )
        clip_norm = self.plan.optimizer.clip_norm
        replicated = NamedSharding(self.mesh, PartitionSpec())
        if self.ranks == 1:
            self._sq_norm = jax.jit(squared_norm)
            self._reduce = None

            def update(params, opt_state, acc, norm):
                params, opt_state = apply_clipped_update(self.tx, params, opt_state, acc, norm, clip_norm)
                return params, opt_state, _zeros_f32(acc)

            state_out = (self.param_sharding, self.opt_sharding, self.acc_sharding)
            self._update = jax.jit(update, donate_argnums=(0, 1, 2), out_shardings=state_out)
            # After `share_state`, one update leaves the parameters and optimizer state where
            # they are (writing the new ones to fresh buffers): the shared arrays stay valid.
            self._update_keeping_state = jax.jit(update, donate_argnums=(2,), out_shardings=state_out)
        else:
            # The step's one reduction over the data ranks: their accumulators summed onto the
            # reduced gradients' layout (ZeRO-1: each rank its slice), with their squared norm
            # (for the global clipping norm). The accumulators are dropped once it has run and
            # made again after the update (`_fresh`): the reduced gradients and the next
            # step's accumulators are never held at once.
            def reduce(acc):
                grads = jax.tree.map(lambda a: jnp.sum(a, axis=0), acc)
                return squared_norm(grads), grads

            self._reduce = jax.jit(reduce, out_shardings=(replicated, self.grad_sharding))
            self._fresh = jax.jit(lambda grads: _zeros_f32(grads, self.ranks), out_shardings=self.acc_sharding)

            def update(params, opt_state, grads, norm):
                return apply_clipped_update(self.tx, params, opt_state, grads, norm, clip_norm)

            state_out = (self.param_sharding, self.opt_sharding)
            self._update = jax.jit(update, donate_argnums=(0, 1), out_shardings=state_out)
            self._update_keeping_state = jax.jit(update, out_shardings=state_out)
        # each program by a name that is the same for every executor of this computation (an
        # emulated chip's clock shares its least measured time over them, emulation.py)
        self._programs = {fn: name for name, fn in (
            ("forward", self._forward), ("forward_backward", self._forward_backward),
            ("backward", getattr(self, "_backward", None)),
            ("backward_input", getattr(self, "_backward_input", None)),
            ("backward_weight", getattr(self, "_backward_weight", None)),
            ("update", self._update), ("update_keeping_state", self._update_keeping_state),
            ("reduce_gradients", self._reduce),
        ) if fn is not None}

    def compiled_memory(self) -> StageMemory | None:
        """Compile forward, backward and update ahead of time for this stage's exact input
        layouts (the later calls reuse these executables) and read their memory analyses."""
        params, opt_state, acc = self._abstract_state
        mb, seq, d = self.plan.micro_batch, self.plan.seq_len, self.plan.model.d_model
        if self.is_first:
            x = jax.ShapeDtypeStruct((mb, seq), jnp.int32, sharding=self.input_sharding)
        else:
            x = jax.ShapeDtypeStruct((mb, seq, d), self.boundary_dtype, sharding=self.input_sharding)
        labels = jax.ShapeDtypeStruct((mb, seq), jnp.int32, sharding=self.labels_sharding) if self.is_last else None
        if self.is_last:
            dy = jax.ShapeDtypeStruct((), jnp.float32)
        else:
            dy = jax.ShapeDtypeStruct((mb, seq, d), self.boundary_dtype, sharding=self.boundary_sharding)
        norm = jax.ShapeDtypeStruct((), jnp.float32)
        accumulators = 0
        if self.ranks == 1:
            update = self._update.lower(params, opt_state, acc, norm).compile()
        else:  # the update takes the reduced gradients; the ranks' accumulators live in their place
            grads = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape[1:], jnp.float32, sharding=sh),
                                 acc, self.grad_sharding)
            update = self._update.lower(params, opt_state, grads, norm).compile()
            accumulators = per_device_bytes(acc) - per_device_bytes(grads)
        fused, split = self._micro_batch_programs(self.actions)
        steps, held, forward, cots = [], (), None, ()
        if fused:
            steps.append(self._forward_backward.lower(acc, params, x, labels, dy).compile())
        if split:
            forward = self._forward.lower(params, x, labels).compile()
            _, held = forward.out_info  # the residuals but the parameters
            if self.split_backward:
                b = self._backward_input.lower(params, held, dy).compile()
                _, cots = b.out_info  # each piece's output gradient, kept from B until W
                steps += [forward, b, self._backward_weight.lower(acc, params, held, cots).compile()]
            else:
                steps += [forward, self._backward.lower(acc, params, held, dy).compile()]
        if self._reduce is not None:  # its reduced gradients beside the accumulators, once a step
            steps.append(self._reduce.lower(acc).compile())
        # the registry's rules (h2jax.schedules): what this stage's action list holds at peak
        p, m = self.plan.n_stages, self.plan.n_micro
        if self.plan.virtual_stages == 1:
            in_flight = self.schedule.in_flight(self.index, p, m) if split else 0
            deferred = self.schedule.deferred(self.index, p, m) if split else 0
        else:  # this chunk's share of the stage's list (ChunkedStage checks the stage's sum)
            in_flight = sched.max_in_flight(self.actions) if split else 0
            deferred = sched.max_deferred(self.actions) if split else 0
        return StageMemory.of(self, update, steps, held, in_flight, forward, deferred, cots, accumulators)

    def _micro_batch_programs(self, actions: list[sched.Action]) -> tuple[bool, bool]:
        """(fused, split): whether the pipeline runs forward_backward (the same rule as
        Pipeline._backward_follows) and whether it runs separate forward and backward."""
        follows = [
            self.is_last and sched.backward_follows(actions, i)
            for i, a in enumerate(actions) if a.kind == sched.F
        ]
        return any(follows), not all(follows)

    # ------------------------------------------------------------------ the runtime's calls

    def _run(self, fn, *args):
        if self.clock is None:
            return fn(*args)
        name = self._programs.get(fn)
        return self.clock.run(fn, *args, program=None if name is None else (self.program_identity, name))

    def forward(self, x, labels=None) -> tuple[Any, Any]:
        """(output, saved): output is the boundary activation, or the loss on the last stage;
        `saved` is what backward needs (each block's residuals under its recompute mode)."""
        return self._run(self._forward, self.params, x, labels)

    def backward_input(self, saved, dy):
        """B of a split backward: (input gradient, what W needs: the residuals and each
        piece's output gradient)."""
        dx, cots = self._run(self._backward_input, self.params, saved, dy)
        return dx, (saved, cots)

    def backward_weight(self, pending) -> None:
        """W of a split backward: accumulates the weight gradients of one micro-batch."""
        saved, cots = pending
        self.grad_acc = self._run(self._backward_weight, self.grad_acc, self.params, saved, cots)

    def backward(self, saved, dy):
        """Accumulates this micro-batch's parameter gradients; returns the input gradient."""
        self.grad_acc, dx = self._run(self._backward, self.grad_acc, self.params, saved, dy)
        return dx

    def forward_backward(self, x, labels, dy):
        """forward then backward of one micro-batch in one program: (output, input gradient)."""
        out, self.grad_acc, dx = self._run(self._forward_backward, self.grad_acc, self.params, x, labels, dy)
        return out, dx

    @property
    def reduces_gradients(self) -> bool:
        """Whether `grad_squared_norm` reduces the step's gradients over data ranks (its own
        program, traced as "dp reduce")."""
        return self._reduce is not None

    def grad_squared_norm(self) -> float:
        """The squared norm of the step's gradients; on a data-parallel stage this is where
        they are reduced over the data ranks (`reduce_gradients`), once per step."""
        if self.clock is not None:
            self.clock.wait()  # known only once this stage's chip has finished its backward
        # Every process of a multi-process stage must run this (it is a collective over the
        # stage's mesh); the result is replicated, so the local copy is the whole value.
        if self._reduce is None:
            return float(self._sq_norm(self.grad_acc).addressable_data(0))
        norm, self._grads = self._run(self._reduce, self.grad_acc)
        self.grad_acc = None  # (made again, zero, after the update)
        return float(norm.addressable_data(0))

    def update(self, global_norm: float) -> None:
        """One optimizer step with the gradients accumulated since the last one."""
        shared, self._state_shared = self._state_shared, None
        program = self._update_keeping_state if shared is not None and not shared.is_set() else self._update
        if self._reduce is None:
            self.params, self.opt_state, self.grad_acc = self._run(
                program, self.params, self.opt_state, self.grad_acc, jnp.float32(global_norm)
            )
            return
        if self._grads is None:  # (the norm was not asked for: reduce now)
            self.grad_squared_norm()
        grads, self._grads = self._grads, None
        self.params, self.opt_state = self._run(program, self.params, self.opt_state, grads, jnp.float32(global_norm))
        self.grad_acc = self._fresh(grads)

    def share_state(self, until: threading.Event | None = None) -> tuple[dict, Any]:
        """(parameters, optimizer state) as they are now, valid until `until` is set (for as
        long as the caller holds them when None): the next update, if `until` is not set by
        then, writes the new state to fresh buffers instead of donating these, and never waits
        for it. A checkpoint's snapshot without a copy on the training thread: the writer
        sets `until` once it has copied every byte (checkpoint.write_data_file), usually long
        before the next update, which then updates in place as usual instead of holding a
        second copy of the state on the stage's devices."""
        self._state_shared = until if until is not None else threading.Event()
        return self.params, self.opt_state


    def put_input(self, x: np.ndarray):
        return jax.device_put(x, self.input_sharding)

    def put_labels(self, y: np.ndarray):
        return jax.device_put(y, self.labels_sharding)

    def params_numpy(self) -> dict:
        return jax.tree.map(np.asarray, self.params)


# ----------------------------------------------------------------------------- interleaved 1F1B


class ChunkedStage:
    """Stage `index` of an interleaved plan (virtual_stages v > 1): one StageExecutor per
    layer chunk, all on the stage's devices (chunk c is virtual stage c * n_stages + index).
    What the runtime asks of a stage as a whole (its gradient norm, its update, its
    parameters and memory) covers every chunk; the pipeline runs each chunk's actions on
    `chunks[c]`. Memory: each chunk compiles its own programs; the stage is checked against
    its chip for the sum of the chunks' persistent state, the registry's in-flight count for
    the whole stage times the largest chunk's per-micro-batch residuals, and the largest
    working set."""

    def __init__(self, plan: Plan, index: int, devices: list, *, check_memory: bool = True, **kwargs):
        self.chunks = [StageExecutor(plan, index, devices, chunk=c, check_memory=False, **kwargs)
                       for c in range(plan.virtual_stages)]
        first = self.chunks[0]
        self.plan, self.index, self.stage, self.chip, self.clock = plan, index, first.stage, first.chip, first.clock
        self.is_first, self.is_last = index == 0, index == plan.n_stages - 1
        self.is_stage_leader = first.is_stage_leader
        self.boundary_sharding, self.boundary_dtype = first.boundary_sharding, first.boundary_dtype
        self.memory = self._memory()
        if check_memory and self.memory is not None:
            self.memory.check(self)

    def _memory(self) -> StageMemory | None:
        parts = [ex.memory for ex in self.chunks]
        if any(m is None for m in parts):
            return None
        schedule = self.chunks[0].schedule
        p, m, v = self.plan.n_stages, self.plan.n_micro, self.plan.virtual_stages
        return StageMemory(
            persistent_bytes=sum(x.persistent_bytes for x in parts),
            per_micro_batch_bytes=max(x.per_micro_batch_bytes for x in parts),
            in_flight=schedule.in_flight(self.index, p, m, v),
            working_bytes=max(x.working_bytes for x in parts),
            capacity_bytes=parts[0].capacity_bytes,
            deferred=schedule.deferred(self.index, p, m, v),
            per_deferred_bytes=max(x.per_deferred_bytes for x in parts),
            update_bytes=max(x.update_bytes for x in parts),
        )

    @property
    def params(self) -> dict:
        """Every chunk's parameters, by global group name (embed, layer_NNN, head)."""
        return {k: v for ex in self.chunks for k, v in ex.params.items()}

    @property
    def reduces_gradients(self) -> bool:
        return self.chunks[0].reduces_gradients

    def grad_squared_norm(self) -> float:
        return float(sum(ex.grad_squared_norm() for ex in self.chunks))

    def update(self, global_norm: float) -> None:
        for ex in self.chunks:
            ex.update(global_norm)

    def params_numpy(self) -> dict:
        return jax.tree.map(np.asarray, self.params)


def chunk_executors(stage) -> list[StageExecutor]:
    """The executors of a stage, by chunk: a ChunkedStage's chunks, else the stage itself."""
    return getattr(stage, "chunks", None) or [stage]
