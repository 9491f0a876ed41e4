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


def attend_einsum(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, bias_BxKxGxTxS, cfg: ModelConfig, key):
    """Reference attention in plain einsums; the only path with soft-capping and attention dropout."""
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
    scores_BxKxGxTxS = scores * cfg.scale
    if cfg.attn_softcap is not None:
        scores_BxKxGxTxS = cfg.attn_softcap * jnp.tanh(scores_BxKxGxTxS / cfg.attn_softcap)
    if bias_BxKxGxTxS is not None:
        scores_BxKxGxTxS = scores_BxKxGxTxS + bias_BxKxGxTxS
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
    ) -> jax.Array:
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
        bias_BxNxTxS = alibi_bias(N, positions_BxT, positions_BxT) if cfg.position == "alibi" else None

        index_T = jnp.arange(T)
        if cfg.attention_impl == "einsum":
            mask_BxTxS = attention_mask(index_T, index_T, window, segment_ids_BxT, segment_ids_BxT)
            bias = None if bias_BxNxTxS is None else bias_BxNxTxS.reshape(B, cfg.n_kv_heads, G, T, T)
            out_BxTxKxGxH = attend_einsum(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask_BxTxS, bias, cfg, key)
            out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, N, H)
        else:
            # A static window and no documents use the library's own causal/local masking (which
            # fused kernels understand); a traced per-layer window or segment ids need an explicit mask.
            static = segment_ids_BxT is None and not isinstance(window, jax.Array)
            mask = None if static else attention_mask(index_T, index_T, window, segment_ids_BxT, segment_ids_BxT)
            out_BxTxNxH = jax.nn.dot_product_attention(
                q_BxTxKxGxH.reshape(B, T, N, H),
                k_BxTxKxH,
                v_BxTxKxH,
                bias=None if bias_BxNxTxS is None else bias_BxNxTxS.astype(dtype),
                mask=None if mask is None else mask[:, None],
                scale=cfg.scale,
                is_causal=static,
                local_window_size=(window - 1, 0) if static and window is not None else None,
                implementation=cfg.attention_impl,
            )
        y_BxTxD = jnp.einsum("BTNH,NHD->BTD", out_BxTxNxH, self.out[...].astype(dtype))
        if self.out_bias is not None:
            y_BxTxD = y_BxTxD + self.out_bias[...].astype(dtype)
        return y_BxTxD
