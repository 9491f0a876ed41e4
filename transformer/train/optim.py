"""The optax chain: learning-rate schedule, optimiser, decoupled weight decay with its mask, clipping."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from transformer.config import ModelConfig, OptimConfig
from transformer.model import OptimizerScaling
from transformer.train.muon import is_matrix, scale_by_muon
from transformer.train.schedule_free import schedule_free
from transformer.train.soap import scale_by_soap

# Norm gains and biases are never decayed: pulling them toward zero shrinks nothing useful.
# router_bias: no gradient reaches it, and no decay may move it (model/moe.py)
NO_DECAY_NAMES = ("scale", "bias", "b_in", "b_out", "qkv_bias", "out_bias", "router_bias")
EMBEDDING_NAMES = ("embed", "pos_embed", "type_embed")


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


def scale_by_adam_each(b1: float, b2: float, eps: float, factors: dict) -> optax.GradientTransformation:
    """optax.scale_by_adam with each parameter's epsilon `eps` times its own factor (µP's and depth
    scaling's: model/parametrization.py), written as optax writes it, so that its state is optax's
    and with every factor 1.0 its update is optax's to the last bit."""
    adam = optax.scale_by_adam(b1, b2, eps)

    def update(updates, state, params=None):
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        # sqrt(v + 0.0) as optax's eps_root of 0 has it: -0.0 + 0.0 is +0.0
        steps = jax.tree.map(lambda m, v, c: m / (jnp.sqrt(v + 0.0) + eps * c), mu_hat, nu_hat, factors)
        return steps, optax.ScaleByAdamState(count=count, mu=mu, nu=optax.tree.cast_like(nu, state.nu))

    return optax.GradientTransformation(adam.init, update)


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


def independent_decay(rate: float, shape, mask: dict) -> optax.GradientTransformation:
    """Weight decay not scaled by the learning rate (optim.independent_decay): the update, already
    scaled by the learning rate, minus shape(t) * rate * theta where `mask` is True; `shape(count)` is
    the schedule's lr(count) / peak, read at the same update count as the optimiser's own schedule."""

    def init(params):
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        assert params is not None, "weight decay needs the parameters"
        factor = shape(state.count) * rate
        decayed = jax.tree.map(lambda u, p, m: u - factor * p if m else u, updates, params, mask)
        return decayed, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def make_optimizer(
    cfg: OptimConfig,
    total_steps: int,
    params: dict,
    scaling: OptimizerScaling | None = None,
    model: ModelConfig | None = None,
) -> optax.GradientTransformation:
    """The chain of `cfg`; with `scaling` (µP's and depth scaling's, model/parametrization.py) each
    parameter's learning rate and weight decay times its multipliers, and Adam's epsilon times its
    factor (the Adam family only, which config.Config checks). Muon needs the `model` its
    parameters' names are read by."""
    lr = schedule(cfg, total_steps)
    mask = decay_mask(params, cfg.decay_embeddings)
    if cfg.independent_decay:  # the optimiser without decay, then the decay after it, at every width alike
        plain = dataclasses.replace(cfg, weight_decay=0.0, independent_decay=False)
        opt = make_optimizer(plain, total_steps, params, scaling, model)
        decay = independent_decay(cfg.weight_decay, lambda count: lr(count) / cfg.lr, mask)
        return optax.chain(opt, decay)
    if cfg.name == "muon":
        assert model is not None, "Muon reads its matrices' layouts from the model config"
        opt = _muon(cfg, lr, total_steps, params, scaling, model)
    elif cfg.name == "schedule_free_adamw":  # µP is refused with it (config.Config)
        opt = _schedule_free_adamw(cfg, lr, mask)
    elif cfg.name == "soap":  # µP is refused with it too
        assert model is not None, "SOAP reads its matrices' layouts from the model config"
        opt = _soap(cfg, lr, params, model)
    elif scaling is not None:
        # the Adam family written out as optax writes adamw, adam and lion, with the per-parameter
        # multipliers between normalising the step and scaling it by the learning rate
        core = (
            optax.scale_by_lion(cfg.b1, cfg.b2)
            if cfg.name == "lion"
            else scale_by_adam_each(cfg.b1, cfg.b2, cfg.eps, scaling.eps)
        )
        steps = [core, scale_each(scaling.lr)]
        if cfg.name in ("adamw", "lion"):
            steps.append(decay_each(cfg.weight_decay, scaling.decay, mask))
        opt = optax.chain(*steps, optax.scale_by_learning_rate(lr))
    else:
        opt = _standard(cfg, lr, mask, total_steps)
    if cfg.clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
    return opt


def ademamix_schedules(cfg: OptimConfig, total_steps: int):
    """(alpha(step), b3(step)) of AdEMAMix as its paper's code warms them up, `step` 1-based (the
    update it is read for): alpha linearly from 0, b3 from b1 linearly in the half-life
    t = log(1/2) / log(beta) - 1, over `warmup` steps."""
    a = cfg.ademamix
    warmup = a.warmup or total_steps

    def half_life(beta):
        return jnp.log(0.5) / jnp.log(beta + 1e-8) - 1.0

    def alpha(step):
        return a.alpha * jnp.minimum(jnp.asarray(step, jnp.float32) / warmup, 1.0)

    def b3(step):
        frac = jnp.minimum(jnp.asarray(step, jnp.float32) / warmup, 1.0)
        life = (1.0 - frac) * half_life(cfg.b1) + frac * half_life(a.b3)
        return jnp.where(frac < 1.0, jnp.power(0.5, 1.0 / (life + 1.0)), a.b3)

    return alpha, b3


def _standard(cfg: OptimConfig, lr, mask: dict, total_steps: int) -> optax.GradientTransformation:
    """optax's own optimiser of `cfg.name` (the Adam family, Adafactor, SGD, AdEMAMix)."""
    match cfg.name:
        case "ademamix":
            alpha, b3 = ademamix_schedules(cfg, total_steps)
            # optax counts updates from 0; the paper's code reads its schedules at the 1-based step
            return optax.contrib.ademamix(
                lr,
                cfg.b1,
                cfg.b2,
                lambda c: b3(c + 1),
                lambda c: alpha(c + 1),
                cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=mask,
            )
        case "adamw":
            return optax.adamw(lr, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
        case "adam":
            return optax.adam(lr, cfg.b1, cfg.b2, cfg.eps)
        case "lion":
            return optax.lion(lr, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
        case "adafactor":
            return optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=mask)
        case _:
            return optax.chain(
                optax.add_decayed_weights(cfg.weight_decay, mask), optax.sgd(lr, momentum=cfg.b1 or None)
            )


def _schedule_free_adamw(cfg: OptimConfig, lr, mask: dict) -> optax.GradientTransformation:
    """Schedule-free AdamW (train/schedule_free.py): its base is AdamW without momentum (b1 is the
    interpolation instead), as optax's `contrib.schedule_free_adamw` and the paper's code have it,
    with this framework's decay mask, at the warm-up-then-constant learning rate."""
    base = optax.chain(
        optax.scale_by_rms(decay=cfg.b2, eps=cfg.eps, eps_in_sqrt=False, bias_correction=True),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(lr),
    )
    return schedule_free(base, lr, cfg.b1)


def _soap(cfg: OptimConfig, lr, params: dict, model: ModelConfig) -> optax.GradientTransformation:
    """SOAP on the hidden matrices (train/soap.py) with decoupled decay lr * wd * W, AdamW on the rest
    (Muon's two groups), both at optim.lr with optim.b1, b2 and eps, on the same schedule."""
    groups = {
        "soap": optax.chain(
            scale_by_soap(cfg, model), optax.add_decayed_weights(cfg.weight_decay), optax.scale_by_learning_rate(lr)
        ),
        "adamw": optax.adamw(
            lr,
            cfg.b1,
            cfg.b2,
            cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=lambda p: decay_mask(p, cfg.decay_embeddings),
        ),
    }
    return optax.partition(groups, jax.tree.map(lambda m: "soap" if m else "adamw", is_matrix(model, params)))


def _muon(
    cfg: OptimConfig, lr, total_steps: int, params: dict, scaling: OptimizerScaling | None, model: ModelConfig
) -> optax.GradientTransformation:
    """Muon on the hidden matrices (train/muon.py), at optim.lr with decoupled decay lr * wd * W as in
    Jordan's and Moonlight's code; AdamW on the rest at optim.muon.adam_lr, decayed where `decay_mask`
    says, on the same schedule. Under µP every learning-rate and decay multiplier here is 1 (the
    spectral scale does the width for the matrices, and the others' rules are 1 across width), which
    this checks; AdamW's epsilon takes µP's one width factor."""
    eps = cfg.eps
    if scaling is not None:
        ones = all(c == 1.0 for c in jax.tree.leaves((scaling.lr, scaling.decay)))
        assert ones, "µP under Muon scales no learning rate (config.Config refuses depth scaling with it)"
        (factor,) = set(jax.tree.leaves(scaling.eps))  # 1/m_d_model for every parameter without depth scaling
        eps = cfg.eps * factor
    adam_lr = schedule(dataclasses.replace(cfg, lr=cfg.muon.adam_lr or cfg.lr), total_steps)
    groups = {
        "muon": optax.chain(
            scale_by_muon(cfg.muon, model),
            optax.add_decayed_weights(cfg.weight_decay),
            optax.scale_by_learning_rate(lr),
        ),
        "adamw": optax.adamw(
            adam_lr,
            cfg.b1,
            cfg.b2,
            eps,
            weight_decay=cfg.weight_decay,
            mask=lambda p: decay_mask(p, cfg.decay_embeddings),
        ),
    }
    labels = jax.tree.map(lambda m: "muon" if m else "adamw", is_matrix(model, params))
    return optax.partition(groups, labels)
