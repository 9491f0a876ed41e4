"""Multi-head latent attention (MLA, DeepSeek-V2: Liu et al. 2024, section 2.1).

Keys and values of every head are projected up from one compressed latent per token, and position
enters through a small RoPE key shared by all heads, kept apart from the latent so that the
latent's up-projections stay position-free. Per token x, with c^Q = RMSNorm(x W^DQ) for low-rank
queries (x itself for full-rank ones):

    c^KV = RMSNorm(x W^DKV)                      the latent, R = kv_lora_rank
    k^R  = RoPE(x W^KR)                          the decoupled key, E = qk_rope_head_dim, all heads
    k_n  = [c^KV W^UK_n ; k^R]                   A + E  (A = qk_nope_head_dim)
    v_n  = c^KV W^UV_n                           Y = v_head_dim
    q_n  = [c^Q W^UQ_n ; RoPE(c^Q W^QR_n)]       A + E
    out  = sum_n softmax(q_n k_n^T / sqrt(A + E)) v_n W^O_n

The KV cache holds c^KV and k^R only, (R + E) numbers per token and layer. Decoding a few tokens
against a long cache takes the absorbed form (section 2.1.2): W^UK folded into the queries and W^UV
into the output, so attention runs in the latent space and no head's key or value is ever made,

    q~_n = q_n^C W^UK_n^T                        R numbers per query head
    p_n  = softmax((q~_n c^KV^T + q_n^R k^R^T) / sqrt(A + E))
    out  = sum_n (p_n c^KV) W^UV_n W^O_n

the same function to float rounding. Which form runs is decided per call from the shapes, by which
needs fewer multiply-adds (`absorbs`): decoding absorbs, a long prefill expands.

Axis legend as in layers.py, plus R the KV latent, Q the query latent, E the RoPE part of a head,
A the rest of a query/key head (H = A + E), Y the value head width. Queries are laid out as the
base class's [B, T, K, G, H] with one "kv head" per query head (K = N, G = 1): the masks,
implementations and statistics of `Attention` then apply unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.attention import (
    MASK_VALUE,
    Attention,
    Keys,
    KVCache,
    cached_and_new,
    position_mask,
    scaled_and_capped,
    write_cache,
)
from transformer.model.layers import InitScales, Norm, normal_param
from transformer.model.positions import Window, positions_for


class MultiHeadLatentAttention(Attention):
    """Self-attention over keys and values decompressed from a per-token latent (MLA)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, causal: bool = True, encoder_stack: bool = False):
        self.cfg = cfg
        self.causal = causal
        self.positions = positions_for(cfg)
        scales = InitScales.of(cfg, encoder_stack)
        D, N, H, A, Y = cfg.d_model, cfg.n_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        R, E, Q = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
        # full-rank queries (q_lora_rank null), or down to a normalised query latent and up again
        full_rank = ("embed", "heads", "head_dim")
        self.wq = normal_param(rngs, (D, N, H), full_rank, scales.qkv, cfg) if Q is None else None
        self.wq_down = None if Q is None else normal_param(rngs, (D, Q), ("embed", "latent"), scales.qkv, cfg)
        self.q_latent_norm = None if Q is None else Norm(cfg, dim=Q, axis_name="latent", kind="rmsnorm")
        up = ("latent", "heads", "head_dim")
        self.wq_up = None if Q is None else normal_param(rngs, (Q, N, H), up, scales.qkv, cfg)
        self.wkv_down = normal_param(rngs, (D, R), ("embed", "latent"), scales.qkv, cfg)
        self.kv_latent_norm = Norm(cfg, dim=R, axis_name="latent", kind="rmsnorm")
        self.wk_rope = normal_param(rngs, (D, E), ("embed", "head_dim"), scales.qkv, cfg)
        self.wk_up = normal_param(rngs, (R, N, A), ("latent", "heads", "head_dim"), scales.kv_up, cfg)
        self.wv_up = normal_param(rngs, (R, N, Y), ("latent", "heads", "head_dim"), scales.v_up, cfg)
        self.out = normal_param(rngs, (N, Y, D), ("heads", "head_dim", "embed"), scales.attn_out, cfg)
        self.out_bias = None  # the config refuses biases with MLA

    def attend_cached(
        self,
        q_BxTxKxGxH: jax.Array,
        entries: KVCache,
        positions_BxT: jax.Array,
        window: Window,
        cache: KVCache,
        index: int | jax.Array,
        bias_table: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """As `Attention.attend_cached`, in the absorbed form where that is cheaper (MLA is rope-only:
        no `bias_table`)."""
        if not self.absorbs(q_BxTxKxGxH.shape[1], cache["pos"].shape[1]):
            return super().attend_cached(q_BxTxKxGxH, entries, positions_BxT, window, cache, index)
        assert self.cfg.position == "rope", "the absorbed form adds no position bias: MLA is rope-only (_check_mla)"
        every_BxS, k_positions_BxS = cached_and_new(cache, entries, positions_BxT)
        mask_BxTxS = position_mask(positions_BxT, k_positions_BxS, window)
        out_BxTxNxY = self.attend_absorbed(q_BxTxKxGxH[:, :, :, 0], every_BxS, mask_BxTxS)
        return out_BxTxNxY, write_cache(cache, entries, positions_BxT, index)

    def absorbs(self, T: int, cached: int) -> bool:
        """Whether T new tokens against `cached` + T keys take fewer multiply-adds absorbed (per
        query head: W^UK into the query, scores and weighted sum over R-wide latents, W^UV out)
        than expanded (every key's and value's head made from its latent, then attention over
        heads of A + E and Y)."""
        cfg, S = self.cfg, cached + T
        R, A, E, Y = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        absorbed = T * (A * R + S * (R + E) + S * R + R * Y)
        expanded = S * R * (A + Y) + T * S * (A + E + Y)
        return absorbed < expanded

    def attend_absorbed(self, q_BxTxNxH: jax.Array, every_BxS: KVCache, mask_BxTxS: jax.Array) -> jax.Array:
        """out [B, T, N, Y]: attention over the cached and new latents themselves, W^UK folded
        into the queries and W^UV applied to each head's weighted latent. Float32 logits, masked
        and soft-capped as `attend_einsum` does."""
        cfg, A = self.cfg, self.cfg.qk_nope_head_dim
        latent_BxSxR, k_rope_BxSxE = every_BxS["latent"], every_BxS["k_rope"]
        dtype = latent_BxSxR.dtype
        q_BxTxNxR = jnp.einsum("BTNA,RNA->BTNR", q_BxTxNxH[..., :A], self.wk_up[...].astype(dtype))
        scores_BxNxTxS = jnp.einsum("BTNR,BSR->BNTS", q_BxTxNxR, latent_BxSxR, preferred_element_type=jnp.float32)
        scores_BxNxTxS += jnp.einsum(
            "BTNE,BSE->BNTS", q_BxTxNxH[..., A:], k_rope_BxSxE.astype(dtype), preferred_element_type=jnp.float32
        )
        scores_BxNxTxS = jnp.where(mask_BxTxS[:, None], scaled_and_capped(scores_BxNxTxS, cfg), MASK_VALUE)
        probs_BxNxTxS = jax.nn.softmax(scores_BxNxTxS, axis=-1).astype(dtype)
        mixed_BxTxNxR = jnp.einsum("BNTS,BSR->BTNR", probs_BxNxTxS, latent_BxSxR)
        return jnp.einsum("BTNR,RNY->BTNY", mixed_BxTxNxR, self.wv_up[...].astype(dtype))

    def empty_cache(self, batch: int, size: int) -> KVCache:
        """The latent and the shared rope key of `size` tokens: (R + E) numbers per token."""
        cfg = self.cfg
        return {
            "latent": jnp.zeros((batch, size, cfg.kv_lora_rank), cfg.compute_dtype),
            "k_rope": jnp.zeros((batch, size, cfg.qk_rope_head_dim), cfg.compute_dtype),
            "pos": jnp.full((batch, size), -1, jnp.int32),  # -1: empty
        }

    def queries(self, x_BxTxD: jax.Array) -> jax.Array:
        """q [B, T, N, H] before rotation: full-rank, or up from the normalised query latent."""
        dtype = x_BxTxD.dtype
        if self.wq is not None:
            return jnp.einsum("BTD,DNH->BTNH", x_BxTxD, self.wq[...].astype(dtype))
        assert self.wq_down is not None and self.q_latent_norm is not None and self.wq_up is not None
        c_BxTxQ = self.q_latent_norm(jnp.einsum("BTD,DQ->BTQ", x_BxTxD, self.wq_down[...].astype(dtype)))
        return jnp.einsum("BTQ,QNH->BTNH", c_BxTxQ, self.wq_up[...].astype(dtype))

    def project(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, window: Window = None) -> tuple[jax.Array, KVCache]:
        """(q [B, T, N, 1, H] with its rope part rotated, what the cache keeps of each token: the
        latent [B, T, R] and the rotated shared key [B, T, E])."""
        dtype, A = x_BxTxD.dtype, self.cfg.qk_nope_head_dim
        q_BxTxNxH = self.queries(x_BxTxD)
        q_rope_BxTxNxE = self.positions.rotate(q_BxTxNxH[..., A:], positions_BxT, window)
        q_BxTxNxH = jnp.concatenate([q_BxTxNxH[..., :A], q_rope_BxTxNxE], axis=-1)
        latent_BxTxR = self.kv_latent_norm(jnp.einsum("BTD,DR->BTR", x_BxTxD, self.wkv_down[...].astype(dtype)))
        k_rope_BxTxE = jnp.einsum("BTD,DE->BTE", x_BxTxD, self.wk_rope[...].astype(dtype))
        entries = {"latent": latent_BxTxR, "k_rope": self.positions.rotate(k_rope_BxTxE, positions_BxT, window)}
        return q_BxTxNxH[:, :, :, None], entries

    def kv_of(self, entries: KVCache) -> tuple[jax.Array, jax.Array]:
        """(k [B, S, N, H], v [B, S, N, Y]): every head's key and value up from the latent, the
        shared rope key appended to each key."""
        latent_BxSxR, k_rope_BxSxE = entries["latent"], entries["k_rope"]
        dtype, N = latent_BxSxR.dtype, self.cfg.n_heads
        k_nope_BxSxNxA = jnp.einsum("BSR,RNA->BSNA", latent_BxSxR, self.wk_up[...].astype(dtype))
        v_BxSxNxY = jnp.einsum("BSR,RNY->BSNY", latent_BxSxR, self.wv_up[...].astype(dtype))
        B, S, E = k_rope_BxSxE.shape
        k_rope_BxSxNxE = jnp.broadcast_to(k_rope_BxSxE[:, :, None].astype(dtype), (B, S, N, E))
        return jnp.concatenate([k_nope_BxSxNxA, k_rope_BxSxNxE], axis=-1), v_BxSxNxY

    def attend(
        self,
        q_BxTxKxGxH: jax.Array,
        keys: Keys,
        bias_BxNxTxS: jax.Array | None,
        window: Window,
        key: jax.Array | None,
    ) -> jax.Array:
        """out [B, T, N, Y]. jax.nn.dot_product_attention wants values as wide as keys, so the
        narrower side is padded with zeros: zero query/key columns add nothing to the scores (the
        scale is passed explicitly), zero value columns give output columns that are cut off."""
        H, Y = q_BxTxKxGxH.shape[-1], keys.v_BxSxKxH.shape[-1]
        if self.cfg.attention_kernel == "einsum" or H == Y:
            return super().attend(q_BxTxKxGxH, keys, bias_BxNxTxS, window, key)
        width = max(H, Y)

        def pad(a: jax.Array) -> jax.Array:
            return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])])

        padded = keys._replace(k_BxSxKxH=pad(keys.k_BxSxKxH), v_BxSxKxH=pad(keys.v_BxSxKxH))
        return super().attend(pad(q_BxTxKxGxH), padded, bias_BxNxTxS, window, key)[..., :Y]
