"""Muon (train/muon.py): the Newton-Schulz iteration against float64 numpy and its singular-value
band, the parameter groups of every family and variant, each matrix of a stack orthogonalised on its
own, µP's rule for it, and one line for every key or combination it refuses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny
from flax import nnx

from transformer.config import ConfigError, MuonConfig, OptimConfig
from transformer.config_loader import load_config
from transformer.model import Transformer, optimizer_scaling
from transformer.train.muon import (
    JORDAN,
    NORMALISER,
    POLAR_EXPRESS,
    coefficients,
    layout,
    newton_schulz,
    orthogonal_update,
    shape_scale,
)
from transformer.train.optim import decay_mask, make_optimizer, schedule

NS_KINDS = ("jordan", "polar_express")


def _numpy_newton_schulz(x: np.ndarray, cfg: MuonConfig) -> np.ndarray:
    """The same iteration in float64, written from the papers' formula, X <- a X + b (X X^T) X + c (X X^T)^2 X."""
    x = x.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    safety, eps = NORMALISER[cfg.ns]
    x = x / (np.linalg.norm(x) * safety + eps)
    for a, b, c in coefficients(cfg):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


def _scalar_iteration(sigma: np.ndarray, cfg: MuonConfig) -> np.ndarray:
    """What the iteration does to each singular value: its odd quintic, composed."""
    for a, b, c in coefficients(cfg):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


@pytest.mark.parametrize("ns", NS_KINDS)
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)], ids=["wide", "tall", "square"])
def test_newton_schulz_equals_float64_numpy(ns, shape):
    cfg = MuonConfig(ns=ns)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ours = np.asarray(newton_schulz(jnp.asarray(x)[None], cfg)[0])
    np.testing.assert_allclose(ours, _numpy_newton_schulz(x, cfg), atol=2e-5)


@pytest.mark.parametrize("ns,band", [("jordan", (0.68, 1.21)), ("polar_express", (0.84, 1.15))])
def test_singular_values_land_in_the_band_the_coefficients_promise(ns, band):
    """U S V^T -> U p(S) V^T: the output's singular vectors are the input's and its singular values
    are the scalar polynomial's image of the normalised ones, which for these coefficients lies in
    `band` wherever the input's are at least 3e-3 of its Frobenius norm (Jordan's ~0.7-1.2; Polar
    Express's tighter, ~0.85-1.15, the point of its per-step coefficients)."""
    cfg = MuonConfig(ns=ns)
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((48, 16)))
    v, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    sigma = np.geomspace(3e-3, 1.0, 16) * 10.0  # condition number ~330, spread across the band's domain
    x = (u * sigma) @ v.T
    out = np.asarray(newton_schulz(jnp.asarray(x, jnp.float32)[None], cfg)[0], np.float64)
    got = np.linalg.svd(out, compute_uv=False)
    safety, _ = NORMALISER[ns]
    mapped = _scalar_iteration(sigma / (np.linalg.norm(sigma) * safety), cfg)
    np.testing.assert_allclose(got, np.sort(mapped)[::-1], atol=1e-4)
    assert band[0] <= got.min() and got.max() <= band[1], got
    np.testing.assert_allclose(out, u @ np.diag(mapped) @ v.T, atol=1e-4)


def test_the_coefficients_are_the_published_ones():
    assert JORDAN == ((3.4445, -4.7750, 2.0315),) and len(POLAR_EXPRESS) == 5
    assert coefficients(MuonConfig(ns_steps=3)) == JORDAN * 3
    assert coefficients(MuonConfig(ns="polar_express", ns_steps=4)) == POLAR_EXPRESS[:4]


def test_shape_scales():
    assert shape_scale(64, 256, "moonlight") == pytest.approx(0.2 * 16)
    assert shape_scale(256, 64, "jordan") == 1.0 and shape_scale(64, 256, "jordan") == 2.0
    assert shape_scale(256, 64, "spectral") == 0.5


# Every family and variant whose parameter tree differs: which of its parameters Muon takes.
VARIANTS = {
    "default-gated": dict(ffn="swiglu"),
    "gqa-untied-learned-bias": dict(n_kv_heads=2, tie_embeddings=False, position="learned", use_bias=True),
    "mqa-gelu": dict(n_kv_heads=1, ffn="gelu"),
    "qk-norm-sandwich": dict(qk_norm=True, norm_position="sandwich"),
    "encoder": dict(arch="encoder"),
    "encoder-decoder": dict(arch="encoder_decoder", n_encoder_layers=1, use_bias=True),
    "moe-shared-gated": dict(n_experts=4, top_k=2, n_shared_experts=1, moe_every=2, ffn="swiglu"),
    "moe-relu": dict(n_experts=4, ffn="relu"),
    "mla": dict(attention="mla"),
    "mla-q-lora": dict(attention="mla", q_lora_rank=24),
}
MATRICES = {"qkv", "out", "wq", "wq_down", "wq_up", "wkv_down", "wk_rope", "wk_up", "wv_up", "w_in", "w_out"}
ADAMW = {"embed", "pos_embed", "head", "router", "scale", "bias", "b_in", "b_out", "qkv_bias", "out_bias"}


def _params(m) -> dict:
    return nnx.to_pure_dict(nnx.state(Transformer(m, rngs=nnx.Rngs(0)), nnx.Param))


def _fan_in(m, path: tuple[str, ...]) -> int:
    """Each matrix's fan-in, written out by hand from the model's einsums."""
    name = path[-1]
    if name == "out":
        return m.n_heads * (m.v_head_dim if m.attention == "mla" else m.head_dim)
    if name in ("wk_up", "wv_up"):
        return m.kv_lora_rank
    if name == "wq_up":
        return m.q_lora_rank
    if name == "w_out":
        return m.moe_d_ff if path[0] == "moe_blocks" and "ffn" in path else m.d_ff
    return m.d_model


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameter_groups_and_matrices_of_every_family_and_variant(variant):
    """Hidden matrices are Muon's, everything else AdamW's; each matrix's batch is its layers (and
    experts), its fan-in what the model contracts over, and the pieces tile the parameter."""
    m = tiny(**VARIANTS[variant])
    seen = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(_params(m))[0]:
        keys = tuple(str(k.key) for k in path)
        lay = layout(m, keys[-1], leaf.shape)
        seen.add(keys[-1])
        if keys[-1] in ADAMW:
            assert lay is None, keys
            continue
        assert keys[-1] in MATRICES and lay is not None, keys
        experts = keys[0] == "moe_blocks" and "ffn" in keys and keys[-1] != "router" and "shared" not in str(keys)
        assert lay.lead == 1 + experts, keys  # the layers, and the experts of an expert stack
        assert np.prod(leaf.shape[lay.lead : lay.lead + lay.fan_in_axes]) == _fan_in(m, keys), keys
        if keys[-1] == "qkv":  # q (every query head of a kv group), k, v
            assert lay.parts == (m.n_heads // m.n_kv_heads, 1, 1)
        elif keys[-1] == "w_in" and m.gated_ffn:  # gate, up
            assert lay.parts == (1, 1)
        else:
            assert lay.split_axis is None
    assert seen <= MATRICES | ADAMW


def _ortho_alone(x: np.ndarray, cfg: MuonConfig, scale: float) -> np.ndarray:
    return np.asarray(newton_schulz(jnp.asarray(x)[None], cfg)[0]) * scale


def test_a_stack_is_orthogonalised_per_layer_per_expert_and_per_projection():
    """[L, D, F]: each layer's matrix alone; [L, E, D, 2, F]: each expert's gate and up alone; the
    fused [L, D, K, G+2, H]: q (D x K*G*H), k and v (D x K*H) alone, not the whole as one matrix."""
    cfg = MuonConfig(scale="jordan")
    rng = np.random.default_rng(2)
    m = tiny(ffn="gelu")
    u = rng.standard_normal((3, 32, 64)).astype(np.float32)
    got = np.asarray(orthogonal_update(jnp.asarray(u), layout(m, "w_in", u.shape), cfg))
    for i in range(3):
        np.testing.assert_allclose(got[i], _ortho_alone(u[i], cfg, np.sqrt(2.0)), atol=1e-5)

    m = tiny(ffn="swiglu")
    u = rng.standard_normal((2, 3, 32, 2, 48)).astype(np.float32)
    got = np.asarray(orthogonal_update(jnp.asarray(u), layout(m, "w_in", u.shape), cfg))
    for i, e, part in np.ndindex(2, 3, 2):
        np.testing.assert_allclose(got[i, e, :, part], _ortho_alone(u[i, e, :, part], cfg, np.sqrt(1.5)), atol=1e-5)

    m = tiny(n_heads=4, n_kv_heads=2)  # G = 2
    u = rng.standard_normal((2, 32, 2, 4, 8)).astype(np.float32)
    got = np.asarray(orthogonal_update(jnp.asarray(u), layout(m, "qkv", u.shape), cfg))
    for i in range(2):
        q = _ortho_alone(u[i, :, :, :2].reshape(32, -1), cfg, 1.0).reshape(32, 2, 2, 8)
        np.testing.assert_allclose(got[i, :, :, :2], q, atol=1e-5)
        for slot in (2, 3):  # k, v
            kv = _ortho_alone(u[i, :, :, slot].reshape(32, -1), cfg, 1.0).reshape(32, 2, 8)
            np.testing.assert_allclose(got[i, :, :, slot], kv, atol=1e-5)
    whole = _ortho_alone(u[0].reshape(32, -1), cfg, 1.0).reshape(u[0].shape)
    assert not np.allclose(got[0], whole, atol=1e-3)  # the fused matrix as one would differ


def _optimizer(m, **optim):
    cfg = OptimConfig(name="muon", schedule="constant", warmup_steps=0, **optim)
    params = _params(m)
    return make_optimizer(cfg, 10, params, model=m), params


def test_one_muon_step_is_the_orthogonalised_gradient_times_lr_and_adamw_elsewhere():
    """First step, no clipping: a matrix moves by -lr (ortho(g) * scale + wd * W) (Nesterov's first
    step is (1 - beta)^2 g + beta (1 - beta) g, a multiple of g); the rest by AdamW's first step."""
    m = tiny(ffn="gelu", tie_embeddings=False)
    lr, wd = 1e-2, 0.1
    tx, params = _optimizer(m, lr=lr, weight_decay=wd, clip_norm=None, muon=MuonConfig(adam_lr=3e-3))
    grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(3).standard_normal(p.shape), p.dtype), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    w, g = params["blocks"]["ffn"]["w_out"], grads["blocks"]["ffn"]["w_out"]
    expected = np.stack([_ortho_alone(np.asarray(g[i]), MuonConfig(), 0.2 * np.sqrt(128)) for i in range(2)])
    np.testing.assert_allclose(updates["blocks"]["ffn"]["w_out"], -lr * (expected + wd * np.asarray(w)), atol=1e-6)
    # AdamW over the whole tree (the same fused ops), decayed where the mask says: the rest's steps
    adam_lr = schedule(OptimConfig(lr=3e-3, schedule="constant", warmup_steps=0), 10)
    adam = optax.adamw(adam_lr, 0.9, 0.95, 1e-8, weight_decay=wd, mask=lambda p: decay_mask(p, False))
    adam_updates, _ = adam.update(grads, adam.init(params), params)
    for name in ("head", "embed"):
        np.testing.assert_array_equal(updates[name], adam_updates[name])
    np.testing.assert_array_equal(updates["final_norm"]["scale"], adam_updates["final_norm"]["scale"])
    assert not np.allclose(updates["blocks"]["ffn"]["w_out"], adam_updates["blocks"]["ffn"]["w_out"])


def test_mup_with_muon_scales_no_learning_rate_and_keeps_the_forward_rules():
    """µP away from its base under Muon's spectral scale: the chain builds (every multiplier 1),
    the model keeps µP's init and output multiplier."""
    cfg = load_config(
        None,
        [
            "optim.name=muon",
            "optim.muon.scale=spectral",
            "model.parametrization=mup",
            "model.mup_base_d_model=32",
            "model.d_model=64",
            "model.n_layers=1",
        ],
    )
    params = _params(cfg.model)
    scaling = optimizer_scaling(cfg.model, params, muon=True)
    assert scaling is not None and set(jax.tree.leaves(scaling.lr)) == {1.0}
    adam_scaling = optimizer_scaling(cfg.model, params)
    assert adam_scaling is not None and 0.5 in jax.tree.leaves(adam_scaling.lr)  # Adam's hidden lr x 1/m
    opt = make_optimizer(cfg.optim, 10, params, scaling, cfg.model)
    # the AdamW group's epsilon is µP's eps / m (m = 2): shown where gradients are as small as it
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-8), params)
    embed = opt.update(grads, opt.init(params), params)[0]["embed"]
    lr = schedule(cfg.optim, 10)
    for eps, same in ((cfg.optim.eps / 2, True), (cfg.optim.eps, False)):
        mask = decay_mask(params, cfg.optim.decay_embeddings)
        adamw = optax.adamw(lr, cfg.optim.b1, cfg.optim.b2, eps, weight_decay=cfg.optim.weight_decay, mask=mask)
        want = adamw.update(grads, adamw.init(params), params)[0]["embed"]
        assert np.allclose(embed, want, rtol=1e-6) == same


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["optim.muon.ns=polar_express"], "optim.muon"),
        (["optim.name=muon", "optim.muon.ns=polar_express", "optim.muon.ns_steps=6"], "optim.muon.ns_steps"),
        (["optim.name=muon", "optim.muon.momentum=1.0"], "optim.muon.momentum"),
        (["optim.name=muon", "optim.muon.adam_lr=0"], "optim.muon.adam_lr"),
        (["optim.name=muon", "model.parametrization=mup"], "optim.muon.scale"),
        (
            [
                "optim.name=muon",
                "optim.muon.scale=spectral",
                "model.parametrization=mup",
                "model.depth_scaling=complete_p",
            ],
            "model.depth_scaling",
        ),
    ],
)
def test_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key, str(err.value)


def test_muon_config_round_trips_through_yaml():
    cfg = load_config(None, ["optim.name=muon", "optim.muon.ns=polar_express", "optim.muon.adam_lr=1e-3"])
    assert cfg.optim.muon == dataclasses.replace(MuonConfig(), ns="polar_express", adam_lr=1e-3)
    assert cfg.to_dict()["optim"]["muon"]["ns"] == "polar_express"
