"""Building blocks: parameters with logical axes and their initial scales, norms, feed-forward layers.

Axis legend (einsum strings and tensor-name suffixes): B batch, T query positions, S key positions,
D model width, N query heads, K kv heads, G query heads per kv head (N = K*G), H head dim,
F FFN width, V vocab, L layers; C the parts of a fused projection (G + 2 for queries, key and
value; 2 for gate and up), P the rows of a learned position table.

Every parameter is an `nnx.Param` carrying `axes`, a tuple of logical axis names; the model never
places anything on devices itself: `transformer/sharding.py` maps those names to mesh axes. The
residual stream is named the same way (`place`), for the step that traces the model to pin.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.parametrization import init_factor

Axes = tuple[str | None, ...]  # a parameter's logical axis names, one per dimension (None: replicated)


class Placer(NamedTuple):
    """How the step being traced lays activations on its devices (see `placing`)."""

    pin: Callable[[jax.Array, Axes], jax.Array]  # x, whose dimensions have these logical axes, placed
    row_groups: int  # the parts the batch's rows are split into: each device's rows are one part
    # f(*args) with each device computing f on its own block of args (dimensions with these logical
    # axes) into its block of the result (these): see `on_each_device`
    each_device: Callable[[Callable, tuple[jax.Array, ...], tuple[Axes, ...], Axes], jax.Array]


_placer: contextvars.ContextVar[Placer | None] = contextvars.ContextVar("placer", default=None)


def place(x: jax.Array, axes: Axes) -> jax.Array:
    """`x`, whose dimensions have these logical axes, where the step being traced wants it (the
    identity outside one: a single device, the model's own tests)."""
    placer = _placer.get()
    return x if placer is None else placer.pin(x, axes)


def on_each_device(f: Callable, args: tuple[jax.Array, ...], axes: tuple[Axes, ...], out_axes: Axes) -> jax.Array:
    """f(*args), each device computing f on its own block of `args` (whose dimensions have these
    logical axes) into its own block of the result (`out_axes`): for work XLA cannot split itself,
    a custom call, which it would otherwise compute whole on every device from gathered inputs. f
    must compute each block's result from that block alone (rows from rows, heads from heads)."""
    placer = _placer.get()
    return f(*args) if placer is None else placer.each_device(f, args, axes, out_axes)


def row_groups() -> int:
    """How many parts the step being traced splits the batch's rows into (1 outside one). Work that
    sorts or gathers across rows (dropless MoE dispatch) runs within each part, on its own device;
    across the whole batch it would gather every row onto every device and repeat the work there."""
    placer = _placer.get()
    return 1 if placer is None else placer.row_groups


@contextlib.contextmanager
def placing(placer: Placer | None) -> Iterator[None]:
    """Trace the model with `place` pinning activations by `placer` (None: nowhere)."""
    token = _placer.set(placer)
    try:
        yield
    finally:
        _placer.reset(token)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, std: float, cfg: ModelConfig) -> nnx.Param:
    """A parameter drawn from N(0, std^2) in float32 (one draw from `rngs.params()`), stored in param_dtype."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(cfg.param_dtype), axes=axes)


def const_param(value: float, shape: tuple[int, ...], axes: Axes, cfg: ModelConfig) -> nnx.Param:
    """A parameter filled with `value` (norm gains, biases)."""
    return nnx.Param(jnp.full(shape, value, cfg.param_dtype), axes=axes)


@dataclasses.dataclass(frozen=True)
class InitScales:
    """The standard deviation each weight is drawn with: every scale the model uses, decided here."""

    embedding: float
    positions: float  # the learned position table
    qkv: float  # queries and keys; values are drawn with it, then rescaled to `value`
    value: float
    attn_out: float
    kv_up: float  # MLA's keys up from its latent (queries and the latent itself are drawn as qkv)
    v_up: float  # MLA's values up from its latent
    ffn_in: float
    ffn_out: float
    head: float  # an untied output head

    @classmethod
    def of(cls, cfg: ModelConfig, encoder_stack: bool = False, experts: bool = False) -> InitScales:
        """The scales of `cfg`: init_std throughout, except where the norm placement changes it,
        which may depend on the stack (`encoder_stack`: an encoder-decoder's encoder), and times
        µP's width factor of each kind (model/parametrization.py; `experts`: of a mixture of
        experts' FFN, whose inner width is moe_d_ff)."""
        std = cfg.init_std
        if cfg.norm_position == "deepnorm":
            # DeepNet (Wang et al. 2022) shrinks by beta what carries values into the residual
            # stream: the value and FFN input projections and both output projections.
            carry = residual = std * cfg.deepnorm(encoder_stack)[1]
        elif cfg.init_depth_scaled:
            # GPT-2: the L*2 writes into the residual stream add up, so each shrinks with its stack's
            # depth; under depth scaling with the base's, as the branch multiplier does the rest
            if cfg.depth_scaling != "none":
                depth = cfg.mup_base_n_layers
            else:
                depth = cfg.n_encoder_layers if encoder_stack else cfg.n_layers
            carry, residual = std, std / math.sqrt(2 * depth)
        else:
            carry, residual = std, std
        width = functools.partial(init_factor, cfg, experts=experts)  # µP's width rule (1.0 at the base shape)
        return cls(
            embedding=std * width("embed"),
            positions=std * width("pos_embed"),
            qkv=std * width("qkv"),
            value=carry * width("qkv"),
            attn_out=residual * width("out"),
            kv_up=std * width("wk_up"),
            v_up=carry * width("wv_up"),
            ffn_in=carry * width("w_in"),
            ffn_out=residual * width("w_out"),
            head=std * width("head"),
        )


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
        self.offset = cfg.norm_offset  # the gain is 1 + scale (Gemma's): weight decay pulls it to 1
        self.scale = const_param(0.0 if self.offset else 1.0, (dim,), (axis_name,), cfg)
        layernorm_bias = self.kind == "layernorm" and cfg.norm_bias
        self.bias = const_param(0.0, (dim,), (axis_name,), cfg) if layernorm_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...].astype(jnp.float32)
        scale = self.scale[...].astype(jnp.float32)
        if self.offset:
            scale = 1.0 + scale
        return normalize(x, scale, bias, self.kind == "layernorm", self.eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def normalize(x: jax.Array, scale: jax.Array, bias: jax.Array | None, centre: bool, eps: float) -> jax.Array:
    """(x - mean) / rms * scale + bias over the last axis in float32 (LayerNorm; RMSNorm without
    `centre` and bias), with its derivative written out: autodiff keeps several [.., D] float32
    intermediates per norm for the backward pass, each stacked by the layer scan; this keeps the
    input and two [.., 1] statistics. The value is bit for bit the plain formula's."""
    return _normalize_fwd(x, scale, bias, centre, eps)[0]


# what the backward pass keeps: the input, the gain, the bias (or None), the mean and 1/rms
_NormResiduals = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array, jax.Array]


def _normalize_fwd(
    x: jax.Array, scale: jax.Array, bias: jax.Array | None, centre: bool, eps: float
) -> tuple[jax.Array, _NormResiduals]:
    y = x.astype(jnp.float32)
    mean = jnp.mean(y, axis=-1, keepdims=True) if centre else jnp.zeros((), jnp.float32)
    if centre:
        y = y - mean
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + eps)
    y = y * inv_rms * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), (x, scale, bias, mean, inv_rms)


def _normalize_bwd(
    centre: bool, eps: float, residuals: _NormResiduals, g: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    x, scale, bias, mean, inv_rms = residuals
    x_hat = (x.astype(jnp.float32) - mean) * inv_rms
    g = g.astype(jnp.float32)
    leading = tuple(range(g.ndim - 1))
    g_hat = g * scale
    # d/dx of x_hat: inv_rms * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)), without the
    # mean(g_hat) term for RMSNorm (it does not centre)
    dx = g_hat - x_hat * jnp.mean(g_hat * x_hat, axis=-1, keepdims=True)
    if centre:
        dx = dx - jnp.mean(g_hat, axis=-1, keepdims=True)
    d_bias = None if bias is None else jnp.sum(g, axis=leading)
    return (dx * inv_rms).astype(x.dtype), jnp.sum(g * x_hat, axis=leading), d_bias


normalize.defvjp(_normalize_fwd, _normalize_bwd)


@jax.custom_vjp
def cotangent_once(y: jax.Array) -> jax.Array:
    """`y` itself. In the backward pass, on a CPU, its cotangent is put in memory once before the
    projection that made `y` reads it twice (for its input's gradient and for its weight's).
    Otherwise XLA:CPU recomputes an elementwise cotangent, GELU's derivative, inside the transpose
    that feeds the weight's gradient, with strided reads: 26 ms a layer; a GELU model without
    biases took 1.22x the step of one with them, whose bias gradient had kept the single copy, and
    takes 1.02x with this (issue 36; benchmarks/bias.py). Other backends keep their own fusion."""
    return y


def _cotangent_once_fwd(y: jax.Array) -> tuple[jax.Array, None]:
    return y, None


def _cotangent_once_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    return (in_memory_on_cpu(g),)


def in_memory_on_cpu(x: jax.Array, after: jax.Array | None = None) -> jax.Array:
    """`x`, bit for bit; on a CPU put in memory behind a conditional (`_in_memory`), made after
    `after` is, so XLA neither fuses its computation into each of its readers nor starts the
    readers before `after` exists. Other backends get `x` as it is."""
    after = x if after is None else after
    return jax.lax.platform_dependent(x, after, cpu=_in_memory, default=lambda x, _: x)


def _in_memory(g: jax.Array, after: jax.Array | None = None) -> jax.Array:
    """`g`, through a conditional: the one boundary XLA:CPU does not fuse across (it expands
    `optimization_barrier` before fusing). The predicate reads one element of `after` (default `g`;
    not a reshape, which a sharded array would gather whole), so it is not folded away and the copy
    is not made before `after` is; both branches give `g`, bit for bit."""
    after = g if after is None else after
    return jax.lax.cond(jnp.isfinite(after[(0,) * after.ndim]), lambda g: g, lambda g: g * 1.0, g)


cotangent_once.defvjp(_cotangent_once_fwd, _cotangent_once_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a projection: `x`'s trailing axes contracted with `w`'s leading
    ones, in the same order ('BTD,DF->BTF', 'BTNH,NHD->BTD'). The same forward pass and input
    gradient as the einsum, bit for bit; the weight gradient is computed otherwise on a CPU (see
    `_weight_gradient_operand`), equal to float rounding."""
    return jnp.einsum(spec, x, w)


def _project_fwd(spec: str, x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return project(spec, x, w), (x, w)


def _project_bwd(spec: str, residuals: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = residuals
    inputs, _ = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    n_in = len(set(x_axes) & set(w_axes))
    assert x_axes[len(x_axes) - n_in :] == w_axes[:n_in], f"project: {spec!r} is not a projection"
    _, input_gradient = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)
    (dx,) = input_gradient(g)
    rows = math.prod(x.shape[: x.ndim - n_in])
    x_IxR = x.reshape(rows, -1).T  # [inputs, rows]
    g_RxO = g.reshape(rows, -1)
    x_IxR = _weight_gradient_operand(x_IxR, g_RxO)
    return dx, (x_IxR @ g_RxO).reshape(w.shape).astype(w.dtype)


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The host CPU's vendor as Linux names it (GenuineIntel, AuthenticAMD); '' where unknown."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


@functools.cache
def copy_weight_gradient_operand(vendor: str | None = None) -> bool:
    """Whether a CPU step computes each projection's weight gradient x^T g from a row-major copy of
    x^T (`layers.project`: one YNNPACK dot) rather than by XLA's own dot on x as the forward pass
    left it. Measured per CPU kind (benchmarks/README.md), with no rule that predicts it: on AMD
    Zen 4 the copy made the medium and t128 steps 7-11% faster (2026-12-06; XLA's dot ran on a
    transposed copy of the gradient there); on the Intel Xeon kind XLA's dot took 4-8% less time
    on four of vs_pytorch.py's five shapes (2026-12-07, with and without huge pages); on Zen 4
    again, with huge pages and the fused attention, the copy still took 3-13% off t128's step
    (2026-12-07). Elsewhere (unmeasured) the copy, as before."""
    return (cpu_vendor() if vendor is None else vendor) != "GenuineIntel"


def _weight_gradient_operand(x_IxR: jax.Array, g_RxO: jax.Array) -> jax.Array:
    """`x_IxR`, on a CPU where it pays (`copy_weight_gradient_operand`: a measured
    choice per CPU kind) put in memory as it is, in the backward pass. Left to itself XLA:CPU
    computes the weight gradient x^T g from x's [rows, inputs] layout with its own dot: a product
    YNNPACK does not take (its contraction is x's leading axis). Written out as x^T, a row-major
    [inputs, rows] behind a conditional XLA does not fuse across (see `_in_memory`), the product is
    one YNNPACK dot. The predicate reads g, so the copy is made when the gradient is, not kept from
    the forward pass."""
    if not copy_weight_gradient_operand():
        return x_IxR
    return in_memory_on_cpu(x_IxR, after=g_RxO)


project.defvjp(_project_fwd, _project_bwd)


@jax.custom_jvp
def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation (GPT-2), with its derivative written out: autodiff of
    `jax.nn.gelu` keeps six hidden-sized intermediates per layer for the backward pass (the layer
    scan stacks each one), this keeps one; on XLA:CPU that is most of what the GELU MLP costs."""
    return jax.nn.gelu(x, approximate=True)


@gelu_tanh.defjvp
def _gelu_tanh_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    (x,), (dx,) = primals, tangents
    c = math.sqrt(2 / math.pi)
    tanh = jnp.tanh(c * (x + 0.044715 * (x**3)))
    cdf = 0.5 * (1.0 + tanh)  # the value as jax.nn.gelu computes it, to the last bit
    slope = cdf + 0.5 * x * (1 - tanh * tanh) * c * (1 + 3 * 0.044715 * x * x)
    return x * cdf, slope * dx


# FFN kind -> activation. The kinds in config.GATED_FFNS apply it to a gate multiplying a second
# projection (Shazeer 2020); the others are the classic two-layer MLP.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": gelu_tanh,  # tanh approximation, as in GPT-2
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),  # erf, as torch's default GELU
    "swiglu": jax.nn.silu,
    "geglu": jax.nn.gelu,  # tanh, as Gemma's and HF's gelu_pytorch_tanh
    "geglu_exact": functools.partial(jax.nn.gelu, approximate=False),  # erf, as ModernBERT's
    "reglu": jax.nn.relu,
}


class FFN(nnx.Module):
    """The feed-forward sublayer: a two-layer MLP, or a gated linear unit for the GATED_FFNS."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        width: int | None = None,
        encoder_stack: bool = False,
        experts: bool = False,
    ):
        """`width`: the hidden width (d_ff); `experts`: this FFN is a mixture of experts' shared ones."""
        self.cfg = cfg
        D, F = cfg.d_model, cfg.d_ff if width is None else width
        scales = InitScales.of(cfg, encoder_stack, experts)
        if cfg.gated_ffn:  # gate and up projection fused: C = 2
            self.w_in = normal_param(rngs, (D, 2, F), ("embed", None, "mlp"), scales.ffn_in, cfg)
            self.b_in = const_param(0.0, (2, F), (None, "mlp"), cfg) if cfg.use_bias else None
        else:
            self.w_in = normal_param(rngs, (D, F), ("embed", "mlp"), scales.ffn_in, cfg)
            self.b_in = const_param(0.0, (F,), ("mlp",), cfg) if cfg.use_bias else None
        self.w_out = normal_param(rngs, (F, D), ("mlp", "embed"), scales.ffn_out, cfg)
        self.b_out = const_param(0.0, (D,), ("embed",), cfg) if cfg.use_bias else None

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dtype = x_BxTxD.dtype
        act = ACTIVATIONS[self.cfg.ffn]
        w_in = self.w_in[...].astype(dtype)
        if self.cfg.gated_ffn:
            h_BxTxCxF = cotangent_once(project("BTD,DCF->BTCF", x_BxTxD, w_in))
            if self.b_in is not None:
                h_BxTxCxF = h_BxTxCxF + self.b_in[...].astype(dtype)
            h_BxTxF = act(h_BxTxCxF[:, :, 0]) * h_BxTxCxF[:, :, 1]
        else:
            h_BxTxF = cotangent_once(project("BTD,DF->BTF", x_BxTxD, w_in))
            if self.b_in is not None:
                h_BxTxF = h_BxTxF + self.b_in[...].astype(dtype)
            h_BxTxF = act(h_BxTxF)
        y_BxTxD = project("BTF,FD->BTD", h_BxTxF, self.w_out[...].astype(dtype))
        if self.b_out is not None:
            y_BxTxD = y_BxTxD + self.b_out[...].astype(dtype)
        return y_BxTxD
