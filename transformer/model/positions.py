"""Position encodings, and the one place that decides what the configured scheme contributes.

A scheme enters the model through at most one of three hooks: something added to the token
embeddings (a learned table, the sinusoidal encoding), a rotation of queries and keys (RoPE), or a
bias on the attention logits (ALiBi); `none` uses none of them, so order reaches the model only
through the causal mask. `positions_for` is the only reader of `model.position`: the embedding and
the attention layers call the hooks of the scheme they are given, never asking which one it is.

Schemes are frozen dataclasses without parameters, so a module may hold one as static data. The
learned table is created and held by the Transformer (at `pos_embed`, the path checkpoints and the
optimizer's decay mask know) from the shape its scheme asks for, and handed back to the hook.

Axis legend as in layers.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from transformer.config import GLOBAL_WINDOW, ModelConfig

# A layer's sliding window: a size, None (full causal attention), or a traced size inside the layer
# scan over a per-layer pattern (GLOBAL_WINDOW for a full-attention layer).
Window = int | jax.Array | None


@dataclasses.dataclass(frozen=True)
class Positions:
    """The hooks every scheme answers. This base contributes nothing: the `none` scheme."""

    @property
    def table_shape(self) -> tuple[int, int] | None:
        """Shape of the learned table [positions, D], or None: only a learned scheme has parameters."""
        return None

    def add_to_embeddings(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, table_PxD: jax.Array | None) -> jax.Array:
        """The token embeddings plus this scheme's encoding of each position."""
        return x_BxTxD

    def rotate(self, x: jax.Array, positions_BxT: jax.Array, window: Window = None) -> jax.Array:
        """Queries or keys [B, T, ..., H] as this scheme rotates them by position, in a layer with
        `window` (None: full attention; a traced size, GLOBAL_WINDOW for full, in a scanned pattern)."""
        return x

    @property
    def bias_table_shape(self) -> tuple[int, int] | None:
        """Shape of a learned logit-bias table [buckets, heads] each stack keeps, or None."""
        return None

    def logit_bias(
        self,
        q_positions_BxT: jax.Array,
        k_positions_BxS: jax.Array,
        table: jax.Array | None = None,
        bidirectional: bool = False,
    ) -> jax.Array | None:
        """bias[b, n, t, s] added to the attention logits, or None for no bias (`table`: the stack's
        learned bias table, for a scheme that has one)."""
        return None


@dataclasses.dataclass(frozen=True)
class LearnedPositions(Positions):
    """A trained table, one row per position, added to the token embeddings (GPT-2)."""

    max_positions: int
    d_model: int

    @property
    def table_shape(self) -> tuple[int, int]:
        return (self.max_positions, self.d_model)

    def add_to_embeddings(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, table_PxD: jax.Array | None) -> jax.Array:
        assert table_PxD is not None, "learned positions need their table"
        return x_BxTxD + jnp.take(table_PxD, positions_BxT, axis=0).astype(x_BxTxD.dtype)


@dataclasses.dataclass(frozen=True)
class SinusoidalPositions(Positions):
    """The fixed encoding of Vaswani et al. 2017, added to the token embeddings."""

    d_model: int

    def add_to_embeddings(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, table_PxD: jax.Array | None) -> jax.Array:
        return x_BxTxD + sinusoidal(positions_BxT, self.d_model).astype(x_BxTxD.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched to reach past the pretraining context (`model.rope_scaling`)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_attention_factor: float | None = None

    @property
    def attention_factor(self) -> float:
        """What the rotated parts are multiplied by: YaRN's temperature (its own, or 0.1 ln(factor) + 1)."""
        if self.kind != "yarn":
            return 1.0
        if self.yarn_attention_factor is not None:
            return self.yarn_attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def apply(self, inv_freq: jax.Array, theta: float | jax.Array) -> jax.Array:
        """The scaled frequencies, as Hugging Face's `rope_type` of the same name computes them."""
        match self.kind:
            case "yarn":  # a frequency's share of interpolation ramps from 0 (fast) to 1 (slow)
                assert isinstance(theta, (int, float)), "yarn needs one theta (the config refuses rope_local_theta)"
                dim = 2 * inv_freq.shape[0]

                def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times in the context
                    return dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

                low = max(math.floor(dim_of(self.beta_fast)), 0)
                high: float = min(math.ceil(dim_of(self.beta_slow)), dim - 1)
                high = high + 0.001 if low == high else high  # as transformers keeps the ramp finite
                ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
                kept = 1 - ramp
                return (inv_freq / self.factor) * (1 - kept) + inv_freq * kept
            case "none":
                return inv_freq
            case "linear":  # positions divided by the factor
                return inv_freq / self.factor
            case "llama3":  # wavelengths beyond the low-frequency bound stretched, short ones kept, a blend between
                wavelen = 2 * math.pi / inv_freq
                scaled = jnp.where(
                    wavelen > self.original_max_len / self.low_freq_factor, inv_freq / self.factor, inv_freq
                )
                smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                blended = (1 - smooth) * scaled / self.factor + smooth * scaled
                medium = (wavelen >= self.original_max_len / self.high_freq_factor) & (
                    wavelen <= self.original_max_len / self.low_freq_factor
                )
                return jnp.where(medium, blended, scaled)
        raise AssertionError(self.kind)


@dataclasses.dataclass(frozen=True)
class RotaryPositions(Positions):
    """RoPE: queries and keys rotated by position, so their scores depend on the distance only."""

    theta: float
    scaling: RopeScaling = RopeScaling()
    local_theta: float | None = None  # the windowed layers' theta (model.rope_local_theta)
    local_scaling: bool = True  # false: the windowed layers' RoPE is not scaled (model.rope_local_scaling)

    def rotate(self, x: jax.Array, positions_BxT: jax.Array, window: Window = None) -> jax.Array:
        theta = self.layer_theta(window)
        if self.local_scaling or window is None:
            return rope(x, positions_BxT, theta, self.scaling)
        if isinstance(window, jax.Array):  # a layer of a scanned pattern: scaled where it is global
            scaled, plain = rope(x, positions_BxT, theta, self.scaling), rope(x, positions_BxT, theta)
            return jnp.where(window >= GLOBAL_WINDOW, scaled, plain)
        return rope(x, positions_BxT, theta)

    def layer_theta(self, window: Window) -> float | jax.Array:
        """The theta of a layer with `window`: the local one where it has a window."""
        if self.local_theta is None or window is None:
            return self.theta
        if isinstance(window, jax.Array):  # a layer of a scanned pattern
            return jnp.where(window >= GLOBAL_WINDOW, self.theta, self.local_theta)
        return self.local_theta


@dataclasses.dataclass(frozen=True)
class AlibiPositions(Positions):
    """ALiBi: a per-head penalty on the attention logits, linear in the distance."""

    n_heads: int

    def logit_bias(
        self,
        q_positions_BxT: jax.Array,
        k_positions_BxS: jax.Array,
        table: jax.Array | None = None,
        bidirectional: bool = False,
    ) -> jax.Array:
        return alibi_bias(self.n_heads, q_positions_BxT, k_positions_BxS)


@dataclasses.dataclass(frozen=True)
class T5RelativePositions(Positions):
    """T5's relative attention bias: a learned bias per head and bucket of the distance k - q, the
    buckets exact up to half their number and logarithmic up to `max_distance`; one table per stack,
    shared by its layers (Raffel et al. 2020)."""

    n_heads: int
    buckets: int
    max_distance: int

    @property
    def bias_table_shape(self) -> tuple[int, int]:
        return (self.buckets, self.n_heads)

    def logit_bias(
        self,
        q_positions_BxT: jax.Array,
        k_positions_BxS: jax.Array,
        table: jax.Array | None = None,
        bidirectional: bool = False,
    ) -> jax.Array:
        assert table is not None, "t5_relative needs its stack's bias table"
        distance_BxTxS = k_positions_BxS[:, None, :] - q_positions_BxT[:, :, None]
        bucket_BxTxS = t5_bucket(distance_BxTxS, bidirectional, self.buckets, self.max_distance)
        return jnp.moveaxis(table[bucket_BxTxS].astype(jnp.float32), -1, 1)  # [B, N, T, S]


def t5_bucket(distance: jax.Array, bidirectional: bool, buckets: int, max_distance: int) -> jax.Array:
    """T5's bucket of each distance k - q (int32): a causal stack sees only the past (its half of the
    buckets is all of them); small distances each their own bucket, larger ones logarithmically
    binned up to `max_distance`, the last bucket beyond. As transformers computes it, in float32."""
    offset = jnp.zeros_like(distance)
    if bidirectional:
        buckets //= 2
        offset = (distance > 0).astype(jnp.int32) * buckets
        distance = jnp.abs(distance)
    else:
        distance = -jnp.minimum(distance, 0)
    exact = buckets // 2
    ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
    large = jnp.minimum(exact + (ratio * (buckets - exact)).astype(jnp.int32), buckets - 1)
    return offset + jnp.where(distance < exact, distance, large)


def positions_for(cfg: ModelConfig) -> Positions:
    """The configured position scheme."""
    match cfg.position:
        case "learned":
            assert cfg.max_positions is not None, "ModelConfig refuses learned positions without a length"
            return LearnedPositions(cfg.max_positions, cfg.d_model)
        case "sinusoidal":
            return SinusoidalPositions(cfg.d_model)
        case "rope":
            scaling = RopeScaling(
                cfg.rope_scaling,
                cfg.rope_factor,
                cfg.rope_low_freq_factor,
                cfg.rope_high_freq_factor,
                cfg.rope_original_max_len,
                cfg.rope_beta_fast,
                cfg.rope_beta_slow,
                cfg.rope_attention_factor,
            )
            return RotaryPositions(cfg.rope_theta, scaling, cfg.rope_local_theta, cfg.rope_local_scaling)
        case "alibi":
            return AlibiPositions(cfg.n_heads)
        case "t5_relative":
            return T5RelativePositions(cfg.n_heads, cfg.rel_buckets, cfg.rel_max_distance)
        case "none":
            return Positions()
    raise AssertionError(cfg.position)


# --- the encodings -------------------------------------------------------------------------------


def rope(
    x: jax.Array, positions_BxT: jax.Array, theta: float | jax.Array, scaling: RopeScaling = RopeScaling()
) -> jax.Array:
    """Rotary embedding (Su et al. 2021) of x[B, T, ..., H], rotating (first half, second half) pairs."""
    half = x.shape[-1] // 2
    inv_freq = scaling.apply(theta ** (-jnp.arange(half, dtype=jnp.float32) / half), theta)
    angle = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    if scaling.attention_factor != 1.0:  # YaRN's temperature, on both queries and keys
        sin, cos = sin * scaling.attention_factor, cos * scaling.attention_factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def sinusoidal(positions_BxT: jax.Array, d_model: int) -> jax.Array:
    """The fixed encoding of Vaswani et al. 2017: sin in even and cos in odd channels."""
    half = d_model // 2
    inv_freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) * 2 / d_model)
    angle_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    pe = jnp.stack([jnp.sin(angle_BxTxHalf), jnp.cos(angle_BxTxHalf)], axis=-1)
    return pe.reshape(positions_BxT.shape + (d_model,))


def alibi_slopes(n_heads: int) -> jax.Array:
    """Head slopes of ALiBi (Press et al. 2022): a geometric sequence from 2^(-8/n); for a head count
    that is not a power of two, the closest power's slopes plus every other slope of the next one."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def alibi_bias(n_heads: int, q_positions_BxT: jax.Array, k_positions_BxS: jax.Array) -> jax.Array:
    """bias[b, n, t, s] = -slope[n] * |pos_q[t] - pos_k[s]|: the paper's causal bias where a causal
    mask keeps only s <= t, and its symmetric form for bidirectional attention, in one formula."""
    distance_BxTxS = jnp.abs(q_positions_BxT[:, :, None] - k_positions_BxS[:, None, :]).astype(jnp.float32)
    return -alibi_slopes(n_heads)[None, :, None, None] * distance_BxTxS[:, None]
