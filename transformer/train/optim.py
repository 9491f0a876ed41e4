"""The optax chain: learning-rate schedule, optimiser, decoupled weight decay with its mask, clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from transformer.config import OptimConfig

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
    optimiser, so Adam's moments, weight decay's mask and clipping are what they were); a
    multiplier of 1.0 leaves its update untouched, bit for bit."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda u, c: u if c == 1.0 else u * c, updates, multipliers), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(
    cfg: OptimConfig, total_steps: int, params: dict, lr_multipliers: dict | None = None
) -> optax.GradientTransformation:
    """The chain of `cfg`; with `lr_multipliers` (a tree like `params`: µP's), each parameter's
    learning rate times its multiplier."""
    lr = schedule(cfg, total_steps)
    mask = decay_mask(params, cfg.decay_embeddings)
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
    if lr_multipliers is not None:
        opt = optax.chain(opt, scale_each(lr_multipliers))
    if cfg.clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
    return opt
