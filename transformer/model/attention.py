"""Causal self-attention: MHA, GQA and MQA through `n_kv_heads`, sliding windows, document masks.

The fused QKV weight is laid out D x K x C x H with C = G + 2: for each kv head, its G query heads,
then its key, then its value. Query head n = k*G + g therefore belongs to kv head k, which is the
grouping `jax.nn.dot_product_attention` uses, and sharding the K axis keeps each group whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.layers import Norm, alibi_bias, const_param, dropout, normal_param, rope

# A finite stand-in for -inf: a fully masked row then softmaxes to uniform weights instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(
    q_index_T: jax.Array,
    k_index_S: jax.Array,
    window: int | jax.Array | None,
    q_segments_BxT: jax.Array | None = None,
    k_segments_BxS: jax.Array | None = None,
) -> jax.Array:
    """mask[b, t, s]: query t may attend key s (causal, inside the window, same document)."""
    allowed_TxS = k_index_S[None, :] <= q_index_T[:, None]
    if window is not None:
        allowed_TxS &= q_index_T[:, None] - k_index_S[None, :] < window
    allowed_BxTxS = allowed_TxS[None]
    if q_segments_BxT is not None:
        allowed_BxTxS = allowed_BxTxS & (q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :])
    return allowed_BxTxS


def attention_logits(q_BxTxKxGxH, k_BxSxKxH, bias_BxKxGxTxS, cfg: ModelConfig) -> jax.Array:
    """Float32 logits before masking: scaled scores, soft-capped, plus the position bias."""
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
    scores_BxKxGxTxS = scores * cfg.scale
    if cfg.attn_softcap is not None:
        scores_BxKxGxTxS = cfg.attn_softcap * jnp.tanh(scores_BxKxGxTxS / cfg.attn_softcap)
    if bias_BxKxGxTxS is not None:
        scores_BxKxGxTxS = scores_BxKxGxTxS + bias_BxKxGxTxS
    return scores_BxKxGxTxS


def attention_stats(logits_BxKxGxTxS, mask_BxTxS) -> dict[str, jax.Array]:
    """Max and mean of the attended logits, and the entropy of each query's attention (mean over
    batch, heads and positions): the quantities that blow up in attention-logit growth."""
    allowed = jnp.broadcast_to(mask_BxTxS[:, None, None], logits_BxKxGxTxS.shape)
    masked = jnp.where(allowed, logits_BxKxGxTxS, MASK_VALUE)
    probs = jax.nn.softmax(masked, axis=-1)
    entropy = -jnp.sum(jnp.where(allowed, probs * jnp.log(jnp.where(allowed, probs, 1.0)), 0.0), axis=-1)
    return {
        "attn_logit_max": jnp.max(masked),
        "attn_logit_mean": jnp.sum(jnp.where(allowed, logits_BxKxGxTxS, 0.0)) / jnp.sum(allowed),
        "attn_entropy": jnp.mean(entropy),
    }


def attend_einsum(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, bias_BxKxGxTxS, cfg: ModelConfig, key):
    """Reference attention in plain einsums; the only path with soft-capping and attention dropout."""
    scores_BxKxGxTxS = attention_logits(q_BxTxKxGxH, k_BxSxKxH, bias_BxKxGxTxS, cfg)
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, MASK_VALUE)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
    probs_BxKxGxTxS = dropout(probs_BxKxGxTxS, cfg.attn_dropout, key).astype(v_BxSxKxH.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs_BxKxGxTxS, v_BxSxKxH)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, N, K, G, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_groups, cfg.head_dim
        qkv = normal_param(rngs, (D, K, G + 2, H), ("embed", "kv_heads", None, "head_dim"), cfg.init_std, cfg)
        # DeepNet scales the value projection's init by beta (1 otherwise).
        qkv[...] = qkv[...].at[:, :, G + 1].multiply(cfg.value_init_std / cfg.init_std)
        self.qkv = qkv
        self.qkv_bias = const_param(0.0, (K, G + 2, H), ("kv_heads", None, "head_dim"), cfg) if cfg.use_bias else None
        self.out = normal_param(rngs, (N, H, D), ("heads", "head_dim", "embed"), cfg.residual_init_std, cfg)
        self.out_bias = const_param(0.0, (D,), ("embed",), cfg) if cfg.use_bias else None
        if cfg.qk_norm:
            self.q_norm = Norm(cfg, dim=H, axis_name="head_dim", kind="rmsnorm")
            self.k_norm = Norm(cfg, dim=H, axis_name="head_dim", kind="rmsnorm")
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None,
        window: int | jax.Array | None,
        key: jax.Array | None = None,
        cache: dict | None = None,
        index: int | jax.Array = 0,
        collect: bool = False,
    ):
        """Attention output [B, T, D]; with a `cache` (decoding), also the updated cache.

        Without a cache, causality and windows follow the token index (training, evaluation).
        With one, they follow positions: the new tokens attend to the cached keys and to each other,
        and keys with position -1 (empty slots, left padding) are never attended to.
        """
        cfg = self.cfg
        B, T, _ = x_BxTxD.shape
        G, N, H = cfg.n_kv_groups, cfg.n_heads, cfg.head_dim
        dtype = x_BxTxD.dtype
        qkv_BxTxKxCxH = jnp.einsum("BTD,DKCH->BTKCH", x_BxTxD, self.qkv[...].astype(dtype))
        if self.qkv_bias is not None:
            qkv_BxTxKxCxH = qkv_BxTxKxCxH + self.qkv_bias[...].astype(dtype)
        q_BxTxKxGxH = qkv_BxTxKxCxH[:, :, :, :G]
        k_BxTxKxH = qkv_BxTxKxCxH[:, :, :, G]
        v_BxTxKxH = qkv_BxTxKxCxH[:, :, :, G + 1]
        if self.q_norm is not None:
            q_BxTxKxGxH, k_BxTxKxH = self.q_norm(q_BxTxKxGxH), self.k_norm(k_BxTxKxH)
        if cfg.position == "rope":
            q_BxTxKxGxH = rope(q_BxTxKxGxH, positions_BxT, cfg.rope_theta)
            k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, cfg.rope_theta)

        new_cache = None
        if cache is None:
            k_BxSxKxH, v_BxSxKxH, k_positions_BxS = k_BxTxKxH, v_BxTxKxH, positions_BxT
            index_T = jnp.arange(T)
            # A static window and no documents use the library's own causal/local masking (which
            # fused kernels understand); a traced window or segment ids need an explicit mask.
            static = segment_ids_BxT is None and not isinstance(window, jax.Array)
            mask_BxTxS = None
            if not static or cfg.attention_impl == "einsum":
                mask_BxTxS = attention_mask(index_T, index_T, window, segment_ids_BxT, segment_ids_BxT)
        else:
            static = False
            k_BxSxKxH = jnp.concatenate([cache["k"].astype(dtype), k_BxTxKxH], axis=1)
            v_BxSxKxH = jnp.concatenate([cache["v"].astype(dtype), v_BxTxKxH], axis=1)
            k_positions_BxS = jnp.concatenate([cache["pos"], positions_BxT], axis=1)
            mask_BxTxS = position_mask(positions_BxT, k_positions_BxS, window)
            new_cache = write_cache(cache, k_BxTxKxH, v_BxTxKxH, positions_BxT, index)

        bias_BxNxTxS = None
        if cfg.position == "alibi":
            bias_BxNxTxS = alibi_bias(N, positions_BxT, k_positions_BxS)
        S = k_BxSxKxH.shape[1]
        if collect:  # stability statistics (sown; a separate, occasional forward pass asks for them)
            bias = None if bias_BxNxTxS is None else bias_BxNxTxS.reshape(B, cfg.n_kv_heads, G, T, S)
            logits = attention_logits(q_BxTxKxGxH, k_BxSxKxH, bias, cfg)
            full_mask = mask_BxTxS
            if full_mask is None:
                full_mask = attention_mask(jnp.arange(T), jnp.arange(S), window, segment_ids_BxT, segment_ids_BxT)
            for name, value in attention_stats(logits, full_mask).items():
                self.sow(nnx.Intermediate, name, value)
        if cfg.attention_impl == "einsum":
            bias = None if bias_BxNxTxS is None else bias_BxNxTxS.reshape(B, cfg.n_kv_heads, G, T, S)
            out_BxTxKxGxH = attend_einsum(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, bias, cfg, key)
            out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, N, H)
        else:
            out_BxTxNxH = jax.nn.dot_product_attention(
                q_BxTxKxGxH.reshape(B, T, N, H),
                k_BxSxKxH,
                v_BxSxKxH,
                bias=None if bias_BxNxTxS is None else bias_BxNxTxS.astype(dtype),
                mask=None if mask_BxTxS is None else mask_BxTxS[:, None],
                scale=cfg.scale,
                is_causal=static,
                local_window_size=(window - 1, 0) if static and window is not None else None,
                implementation=cfg.attention_impl,
            )
        y_BxTxD = jnp.einsum("BTNH,NHD->BTD", out_BxTxNxH, self.out[...].astype(dtype))
        if self.out_bias is not None:
            y_BxTxD = y_BxTxD + self.out_bias[...].astype(dtype)
        return y_BxTxD if cache is None else (y_BxTxD, new_cache)


# --- the KV cache --------------------------------------------------------------------------------


def cache_size(window: int | None, max_len: int) -> int:
    """Entries a layer keeps: the window for a sliding-window layer (a ring buffer), else max_len."""
    return max_len if window is None else min(window, max_len)


def init_cache(cfg: ModelConfig, batch: int, size: int) -> dict:
    shape = (batch, size, cfg.n_kv_heads, cfg.head_dim)
    return {
        "k": jnp.zeros(shape, cfg.dtype),
        "v": jnp.zeros(shape, cfg.dtype),
        "pos": jnp.full((batch, size), -1, jnp.int32),  # -1: empty
    }


def write_cache(cache: dict, k_BxTxKxH, v_BxTxKxH, positions_BxT, index) -> dict:
    """Store the T new entries at absolute indices index..index+T-1 in slots index % size; of more
    than `size` new entries only the last `size` can stay."""
    size, T = cache["pos"].shape[1], k_BxTxKxH.shape[1]
    if T > size:
        k_BxTxKxH, v_BxTxKxH, positions_BxT = k_BxTxKxH[:, -size:], v_BxTxKxH[:, -size:], positions_BxT[:, -size:]
        index = index + T - size
        T = size
    slots_T = (index + jnp.arange(T)) % size
    return {
        "k": cache["k"].at[:, slots_T].set(k_BxTxKxH.astype(cache["k"].dtype)),
        "v": cache["v"].at[:, slots_T].set(v_BxTxKxH.astype(cache["v"].dtype)),
        "pos": cache["pos"].at[:, slots_T].set(positions_BxT),
    }


def position_mask(q_positions_BxT, k_positions_BxS, window) -> jax.Array:
    """mask[b, t, s]: key s is filled (position >= 0), not after query t, and inside its window."""
    q, k = q_positions_BxT[:, :, None], k_positions_BxS[:, None, :]
    allowed = (k >= 0) & (k <= q)
    if window is not None:
        allowed &= q - k < window
    return allowed
