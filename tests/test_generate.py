"""KV-cache decoding equals the full forward pass; generation, padding, windows, sampling."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTENTION_VARIANTS, NORM_POSITIONS, POSITIONS, build, tiny
from flax import nnx

from transformer.eval.generate import SamplingConfig, generate, left_pad, sample_logits
from transformer.model.summary import kv_cache_bytes_per_token

# Every attention variant with every position encoding; norm placements cycle through the grid so
# each placement meets every attention variant (placement does not touch the cache path).
GRID = [
    (variant, position, NORM_POSITIONS[(i + j) % len(NORM_POSITIONS)])
    for (i, variant), (j, position) in itertools.product(enumerate(ATTENTION_VARIANTS), enumerate(POSITIONS))
]


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill"))
def prefill_then_decode(graphdef, params, tokens_BxT, prefill):
    """Logits for every position: the first `prefill` tokens in one pass, then one token per step."""
    model = nnx.merge(graphdef, params)
    B, T = tokens_BxT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = model.init_cache(B, T)
    first, cache = model.decode(tokens_BxT[:, :prefill], positions[:, :prefill], cache, 0)

    def step(cache, t):
        tok = jax.lax.dynamic_slice_in_dim(tokens_BxT, t, 1, axis=1)
        pos = jax.lax.dynamic_slice_in_dim(positions, t, 1, axis=1)
        logits, cache = model.decode(tok, pos, cache, t)
        return cache, logits[:, 0]

    _, rest = jax.lax.scan(step, cache, jnp.arange(prefill, T))
    return jnp.concatenate([first, rest.swapaxes(0, 1)], axis=1)


def check_cached_equals_full(cfg, T=12, prefill=5, seed=0):
    model = build(cfg)
    tokens = jax.random.randint(jax.random.key(seed), (2, T), 0, cfg.vocab_size)
    full = model(tokens)
    graphdef, params = nnx.split(model)
    cached = prefill_then_decode(graphdef, params, tokens, prefill)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("variant, position, norm_position", GRID)
def test_prefill_and_decode_equal_the_full_forward(variant, position, norm_position):
    cfg = tiny(position=position, norm_position=norm_position, max_seq_len=16, **ATTENTION_VARIANTS[variant])
    check_cached_equals_full(cfg)


@pytest.mark.parametrize("impl", ["einsum", "xla"])
def test_decoding_far_past_the_window(impl):
    """A window of 3 and 40 tokens: the ring buffer wraps many times and still matches."""
    cfg = tiny(window=3, n_kv_heads=2, attention_impl=impl, max_seq_len=64, position="rope")
    check_cached_equals_full(cfg, T=40, prefill=7)
    cache = build(cfg).init_cache(2, 40)
    assert all(layer["k"].shape[1] == 3 for layer in cache)  # bounded by the window, not the length


def test_pattern_caches_have_per_layer_sizes():
    cfg = tiny(window=4, attention_pattern=("local", "global"), max_seq_len=64)
    cache = build(cfg).init_cache(1, 50)
    assert [layer["k"].shape[1] for layer in cache] == [4, 50]
    check_cached_equals_full(cfg, T=30, prefill=3)
    check_cached_equals_full(dataclasses.replace(cfg, rope_local_theta=50.0), T=30, prefill=3)  # Gemma 3's thetas


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_equal_the_closed_form(n_kv_heads, dtype):
    cfg = tiny(n_kv_heads=n_kv_heads, dtype=dtype)
    cache = build(cfg).init_cache(1, 10)
    kv_bytes = sum(layer["k"].nbytes + layer["v"].nbytes for layer in cache)
    assert (
        kv_bytes
        == 10 * kv_cache_bytes_per_token(cfg)
        == 10 * 2 * cfg.n_layers * n_kv_heads * cfg.head_dim * (4 if dtype == "float32" else 2)
    )


def greedy_without_cache(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        logits = model(jnp.asarray([tokens], jnp.int32))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("extra", [dict(), dict(position="alibi", n_kv_heads=1, window=4)])
def test_greedy_generation_with_and_without_cache(extra):
    cfg = tiny(max_seq_len=32, **extra)
    model = build(cfg, seed=3)
    prompt = [5, 9, 2, 7]
    eos = cfg.vocab_size + 1  # never produced: generate all 10 tokens
    got = generate(model, [prompt], eos_id=eos, pad_id=0, cfg=SamplingConfig(max_new_tokens=10, temperature=0.0))
    assert got == [greedy_without_cache(model, prompt, 10)]


def test_prompts_of_different_lengths_in_one_batch():
    cfg = tiny(max_seq_len=32, position="rope", n_kv_heads=2)
    model = build(cfg, seed=4)
    prompts = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12]]
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
    batched = generate(model, prompts, eos_id=999, pad_id=0, cfg=sampling)
    alone = [generate(model, [p], eos_id=999, pad_id=0, cfg=sampling)[0] for p in prompts]
    assert batched == alone


def test_generation_stops_at_eos():
    cfg = tiny(max_seq_len=32)
    model = build(cfg, seed=5)
    free = generate(model, [[1, 2, 3]], eos_id=999, pad_id=0, cfg=SamplingConfig(max_new_tokens=8, temperature=0.0))[0]
    eos = free[3]  # pretend the 4th generated token is EOS
    stopped = generate(model, [[1, 2, 3]], eos_id=eos, pad_id=0, cfg=SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert stopped[0] == free[: free.index(eos)]


def test_left_pad():
    tokens, positions = left_pad([[1, 2, 3], [4]], pad_id=0)
    np.testing.assert_array_equal(tokens, [[1, 2, 3], [0, 0, 4]])
    np.testing.assert_array_equal(positions, [[0, 1, 2], [-1, -1, 0]])


def test_sampling_rules():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
    key = jax.random.key(0)
    greedy = sample_logits(logits, key, SamplingConfig(temperature=0.0))
    assert set(np.asarray(greedy).tolist()) == {0}
    assert set(np.asarray(sample_logits(logits, key, SamplingConfig(top_k=1))).tolist()) == {0}
    top2 = np.asarray(sample_logits(logits, key, SamplingConfig(top_k=2)))
    assert set(top2.tolist()) == {0, 1}
    top_p = np.asarray(sample_logits(logits, key, SamplingConfig(top_p=0.7)))  # 0.5 + 0.3 reach 0.7
    assert set(top_p.tolist()) == {0, 1}
    full = np.asarray(sample_logits(logits, key, SamplingConfig()))
    np.testing.assert_allclose(np.bincount(full, minlength=4) / 2000, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    np.testing.assert_array_equal(full, np.asarray(sample_logits(logits, key, SamplingConfig())))  # seeded


def test_learned_positions_refuse_too_long_a_request():
    cfg = tiny(position="learned", max_seq_len=8)
    with pytest.raises(ValueError, match="exceed the model's context of 8"):
        generate(build(cfg), [[1] * 6], eos_id=0, pad_id=0, cfg=SamplingConfig(max_new_tokens=5))
