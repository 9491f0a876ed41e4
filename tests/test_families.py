"""The encoder and encoder-decoder families: who depends on whom (by gradient), cached decoding,
the scan, the attention implementations, generation and the closed-form summary."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build, tiny
from flax import nnx

from transformer.config import ModelConfig
from transformer.eval.generate import SamplingConfig, fill_mask, generate_seq2seq
from transformer.model.attention import attention_mask
from transformer.model.cross_attention import Memory
from transformer.model.summary import (
    count_params,
    cross_cache_bytes_per_source_token,
    flops_per_token,
    kv_cache_bytes_per_token,
    mean_attended_keys,
    params_by_component,
    summary_text,
)

S, T = 8, 6  # encoder and decoder lengths
ENC_SEGMENTS = jnp.asarray([[1, 1, 1, 1, 1, 0, 0, 0]])  # 5 real input tokens, then padding
DEC_SEGMENTS = jnp.asarray([[1, 1, 1, 1, 0, 0]])  # 4 real target tokens, then padding


def encoder(**kw):
    return tiny(arch="encoder", **kw)


def encoder_decoder(**kw):
    return tiny(**{"arch": "encoder_decoder", "n_layers": 2, "n_encoder_layers": 2, **kw})


def dependence(fn, x_1xTxD):
    """dep[t, s] = sum over channels of |d (probe . fn(x)[t]) / d x[s]|: whether output t reads input s."""
    probe = jax.random.normal(jax.random.key(7), fn(x_1xTxD)[0].shape)
    jac = jax.jit(jax.jacrev(lambda x: jnp.sum(fn(x)[0] * probe, axis=-1)))(x_1xTxD)[:, 0]
    return np.asarray(jnp.sum(jnp.abs(jac), axis=-1))


def embeddings(cfg, length, seed=1):
    return jax.random.normal(jax.random.key(seed), (1, length, cfg.d_model))


def positions(length):
    return jnp.arange(length)[None]


# --- encoders: bidirectional ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(position="rope", n_kv_heads=2),
        dict(position="alibi", attention_impl="einsum", norm_position="post"),
        dict(position="learned", n_kv_heads=1, window=3, attention_pattern=("local", "global")),
        dict(position="none", n_experts=4, top_k=2, use_bias=False),  # MoE in an encoder
        dict(attention="mla", kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
    ],
    ids=["gqa-rope", "alibi-einsum-post", "mqa-pattern", "moe", "mla"],
)
def test_every_encoder_output_depends_on_every_input(kw):
    cfg = encoder(**kw)
    model = build(cfg)
    dep = dependence(lambda x: model.run_blocks(x, positions(S))[0], embeddings(cfg, S))
    assert np.all(dep > 0.0)


@pytest.mark.parametrize("impl", ["xla", "einsum"])
def test_documents_never_attend_across_their_boundary_in_an_encoder(impl):
    cfg = encoder(attention_impl=impl, n_kv_heads=2, window=4, attention_pattern=("local", "global"))
    model = build(cfg)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 3]])
    dep = dependence(lambda x: model.run_blocks(x, positions(S), segments)[0], embeddings(cfg, S))
    same = np.asarray(segments[0][:, None] == segments[0][None, :])
    assert np.all(dep[~same] == 0.0) and np.all(dep[same] > 0.0)


@pytest.mark.parametrize("impl, explicit_mask", [("xla", False), ("xla", True), ("einsum", False)])
def test_an_encoders_window_reaches_both_ways_within_it(impl, explicit_mask):
    """One layer, window 3: out[t] reads exactly x[t-2 .. t+2] (the library's own local window, or
    the explicit mask that segment ids bring)."""
    cfg = encoder(n_layers=1, window=3, attention_impl=impl, n_kv_heads=2)
    model = build(cfg)
    segments = jnp.ones((1, 10), jnp.int32) if explicit_mask else None
    dep = dependence(lambda x: model.run_blocks(x, positions(10), segments)[0], embeddings(cfg, 10))
    t, s = np.indices(dep.shape)
    inside = np.abs(t - s) < 3
    assert np.all(dep[~inside] == 0.0) and np.all(dep[inside] > 0.0)


def test_an_encoder_with_alibi_and_a_window_reads_a_reversed_input_in_reverse():
    """ALiBi's bias is symmetric (-slope*|t-s|) and so is the window: reversing the input reverses
    the output exactly (a one-sided bias would not)."""
    cfg = encoder(position="alibi", window=3, attention_pattern=("local", "global"))
    model = build(cfg)
    x = embeddings(cfg, S)
    forward = jax.jit(lambda x: model.run_blocks(x, positions(S))[0])
    np.testing.assert_allclose(forward(x[:, ::-1])[:, ::-1], forward(x), atol=1e-5)


# --- encoder-decoders: a causal decoder reading the whole input ------------------------------------


def decoder_given_encoder_input(model, x_enc_1xSxD, enc_segments=None, dec_segments=None, seed=2):
    """Decoder output as a function of the encoder's input embeddings (the decoder's fixed)."""
    memory_x, _ = model.run_encoder(x_enc_1xSxD, positions(S), enc_segments)
    x_dec = embeddings(model.cfg, T, seed)
    return model.run_blocks(x_dec, positions(T), dec_segments, memory=Memory(memory_x, enc_segments))[0]


def test_the_decoder_is_causal_in_the_target_and_reads_every_input_position():
    cfg = encoder_decoder(n_kv_heads=2, position="alibi")
    model = build(cfg)
    memory = Memory(model.encode(jnp.arange(S)[None]), None)
    dep = dependence(lambda x: model.run_blocks(x, positions(T), memory=memory)[0], embeddings(cfg, T))
    t, s = np.indices(dep.shape)
    assert np.all(dep[s > t] == 0.0) and np.all(dep[s <= t] > 0.0)
    dep = dependence(lambda x: decoder_given_encoder_input(model, x), embeddings(cfg, S))
    assert np.all(dep > 0.0)  # [T, S]: every target position reads every input position


@pytest.mark.parametrize("impl", ["xla", "einsum"])
def test_input_padding_never_reaches_a_real_target_position(impl):
    cfg = encoder_decoder(attention_impl=impl, n_kv_heads=1)
    model = build(cfg)
    dep = dependence(lambda x: decoder_given_encoder_input(model, x, ENC_SEGMENTS, DEC_SEGMENTS), embeddings(cfg, S))
    real_t, real_s = np.asarray(DEC_SEGMENTS[0] == 1), np.asarray(ENC_SEGMENTS[0] == 1)
    assert np.all(dep[np.ix_(real_t, ~real_s)] == 0.0)
    assert np.all(dep[np.ix_(real_t, real_s)] > 0.0)


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill"))
def decode_step_by_step(graphdef, params, source_BxS, enc_segments_BxS, tokens_BxT, prefill):
    """Logits for every target position: the encoder once, then `prefill` tokens, then one at a time."""
    model = nnx.merge(graphdef, params)
    B, T_ = tokens_BxT.shape
    pos = jnp.broadcast_to(jnp.arange(T_), (B, T_))
    cache = model.init_cache(B, T_, model.encode(source_BxS, None, enc_segments_BxS), enc_segments_BxS)
    logits, cache = model.decode(tokens_BxT[:, :prefill], pos[:, :prefill], cache, 0)
    steps = [logits]
    for t in range(prefill, T_):
        logits, cache = model.decode(tokens_BxT[:, t : t + 1], pos[:, t : t + 1], cache, t)
        steps.append(logits)
    return jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_heads=2, position="rope"),
        dict(n_kv_heads=1, position="alibi", norm_position="post", qk_norm=True),
        dict(window=3, attention_pattern=("local", "global"), norm_position="sandwich", position="learned"),
        dict(norm_position="deepnorm", use_bias=True, norm="layernorm", attention_impl="einsum"),
        dict(attention="mla", kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
        # BART's: a position table and an embedding norm per stack, scaled embeddings, a logit bias
        dict(
            position="learned",
            encoder_positions=True,
            embedding_norm=True,
            embed_scale=True,
            output_bias=True,
            norm_position="post",
            norm="layernorm",
            use_bias=True,
        ),
        # T5's: a relative bias table per stack, its distances past the rows' length bucketed
        dict(position="t5_relative", rel_buckets=8, rel_max_distance=6, attn_scale=1.0, tie_embeddings=False),
    ],
    ids=["gqa-rope", "mqa-alibi-post-qknorm", "pattern-sandwich-learned", "deepnorm-bias-einsum", "mla", "bart", "t5"],
)
def test_cached_decoding_with_cross_attention_equals_the_full_forward(kw):
    cfg = encoder_decoder(**kw)
    model = build(cfg)
    source = jax.random.randint(jax.random.key(0), (2, S), 0, cfg.vocab_size)
    target = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
    enc_segments = jnp.asarray([[1] * S, [1] * 5 + [0] * 3])
    full = nnx.jit(
        lambda m: m(
            target, None, jnp.ones_like(target), encoder_tokens_BxS=source, encoder_segment_ids_BxS=enc_segments
        )
    )(model)
    graphdef, params = nnx.split(model)
    cached = decode_step_by_step(graphdef, params, source, enc_segments, target, prefill=2)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)


def test_greedy_decoding_is_teacher_forcing_on_its_own_output():
    """Each generated token is the argmax of the teacher-forced logits on BOS + the tokens before it,
    the input encoded alone (no padding): the loop and padded batches change nothing."""
    cfg = encoder_decoder(n_kv_heads=2, max_seq_len=16)
    model = build(cfg)
    bos, eos, pad = 1, 0, 2
    inputs = [[5, 9, 3, 7, 11, 4], [8, 6], [12, 13, 14, 15, 16, 17, 18, 19]]
    outputs = generate_seq2seq(model, inputs, bos, eos, pad, SamplingConfig(max_new_tokens=8, temperature=0.0))
    for source, out in zip(inputs, outputs):
        assert len(out) >= 1
        decoder_in = jnp.asarray([[bos] + out[:-1]])
        logits = nnx.jit(lambda m, d, s: m(d, encoder_tokens_BxS=s))(model, decoder_in, jnp.asarray([source]))
        assert np.asarray(jnp.argmax(logits[0], axis=-1)).tolist() == out


# --- one layer machinery, two attention implementations ------------------------------------------


def test_the_encoder_stack_scanned_equals_unrolled_with_remat():
    kw = dict(n_encoder_layers=3, window=3, attention_pattern=("local", "global"), dropout=0.1)
    scanned = build(encoder_decoder(remat="dots", **kw))
    unrolled = build(encoder_decoder(scan_layers=False, remat="full", **kw))
    source = jax.random.randint(jax.random.key(0), (2, S), 0, 61)
    target = jax.random.randint(jax.random.key(1), (2, T), 0, 61)
    key = jax.random.key(3)  # dropout on: the per-layer keys must line up too

    @nnx.jit
    def everything(m):
        stats = m.stability_stats(target, encoder_tokens_BxS=source)
        return dict(encoded=m.encode(source, key=key), logits=m(target, key=key, encoder_tokens_BxS=source), **stats)

    a, b = everything(scanned), everything(unrolled)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, err_msg=name)


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_einsum_equals_xla_for_bidirectional_and_cross_attention(arch):
    kw = dict(arch=arch, n_kv_heads=2, window=3, attention_pattern=("local", "global"), position="alibi")
    xla, einsum = build(tiny(**kw)), build(tiny(attention_impl="einsum", **kw))
    tokens = jax.random.randint(jax.random.key(0), (2, S), 0, 61)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2], [1] * 5 + [0] * 3])
    extra = {}
    if arch == "encoder_decoder":
        extra = dict(encoder_tokens_BxS=tokens[:, ::-1], encoder_segment_ids_BxS=segments)
    both = nnx.jit(lambda m: (m(tokens, None, segments, **extra), m(tokens, **extra)))  # with segments, the static path
    for a, b in zip(both(einsum), both(xla)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_blocked_equals_einsum_for_bidirectional_and_cross_attention(arch):
    """The blocked kernel (a CPU's pick under auto) with the two-sided window of an encoder, and over
    an encoder output of another length than the target (cross-attention), values and gradients."""
    kw = dict(arch=arch, n_kv_heads=2, window=3)
    blocked, einsum = build(tiny(attention_impl="blocked", **kw)), build(tiny(attention_impl="einsum", **kw))
    tokens = jax.random.randint(jax.random.key(0), (2, S), 0, 61)
    extra = {}
    if arch == "encoder_decoder":
        extra = dict(encoder_tokens_BxS=jax.random.randint(jax.random.key(1), (2, S + 3), 0, 61))

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)
        return jax.value_and_grad(lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(tokens, **extra))))(params)

    (a, ga), (b, gb) = loss_and_grads(blocked), loss_and_grads(einsum)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_the_encoder_input_goes_exactly_to_an_encoder_decoder_and_encoders_do_not_decode():
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="encoder_tokens_BxS"):
        build(encoder_decoder())(tokens)
    with pytest.raises(ValueError, match="encoder_tokens_BxS"):
        build(encoder())(tokens, encoder_tokens_BxS=tokens)
    with pytest.raises(ValueError, match="memory_BxSxD"):
        build(encoder_decoder()).init_cache(1, 4)
    with pytest.raises(ValueError, match="an encoder decodes nothing"):
        build(encoder()).init_cache(1, 4)


def test_stats_name_the_encoder_stack_and_cross_attention():
    cfg = encoder_decoder(n_encoder_layers=3)
    model = build(cfg)
    target = jax.random.randint(jax.random.key(1), (1, T), 0, 61)
    source = jax.random.randint(jax.random.key(0), (1, S), 0, 61)
    stats = nnx.jit(type(model).stability_stats)(
        model, target, None, DEC_SEGMENTS, encoder_tokens_BxS=source, encoder_segment_ids_BxS=ENC_SEGMENTS
    )
    assert stats["encoder_attn_entropy"].shape == stats["encoder_residual_rms"].shape == (3,)
    assert (
        stats["attn_entropy"].shape == stats["cross_attn_entropy"].shape == stats["cross_attn_logit_max"].shape == (2,)
    )
    # real targets see the 5 real inputs, padding targets the 3 padding ones: entropy within (0, log 5]
    assert np.all(stats["cross_attn_entropy"] > 0.0) and np.all(stats["cross_attn_entropy"] <= math.log(5) + 1e-5)


# --- generation for encoders ---------------------------------------------------------------------


def test_fill_mask_predicts_the_best_tokens_at_each_mask_whatever_the_padding():
    cfg = encoder(n_kv_heads=2)
    model = build(cfg)
    mask, pad = 60, 0
    rows = [[5, mask, 7, 8, mask, 9], [11, mask]]
    predicted = fill_mask(model, rows, mask, pad, top_k=3)
    for row, best in zip(rows, predicted):
        logits = nnx.jit(lambda m, r: m(r))(model, jnp.asarray([row]))[0]
        at_masks = [t for t, tok in enumerate(row) if tok == mask]
        assert best == [np.argsort(-np.asarray(logits[t]))[:3].tolist() for t in at_masks]


# --- DeepNorm and the closed-form summary ---------------------------------------------------------


def test_deepnorm_takes_the_encoder_decoder_constants_of_the_paper():
    cfg = encoder_decoder(n_layers=3, n_encoder_layers=4, norm_position="deepnorm")
    N, M = 4, 3
    assert cfg.deepnorm(encoder_stack=True) == pytest.approx(
        (0.81 * (N**4 * M) ** (1 / 16), 0.87 * (N**4 * M) ** (-1 / 16))
    )
    assert cfg.deepnorm() == pytest.approx(((3 * M) ** 0.25, (12 * M) ** -0.25))
    model = build(cfg)
    G = cfg.n_kv_groups
    for stack, beta in [(model.encoder_blocks, cfg.deepnorm(True)[1]), (model.blocks, cfg.deepnorm()[1])]:
        values = stack.attn.qkv[...][:, :, :, G + 1]
        assert float(jnp.std(values)) == pytest.approx(cfg.init_std * beta, rel=0.05)


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_heads=2, norm_position="sandwich"),
        dict(use_bias=True, norm="layernorm", qk_norm=True, norm_position="post"),
        dict(tie_embeddings=False, position="learned", n_kv_heads=1, ffn="swiglu", norm_position="deepnorm"),
        dict(embedding_norm=True, norm="layernorm", position="learned", norm_position="post"),
        dict(mlm_head=True, output_bias=True, use_bias=True, ffn="gelu_exact", tie_embeddings=False),
    ],
)
def test_closed_form_parameters_equal_the_tree_for_each_family(arch, kw):
    cfg = tiny(arch=arch, **kw)
    assert count_params(cfg) == sum(params_by_component(cfg).values())


def test_closed_form_parameters_of_an_encoder_with_experts_and_one_with_mla():
    for cfg in [
        encoder(n_experts=4, top_k=2, moe_every=2, n_layers=4),
        encoder(attention="mla", kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
    ]:
        assert count_params(cfg) == sum(params_by_component(cfg).values())


def test_full_size_t5_base_shape_check():
    """Shapes only: a T5-base-sized encoder-decoder (12 + 12 layers, d_model 768, relu d_ff 3072, 12
    heads, vocab 32128, RMSNorm, tied) has T5-base's published 222,903,552 parameters less its 768
    relative-position biases (RoPE here has none), and its forward has the right shapes."""
    cfg = ModelConfig(
        arch="encoder_decoder", d_model=768, n_layers=12, n_heads=12, d_ff=3072, ffn="relu", vocab_size=32128
    )
    assert sum(params_by_component(cfg).values()) == count_params(cfg) == 222_903_552 - 768
    model = nnx.eval_shape(lambda: build(cfg))
    out = jax.eval_shape(
        lambda m, t, s: m.forward(t, encoder_tokens_BxS=s)[0],
        model,
        jax.ShapeDtypeStruct((2, 128), jnp.int32),
        jax.ShapeDtypeStruct((2, 512), jnp.int32),
    )
    assert out.shape == (2, 128, 768)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3, 20])
def test_attended_keys_count_the_real_mask(causal, window):
    cfg = tiny(arch="decoder" if causal else "encoder", window=window)
    index = jnp.arange(10)
    mask = attention_mask(index, index, window, causal=causal)
    assert mean_attended_keys(cfg, 10) == pytest.approx(float(jnp.sum(mask)) / 10)


def test_encoder_decoder_flops_add_the_encoder_and_cross_attention():
    """At equal depth and width the encoder-decoder's extra FLOPs per target token are the encoder
    (an encoder-only model's work without its head, here with S = T) plus cross-attention."""
    dec, enc, ed = tiny(), encoder(), encoder_decoder()
    D, N, H, L, V, K = 32, 4, 8, 2, 64, 4
    head = 3 * 2 * D * V
    cross = 3 * L * (2 * 2 * D * N * H + 4 * N * H * 16 + 2 * 2 * D * K * H)
    assert flops_per_token(ed, 16) == pytest.approx(flops_per_token(dec, 16) + flops_per_token(enc, 16) - head + cross)
    assert flops_per_token(enc, 16) > flops_per_token(dec, 16)  # bidirectional: no causal half


def test_cache_bytes_per_token_are_what_the_cache_holds():
    cfg = encoder_decoder(n_kv_heads=2)
    model = build(cfg)
    cache = model.init_cache(3, 10, jnp.zeros((3, S, cfg.d_model)))
    self_bytes = sum(layer[k].nbytes for layer in cache for k in ("k", "v"))
    cross_bytes = sum(layer[k].nbytes for layer in cache for k in ("cross_k", "cross_v"))
    assert self_bytes == 3 * 10 * kv_cache_bytes_per_token(cfg)
    assert cross_bytes == 3 * S * cross_cache_bytes_per_source_token(cfg)
    assert kv_cache_bytes_per_token(encoder()) == cross_cache_bytes_per_source_token(encoder()) == 0
    text = summary_text(cfg, 16)
    assert f"cross-attention cache per input token: {cross_cache_bytes_per_source_token(cfg):,} bytes" in text
    assert "KV cache: none" in summary_text(encoder(), 16)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_the_embedding_norm_sits_on_the_embeddings_after_the_positions(arch):
    """model.embedding_norm: the embeddings with their positions reach the blocks normalised, so
    scaling the token and position tables together changes no logit (the head untied); each stack of
    an encoder-decoder has its own norm."""
    cfg = tiny(arch=arch, embedding_norm=True, position="learned", tie_embeddings=False, norm="layernorm")
    model = build(cfg)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    extra = {"encoder_tokens_BxS": tokens[:, ::-1]} if arch == "encoder_decoder" else {}
    before = np.asarray(model(tokens, **extra))
    for table in (model.embed, model.pos_embed):
        table[...] = table[...] * 7.0
    np.testing.assert_allclose(np.asarray(model(tokens, **extra)), before, atol=1e-4, rtol=1e-4)
    plain = build(dataclasses.replace(cfg, embedding_norm=False))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.update(plain, {k: v for k, v in params.items() if "embed_norm" not in k})
    assert np.abs(np.asarray(plain(tokens, **extra)) - before).max() > 1e-3  # without it the scale shows
    if arch == "encoder_decoder":  # the encoder's own: its bias moves the logits, through the memory
        bias = model.encoder_embed_norm.bias
        bias[...] = jax.random.normal(jax.random.key(1), bias[...].shape)
        assert np.abs(np.asarray(model(tokens, **extra)) - before).max() > 1e-3


def test_an_encoder_with_its_own_position_table_reads_only_it():
    """model.encoder_positions (BART): the encoder's positions come from its own table, the decoder's
    from the shared one; the closed-form count holds the second table."""
    cfg = tiny(arch="encoder_decoder", position="learned", encoder_positions=True)
    assert count_params(cfg) == sum(params_by_component(cfg).values())
    model = build(cfg)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    memory = np.asarray(model.encode(tokens))
    logits = np.asarray(model(tokens, encoder_tokens_BxS=tokens[:, ::-1]))
    model.pos_embed[...] = model.pos_embed[...] + 1.0  # the decoder's
    np.testing.assert_array_equal(np.asarray(model.encode(tokens)), memory)
    model.encoder_pos_embed[...] = model.encoder_pos_embed[...] + 1.0
    assert np.abs(np.asarray(model.encode(tokens)) - memory).max() > 1e-3
    assert np.abs(np.asarray(model(tokens, encoder_tokens_BxS=tokens[:, ::-1])) - logits).max() > 1e-4
