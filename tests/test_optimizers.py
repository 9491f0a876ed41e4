"""Optimisers beside AdamW and Muon (train/optim.py): AdEMAMix's warm-up schedules in closed form
and its step against the formula, schedule-free AdamW against optax's and its average in closed
form, independent weight decay against its closed form, each optimiser's refused keys in one line. Resume bit for bit of
every optimiser is tests/test_checkpoint.py's; Muon's own tests are tests/test_muon.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.config import AdEMAMixConfig, ConfigError, OptimConfig
from transformer.config_loader import load_config
from transformer.train.optim import ademamix_schedules, make_optimizer, schedule
from transformer.train.schedule_free import gradient_point


def test_ademamix_warms_alpha_linearly_and_b3_linearly_in_half_life():
    cfg = OptimConfig(name="ademamix", b1=0.9, ademamix=AdEMAMixConfig(b3=0.999, alpha=8.0, warmup=100))
    alpha, b3 = ademamix_schedules(cfg, total_steps=1000)
    assert float(alpha(0)) == 0.0 and float(alpha(50)) == pytest.approx(4.0) and float(alpha(400)) == 8.0
    half_life = lambda b: math.log(0.5) / math.log(b) - 1
    assert float(b3(0)) == pytest.approx(0.9, rel=1e-6) and float(b3(100)) == pytest.approx(0.999)
    middle = 0.5 * (half_life(0.9) + half_life(0.999))  # half-way in half-life, not in beta
    assert float(b3(50)) == pytest.approx(0.5 ** (1 / (middle + 1)), rel=1e-5)
    # null warmup: the whole run
    alpha, _ = ademamix_schedules(OptimConfig(name="ademamix"), total_steps=200)
    assert float(alpha(100)) == pytest.approx(2.5)


def test_ademamix_steps_are_the_formula():
    """Two steps by hand: m1 and nu Adam's (bias-corrected), m2 the slow EMA with b3(count) and not
    corrected, the step lr * ((m1_hat + alpha m2) / (sqrt(nu_hat) + eps) + wd * w)."""
    a = AdEMAMixConfig(b3=0.99, alpha=4.0, warmup=4)
    cfg = OptimConfig(name="ademamix", lr=0.1, schedule="constant", warmup_steps=0, clip_norm=None, ademamix=a)
    params = {"w": jnp.asarray([[1.0, -2.0], [0.5, 3.0]])}
    tx = make_optimizer(cfg, 10, params)
    alpha, b3 = ademamix_schedules(cfg, 10)
    state = tx.init(params)
    m1 = m2 = nu = np.zeros((2, 2))
    grads = [np.asarray([[0.3, -0.1], [0.2, 0.4]]), np.asarray([[-0.2, 0.5], [0.1, -0.3]])]
    for t, g in enumerate(grads):
        updates, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
        m1 = 0.9 * m1 + 0.1 * g
        m2 = float(b3(t + 1)) * m2 + (1 - float(b3(t + 1))) * g  # the schedules read the 1-based step
        nu = 0.95 * nu + 0.05 * g**2
        m1_hat, nu_hat = m1 / (1 - 0.9 ** (t + 1)), nu / (1 - 0.95 ** (t + 1))
        step = (m1_hat + float(alpha(t + 1)) * m2) / (np.sqrt(nu_hat) + 1e-8) + 0.1 * np.asarray(params["w"])
        np.testing.assert_allclose(updates["w"], -0.1 * step, rtol=1e-5)
    assert jax.tree.leaves(state)  # the slow EMA lives in the state that checkpoints save


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["optim.ademamix.alpha=3"], "optim.ademamix"),
        (["optim.name=ademamix", "optim.ademamix.b3=1.0"], "optim.ademamix.b3"),
        (["optim.name=ademamix", "optim.ademamix.warmup=0"], "optim.ademamix.warmup"),
        (["optim.name=ademamix", "model.parametrization=mup"], "optim.name"),
        (["optim.name=schedule_free_adamw"], "optim.schedule"),  # the default schedule decays
        (["optim.name=schedule_free_adamw", "optim.schedule=constant", "optim.b1=0"], "optim.b1"),
        (["optim.name=schedule_free_adamw", "optim.schedule=constant", "monitor.lr_factor=0.5"], "monitor.lr_factor"),
        (["optim.name=schedule_free_adamw", "optim.schedule=constant", "model.parametrization=mup"], "optim.name"),
        (["optim.soap.precondition_every=5"], "optim.soap"),
        (["optim.name=soap", "optim.soap.precondition_every=0"], "optim.soap.precondition_every"),
        (["optim.name=soap", "optim.soap.max_precond_dim=0"], "optim.soap.max_precond_dim"),
        (["optim.name=soap", "model.parametrization=mup"], "optim.name"),
        (
            ["optim.independent_decay=true", "model.parametrization=mup", "model.depth_scaling=complete_p"],
            "optim.independent_decay",
        ),
        (
            ["optim.name=schedule_free_adamw", "optim.schedule=constant", "optim.independent_decay=true"],
            "optim.independent_decay",
        ),
    ],
)
def test_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key, str(err.value)


def _regression():
    """A least-squares problem with two decayed matrices, and its loss."""
    rng = np.random.default_rng(0)
    data, target = jnp.asarray(rng.standard_normal((32, 6))), jnp.asarray(rng.standard_normal((32, 3)))
    params = {
        "w_in": jnp.asarray(rng.standard_normal((6, 5))) * 0.3,
        "w_out": jnp.asarray(rng.standard_normal((5, 3))) * 0.3,
    }

    def loss(p):
        return jnp.mean(jnp.square(jnp.tanh(data @ p["w_in"]) @ p["w_out"] - target))

    return params, loss


def _schedule_free_run(cfg: OptimConfig, steps: int):
    """(x after each step, z after each step) of our schedule-free AdamW on `_regression`."""
    params, loss = _regression()
    tx = make_optimizer(cfg, steps, params)
    state, xs, zs = tx.init(params), [], []
    for _ in range(steps):
        grads = jax.grad(loss)(gradient_point(params, state, cfg.b1))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        xs.append(params)
        zs.append(state.z)
    return xs, zs


def test_schedule_free_adamw_is_optaxs():
    """The parameters here are optax's evaluation parameters x (optax keeps y and recovers x), step
    after step, weight decay included."""
    cfg = OptimConfig(
        name="schedule_free_adamw", schedule="constant", warmup_steps=0, lr=0.05, b2=0.999, clip_norm=None
    )
    ours, _ = _schedule_free_run(cfg, 30)
    params, loss = _regression()
    tx = optax.contrib.schedule_free_adamw(cfg.lr, None, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay)
    state = tx.init(params)
    for step in range(30):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = optax.apply_updates(params, updates)
        theirs = optax.contrib.schedule_free_eval_params(state, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours[step], theirs)


def test_schedule_free_average_weights_each_z_by_the_squared_largest_lr():
    """Through a warm-up, x after step t is the average of z_1..z_t weighted by the largest learning
    rate so far squared (the paper's c_t with r = 2), and the gradients are taken at (1-b1) z + b1 x."""
    cfg = OptimConfig(name="schedule_free_adamw", schedule="constant", warmup_steps=8, lr=0.05, clip_norm=None)
    xs, zs = _schedule_free_run(cfg, 12)
    lr = schedule(cfg, 12)
    weights = np.maximum.accumulate([float(lr(t)) for t in range(12)]) ** 2
    for t in range(12):
        w = weights[: t + 1] / weights[: t + 1].sum()
        for name in ("w_in", "w_out"):
            average = sum(wi * np.asarray(z[name], np.float64) for wi, z in zip(w, zs[: t + 1]))
            np.testing.assert_allclose(xs[t][name], average, rtol=1e-5, atol=1e-7)


def _decay_run(name: str, lr: float, independent: bool, grads: bool, steps: int = 4):
    """The parameters after `steps` updates of a decayed matrix and an undecayed embedding (zero
    gradients: only the decay moves them), weight decay 0.5, a warm-up of 2 into a cosine over 10."""
    overrides = [f"optim.name={name}", f"optim.lr={lr}", "optim.weight_decay=0.5", "optim.warmup_steps=2"]
    cfg = load_config(None, [*overrides, f"optim.independent_decay={str(independent).lower()}"]).optim
    params, loss = _regression()
    params = {"blocks": params, "embed": jnp.ones(4)}
    tx = make_optimizer(cfg, 10, params)
    state = tx.init(params)
    for _ in range(steps):
        g = jax.grad(lambda p: loss(p["blocks"]) + jnp.sum(p["embed"]))(params)
        updates, state = tx.update(g if grads else jax.tree.map(jnp.zeros_like, g), state, params)
        params = optax.apply_updates(params, updates)
    return cfg, params


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_independent_decay_is_the_same_at_every_learning_rate_and_follows_the_schedule(name):
    """Without gradients only the decay moves a parameter: theta * prod_t (1 - s_t * wd), s_t the
    schedule's lr(t) / optim.lr, at every learning rate (lr-coupled decay: prod (1 - lr(t) * wd),
    which differs); the embedding, outside the decay mask, never moves."""
    runs = {lr: _decay_run(name, lr, True, grads=False) for lr in (1e-3, 1e-1)}
    cfg, _ = runs[1e-3]
    shape = schedule(cfg, 10)
    want = math.prod(1 - float(shape(t)) / cfg.lr * 0.5 for t in range(4))
    start = _regression()[0]["w_in"]
    for _, after in runs.values():
        np.testing.assert_allclose(after["blocks"]["w_in"], start * want, rtol=1e-6)
        np.testing.assert_array_equal(after["embed"], jnp.ones(4))
    coupled = [_decay_run(name, lr, False, grads=False)[1]["blocks"]["w_in"] for lr in (1e-3, 1e-1)]
    assert not np.allclose(coupled[0], coupled[1])


def test_independent_decay_adds_to_the_undecayed_optimisers_step():
    """With gradients: the step is the optimiser's own without decay, minus s_t * wd * theta."""
    cfg, independent = _decay_run("adamw", 1e-2, True, grads=True, steps=1)
    plain = load_config(None, ["optim.lr=1e-2", "optim.weight_decay=0", "optim.warmup_steps=2"]).optim
    params, loss = _regression()
    params = {"blocks": params, "embed": jnp.ones(4)}
    tx = make_optimizer(plain, 10, params)
    g = jax.grad(lambda p: loss(p["blocks"]) + jnp.sum(p["embed"]))(params)
    updates, _ = tx.update(g, tx.init(params), params)
    factor = float(schedule(cfg, 10)(0)) / cfg.lr * 0.5
    want = params["blocks"]["w_in"] + updates["blocks"]["w_in"] - factor * params["blocks"]["w_in"]
    np.testing.assert_allclose(independent["blocks"]["w_in"], want, rtol=1e-6, atol=1e-7)
