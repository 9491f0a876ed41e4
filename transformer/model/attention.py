"""Self-attention, causal (decoders) or bidirectional (encoders): MHA, GQA and MQA through
`n_kv_heads`, sliding windows (symmetric when bidirectional), document masks.

The fused QKV weight is laid out D x K x C x H with C = G + 2: for each kv head, its G query heads,
then its key, then its value. Query head n = k*G + g therefore belongs to kv head k, which is the
grouping `jax.nn.dot_product_attention` uses, and sharding the K axis keeps each group whole.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.flash import Mask, attend_blocked
from transformer.model.layers import InitScales, Norm, const_param, dropout, normal_param, project
from transformer.model.positions import Window, positions_for

# One layer's KV cache: "k" and "v" [B, S, K, H] and "pos" [B, S] (-1: an empty slot).
KVCache = dict[str, jax.Array]

# A finite stand-in for -inf: a fully masked row then softmaxes to uniform weights instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(
    q_index_T: jax.Array,
    k_index_S: jax.Array,
    window: Window,
    q_segments_BxT: jax.Array | None = None,
    k_segments_BxS: jax.Array | None = None,
    causal: bool = True,
) -> jax.Array:
    """mask[b, t, s]: query t may attend key s (not after it when causal, inside the window, same
    document). Bidirectional windows are symmetric: |t - s| < window."""
    distance_TxS = q_index_T[:, None] - k_index_S[None, :]
    allowed_TxS = distance_TxS >= 0 if causal else jnp.ones(distance_TxS.shape, bool)
    if window is not None:
        allowed_TxS &= jnp.abs(distance_TxS) < window
    allowed_BxTxS = allowed_TxS[None]
    if q_segments_BxT is not None and k_segments_BxS is not None:
        allowed_BxTxS = allowed_BxTxS & (q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :])
    return allowed_BxTxS


def attention_logits(
    q_BxTxKxGxH: jax.Array, k_BxSxKxH: jax.Array, bias_BxKxGxTxS: jax.Array | None, cfg: ModelConfig
) -> jax.Array:
    """Float32 logits before masking: scaled scores, soft-capped, plus the position bias."""
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
    scores_BxKxGxTxS = scaled_and_capped(scores, cfg)
    if bias_BxKxGxTxS is not None:
        scores_BxKxGxTxS = scores_BxKxGxTxS + bias_BxKxGxTxS
    return scores_BxKxGxTxS


def scaled_and_capped(scores: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Raw float32 scores (any layout) times the attention scale, soft-capped where configured."""
    scores = scores * cfg.scale
    if cfg.attn_softcap is not None:
        scores = cfg.attn_softcap * jnp.tanh(scores / cfg.attn_softcap)
    return scores


def attention_stats(logits_BxKxGxTxS: jax.Array, mask_BxTxS: jax.Array) -> dict[str, jax.Array]:
    """Max, mean and RMS of the attended logits, and the entropy of each query's attention (mean over
    batch, heads and positions): the quantities that blow up in attention-logit growth."""
    allowed = jnp.broadcast_to(mask_BxTxS[:, None, None], logits_BxKxGxTxS.shape)
    masked = jnp.where(allowed, logits_BxKxGxTxS, MASK_VALUE)
    probs = jax.nn.softmax(masked, axis=-1)
    # 0 * log 0 is 0: collapsed (one-hot) attention, where the other keys' probabilities underflow
    # to exactly 0, has entropy 0, not nan
    attended = allowed & (probs > 0)
    entropy = -jnp.sum(jnp.where(attended, probs * jnp.log(jnp.where(attended, probs, 1.0)), 0.0), axis=-1)
    return {
        "attn_logit_max": jnp.max(masked),
        "attn_logit_mean": jnp.sum(jnp.where(allowed, logits_BxKxGxTxS, 0.0)) / jnp.sum(allowed),
        "attn_logit_rms": jnp.sqrt(jnp.sum(jnp.where(allowed, jnp.square(logits_BxKxGxTxS), 0.0)) / jnp.sum(allowed)),
        "attn_entropy": jnp.mean(entropy),
    }


def attend_einsum(
    q_BxTxKxGxH: jax.Array,
    k_BxSxKxH: jax.Array,
    v_BxSxKxH: jax.Array,
    mask_BxTxS: jax.Array,
    bias_BxKxGxTxS: jax.Array | None,
    cfg: ModelConfig,
    key: jax.Array | None,
) -> jax.Array:
    """Reference attention in plain einsums; the only path with soft-capping and attention dropout."""
    scores_BxKxGxTxS = attention_logits(q_BxTxKxGxH, k_BxSxKxH, bias_BxKxGxTxS, cfg)
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, MASK_VALUE)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
    probs_BxKxGxTxS = dropout(probs_BxKxGxTxS, cfg.attn_dropout, key).astype(v_BxSxKxH.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs_BxKxGxTxS, v_BxSxKxH)


class Keys(NamedTuple):
    """What the queries attend to: keys and values with their positions, and how they may."""

    k_BxSxKxH: jax.Array
    v_BxSxKxH: jax.Array
    positions_BxS: jax.Array
    mask_BxTxS: jax.Array | None  # None: the library masks by itself (static)
    static: bool  # by token index (causal when the layer is), a window known at trace time: the library's own masking


def head_logit_max(
    q_BxTxKxGxH: jax.Array, keys: Keys, window: Window, causal: bool, cfg: ModelConfig, block: int = 256
) -> jax.Array:
    """[K*G]: each query head's largest scaled score q·k over the pairs its mask allows in the batch
    (before soft-capping and any position bias: the part that rescaling the query and key
    projections changes), what QK-clip reads (model/qk_clip.py). No gradient flows through it. The
    scores are formed `block` queries at a time, so a long sequence never holds all of them."""
    q_BxTxKxGxH, k_BxSxKxH = jax.lax.stop_gradient(q_BxTxKxGxH), jax.lax.stop_gradient(keys.k_BxSxKxH)
    B, T, K, G, H = q_BxTxKxGxH.shape
    n = T // block if T > block and T % block == 0 else 1
    rows = T // n
    index_S = jnp.arange(k_BxSxKxH.shape[1])

    def chunk_max(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        c, q_BxRxKxGxH = xs
        if keys.mask_BxTxS is None:  # the library's own masking: by token index, a static window
            mask_BxRxS = attention_mask(c * rows + jnp.arange(rows), index_S, window, causal=causal)
        else:
            mask_BxRxS = jax.lax.dynamic_slice_in_dim(keys.mask_BxTxS, c * rows, rows, axis=1)
        scores = jnp.einsum("BRKGH,BSKH->BKGRS", q_BxRxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
        allowed = jnp.broadcast_to(mask_BxRxS[:, None, None], scores.shape)
        return jnp.max(jnp.where(allowed, scores * cfg.scale, -jnp.inf), axis=(0, 3, 4))

    q_NxBxRxKxGxH = q_BxTxKxGxH.reshape(B, n, rows, K, G, H).swapaxes(0, 1)
    return jnp.max(jax.lax.map(chunk_max, (jnp.arange(n), q_NxBxRxKxGxH)), axis=0).reshape(K * G)


class Attention(nnx.Module):
    """Self-attention over the K kv heads' G query heads each, with the configured positions:
    causal, or bidirectional (`causal=False`, an encoder's); `encoder_stack` picks the init scales
    of an encoder-decoder's encoder."""

    STATS_PREFIX = ""  # what the names of the sown statistics start with

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, causal: bool = True, encoder_stack: bool = False):
        self.cfg = cfg
        self.causal = causal
        self.positions = positions_for(cfg)
        scales = InitScales.of(cfg, encoder_stack)
        D, N, K, G, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_groups, cfg.head_dim
        qkv = normal_param(rngs, (D, K, G + 2, H), ("embed", "kv_heads", None, "head_dim"), scales.qkv, cfg)
        # One draw for the fused weight, then the value slice rescaled: the random stream is the
        # same whatever the value scale.
        qkv[...] = qkv[...].at[:, :, G + 1].multiply(scales.value / scales.qkv)
        self.qkv = qkv
        qkv_bias = cfg.has_qkv_bias
        self.qkv_bias = const_param(0.0, (K, G + 2, H), ("kv_heads", None, "head_dim"), cfg) if qkv_bias else None
        self.out = normal_param(rngs, (N, H, D), ("heads", "head_dim", "embed"), scales.attn_out, cfg)
        self.out_bias = const_param(0.0, (D,), ("embed",), cfg) if cfg.use_bias else None
        self.q_norm = Norm(cfg, dim=H, axis_name="head_dim", kind="rmsnorm") if cfg.qk_norm else None
        self.k_norm = Norm(cfg, dim=H, axis_name="head_dim", kind="rmsnorm") if cfg.qk_norm else None

    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None,
        window: Window,
        key: jax.Array | None = None,
        cache: KVCache | None = None,
        index: int | jax.Array = 0,
        collect: bool = False,
        bias_table: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """(attention output [B, T, D], the updated cache; None without a cache).

        Without a cache, causality and windows follow the token index (training, evaluation).
        With one (decoding), they follow positions: the new tokens attend to the cached keys and to
        each other, and keys with position -1 (empty slots, left padding) are never attended to.
        With `collect`, the attention statistics are sown (see `sow_stats`). `bias_table`: the
        stack's learned logit-bias table, where the position scheme has one (t5_relative).
        """
        q_BxTxKxGxH, entries = self.project(x_BxTxD, positions_BxT, window)
        if cache is not None and not collect:  # decoding: never dropout
            decoded_BxTxNxH, updated = self.attend_cached(
                q_BxTxKxGxH, entries, positions_BxT, window, cache, index, bias_table
            )
            return self.output(decoded_BxTxNxH, x_BxTxD.dtype), updated
        keys, new_cache = self.keys_and_mask(entries, positions_BxT, segment_ids_BxT, window, cache, index)
        bias_BxNxTxS = self.positions.logit_bias(positions_BxT, keys.positions_BxS, bias_table, not self.causal)
        if collect:
            self.sow_stats(q_BxTxKxGxH, keys, bias_BxNxTxS, segment_ids_BxT, window)
        elif self.cfg.qk_clip is not None and cache is None:  # the step's forward pass: what QK-clip reads
            self.sow(
                nnx.Intermediate, "head_logit_max", head_logit_max(q_BxTxKxGxH, keys, window, self.causal, self.cfg)
            )
        out_BxTxNxH = self.attend(q_BxTxKxGxH, keys, bias_BxNxTxS, window, key)
        return self.output(out_BxTxNxH, x_BxTxD.dtype), new_cache

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
        """Decoding: (out [B, T, N, H] of the new tokens against the cached ones and each other, the
        cache with the new entries). MLA attends to its latents here instead (absorbed)."""
        keys, new_cache = self.keys_and_mask(entries, positions_BxT, None, window, cache, index)
        assert new_cache is not None
        bias_BxNxTxS = self.positions.logit_bias(positions_BxT, keys.positions_BxS, bias_table, not self.causal)
        return self.attend(q_BxTxKxGxH, keys, bias_BxNxTxS, window, None), new_cache

    def output(self, out_BxTxNxH: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """The heads' outputs projected back to the model width [B, T, D]."""
        y_BxTxD = project("BTNH,NHD->BTD", out_BxTxNxH, self.out[...].astype(dtype))
        if self.out_bias is not None:
            y_BxTxD = y_BxTxD + self.out_bias[...].astype(dtype)
        return y_BxTxD

    def empty_cache(self, batch: int, size: int) -> KVCache:
        """An empty cache of `size` entries for this layer (what it holds is the variant's choice)."""
        return init_cache(self.cfg, batch, size)

    def project(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, window: Window = None) -> tuple[jax.Array, KVCache]:
        """(q [B, T, K, G, H], the entries a cache keeps of each token: k and v [B, T, K, H]): the
        fused projection, qk-norm, and the rotation the position scheme applies to queries and keys
        (in a layer with `window`).
        (MLA keeps its latent and shared rope key instead; its `kv_of` expands them.)"""
        G = self.cfg.n_kv_groups
        qkv_BxTxKxCxH = self.fused(x_BxTxD, slice(None))
        q_BxTxKxGxH = qkv_BxTxKxCxH[:, :, :, :G]
        k_BxTxKxH = qkv_BxTxKxCxH[:, :, :, G]
        v_BxTxKxH = qkv_BxTxKxCxH[:, :, :, G + 1]
        if self.q_norm is not None:
            q_BxTxKxGxH = self.q_norm(q_BxTxKxGxH)
        if self.k_norm is not None:
            k_BxTxKxH = self.k_norm(k_BxTxKxH)
        q_BxTxKxGxH = self.positions.rotate(q_BxTxKxGxH, positions_BxT, window)
        k_BxTxKxH = self.positions.rotate(k_BxTxKxH, positions_BxT, window)
        return q_BxTxKxGxH, {"k": k_BxTxKxH, "v": v_BxTxKxH}

    def fused(self, x_BxTxD: jax.Array, parts: slice) -> jax.Array:
        """x through `parts` of the fused weight's C axis (with their bias): [B, T, K, C', H]."""
        dtype = x_BxTxD.dtype
        y_BxTxKxCxH = project("BTD,DKCH->BTKCH", x_BxTxD, self.qkv[...][:, :, parts].astype(dtype))
        if self.qkv_bias is not None:
            y_BxTxKxCxH = y_BxTxKxCxH + self.qkv_bias[...][:, parts].astype(dtype)
        return y_BxTxKxCxH

    def kv_of(self, entries: KVCache) -> tuple[jax.Array, jax.Array]:
        """(k, v) from what the cache holds per token: here the keys and values themselves."""
        return entries["k"], entries["v"]

    def keys_and_mask(
        self,
        entries: KVCache,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None,
        window: Window,
        cache: KVCache | None,
        index: int | jax.Array,
    ) -> tuple[Keys, KVCache | None]:
        """The keys the new tokens attend to (from their `entries` and, decoding, the cached ones) and
        their mask, and the cache with the new entries."""
        if cache is None:
            k_BxTxKxH, v_BxTxKxH = self.kv_of(entries)
            # A static window and no documents use the library's own causal/local masking (which
            # fused kernels understand); a traced window or segment ids need an explicit mask.
            static = segment_ids_BxT is None and not isinstance(window, jax.Array)
            mask_BxTxS = None
            if not static or self.cfg.attention_kernel == "einsum":
                index_T = jnp.arange(k_BxTxKxH.shape[1])
                mask_BxTxS = attention_mask(index_T, index_T, window, segment_ids_BxT, segment_ids_BxT, self.causal)
            return Keys(k_BxTxKxH, v_BxTxKxH, positions_BxT, mask_BxTxS, static), None
        every_BxS, k_positions_BxS = cached_and_new(cache, entries, positions_BxT)
        k_BxSxKxH, v_BxSxKxH = self.kv_of(every_BxS)
        mask_BxTxS = position_mask(positions_BxT, k_positions_BxS, window)
        keys = Keys(k_BxSxKxH, v_BxSxKxH, k_positions_BxS, mask_BxTxS, static=False)
        return keys, write_cache(cache, entries, positions_BxT, index)

    def attend(
        self,
        q_BxTxKxGxH: jax.Array,
        keys: Keys,
        bias_BxNxTxS: jax.Array | None,
        window: Window,
        key: jax.Array | None,
    ) -> jax.Array:
        """Attention of every query head to its kv head's keys: out [B, T, N, H]."""
        cfg = self.cfg
        B, T, K, G, H = q_BxTxKxGxH.shape
        if cfg.attention_kernel == "einsum":
            assert keys.mask_BxTxS is not None, "keys_and_mask always masks explicitly for einsum"
            bias_BxKxGxTxS = group_heads(bias_BxNxTxS, K, G)
            out_BxTxKxGxH = attend_einsum(
                q_BxTxKxGxH, keys.k_BxSxKxH, keys.v_BxSxKxH, keys.mask_BxTxS, bias_BxKxGxTxS, cfg, key
            )
            return out_BxTxKxGxH.reshape(B, T, K * G, -1)  # values may be narrower than queries (MLA)
        static_window = window if keys.static and not isinstance(window, jax.Array) else None
        if cfg.attention_kernel == "blocked" and keys.static and bias_BxNxTxS is None:
            out_BxTxKxGxH = attend_blocked(
                q_BxTxKxGxH, keys.k_BxSxKxH, keys.v_BxSxKxH, cfg.scale, Mask(causal=self.causal, window=static_window)
            )
            return out_BxTxKxGxH.reshape(B, T, K * G, -1)
        return jax.nn.dot_product_attention(
            q_BxTxKxGxH.reshape(B, T, K * G, H),
            keys.k_BxSxKxH,
            keys.v_BxSxKxH,
            bias=None if bias_BxNxTxS is None else bias_BxNxTxS.astype(q_BxTxKxGxH.dtype),
            mask=None if keys.mask_BxTxS is None else keys.mask_BxTxS[:, None],
            scale=cfg.scale,
            is_causal=keys.static and self.causal,
            local_window_size=None if static_window is None else self.window_extent(static_window),
            # never auto (see accelerator.resolve); blocked falls back to xla for explicit masks and biases
            implementation="cudnn" if cfg.attention_kernel == "cudnn" else "xla",
        )

    def window_extent(self, window: int) -> tuple[int, int]:
        """(keys before, keys after) a query that a window reaches: symmetric when bidirectional."""
        return (window - 1, 0) if self.causal else (window - 1, window - 1)

    def sow_stats(
        self,
        q_BxTxKxGxH: jax.Array,
        keys: Keys,
        bias_BxNxTxS: jax.Array | None,
        segment_ids_BxT: jax.Array | None,
        window: Window,
    ) -> None:
        """Sow the attention statistics (`attention_stats`) as nnx.Intermediate. They cost a second
        computation of the logits, so only a separate, occasional forward pass asks for them."""
        _, T, K, G, _ = q_BxTxKxGxH.shape
        S = keys.k_BxSxKxH.shape[1]
        logits_BxKxGxTxS = attention_logits(q_BxTxKxGxH, keys.k_BxSxKxH, group_heads(bias_BxNxTxS, K, G), self.cfg)
        mask_BxTxS = keys.mask_BxTxS
        if mask_BxTxS is None:
            index_T, index_S = jnp.arange(T), jnp.arange(S)
            mask_BxTxS = attention_mask(index_T, index_S, window, segment_ids_BxT, segment_ids_BxT, self.causal)
        for name, value in attention_stats(logits_BxKxGxTxS, mask_BxTxS).items():
            self.sow(nnx.Intermediate, self.STATS_PREFIX + name, value)


def group_heads(bias_BxNxTxS: jax.Array | None, K: int, G: int) -> jax.Array | None:
    """A per-query-head bias laid out by kv head and group, [B, K, G, T, S] (query head n = k*G + g)."""
    if bias_BxNxTxS is None:
        return None
    B, _, T, S = bias_BxNxTxS.shape
    return bias_BxNxTxS.reshape(B, K, G, T, S)


# --- the KV cache --------------------------------------------------------------------------------


def cache_size(window: int | None, max_len: int) -> int:
    """Entries a layer keeps: the window for a sliding-window layer (a ring buffer), else max_len."""
    return max_len if window is None else min(window, max_len)


def init_cache(cfg: ModelConfig, batch: int, size: int) -> KVCache:
    """An empty cache of `size` entries for one layer."""
    shape = (batch, size, cfg.n_kv_heads, cfg.head_dim)
    return {
        "k": jnp.zeros(shape, cfg.compute_dtype),
        "v": jnp.zeros(shape, cfg.compute_dtype),
        "pos": jnp.full((batch, size), -1, jnp.int32),  # -1: empty
    }


def cached_and_new(
    cache: KVCache, new: dict[str, jax.Array], positions_BxT: jax.Array
) -> tuple[dict[str, jax.Array], jax.Array]:
    """Each cached entry followed by its T new ones along S (in the new entries' dtype), and the
    positions of all S: what the new tokens attend to."""
    entries = {name: jnp.concatenate([cache[name].astype(value.dtype), value], axis=1) for name, value in new.items()}
    return entries, jnp.concatenate([cache["pos"], positions_BxT], axis=1)


def write_cache(cache: KVCache, new: dict[str, jax.Array], positions_BxT: jax.Array, index: int | jax.Array) -> KVCache:
    """Store the T new entries (each [B, T, ...], by name) at absolute indices index..index+T-1 in
    slots index % size; of more than `size` new entries only the last `size` can stay."""
    size, T = cache["pos"].shape[1], positions_BxT.shape[1]
    if T > size:
        new = {name: value[:, -size:] for name, value in new.items()}
        positions_BxT = positions_BxT[:, -size:]
        index = index + T - size
        T = size
    slots_T = (index + jnp.arange(T)) % size
    updated = {name: cache[name].at[:, slots_T].set(value.astype(cache[name].dtype)) for name, value in new.items()}
    # what else the layer keeps (an encoder-decoder's cross-attention keys) stays as it is
    return {**cache, **updated, "pos": cache["pos"].at[:, slots_T].set(positions_BxT)}


def position_mask(q_positions_BxT: jax.Array, k_positions_BxS: jax.Array, window: Window) -> jax.Array:
    """mask[b, t, s]: key s is filled (position >= 0), not after query t, and inside its window."""
    q, k = q_positions_BxT[:, :, None], k_positions_BxS[:, None, :]
    allowed = (k >= 0) & (k <= q)
    if window is not None:
        allowed &= q - k < window
    return allowed
