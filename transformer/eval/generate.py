"""Text generation with a KV cache: prefill the prompts in one pass, then decode one token per step
inside one compiled loop. An encoder-decoder encodes its inputs once, keeps the keys and values of
the encoder output in the cache, and decodes from BOS in the same loop (`generate_seq2seq`); an
encoder gives its top predictions at masked positions instead (`fill_mask`).

Prompts of different lengths are left-padded to a common length; each row's positions start at 0
on its first real token, and padding never enters attention (its cache slots carry position -1).
Each layer caches K/V for its K kv heads: a full layer holds `max_len` entries, a sliding-window
layer a ring buffer of `window` entries, so its memory is bounded by the window, not the length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer.model import Transformer, for_inference


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


def left_pad(prompts: list[list[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, P], positions [B, P]) with each prompt right-aligned; padding has position -1.
    P is the longest prompt's length, or `length` (a fixed shape, compiled once for many batches)."""
    P = max(len(p) for p in prompts) if length is None else length
    tokens = np.full((len(prompts), P), pad_id, np.int32)
    positions = np.full((len(prompts), P), -1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, P - len(prompt) :] = prompt
        positions[row, P - len(prompt) :] = np.arange(len(prompt))
    return tokens, positions


def right_pad(rows: list[list[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, S], segment ids [B, S]: 1 on real tokens, 0 on padding) with each row left-aligned;
    S is the longest row's length, or `length`."""
    S = max(len(r) for r in rows) if length is None else length
    tokens = np.full((len(rows), S), pad_id, np.int32)
    segments = np.zeros((len(rows), S), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
        segments[i, : len(row)] = 1
    return tokens, segments


def sample_logits(logits_BxV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Next tokens from float32 logits: greedy at temperature 0, else top-k / top-p sampling."""
    if cfg.temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV / cfg.temperature
    if cfg.top_k is not None:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop_sorted = cumulative - jax.nn.softmax(sorted_logits, axis=-1) >= cfg.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: Transformer,
    prompts: list[list[int]],
    eos_id: int,
    pad_id: int,
    cfg: SamplingConfig,
    prompt_len: int | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (without the prompt), stopping at EOS (not included); the prompts
    left-padded to `prompt_len` when given (at least the longest), else to the longest."""
    return _until_eos(model, prompts, eos_id, pad_id, cfg, None, prompt_len)


def generate_seq2seq(
    model: Transformer,
    inputs: list[list[int]],
    bos_id: int,
    eos_id: int,
    pad_id: int,
    cfg: SamplingConfig,
    input_len: int | None = None,
) -> list[list[int]]:
    """An encoder-decoder's output for each input (token rows of any lengths, right-padded with
    segment id 0, to `input_len` when given, so that padding is never attended): encoded once, then
    decoded from BOS until EOS (not included) or `max_new_tokens`."""
    longest = max(len(row) for row in inputs) if input_len is None else input_len
    if not model.cfg.fits_positions(longest):
        raise ValueError(f"an input of {longest} tokens exceeds the model's context of {model.cfg.max_seq_len} tokens")
    tokens_BxS, segments_BxS = right_pad(inputs, pad_id, input_len)
    encoder_inputs = (jnp.asarray(tokens_BxS), jnp.asarray(segments_BxS))
    return _until_eos(model, [[bos_id]] * len(inputs), eos_id, pad_id, cfg, encoder_inputs)


def _until_eos(
    model: Transformer,
    prompts: list[list[int]],
    eos_id: int,
    pad_id: int,
    cfg: SamplingConfig,
    encoder_inputs: tuple[jax.Array, jax.Array] | None,
    prompt_len: int | None = None,
) -> list[list[int]]:
    """The compiled loop on left-padded prompts (an encoder-decoder's: its encoder tokens and segment
    ids beside), each row cut at its first EOS."""
    longest = max(len(p) for p in prompts)
    assert prompt_len is None or prompt_len >= longest
    max_len = (prompt_len or longest) + cfg.max_new_tokens
    if not model.cfg.fits_positions(max_len):
        raise ValueError(
            f"prompt plus new tokens ({max_len}) exceed the model's context of {model.cfg.max_seq_len} tokens"
        )
    tokens, positions = left_pad(prompts, pad_id, prompt_len)
    graphdef, params = nnx.split(for_inference(model))
    out = _generate(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions), eos_id, max_len, cfg, encoder_inputs)
    result = []
    for row in np.asarray(out):
        row = row.tolist()
        result.append(row[: row.index(eos_id)] if eos_id in row else row)
    return result


@functools.partial(jax.jit, static_argnames=("graphdef", "eos_id", "max_len", "cfg"))
def _generate(graphdef, params, tokens_BxP, positions_BxP, eos_id, max_len, cfg, encoder_inputs=None):
    model = nnx.merge(graphdef, params)
    B, P = tokens_BxP.shape
    if encoder_inputs is None:
        cache = model.init_cache(B, max_len)
    else:  # encoded once: each layer's cross-attention keys and values go into its cache
        encoder_tokens_BxS, encoder_segments_BxS = encoder_inputs
        memory_BxSxD = model.encode(encoder_tokens_BxS, None, encoder_segments_BxS)
        cache = model.init_cache(B, max_len, memory_BxSxD, encoder_segments_BxS)
    logits_BxPxV, cache = model.decode(tokens_BxP, positions_BxP, cache, 0)
    key = jax.random.key(cfg.seed)
    first = sample_logits(logits_BxPxV[:, -1], jax.random.fold_in(key, 0), cfg)
    next_pos = positions_BxP[:, -1] + 1

    def step(carry, i):
        token_B, pos_B, cache, finished_B = carry
        logits, cache = model.decode(token_B[:, None], pos_B[:, None], cache, P + i)
        new = sample_logits(logits[:, -1], jax.random.fold_in(key, i + 1), cfg)
        finished_B = finished_B | (token_B == eos_id)
        new = jnp.where(finished_B, eos_id, new)
        return (new, pos_B + 1, cache, finished_B), token_B

    init = (first, next_pos, cache, jnp.zeros((B,), bool))
    _, generated = jax.lax.scan(step, init, jnp.arange(cfg.max_new_tokens))
    return generated.T  # [B, max_new_tokens]


def fill_mask(
    model: Transformer, rows: list[list[int]], mask_id: int, pad_id: int, top_k: int = 5
) -> list[list[list[int]]]:
    """An encoder's `top_k` predictions (best first) at each `mask_id` of each row, in order; rows
    of different lengths are right-padded with segment id 0, so padding is never attended."""
    tokens, segments = right_pad(rows, pad_id)
    graphdef, params = nnx.split(for_inference(model))
    best = np.asarray(_top_predictions(graphdef, params, jnp.asarray(tokens), jnp.asarray(segments), top_k))
    return [[best[i, t].tolist() for t in np.flatnonzero(tokens[i] == mask_id)] for i in range(len(rows))]


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k"))
def _top_predictions(graphdef, params, tokens_BxS, segments_BxS, top_k):
    logits_BxSxV = nnx.merge(graphdef, params)(tokens_BxS, None, segments_BxS)
    return jax.lax.top_k(logits_BxSxV, top_k)[1]  # [B, S, top_k]
