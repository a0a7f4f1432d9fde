"""The unpipelined reference: the whole model as one jitted train step on one device.

Same initialization (StageModel over all layers), same data, same clipping and optimizer
functions as the pipeline, so a correct pipeline reproduces its losses and parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from h2jax.model import StageModel
from h2jax.plan import Plan
from h2jax.runtime.optim import apply_clipped_update, make_optimizer, squared_norm


class ReferenceModel:
    def __init__(self, plan: Plan, device=None, *, precision=None):
        device = device or jax.devices()[0]
        cfg = plan.model

        def build() -> StageModel:
            return StageModel(cfg, 0, cfg.n_layers, plan.seed, precision=precision)

        self.graphdef = nnx.graphdef(nnx.eval_shape(build))
        with jax.default_device(device):
            self.params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build())))()
            self.tx = make_optimizer(plan.optimizer, plan.train)
            self.opt_state = jax.jit(self.tx.init)(self.params)
        # Committed to the device like every step's outputs, so the step compiles once (an
        # uncommitted first input is a different signature and would compile it twice).
        self.params, self.opt_state = jax.device_put((self.params, self.opt_state), device)
        self.device = device
        clip_norm = plan.optimizer.clip_norm

        def step(params, opt_state, tokens):
            def loss_fn(p):
                return nnx.merge(self.graphdef, p)(tokens[:, :-1], tokens[:, 1:])

            loss, grads = jax.value_and_grad(loss_fn)(params)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            norm = jnp.sqrt(squared_norm(grads))
            params, opt_state = apply_clipped_update(self.tx, params, opt_state, grads, norm, clip_norm)
            return params, opt_state, loss, norm

        self.last_grad_norm = float("nan")
        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._loss = jax.jit(lambda params, tokens: nnx.merge(self.graphdef, params)(tokens[:, :-1], tokens[:, 1:]))

    def step(self, tokens: np.ndarray) -> float:
        tokens = jax.device_put(tokens, self.device)
        self.params, self.opt_state, loss, norm = self._step(self.params, self.opt_state, tokens)
        self.last_grad_norm = float(norm)
        return float(loss)

    def evaluate(self, tokens: np.ndarray) -> float:
        """The loss on `tokens` with the current parameters (no update)."""
        return float(self._loss(self.params, jax.device_put(tokens, self.device)))

    def params_numpy(self) -> dict:
        return jax.tree.map(np.asarray, self.params)
