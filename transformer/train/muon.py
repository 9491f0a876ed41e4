"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"): each hidden matrix's update is
its (Nesterov) momentum made orthogonal by a Newton-Schulz iteration, U S V^T -> ~U V^T, then
scaled by its shape; every other parameter takes AdamW (train/optim.py builds both groups).

Which parameter is a matrix, and how its axes make one, is model/parametrization.py's table
(`matrix_axes`): a layer-stacked [L, ...] parameter is L matrices and an expert stack E more, each
orthogonalised alone (never the stack as one matrix: the layers are separate linear maps, and one
polar factor over all of them would couple their steps); a fused projection is cut along its C axis
into the maps it fuses, q, k and v (GQA's query heads stay one q) or gate and up, so a step does not
depend on whether the model stores them fused.

The iteration runs in float32 whatever the parameters' dtype; on the sharded matrices inside the
jitted step, where XLA's partitioner places the Gram products (see benchmarks/README.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from transformer.config import ModelConfig, MuonConfig
from transformer.model import matrix_axes

# Keller Jordan's quintic, the same at every step: its slope at 0 (3.4445) is pushed past where it
# converges to 1, so singular values end in a band around 1 (~0.7-1.2) rather than at 1, in 5 steps.
JORDAN = ((3.4445, -4.7750, 2.0315),)
# Polar Express (Amsel et al. 2025, arXiv 2505.16932), one quintic per step, computed for 5 steps with
# a safety factor of 2e-2 (hence the 1.02 in the normaliser below) as modded-nanogpt and nanochat use.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# each iteration's normaliser: x / (|x|_F * safety + eps), so every singular value starts in [0, 1]
NORMALISER = {"jordan": (1.0, 1e-7), "polar_express": (1.02, 1e-6)}


def coefficients(cfg: MuonConfig) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of `cfg.ns_steps` steps X <- a X + (b A + c A^2) X, A = X X^T."""
    return JORDAN * cfg.ns_steps if cfg.ns == "jordan" else POLAR_EXPRESS[: cfg.ns_steps]


def newton_schulz(x_BxMxN: jax.Array, cfg: MuonConfig) -> jax.Array:
    """Each [M, N] matrix of the batch made approximately orthogonal (its singular values mapped by
    the iteration's scalar polynomial), in float32, through the smaller of the two Gram matrices."""
    x = x_BxMxN.astype(jnp.float32)
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = jnp.swapaxes(x, 1, 2)
    safety, eps = NORMALISER[cfg.ns]
    x = x / (jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True)) * safety + eps)
    for a, b, c in coefficients(cfg):
        gram_BxMxM = jnp.einsum("BMN,BKN->BMK", x, x)
        poly_BxMxM = b * gram_BxMxM + c * jnp.einsum("BMK,BKJ->BMJ", gram_BxMxM, gram_BxMxM)
        x = a * x + jnp.einsum("BMK,BKN->BMN", poly_BxMxM, x)
    return jnp.swapaxes(x, 1, 2) if tall else x


def shape_scale(fan_in: int, fan_out: int, scale: str) -> float:
    """What an orthogonal [fan_in, fan_out] update is multiplied by (`MuonConfig.scale`)."""
    match scale:
        case "moonlight":
            return 0.2 * math.sqrt(max(fan_in, fan_out))
        case "jordan":
            return math.sqrt(max(1.0, fan_out / fan_in))
        case _:
            return math.sqrt(fan_out / fan_in)


class MatrixLayout(NamedTuple):
    """How one parameter's array is a batch of matrices: the number of its leading axes that index
    separate matrices, how many of the rest are fan-in, and where (and into what sizes) a fused
    axis is cut (None: nothing fused)."""

    lead: int
    fan_in_axes: int
    split_axis: int | None
    parts: tuple[int, ...]


def layout(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> MatrixLayout | None:
    """The layout of parameter `name` of `shape` (None: not a Muon matrix)."""
    axes = matrix_axes(cfg, name)
    if axes is None:
        return None
    fan_in, fan_out = axes.split(",")
    letters = fan_in + fan_out
    lead = len(shape) - len(letters)
    if "C" not in letters:
        return MatrixLayout(lead, len(fan_in), None, ())
    # queries' G heads per kv head, then k and v (attention.py); gate and up (layers.FFN)
    parts = (cfg.n_heads // cfg.n_kv_heads, 1, 1) if name == "qkv" else (1, 1)
    return MatrixLayout(lead, len(fan_in), lead + letters.index("C"), parts)


def orthogonal_update(u: jax.Array, lay: MatrixLayout, cfg: MuonConfig) -> jax.Array:
    """`u` (a parameter's momentum) with each of its matrices orthogonalised and shape-scaled."""
    out = []
    for piece in pieces(u, lay):
        o = newton_schulz(as_matrices(piece, lay), cfg)
        out.append((o * shape_scale(o.shape[1], o.shape[2], cfg.scale)).reshape(piece.shape).astype(u.dtype))
    return joined(out, lay)


def pieces(u: jax.Array, lay: MatrixLayout) -> list[jax.Array]:
    """A parameter-shaped array cut into the projections its fused axis holds (itself if none)."""
    if lay.split_axis is None:
        return [u]
    return jnp.split(u, [sum(lay.parts[: i + 1]) for i in range(len(lay.parts) - 1)], axis=lay.split_axis)


def joined(parts: list[jax.Array], lay: MatrixLayout) -> jax.Array:
    """`pieces`' inverse."""
    return parts[0] if lay.split_axis is None else jnp.concatenate(parts, axis=lay.split_axis)


def as_matrices(piece: jax.Array, lay: MatrixLayout) -> jax.Array:
    """One piece as its batch of [fan_in, fan_out] matrices (the layers' and experts' on a leading axis)."""
    batch = math.prod(piece.shape[: lay.lead])
    fan_in = math.prod(piece.shape[lay.lead : lay.lead + lay.fan_in_axes])
    return piece.reshape(batch, fan_in, piece.size // (batch * fan_in))


class MuonState(NamedTuple):
    momentum: optax.Updates  # the exponential average of the gradients, shaped like the matrices


def scale_by_muon(cfg: MuonConfig, model: ModelConfig) -> optax.GradientTransformation:
    """Momentum m <- beta m + (1 - beta) g, the step (1 - beta) g + beta m under Nesterov (else m),
    each matrix of it (`layout`, by the parameter's name) orthogonalised and scaled by `cfg.scale`,
    for a tree of hidden matrices (the Muon group). Learning rate and weight decay follow in the chain."""

    def init(params):
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def ortho(path, u):
        lay = layout(model, str(path[-1].key), u.shape)
        assert lay is not None, f"{jax.tree_util.keystr(path)} is not a hidden matrix"
        return orthogonal_update(u, lay, cfg)

    def update(updates, state, params=None):
        momentum = optax.tree.update_moment(updates, state.momentum, cfg.momentum, 1)
        step = optax.tree.update_moment(updates, momentum, cfg.momentum, 1) if cfg.nesterov else momentum
        return jax.tree_util.tree_map_with_path(ortho, step), MuonState(momentum)

    return optax.GradientTransformation(init, update)


def is_matrix(model: ModelConfig, params: dict) -> dict:
    """For a pure-dict parameter tree: True where the parameter is a hidden matrix (Muon's group)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: matrix_axes(model, str(path[-1].key)) is not None, params)
