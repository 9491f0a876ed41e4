"""Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682),
`optim.name: schedule_free_adamw`.

Three sequences: z takes the base optimiser's steps (Adam without momentum, decoupled decay, the
learning rate), x is their average weighted by lr_max^2 (the paper's c_t; the model to evaluate),
and gradients are taken at their interpolation y = (1 - b1) z + b1 x, which replaces momentum:

    y_t     = (1 - b1) z_t + b1 x_t
    z_t+1   = z_t + base_step(grad f(y_t), y_t)
    x_t+1   = (1 - c_t+1) x_t + c_t+1 z_t+1,    c_t+1 = lr_max,t^2 / sum_i<=t lr_max,i^2

optax's `contrib.schedule_free` keeps y as the parameters and recovers x from y and z for
evaluation. Here the train state's parameters are x, and y is formed inside the step
(`gradient_point`): everything that reads the parameters (validation, eval.py, generation, export,
a checkpoint's weights) then reads the model the paper evaluates, with no special case. The
arithmetic is the same as optax's to float rounding (tested). There is no decay schedule: the
learning rate is constant after its warm-up (config.OptimConfig refuses another schedule).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

WEIGHT_LR_POWER = 2.0  # the paper's r: each z's weight in the average is lr_max^2


class ScheduleFreeState(NamedTuple):
    step: jax.Array  # int32: updates made
    weight_sum: jax.Array  # float32: the sum of the weights so far
    max_lr: jax.Array  # float32: the largest learning rate so far (the warm-up's end, after it)
    z: optax.Params  # the base sequence, shaped (and sharded) like the parameters
    base: optax.OptState


def schedule_free(base: optax.GradientTransformation, lr, b1: float) -> optax.GradientTransformation:
    """`base` (which must include the learning rate and have no momentum of its own) made
    schedule-free with interpolation `b1`; `lr(step)` the schedule `base` follows, for the averaging
    weights. Its `update` takes the gradients at `gradient_point(params, state)` and the parameters
    x, and returns the step from x to the next x."""

    def init(params: optax.Params) -> ScheduleFreeState:
        zero = jnp.zeros([], jnp.float32)
        z = jax.tree.map(jnp.copy, params)  # its own buffer: the state and the parameters are both donated
        return ScheduleFreeState(jnp.zeros([], jnp.int32), zero, zero, z, base.init(params))

    def update(grads, state: ScheduleFreeState, params=None):
        assert params is not None, "schedule-free averages the parameters"
        y = interpolation(params, state.z, b1)
        steps, base_state = base.update(grads, state.base, y)
        z = jax.tree.map(lambda zi, si: (zi + si).astype(zi.dtype), state.z, steps)
        max_lr = jnp.maximum(state.max_lr, jnp.asarray(lr(state.step), jnp.float32))
        weight = max_lr**WEIGHT_LR_POWER
        weight_sum = state.weight_sum + weight
        c = jnp.where(weight_sum > 0, weight / jnp.where(weight_sum > 0, weight_sum, 1.0), 0.0)
        updates = jax.tree.map(lambda xi, zi: (c * (zi - xi)).astype(xi.dtype), params, z)
        return updates, ScheduleFreeState(optax.safe_increment(state.step), weight_sum, max_lr, z, base_state)

    return optax.GradientTransformation(init, update)


def interpolation(x: optax.Params, z: optax.Params, b1: float) -> optax.Params:
    """y = (1 - b1) z + b1 x, where the gradients are taken."""
    return jax.tree.map(lambda xi, zi: ((1.0 - b1) * zi + b1 * xi).astype(xi.dtype), x, z)


def gradient_point(params: optax.Params, opt_state: optax.OptState, b1: float) -> optax.Params:
    """Where a step's gradients are taken: y under schedule-free (whose state `opt_state` holds,
    at any depth of a chain), else the parameters themselves."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    return interpolation(params, found[0].z, b1) if found else params


def _is_state(node) -> bool:
    return isinstance(node, ScheduleFreeState)
