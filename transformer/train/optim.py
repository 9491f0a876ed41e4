"""The optax chain: learning-rate schedule, optimiser, decoupled weight decay with its mask, clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from transformer.config import OptimConfig
from transformer.model import OptimizerScaling

# Norm gains and biases are never decayed: pulling them toward zero shrinks nothing useful.
NO_DECAY_NAMES = ("scale", "bias", "b_in", "b_out", "qkv_bias", "out_bias")
EMBEDDING_NAMES = ("embed", "pos_embed")


def schedule(cfg: OptimConfig, total_steps: int):
    """lr(step): linear warmup from lr/warmup to lr, then cosine / linear / constant / warmup-stable-
    decay down to lr * min_lr_ratio at `total_steps`."""
    floor = cfg.min_lr_ratio
    warmup = cfg.warmup_steps

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1) / warmup) if warmup else 1.0
        progress = jnp.clip((step - warmup) / max(1, total_steps - warmup), 0.0, 1.0)
        match cfg.schedule:
            case "cosine":
                factor = floor + (1 - floor) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
            case "linear":
                factor = floor + (1 - floor) * (1 - progress)
            case "constant":
                factor = jnp.float32(1.0)
            case "wsd":
                decay = max(1, round(cfg.decay_fraction * total_steps))
                into_decay = jnp.clip((step - (total_steps - decay)) / decay, 0.0, 1.0)
                factor = 1 - (1 - floor) * into_decay
        return cfg.lr * warm * factor

    return lr


def decay_mask(params: dict, decay_embeddings: bool) -> dict:
    """For a pure-dict parameter tree: True where weight decay applies (weight matrices, and the
    embeddings if asked)."""

    def decays(path, _):
        name = path[-1].key
        if name in NO_DECAY_NAMES:
            return False
        return decay_embeddings if name in EMBEDDING_NAMES else True

    return jax.tree_util.tree_map_with_path(decays, params)


def scale_each(multipliers: dict) -> optax.GradientTransformation:
    """Each parameter's update times its own constant (µP's per-parameter learning rates, after the
    optimiser's normalisation, so Adam's moments and clipping are what they were); a multiplier of
    1.0 leaves its update untouched, bit for bit."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda u, c: u if c == 1.0 else u * c, updates, multipliers), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def decay_each(weight_decay: float, multipliers: dict, mask: dict) -> optax.GradientTransformation:
    """Decoupled weight decay (to be scaled by the learning rate, as in AdamW) at `weight_decay` times
    each parameter's own constant, where `mask` is True. With every multiplier 1.0 it is
    optax.add_decayed_weights's update to the last bit."""

    def update(updates, state, params=None):
        assert params is not None, "weight decay needs the parameters"
        if weight_decay == 0.0:  # as optax skips it: u + 0 * p would turn a -0.0 update into +0.0
            return updates, state

        def add(u, p, c, decays):
            return u + (weight_decay * c) * p if decays else u

        return jax.tree.map(add, updates, params, multipliers, mask), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(
    cfg: OptimConfig, total_steps: int, params: dict, scaling: OptimizerScaling | None = None
) -> optax.GradientTransformation:
    """The chain of `cfg`; with `scaling` (µP's and depth scaling's, model/parametrization.py) each
    parameter's learning rate and weight decay times its multipliers, and Adam's epsilon times its
    factor (the Adam family only, which config.Config checks)."""
    lr = schedule(cfg, total_steps)
    mask = decay_mask(params, cfg.decay_embeddings)
    if scaling is not None:
        # the Adam family written out as optax writes adamw, adam and lion, with the per-parameter
        # multipliers between normalising the step and scaling it by the learning rate
        core = (
            optax.scale_by_lion(cfg.b1, cfg.b2)
            if cfg.name == "lion"
            else optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps * scaling.eps)
        )
        steps = [core, scale_each(scaling.lr)]
        if cfg.name in ("adamw", "lion"):
            steps.append(decay_each(cfg.weight_decay, scaling.decay, mask))
        opt = optax.chain(*steps, optax.scale_by_learning_rate(lr))
    else:
        match cfg.name:
            case "adamw":
                opt = optax.adamw(lr, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
            case "adam":
                opt = optax.adam(lr, cfg.b1, cfg.b2, cfg.eps)
            case "lion":
                opt = optax.lion(lr, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
            case "adafactor":
                opt = optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=mask)
            case "sgd":
                opt = optax.chain(
                    optax.add_decayed_weights(cfg.weight_decay, mask),
                    optax.sgd(lr, momentum=cfg.b1 or None),
                )
    if cfg.clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
    return opt
