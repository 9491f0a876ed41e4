"""Norms, norm placement, FFNs, position encodings and initialisation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build, compiled_dots, tiny
from flax import nnx

from transformer.model import Block
from transformer.model.layers import (
    FFN,
    Norm,
    copy_weight_gradient_operand,
    cotangent_once,
    cpu_vendor,
    gelu_tanh,
    normalize,
    project,
)
from transformer.model.positions import sinusoidal


def test_layernorm_and_rmsnorm():
    x = 3.0 + 5.0 * jax.random.normal(jax.random.key(0), (4, 7, 64))
    ln = Norm(tiny(d_model=64, norm="layernorm"))(x)
    np.testing.assert_allclose(ln.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(ln.var(-1), 1.0, atol=1e-4)
    rms = Norm(tiny(d_model=64, norm="rmsnorm"))(x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(rms**2, -1)), 1.0, atol=1e-4)
    assert not np.allclose(rms.mean(-1), 0.0, atol=0.1)  # RMSNorm does not centre


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_an_offset_gain_is_applied_as_one_plus_it_and_starts_at_zero(kind):
    """model.norm_offset (Gemma): the stored gain w is 0 at init and the norm applies 1 + w, in float32
    as Gemma computes it, so a norm with offset w equals the plain one with gain fl(1 + w) bit for bit."""
    offset, plain = Norm(tiny(norm=kind, norm_offset=True)), Norm(tiny(norm=kind))
    assert np.all(np.asarray(offset.scale[...]) == 0.0)
    w = 0.3 * jax.random.normal(jax.random.key(0), offset.scale[...].shape)
    offset.scale[...], plain.scale[...] = w, 1.0 + w
    x = jax.random.normal(jax.random.key(1), (2, 5, 32))
    np.testing.assert_array_equal(np.asarray(offset(x)), np.asarray(plain(x)))


def test_scaled_embeddings_are_the_table_rows_times_sqrt_d_model():
    """model.embed_scale (Vaswani et al., Gemma): the rows times sqrt(d_model), in the compute dtype."""
    cfg = tiny(embed_scale=True, position="none")
    model = build(cfg)
    tokens = jnp.asarray([[3, 1, 4, 1, 5]])
    got = np.asarray(model.embed_tokens(tokens, jnp.arange(5)[None]))
    want = np.asarray(model.embed[...])[np.asarray(tokens)] * np.float32(math.sqrt(32))
    np.testing.assert_array_equal(got, want)


def test_norm_keeps_dtype_but_computes_in_float32():
    x = (1000.0 + jax.random.normal(jax.random.key(0), (2, 64))).astype(jnp.bfloat16)
    y = Norm(tiny(d_model=64, norm="layernorm"))(x)
    assert y.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(y, np.float32)))


def plain_norm(x, scale, bias, centre, eps):
    """The norm as autodiff sees it: the formula `normalize` writes the derivative of."""
    y = x.astype(jnp.float32)
    if centre:
        y = y - jnp.mean(y, axis=-1, keepdims=True)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + eps) * scale
    return (y if bias is None else y + bias).astype(x.dtype)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "layernorm_without_bias"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_derivative_is_autodiffs(kind, dtype):
    """The hand-written VJP (kept for speed: the layer scan stacks fewer [B, T, D] intermediates)
    gives autodiff's gradients for the input, the gain and the bias, to float rounding, and the
    value bit for bit; over leading axes of any rank (the q/k norms see [B, T, N, H])."""
    k = jax.random.split(jax.random.key(0), 4)
    x = (2.0 + 3.0 * jax.random.normal(k[0], (3, 5, 4, 32))).astype(dtype)
    scale = 1.0 + 0.3 * jax.random.normal(k[1], (32,))
    bias = None if kind != "layernorm" else 0.1 * jax.random.normal(k[2], (32,))
    g = jax.random.normal(k[3], x.shape).astype(dtype)
    centre, eps = kind != "rmsnorm", 1e-5

    def pullback(f):
        y, vjp = jax.vjp(lambda x, s, b: f(x, s, b, centre, eps), x, scale, bias)
        return y, vjp(g)

    (y, grads), (want_y, want_grads) = pullback(normalize), pullback(plain_norm)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
    assert grads[0].dtype == dtype and (bias is None) == (grads[2] is None)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def block_output(norm_position, x, norm="layernorm", **kw):
    cfg = tiny(norm=norm, norm_position=norm_position, **kw)
    block = Block(cfg, rngs=nnx.Rngs(0))
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    y, _ = block(x, positions, None, None)
    return y, cfg


def test_post_ln_block_output_is_normalised():
    x = 4.0 * jax.random.normal(jax.random.key(0), (2, 8, 32)) + 1.0
    y, _ = block_output("post", x)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-3)


@pytest.mark.parametrize("norm_position", ["pre", "sandwich"])
def test_pre_ln_and_sandwich_leave_the_residual_stream_unnormalised(norm_position):
    x = 4.0 * jax.random.normal(jax.random.key(0), (2, 8, 32)) + 1.0
    y, _ = block_output(norm_position, x)
    assert np.all(np.abs(y.var(-1) - 1.0) > 1.0)  # the residual keeps the input's scale (var ~ 16)
    if norm_position == "pre":  # a small correction at init; sandwich adds normalised (unit-scale) ones
        assert float(jnp.std(y - x)) < 0.5 * float(jnp.std(x))


def test_deepnorm_constants_and_residual_scale():
    for L in (1, 6, 24, 100):
        cfg = tiny(n_layers=L, norm_position="deepnorm")
        assert cfg.deepnorm_alpha == pytest.approx((2 * L) ** 0.25)
        assert cfg.deepnorm_beta == pytest.approx((8 * L) ** -0.25)
    # The block is N(alpha*x + f(x)): with f zeroed out, it is N(alpha*x) = N(x) for LayerNorm.
    cfg = tiny(n_layers=6, norm="layernorm", norm_position="deepnorm")
    block = Block(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 8, 32))
    f = lambda h: jnp.zeros_like(h)
    out = block.residual(x, f, block.attn_norm, None, None)
    np.testing.assert_allclose(out, block.attn_norm(x), atol=1e-5)
    g = lambda h: h  # identity sublayer: N((alpha + 1) x)
    out = block.residual(x, g, block.attn_norm, None, None)
    raw = block.residual(x, g, Norm(cfg, kind="layernorm"), None, None)
    np.testing.assert_allclose(out, raw, atol=1e-5)


def empirical_std(param) -> float:
    return float(jnp.std(param[...]))


def test_deepnorm_scales_init_by_beta():
    cfg = tiny(d_model=128, n_heads=4, n_layers=8, norm_position="deepnorm", ffn="gelu")
    block = Block(cfg, rngs=nnx.Rngs(0))
    beta, std = cfg.deepnorm_beta, cfg.init_std
    G = cfg.n_kv_groups
    qkv = block.attn.qkv[...]
    assert float(jnp.std(qkv[:, :, :G])) == pytest.approx(std, rel=0.05)  # queries: unscaled
    assert float(jnp.std(qkv[:, :, G])) == pytest.approx(std, rel=0.1)  # keys: unscaled
    assert float(jnp.std(qkv[:, :, G + 1])) == pytest.approx(std * beta, rel=0.1)  # values
    assert empirical_std(block.attn.out) == pytest.approx(std * beta, rel=0.1)
    assert empirical_std(block.ffn.w_in) == pytest.approx(std * beta, rel=0.05)
    assert empirical_std(block.ffn.w_out) == pytest.approx(std * beta, rel=0.05)


@pytest.mark.parametrize("depth_scaled", [True, False])
def test_residual_projections_scaled_by_depth(depth_scaled):
    cfg = tiny(d_model=128, n_layers=8, ffn="gelu", init_depth_scaled=depth_scaled)
    block = Block(cfg, rngs=nnx.Rngs(0))
    want = cfg.init_std / math.sqrt(2 * 8) if depth_scaled else cfg.init_std
    assert empirical_std(block.attn.out) == pytest.approx(want, rel=0.05)
    assert empirical_std(block.ffn.w_out) == pytest.approx(want, rel=0.05)
    assert empirical_std(block.ffn.w_in) == pytest.approx(cfg.init_std, rel=0.05)


ACTS = {
    "relu": lambda g, u: np.maximum(g, 0),
    "gelu": lambda g, u: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))),
    "swiglu": lambda g, u: g / (1 + np.exp(-g)) * u,
    "geglu": lambda g, u: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u,
    "reglu": lambda g, u: np.maximum(g, 0) * u,
    "gelu_exact": lambda g, u: 0.5 * g * (1 + np.vectorize(math.erf)(g / np.sqrt(2))),
    "geglu_exact": lambda g, u: 0.5 * g * (1 + np.vectorize(math.erf)(g / np.sqrt(2))) * u,
}


@pytest.mark.parametrize("ffn", list(ACTS))
@pytest.mark.parametrize("use_bias", [False, True])
def test_ffn_matches_numpy(ffn, use_bias):
    cfg = tiny(ffn=ffn, use_bias=use_bias)
    layer = FFN(cfg, rngs=nnx.Rngs(0))
    if use_bias:  # non-zero biases, so a dropped bias would show
        for name in ("b_in", "b_out"):
            p = getattr(layer, name)
            p[...] = jax.random.normal(jax.random.key(5), p[...].shape)
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model)), np.float64)
    w_in, w_out = np.asarray(layer.w_in[...], np.float64), np.asarray(layer.w_out[...], np.float64)
    b_in = np.asarray(layer.b_in[...], np.float64) if use_bias else 0.0
    b_out = np.asarray(layer.b_out[...], np.float64) if use_bias else 0.0
    if cfg.gated_ffn:
        h = np.einsum("BTD,DCF->BTCF", x, w_in) + b_in
        hidden = ACTS[ffn](h[:, :, 0], h[:, :, 1])
    else:
        hidden = ACTS[ffn](np.einsum("BTD,DF->BTF", x, w_in) + b_in, None)
    np.testing.assert_allclose(layer(jnp.asarray(x, jnp.float32)), hidden @ w_out + b_out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "ffn, d_model, multiple, want",
    [
        ("gelu", 32, 16, 128),
        ("relu", 40, 64, 192),
        ("swiglu", 32, 16, 96),
        ("geglu", 96, 32, 256),
        ("reglu", 128, 64, 384),
    ],
)
def test_default_ffn_width(ffn, d_model, multiple, want):
    assert tiny(ffn=ffn, d_model=d_model, ffn_multiple=multiple).d_ff == want


def test_sinusoidal_matches_the_paper():
    D = 16
    pos = np.arange(11)
    pe = np.asarray(sinusoidal(jnp.asarray(pos)[None], D))[0]
    i = np.arange(D // 2)
    angle = pos[:, None] / 10000 ** (2 * i / D)
    np.testing.assert_allclose(pe[:, 0::2], np.sin(angle), atol=1e-5)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(angle), atol=1e-5)


def test_learned_positions_are_used():
    cfg = tiny(position="learned")
    model = build(cfg)
    tokens = jnp.zeros((1, 6), jnp.int32)
    base = model(tokens)
    model.pos_embed[...] = model.pos_embed[...].at[3].add(1.0)
    changed = np.any(np.abs(model(tokens) - base) > 1e-6, axis=-1)[0]
    np.testing.assert_array_equal(changed, [False, False, False, True, True, True])


def test_gelu_tanh_equals_jax_gelu_in_value_and_gradient():
    """The hand-written derivative (kept for speed: one residual instead of six) is autodiff's to
    float rounding, and the value under differentiation is jax.nn.gelu's bit for bit."""
    x = 4.0 * jax.random.normal(jax.random.key(0), (4096,))
    value, slope = jax.jvp(gelu_tanh, (x,), (jnp.ones_like(x),))
    want_value, want_slope = jax.jvp(jax.nn.gelu, (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(value, want_value)
    np.testing.assert_allclose(slope, want_slope, atol=2e-6)
    np.testing.assert_allclose(jax.grad(lambda x: gelu_tanh(x).sum())(x), want_slope, atol=2e-6)


@pytest.mark.parametrize("first", [1.0, math.nan, math.inf])
def test_cotangent_once_changes_no_value_and_no_gradient(first):
    """The FFN's pre-activation passes through `cotangent_once`: the value and every gradient are
    those without it, bit for bit, whatever the cotangent holds (its first element picks the
    conditional's branch), and on a CPU the backward pass holds the conditional that keeps XLA from
    recomputing the cotangent inside the weight gradient's transpose."""
    x_RxD = jax.random.normal(jax.random.key(0), (64, 16))
    w_DxF = jax.random.normal(jax.random.key(1), (16, 48))
    scale_RxF = jnp.ones((64, 48)).at[0, 0].set(first)

    def loss(x, w, through):
        h = x @ w
        return jnp.sum(gelu_tanh(cotangent_once(h) if through else h) * scale_RxF)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for got, want in zip(grad(x_RxD, w_DxF, True), grad(x_RxD, w_DxF, False)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cotangent_once(x_RxD), x_RxD)
    if jax.default_backend() == "cpu":
        assert " conditional(" in grad.lower(x_RxD, w_DxF, True).compile().as_text()


PROJECTIONS = [  # (spec, x shape, w shape): the model's projections, small
    ("BTD,DF->BTF", (2, 8, 16), (16, 24)),
    ("BTD,DCF->BTCF", (2, 8, 16), (16, 2, 24)),
    ("BTNH,NHD->BTD", (2, 8, 4, 6), (4, 6, 16)),
    ("BTD,DKCH->BTKCH", (2, 8, 16), (16, 3, 2, 5)),
]


@pytest.mark.parametrize(("spec", "x_shape", "w_shape"), PROJECTIONS)
@pytest.mark.parametrize("first", [1.0, math.nan])
def test_project_is_the_einsum(spec, x_shape, w_shape, first):
    """`project` is `jnp.einsum(spec)`: the value and the input gradient bit for bit, the weight
    gradient to float rounding (on a CPU it is computed from x^T in memory), whatever the
    cotangent holds (its first element picks the conditional's branch)."""
    kx, kw, kc = jax.random.split(jax.random.key(len(spec)), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    cotangent = jax.random.normal(kc, jnp.einsum(spec, x, w).shape)
    cotangent = cotangent.reshape(-1).at[0].set(first).reshape(cotangent.shape)

    def loss(x, w, mine):
        y = project(spec, x, w) if mine else jnp.einsum(spec, x, w)
        return jnp.sum(y * cotangent)

    value = jax.jit(lambda x, w: project(spec, x, w))(x, w)
    np.testing.assert_array_equal(value, jax.jit(lambda x, w: jnp.einsum(spec, x, w))(x, w))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    (dx, dw), (want_dx, want_dw) = grad(x, w, True), grad(x, w, False)
    np.testing.assert_array_equal(dx, want_dx)
    if math.isnan(first):  # the first row of every product with the cotangent is NaN, in both
        np.testing.assert_array_equal(np.isnan(dw), np.isnan(want_dw))
        return
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_project_refuses_what_is_not_a_projection():
    x, w = jnp.ones((2, 3, 4)), jnp.ones((5, 4))
    with pytest.raises(AssertionError, match="not a projection"):
        jax.grad(lambda w: project("BTD,FD->BTF", x, w).sum())(w)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's choice of dot kernels")
def test_a_cpu_weight_gradient_is_one_ynnpack_dot_where_that_was_measured_faster():
    """On a CPU kind where the copy of x^T was measured to pay (`copy_weight_gradient_operand`) the
    FFN's weight gradients compile to YNNPACK dots, with no XLA dot left in the backward pass; through
    the plain einsum, and on the other kinds, XLA computes them with its own dot (benchmarks/README.md).
    Skipped where this jaxlib hands no dot to YNNPACK."""
    x = jax.random.normal(jax.random.key(0), (4, 64, 32))
    w_in, w_out = jax.random.normal(jax.random.key(1), (32, 128)), jax.random.normal(jax.random.key(2), (128, 32))

    def loss(x, w_in, w_out, mine):
        dot = project if mine else jnp.einsum
        return jnp.sum(dot("BTF,FD->BTD", gelu_tanh(dot("BTD,DF->BTF", x, w_in)), w_out) ** 2)

    def xla_dots(mine: bool) -> int:
        grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=3)
        ynn, xla = compiled_dots(grad.lower(x, w_in, w_out, mine).compile().as_text())
        if not ynn:
            pytest.skip("this jaxlib's XLA:CPU hands no dot to YNNPACK")
        return xla

    assert xla_dots(mine=False) > 0
    assert xla_dots(mine=True) == (0 if copy_weight_gradient_operand() else xla_dots(mine=False))


def test_the_weight_gradient_copy_is_chosen_by_the_cpu_kind_it_was_measured_on(tmp_path):
    intel, amd = tmp_path / "intel", tmp_path / "amd"
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert (cpu_vendor(intel), cpu_vendor(amd), cpu_vendor(tmp_path / "absent")) == ("GenuineIntel", "AuthenticAMD", "")
    assert not copy_weight_gradient_operand("GenuineIntel")
    assert copy_weight_gradient_operand("AuthenticAMD") and copy_weight_gradient_operand("")
