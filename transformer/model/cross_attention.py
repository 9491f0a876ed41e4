"""Cross-attention of an encoder-decoder's decoder blocks: queries from the decoder stream, keys and
values from the encoder output (the "memory"), with the K kv heads of `n_kv_heads` (GQA/MQA apply).

No position scheme enters cross-attention, as in T5 and BART: queries and keys belong to two
different sequences, so there is no rotation and no logit bias here; order reaches the decoder
through its self-attention and the encoder through its own. The keys and values of the memory are
computed once per sequence; decoding keeps them in each layer's cache (`cross_k`, `cross_v`, and
the encoder's segment ids as `cross_segments`) beside the self-attention entries. With
`model.attention=mla` only self-attention is latent: the memory's keys and values are made once
per input, so compressing them per token would save no decoding work, and cross-attention stays
MHA/GQA.

Axis legend as in layers.py; S here counts encoder positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.attention import Attention, Keys, KVCache


class Memory(NamedTuple):
    """What the decoder's cross-attention reads: the encoder output [B, S, D] and its segment ids
    [B, S] (None: every encoder position is one sequence)."""

    x_BxSxD: jax.Array
    segment_ids_BxS: jax.Array | None


def cross_mask(q_segments_BxT: jax.Array | None, k_segments_BxS: jax.Array | None) -> jax.Array | None:
    """mask[b, t, s]: decoder position t may attend encoder position s iff their segment ids are
    equal when both are given (so target padding only meets encoder padding); None: every key."""
    if q_segments_BxT is None or k_segments_BxS is None:
        return None
    return q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :]


class CrossAttention(Attention):
    """Attention of the decoder's queries to the memory's keys and values: the fused weight of
    `Attention` (its query part reads the decoder, its key and value parts the memory), qk-norm
    and biases as configured, always bidirectional and without positions."""

    STATS_PREFIX = "cross_"

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, causal=False)

    def memory_entries(self, memory_BxSxD: jax.Array) -> KVCache:
        """The keys and values [B, S, K, H] of the encoder output, computed once per sequence."""
        G = self.cfg.n_kv_groups
        kv_BxSxKxCxH = self.fused(memory_BxSxD, slice(G, G + 2))
        k_BxSxKxH, v_BxSxKxH = kv_BxSxKxCxH[:, :, :, 0], kv_BxSxKxCxH[:, :, :, 1]
        if self.k_norm is not None:
            k_BxSxKxH = self.k_norm(k_BxSxKxH)
        return {"k": k_BxSxKxH, "v": v_BxSxKxH}

    def __call__(  # type: ignore[override]  # its own arguments: the memory instead of positions and a cache
        self,
        x_BxTxD: jax.Array,
        entries: KVCache,
        segment_ids_BxT: jax.Array | None,
        memory_segment_ids_BxS: jax.Array | None,
        key: jax.Array | None = None,
        collect: bool = False,
    ) -> jax.Array:
        """The output [B, T, D] of the decoder stream x attending to the memory's `entries`."""
        q_BxTxKxGxH = self.fused(x_BxTxD, slice(0, self.cfg.n_kv_groups))
        if self.q_norm is not None:
            q_BxTxKxGxH = self.q_norm(q_BxTxKxGxH)
        B, T = x_BxTxD.shape[:2]
        S = entries["k"].shape[1]
        mask_BxTxS = cross_mask(segment_ids_BxT, memory_segment_ids_BxS)
        if mask_BxTxS is None and (collect or self.cfg.attention_kernel == "einsum"):
            mask_BxTxS = jnp.ones((B, T, S), bool)  # these paths mask explicitly
        # static: no mask at all where none is needed (the fused kernels' fast path); never causal here
        keys = Keys(entries["k"], entries["v"], jnp.zeros((B, S), jnp.int32), mask_BxTxS, mask_BxTxS is None)
        if collect:
            self.sow_stats(q_BxTxKxGxH, keys, None, segment_ids_BxT, None)
        out_BxTxNxH = self.attend(q_BxTxKxGxH, keys, None, None, key)
        return self.output(out_BxTxNxH, x_BxTxD.dtype)
