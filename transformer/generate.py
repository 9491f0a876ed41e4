"""Text generation with a KV cache: prefill the prompts in one pass, then decode one token per step
inside one compiled loop.

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

from transformer.model import Transformer


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, P], positions [B, P]) with each prompt right-aligned; padding has position -1."""
    P = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), P), pad_id, np.int32)
    positions = np.full((len(prompts), P), -1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, P - len(prompt) :] = prompt
        positions[row, P - len(prompt) :] = np.arange(len(prompt))
    return tokens, positions


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
    model: Transformer, prompts: list[list[int]], eos_id: int, pad_id: int, cfg: SamplingConfig
) -> list[list[int]]:
    """New tokens for each prompt (without the prompt), stopping at EOS (not included)."""
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens
    if not model.cfg.fits_positions(max_len):
        raise ValueError(
            f"prompt plus new tokens ({max_len}) exceed the model's context of {model.cfg.max_seq_len} tokens"
        )
    tokens, positions = left_pad(prompts, pad_id)
    graphdef, params = nnx.split(model)
    out = _generate(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions), eos_id, max_len, cfg)
    result = []
    for row in np.asarray(out):
        row = row.tolist()
        result.append(row[: row.index(eos_id)] if eos_id in row else row)
    return result


@functools.partial(jax.jit, static_argnames=("graphdef", "eos_id", "max_len", "cfg"))
def _generate(graphdef, params, tokens_BxP, positions_BxP, eos_id, max_len, cfg):
    model = nnx.merge(graphdef, params)
    B, P = tokens_BxP.shape
    cache = model.init_cache(B, max_len)
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
