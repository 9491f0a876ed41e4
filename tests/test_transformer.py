"""Whole-model properties: scan = unrolled, jit = eager, remat, dtypes, axes, every variant runs and learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ATTENTION_VARIANTS, NORM_POSITIONS, POSITIONS, all_pairs, build, tiny
from flax import nnx

LOGICAL_AXES = {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", None}


def tokens_for(cfg, B=2, T=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, cfg.vocab_size)


def with_config(model, cfg):
    """The same parameters under another (execution-only) config."""
    other = build(cfg, seed=123)
    nnx.update(other, nnx.state(model))
    return other


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(window=3, attention_pattern=("local", "global"), n_layers=3),
        dict(window=3, attention_pattern=("local", "global"), n_layers=3, rope_local_theta=40.0),
        dict(position="alibi", n_kv_heads=1),
        dict(first_attn_norm=False, norm="layernorm", norm_bias=False, n_layers=3),
        dict(window=3, attention_pattern=("local", "global"), n_layers=3, rope_scaling="linear", rope_factor=4.0)
        | dict(rope_local_scaling=False),
    ],
    ids=["default", "pattern", "pattern-local-theta", "alibi-mqa", "first-apart", "global-scaling"],
)
@pytest.mark.parametrize("unroll", [dict(scan_layers=False), dict(scan_unroll=2), dict(scan_unroll=8)])
def test_scan_equals_unrolled(extra, unroll):
    """In Python, or by the scan 2 layers an iteration (3 layers: a remainder) or all at once."""
    cfg = tiny(**extra, scan_unroll=1)
    scanned = build(cfg)
    unrolled = with_config(scanned, dataclasses.replace(cfg, **unroll))
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(scanned(tokens), unrolled(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_first_layer_without_its_attention_norm_reads_the_stream(scan_layers):
    """model.first_attn_norm=false (ModernBERT): layer 0's attention norm is never read (its
    parameters get no gradient, and a model whose layer 0 has none computes the same); every other
    layer's is. Cached decoding equals the full forward pass."""
    from test_generate import prefill_then_decode

    cfg = tiny(first_attn_norm=False, n_layers=3, scan_layers=scan_layers)
    model = build(cfg)
    tokens = tokens_for(cfg)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(tokens) ** 2)

    gains_LxD = np.asarray(jax.grad(loss)(params)["blocks"]["attn_norm"]["scale"][...])
    assert not np.any(gains_LxD[0]) and np.all(np.any(gains_LxD[1:], axis=-1))
    normed = with_config(model, dataclasses.replace(cfg, first_attn_norm=True))
    assert np.abs(np.asarray(normed(tokens)) - np.asarray(model(tokens))).max() > 1e-3
    full = np.asarray(model(tokens))
    np.testing.assert_allclose(prefill_then_decode(*nnx.split(model), tokens, 3), full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_windowed_layer_rotates_by_the_local_theta(scan_layers):
    """model.rope_local_theta: a layer with a window rotates by it, one without by rope_theta. With
    a window longer than the sequence, a local layer computes what a global one of that theta does;
    in a local/global pattern (the windows traced when scanned) likewise, layer by layer."""
    T, far = 8, 64
    kw = dict(scan_layers=scan_layers, rope_theta=10000.0)
    one = build(tiny(n_layers=1, window=far, rope_local_theta=50.0, **kw))
    same = with_config(one, tiny(n_layers=1, rope_theta=50.0, scan_layers=scan_layers))
    tokens = tokens_for(one.cfg, T=T)
    np.testing.assert_array_equal(np.asarray(one(tokens)), np.asarray(same(tokens)))
    pattern = build(tiny(window=far, attention_pattern=("local", "global"), rope_local_theta=50.0, **kw))
    plain = with_config(pattern, tiny(window=far, attention_pattern=("local", "global"), **kw))
    assert np.abs(np.asarray(pattern(tokens)) - np.asarray(plain(tokens))).max() > 1e-4
    swapped = with_config(pattern, tiny(window=far, attention_pattern=("global", "local"), rope_local_theta=50.0, **kw))
    assert np.abs(np.asarray(pattern(tokens)) - np.asarray(swapped(tokens))).max() > 1e-4  # per layer


def test_the_output_bias_adds_to_every_positions_logits():
    """model.output_bias: 0 at init, then its value added to each vocabulary entry's logit."""
    cfg = tiny(output_bias=True)
    model = build(cfg)
    tokens = tokens_for(cfg)
    V = cfg.vocab_size
    before = np.asarray(model(tokens))[..., :V]
    np.testing.assert_array_equal(before, np.asarray(build(tiny())(tokens))[..., :V])  # the same draws
    bias = jax.random.normal(jax.random.key(3), model.output_bias[...].shape)
    model.output_bias[...] = bias
    np.testing.assert_allclose(
        np.asarray(model(tokens))[..., :V] - before, np.broadcast_to(bias[:V], before.shape), atol=1e-5
    )


def test_jit_equals_eager():
    cfg = tiny(n_kv_heads=2, window=4)
    model = build(cfg)
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(model, tokens), model(tokens), atol=1e-5, rtol=1e-5)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_gives_the_same_gradients(remat, scan_layers):
    cfg = tiny(scan_layers=scan_layers)
    model = build(cfg)
    remat_model = with_config(model, dataclasses.replace(cfg, remat=remat))
    tokens = tokens_for(cfg, T=13)
    grad = lambda m: nnx.grad(loss_fn)(m, tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grad(model), grad(remat_model))


def test_bf16_compute_is_finite_with_float32_params_and_logits():
    cfg = tiny(dtype="bfloat16", n_kv_heads=2, position="alibi", window=4)
    model = build(cfg)
    logits = model(tokens_for(cfg))
    assert logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    grads = nnx.grad(loss_fn)(model, tokens_for(cfg, T=13))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    reference = with_config(model, dataclasses.replace(cfg, dtype="float32"))(tokens_for(cfg))
    np.testing.assert_allclose(logits, reference, atol=0.1)  # same function, lower precision


def test_bf16_parameters():
    cfg = tiny(param_dtype="bfloat16", dtype="bfloat16")
    model = build(cfg)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert np.all(np.isfinite(model(tokens_for(cfg))))


def test_dropout_needs_a_key_and_is_seeded():
    cfg = tiny(dropout=0.3)
    model = build(cfg)
    tokens = tokens_for(cfg)
    np.testing.assert_array_equal(model(tokens), model(tokens))  # no key: deterministic evaluation
    a, b = model(tokens, key=jax.random.key(1)), model(tokens, key=jax.random.key(2))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, model(tokens, key=jax.random.key(1)))
    no_drop = with_config(model, dataclasses.replace(cfg, dropout=0.0))
    np.testing.assert_array_equal(no_drop(tokens, key=jax.random.key(1)), model(tokens))


def test_attention_dropout_changes_outputs():
    cfg = tiny(attn_dropout=0.5, attention_impl="einsum")
    model = build(cfg)
    tokens = tokens_for(cfg)
    assert not np.allclose(model(tokens, key=jax.random.key(1)), model(tokens))


def test_padded_vocab_is_never_predicted():
    cfg = tiny(vocab_size=61, vocab_multiple=16)
    assert cfg.padded_vocab == 64
    probs = jax.nn.softmax(build(cfg)(tokens_for(cfg)), axis=-1)
    assert probs.shape[-1] == 64
    assert float(probs[..., 61:].max()) == 0.0


def test_logit_softcap_bounds_logits():
    cfg = tiny(logit_softcap=0.05, vocab_size=64)
    logits = build(cfg)(tokens_for(cfg))
    assert float(jnp.abs(logits).max()) <= 0.05 * (1 + 1e-6)
    assert float(jnp.abs(logits).max()) > 0.01


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_heads(tie):
    """Embedding rows that no input token reads reach the logits only through a tied head: tied,
    exactly their vocab columns move; untied, nothing moves, and the logits follow `head` instead."""
    cfg = tiny(tie_embeddings=tie)
    model = build(cfg)
    assert (model.head is None) == tie
    tokens = tokens_for(cfg)
    before = model(tokens)
    unread = np.setdiff1d(np.arange(cfg.vocab_size), np.asarray(tokens))
    assert unread.size > 0
    model.embed[...] = model.embed[...].at[unread].multiply(2.0)
    after = model(tokens)
    moved_V = ~np.all(np.isclose(after, before), axis=(0, 1))
    if tie:
        np.testing.assert_array_equal(moved_V, np.isin(np.arange(cfg.padded_vocab), unread))
    else:
        np.testing.assert_array_equal(after, before)
        model.head[...] = model.head[...] * 2.0
        assert np.all(~np.isclose(model(tokens), before)[..., : cfg.vocab_size])


def test_every_parameter_has_logical_axes():
    cfg = tiny(use_bias=True, qk_norm=True, position="learned", tie_embeddings=False, norm="layernorm", ffn="gelu")
    for path, param in nnx.to_flat_state(nnx.state(build(cfg), nnx.Param)):
        axes = param.get_metadata()["axes"]
        assert len(axes) == param.get_value().ndim, path
        assert set(axes) <= LOGICAL_AXES, path
        assert (axes[0] == "layers") == (path[0] == "blocks"), path
    model = build(cfg)
    assert model.embed.get_metadata()["axes"] == ("vocab", "embed")
    assert model.blocks.attn.out.get_metadata()["axes"] == ("layers", "heads", "head_dim", "embed")
    assert model.blocks.ffn.w_in.get_metadata()["axes"] == ("layers", "embed", "mlp")


SMOKE = all_pairs(tuple(ATTENTION_VARIANTS), POSITIONS, NORM_POSITIONS, ("gelu", "swiglu"))


@pytest.mark.parametrize("variant, position, norm_position, ffn", SMOKE)
def test_every_combination_builds_and_runs(variant, position, norm_position, ffn):
    cfg = tiny(position=position, norm_position=norm_position, ffn=ffn, **ATTENTION_VARIANTS[variant])
    logits = nnx.jit(lambda m, t: m(t))(build(cfg), tokens_for(cfg, B=1, T=8))
    assert logits.shape == (1, 8, cfg.padded_vocab)
    assert np.all(np.isfinite(logits))


OVERFIT = [
    dict(),
    dict(n_kv_heads=1, position="alibi", norm_position="post", ffn="gelu", norm="layernorm"),
    dict(n_kv_heads=2, window=4, position="learned", norm_position="sandwich"),
    dict(window=4, attention_pattern=("local", "global"), position="sinusoidal", norm_position="deepnorm", ffn="geglu"),
    dict(position="none", ffn="reglu", qk_norm=True, attention_impl="einsum", attn_softcap=30.0, logit_softcap=30.0),
    dict(dtype="bfloat16", n_kv_heads=2, ffn="relu", use_bias=True, tie_embeddings=False),
]


@pytest.mark.parametrize("extra", OVERFIT, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "default")
def test_overfits_a_repeated_batch(extra):
    cfg = tiny(**extra)
    model = build(cfg)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    tokens = tokens_for(cfg, B=4, T=13, seed=5)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(50)]
    assert losses[-1] < 0.5 * losses[0], losses[::10]
