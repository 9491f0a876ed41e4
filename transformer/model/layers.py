"""Building blocks: parameters with logical axes, norms, feed-forward layers, position encodings.

Axis legend (einsum strings and tensor-name suffixes): B batch, T query positions, S key positions,
D model width, N query heads, K kv heads, G query heads per kv head (N = K*G), H head dim,
F FFN width, V vocab, L layers.

Every parameter is an `nnx.Param` carrying `axes`, a tuple of logical axis names; the model never
places anything on devices itself: `transformer/sharding.py` maps those names to mesh axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def normal_param(rngs: nnx.Rngs, shape, axes, std: float, cfg: ModelConfig) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(cfg.param_dtype), axes=axes)


def const_param(value: float, shape, axes, cfg: ModelConfig) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, cfg.param_dtype), axes=axes)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; a no-op without a key (evaluation) or at rate 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Norm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis, computed in float32, returned in the input dtype."""

    def __init__(self, cfg: ModelConfig, *, dim: int | None = None, axis_name: str = "embed", kind: str | None = None):
        dim = cfg.d_model if dim is None else dim
        self.kind = kind or cfg.norm
        self.eps = cfg.norm_eps
        self.scale = const_param(1.0, (dim,), (axis_name,), cfg)
        self.bias = const_param(0.0, (dim,), (axis_name,), cfg) if self.kind == "layernorm" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        if self.kind == "layernorm":
            y = y - jnp.mean(y, axis=-1, keepdims=True)
        y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.eps)
        y = y * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


# FFN kind -> activation. The kinds in config.GATED_FFNS apply it to a gate multiplying a second
# projection (Shazeer 2020); the others are the classic two-layer MLP.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,  # tanh approximation, as in GPT-2
    "swiglu": jax.nn.silu,
    "geglu": jax.nn.gelu,
    "reglu": jax.nn.relu,
}


class FFN(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, F = cfg.d_model, cfg.d_ff
        std_in = cfg.value_init_std  # DeepNet scales the FFN input projection by beta too
        if cfg.gated_ffn:  # gate and up projection fused: C = 2
            self.w_in = normal_param(rngs, (D, 2, F), ("embed", None, "mlp"), std_in, cfg)
            self.b_in = const_param(0.0, (2, F), (None, "mlp"), cfg) if cfg.use_bias else None
        else:
            self.w_in = normal_param(rngs, (D, F), ("embed", "mlp"), std_in, cfg)
            self.b_in = const_param(0.0, (F,), ("mlp",), cfg) if cfg.use_bias else None
        self.w_out = normal_param(rngs, (F, D), ("mlp", "embed"), cfg.residual_init_std, cfg)
        self.b_out = const_param(0.0, (D,), ("embed",), cfg) if cfg.use_bias else None

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dtype = x_BxTxD.dtype
        act = ACTIVATIONS[self.cfg.ffn]
        w_in = self.w_in[...].astype(dtype)
        if self.cfg.gated_ffn:
            h_BxTxCxF = jnp.einsum("BTD,DCF->BTCF", x_BxTxD, w_in)
            if self.b_in is not None:
                h_BxTxCxF = h_BxTxCxF + self.b_in[...].astype(dtype)
            h_BxTxF = act(h_BxTxCxF[:, :, 0]) * h_BxTxCxF[:, :, 1]
        else:
            h_BxTxF = jnp.einsum("BTD,DF->BTF", x_BxTxD, w_in)
            if self.b_in is not None:
                h_BxTxF = h_BxTxF + self.b_in[...].astype(dtype)
            h_BxTxF = act(h_BxTxF)
        y_BxTxD = jnp.einsum("BTF,FD->BTD", h_BxTxF, self.w_out[...].astype(dtype))
        if self.b_out is not None:
            y_BxTxD = y_BxTxD + self.b_out[...].astype(dtype)
        return y_BxTxD


# --- position encodings --------------------------------------------------------------------------


def rope(x: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (Su et al. 2021) of x[B, T, ..., H], rotating (first half, second half) pairs."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def sinusoidal(positions_BxT: jax.Array, d_model: int) -> jax.Array:
    """The fixed encoding of Vaswani et al. 2017: sin in even and cos in odd channels."""
    half = d_model // 2
    inv_freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) * 2 / d_model)
    angle_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    pe = jnp.stack([jnp.sin(angle_BxTxHalf), jnp.cos(angle_BxTxHalf)], axis=-1)
    return pe.reshape(positions_BxT.shape + (d_model,))


def alibi_slopes(n_heads: int) -> jnp.ndarray:
    """Head slopes of ALiBi (Press et al. 2022): a geometric sequence from 2^(-8/n); for a head count
    that is not a power of two, the closest power's slopes plus every other slope of the next one."""

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def alibi_bias(n_heads: int, q_positions_BxT: jax.Array, k_positions_BxS: jax.Array) -> jax.Array:
    """bias[b, n, t, s] = -slope[n] * (pos_q[t] - pos_k[s]); only causal entries survive the mask."""
    distance_BxTxS = (q_positions_BxT[:, :, None] - k_positions_BxS[:, None, :]).astype(jnp.float32)
    return -alibi_slopes(n_heads)[None, :, None, None] * distance_BxTxS[:, None]
