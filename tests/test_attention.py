"""Attention: causality and windows by gradient, GQA/MQA against reference MHA, implementations agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTENTION_VARIANTS, POSITIONS, build, tiny
from flax import nnx

from transformer.model.attention import Attention, attend_einsum, attention_mask
from transformer.model.positions import alibi_bias, alibi_slopes, rope

T = 8


def input_jacobian(model, x_BxTxD, positions_BxT=None, segment_ids_BxT=None):
    """dep[t, s] = |d out[t] / d x[s]| summed over channels, for a random projection of the output."""
    _, T_, D = x_BxTxD.shape
    if positions_BxT is None:
        positions_BxT = jnp.arange(T_)[None]
    probe_TxD = jax.random.normal(jax.random.key(7), (T_, D))

    def out(x):
        out_BxTxD, _ = model.run_blocks(x, positions_BxT, segment_ids_BxT)
        return jnp.sum(out_BxTxD[0] * probe_TxD, axis=-1)

    jac_TxTxD = jax.jit(jax.jacrev(out))(x_BxTxD)[:, 0]
    return np.asarray(jnp.sum(jnp.abs(jac_TxTxD), axis=-1))


def embeddings(cfg, T_=T, seed=1):
    return jax.random.normal(jax.random.key(seed), (1, T_, cfg.d_model))


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_causal_by_gradient(variant, position):
    cfg = tiny(position=position, **ATTENTION_VARIANTS[variant])
    dep = input_jacobian(build(cfg), embeddings(cfg))
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(dep[future] == 0.0), "an output depends on a later input"
    assert np.all(dep[np.diag_indices(T)] > 0)


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_causal_by_gradient_einsum(variant):
    cfg = tiny(attention_impl="einsum", position="alibi", **ATTENTION_VARIANTS[variant])
    dep = input_jacobian(build(cfg), embeddings(cfg))
    assert np.all(dep[np.triu_indices(T, k=1)] == 0.0)


@pytest.mark.parametrize("impl", ["xla", "einsum", "blocked"])
@pytest.mark.parametrize("window", [1, 3])
def test_sliding_window_reach(impl, window):
    """One layer: out[t] depends on exactly x[t-window+1 .. t]."""
    cfg = tiny(n_layers=1, window=window, attention_impl=impl, n_kv_heads=2)
    dep = input_jacobian(build(cfg), embeddings(cfg, T_=10))
    t, s = np.indices(dep.shape)
    inside = (s <= t) & (t - s < window)
    assert np.all(dep[~inside] == 0.0)
    assert np.all(dep[inside] > 0.0)


def test_window_reach_grows_with_depth_and_pattern_has_global_layers():
    T_, window = 12, 3
    stacked = input_jacobian(build(tiny(n_layers=2, window=window)), embeddings(tiny(), T_))
    t, s = np.indices(stacked.shape)
    reach = (s <= t) & (t - s <= 2 * (window - 1))
    assert np.all(stacked[~reach] == 0.0) and np.all(stacked[reach] > 0.0)
    # local, global: the global layer sees the whole prefix
    patterned = input_jacobian(
        build(tiny(window=window, attention_pattern=("local", "global"))), embeddings(tiny(), T_)
    )
    assert np.all(patterned[s <= t] > 0.0) and np.all(patterned[s > t] == 0.0)


@pytest.mark.parametrize("impl", ["xla", "einsum"])
def test_document_mask_isolates_documents(impl):
    """Two packed documents give the same outputs as each document run on its own."""
    cfg = tiny(position="rope", attention_impl=impl, n_kv_heads=2)
    model = build(cfg)
    lengths = (5, 3)
    tokens = jax.random.randint(jax.random.key(3), (1, sum(lengths)), 0, cfg.vocab_size)
    segments = jnp.asarray([[0] * lengths[0] + [1] * lengths[1]])
    positions = jnp.asarray([list(range(lengths[0])) + list(range(lengths[1]))])
    packed = model(tokens, positions, segments)
    alone = [model(tokens[:, : lengths[0]]), model(tokens[:, lengths[0] :])]
    np.testing.assert_allclose(packed, jnp.concatenate(alone, axis=1), atol=1e-5, rtol=1e-5)


def reference_attention(x_TxD, qkv_DxKxCxH, out_NxHxD, scale, window=None, softcap=None):
    """Per-head loops in numpy: query head n reads kv head n // G."""
    x = np.asarray(x_TxD, np.float64)
    w = np.asarray(qkv_DxKxCxH, np.float64)
    T_, K, G = x.shape[0], w.shape[1], w.shape[2] - 2
    heads = []
    for n in range(K * G):
        k_head, g = divmod(n, G)
        q, k, v = x @ w[:, k_head, g], x @ w[:, k_head, G], x @ w[:, k_head, G + 1]
        scores = q @ k.T * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        t, s = np.indices((T_, T_))
        allowed = (s <= t) & ((t - s < window) if window else True)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        heads.append((p / p.sum(-1, keepdims=True)) @ v)
    return np.einsum("NTH,NHD->TD", np.stack(heads), np.asarray(out_NxHxD, np.float64))


def run_attention(module, x_BxTxD, window=None, segment_ids=None):
    positions = jnp.broadcast_to(jnp.arange(x_BxTxD.shape[1]), x_BxTxD.shape[:2])
    y_BxTxD, _ = module(x_BxTxD, positions, segment_ids, window)
    return y_BxTxD


@pytest.mark.parametrize("impl", ["xla", "einsum", "blocked"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_kv_heads", [8, 4, 2, 1])
def test_gqa_matches_reference(n_kv_heads, window, impl):
    cfg = tiny(d_model=32, n_heads=8, n_kv_heads=n_kv_heads, position="none", attention_impl=impl)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    got = run_attention(attn, x, window)[0]
    want = reference_attention(x[0], attn.qkv[...], attn.out[...], cfg.scale, window)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def repeat_kv_as_mha(gqa: Attention, cfg_mha) -> Attention:
    """An MHA module whose query head n has its own copy of the GQA kv head n // G."""
    G = gqa.cfg.n_kv_groups
    w = gqa.qkv[...]
    mha = Attention(cfg_mha, rngs=nnx.Rngs(99))
    q_DxNxH = w[:, :, :G].reshape(w.shape[0], -1, w.shape[-1])
    k_DxNxH = jnp.repeat(w[:, :, G], G, axis=1)
    v_DxNxH = jnp.repeat(w[:, :, G + 1], G, axis=1)
    mha.qkv[...] = jnp.stack([q_DxNxH, k_DxNxH, v_DxNxH], axis=2)
    mha.out[...] = gqa.out[...]
    return mha


@pytest.mark.parametrize("position", ["rope", "alibi"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_gqa_and_mqa_equal_mha_with_repeated_kv(n_kv_heads, position):
    cfg = tiny(n_heads=4, n_kv_heads=n_kv_heads, position=position)
    gqa = Attention(cfg, rngs=nnx.Rngs(0))
    mha = repeat_kv_as_mha(gqa, dataclasses.replace(cfg, n_kv_heads=4))
    x = jax.random.normal(jax.random.key(1), (2, T, cfg.d_model))
    np.testing.assert_allclose(run_attention(gqa, x), run_attention(mha, x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        dict(n_kv_heads=4),
        dict(n_kv_heads=2, window=3),
        dict(n_kv_heads=1, position="alibi"),
        dict(n_kv_heads=2, position="alibi", window=2, qk_norm=True),
        dict(n_kv_heads=2, attn_scale=0.3),
    ],
    ids=["mha", "gqa-window", "mqa-alibi", "gqa-alibi-window-qknorm", "scale"],
)
@pytest.mark.parametrize("with_segments", [False, True])
def test_einsum_equals_dot_product_attention(extra, with_segments):
    cfg_x = tiny(**extra)
    cfg_e = dataclasses.replace(cfg_x, attention_impl="einsum")
    xla_attn = Attention(cfg_x, rngs=nnx.Rngs(0))
    ein_attn = Attention(cfg_e, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, T, cfg_x.d_model))
    segments = jnp.asarray([[0] * 3 + [1] * 5, [0] * 6 + [1] * 2]) if with_segments else None
    window = cfg_x.window
    np.testing.assert_allclose(
        run_attention(xla_attn, x, window, segments), run_attention(ein_attn, x, window, segments), atol=1e-5, rtol=1e-5
    )


def test_traced_window_equals_static_window():
    cfg = tiny(n_kv_heads=2, window=3)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    static = run_attention(attn, x, 3)
    traced = jax.jit(lambda w: run_attention(attn, x, w))(jnp.int32(3))
    np.testing.assert_allclose(static, traced, atol=1e-6)


def test_softcap_matches_reference():
    cfg = tiny(attention_impl="einsum", attn_softcap=0.5, position="none", n_kv_heads=2)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    x = 10 * jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    want = reference_attention(x[0], attn.qkv[...], attn.out[...], cfg.scale, softcap=0.5)
    np.testing.assert_allclose(run_attention(attn, x)[0], want, atol=1e-4, rtol=1e-4)
    uncapped = reference_attention(x[0], attn.qkv[...], attn.out[...], cfg.scale)
    assert not np.allclose(want, uncapped, atol=1e-3)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_invariant_to_query_key_scale(qk_norm):
    cfg = tiny(qk_norm=qk_norm, n_kv_heads=2)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    before = run_attention(attn, x)
    G = cfg.n_kv_groups
    attn.qkv[...] = attn.qkv[...].at[:, :, : G + 1].multiply(5.0)  # queries and keys, not values
    after = run_attention(attn, x)
    assert np.allclose(before, after, atol=1e-5) == qk_norm


def test_fully_masked_row_is_finite():
    cfg = tiny(attention_impl="einsum")
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 2, cfg.head_dim))
    kv = jax.random.normal(jax.random.key(1), (1, 4, 2, cfg.head_dim))
    mask = jnp.zeros((1, 4, 4), bool)
    out = attend_einsum(q, kv, kv, mask, None, cfg, None)
    assert np.all(np.isfinite(out))
    grads = jax.grad(lambda q: attend_einsum(q, kv, kv, mask, None, cfg, None).sum())(q)
    assert np.all(np.isfinite(grads))


def test_attention_mask_semantics():
    idx = jnp.arange(5)
    mask = np.asarray(attention_mask(idx, idx, 2, jnp.asarray([[0, 0, 0, 1, 1]]), jnp.asarray([[0, 0, 0, 1, 1]])))[0]
    want = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, want)


@pytest.mark.parametrize("shift", [1, 5, 100])
def test_rope_scores_depend_only_on_relative_position(shift):
    H = 16
    q = jax.random.normal(jax.random.key(0), (1, T, H))
    k = jax.random.normal(jax.random.key(1), (1, T, H))
    pos = jnp.arange(T)[None]

    def scores(offset):
        return jnp.einsum("BTH,BSH->BTS", rope(q, pos + offset, 10000.0), rope(k, pos + offset, 10000.0))

    np.testing.assert_allclose(scores(0), scores(shift), atol=1e-4, rtol=1e-4)
    # and it is a rotation: norms are preserved, positions do change the vectors
    np.testing.assert_allclose(jnp.linalg.norm(rope(q, pos, 1e4), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    assert not np.allclose(rope(q, pos + shift, 1e4), rope(q, pos, 1e4))


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    np.testing.assert_allclose(alibi_slopes(4), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    # not a power of two: the 4-head slopes, then every other slope of the 8-head sequence
    np.testing.assert_allclose(alibi_slopes(6), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3])


def test_alibi_bias_is_slope_times_distance():
    pos = jnp.arange(6)[None]
    bias = np.asarray(alibi_bias(4, pos, pos))[0]
    slopes = np.asarray(alibi_slopes(4))
    t, s = np.indices((6, 6))
    np.testing.assert_allclose(bias, -slopes[:, None, None] * np.abs(t - s)[None], rtol=1e-6)  # symmetric: encoders
