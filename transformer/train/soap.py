"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv 2409.11321):
Adam run in the eigenbasis of Shampoo's preconditioner, for the hidden matrices (`optim.name: soap`;
every other parameter takes AdamW, train/optim.py builds both groups).

For each matrix W [m, n] with gradient G (the paper's Algorithm 3):

    L <- b2 L + (1 - b2) G G^T,  R <- b2 R + (1 - b2) G^T G           Shampoo's two factors
    Q_L, Q_R: their eigenbases, refreshed every `precondition_every` steps by one step of power
              iteration and a QR decomposition (the eigenvalue estimates of the old basis sort the
              new one, and Adam's second moment is permuted with it), made by a full
              eigendecomposition on the first step
    M <- b1 M + (1 - b1) G                                             first moment, as W is
    V <- b2 V + (1 - b2) (Q_L^T G Q_R)^2                               second moment, rotated
    step = Q_L [ (Q_L^T M^ Q_R) / (sqrt(V^) + eps) ] Q_R^T            M^, V^ bias-corrected

The first step only gathers the factors and makes the first bases, as the reference code does (its
step would use the gradient's own basis); its bias corrections count from the second. A side longer
than `max_precond_dim` is not rotated (one-sided SOAP, the reference's rule for vocabulary-sized
sides). Matrices are Muon's (model/parametrization.py `matrix_axes`, train/muon.py `layout`): each
layer's, expert's and fused projection's own, so that the two matrix optimisers differ only in what
they do to the same matrices; the factors and bases are [matrices, m, m] and [matrices, n, n],
replicated, the moments shaped (and sharded) like the parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from transformer.config import ModelConfig, OptimConfig
from transformer.train.muon import as_matrices, joined, layout, pieces


class Factors(NamedTuple):
    """One side's Shampoo factor and its eigenbasis, [matrices, k, k] each."""

    factor: jax.Array
    basis: jax.Array


class Sides(NamedTuple):
    """A piece's left (fan-in) and right (fan-out) factors; None: that side is not rotated."""

    left: Factors | None
    right: Factors | None


class SoapState(NamedTuple):
    step: jax.Array  # int32: steps taken, the first (factors only) included
    mu: optax.Updates  # first moments, shaped like the parameters
    nu: optax.Updates  # second moments in the eigenbases, shaped like the parameters
    sides: dict  # per parameter, one Sides per fused piece


def rotate(x_BxMxN: jax.Array, sides: Sides, back: bool = False) -> jax.Array:
    """Q_L^T x Q_R (into the eigenbasis), or Q_L x Q_R^T (`back`), skipping sides not rotated."""
    if sides.left is not None:
        spec = "BIM,BIN->BMN" if not back else "BMI,BIN->BMN"
        x_BxMxN = jnp.einsum(spec, sides.left.basis, x_BxMxN)
    if sides.right is not None:
        spec = "BMJ,BJN->BMN" if not back else "BMJ,BNJ->BMN"
        x_BxMxN = jnp.einsum(spec, x_BxMxN, sides.right.basis)
    return x_BxMxN


def _gram(g_BxMxN: jax.Array, side: str) -> jax.Array:
    return (
        jnp.einsum("BMN,BKN->BMK", g_BxMxN, g_BxMxN) if side == "left" else jnp.einsum("BMN,BMK->BNK", g_BxMxN, g_BxMxN)
    )


# The eigendecompositions and QRs run one matrix at a time (lax.map): jaxlib's batched LAPACK kernels
# split a batch over the CPU's intra-op thread pool and wait for it (ParallelBatchMap), and with
# several devices in one process each device's kernel waited on workers the others held: the train
# step deadlocked on 2 or 4 fake CPU devices (seen in gdb: every device thread in ssyevd's
# BlockingCounter::Wait), never on one.


def _eigenbasis(factor: jax.Array) -> jax.Array:
    """The eigenvectors of each symmetric factor, by eigenvalue from the largest."""
    return jax.lax.map(lambda f: jnp.linalg.eigh(f)[1], factor)[..., ::-1]


def _refreshed(side: Factors, nu_BxMxN: jax.Array, axis: int) -> tuple[Factors, jax.Array]:
    """One power-iteration step of the basis, QR-orthonormalised, its columns in order of the old
    basis's eigenvalue estimates; the second moment's `axis` permuted the same way."""
    power = jnp.einsum("BIJ,BJK->BIK", side.factor, side.basis)
    estimates = jnp.einsum("BIK,BIK->BK", side.basis, power)
    order = jnp.argsort(-estimates, axis=-1)
    basis = jax.lax.map(lambda p: jnp.linalg.qr(p)[0], jnp.take_along_axis(power, order[:, None, :], axis=2))
    index = order[:, :, None] if axis == 1 else order[:, None, :]
    return Factors(side.factor, basis), jnp.take_along_axis(nu_BxMxN, index, axis=axis)


def _with_factors(sides: Sides, g_BxMxN: jax.Array, decay: float) -> Sides:
    def add(side: Factors | None, which: str) -> Factors | None:
        if side is None:
            return None
        return side._replace(factor=decay * side.factor + (1.0 - decay) * _gram(g_BxMxN, which))

    return Sides(add(sides.left, "left"), add(sides.right, "right"))


def _first_step(g, mu, nu, sides: Sides, cfg: OptimConfig):
    """The factors from the first gradient, and their eigenbases; no step."""
    sides = _with_factors(sides, g, cfg.b2)
    made = [None if s is None else Factors(s.factor, _eigenbasis(s.factor)) for s in sides]
    return jnp.zeros_like(g), mu, nu, Sides(*made)


def _later_step(g, mu, nu, sides: Sides, step, cfg: OptimConfig):
    """Adam in the current bases, then the factors, and every `precondition_every` steps the bases."""
    mu = cfg.b1 * mu + (1.0 - cfg.b1) * g
    nu = cfg.b2 * nu + (1.0 - cfg.b2) * jnp.square(rotate(g, sides))
    count = step.astype(jnp.float32)  # updates made, this one included (the first step made none)
    mu_hat, nu_hat = mu / (1.0 - cfg.b1**count), nu / (1.0 - cfg.b2**count)
    update = rotate(rotate(mu_hat, sides) / (jnp.sqrt(nu_hat) + cfg.eps), sides, back=True)
    sides = _with_factors(sides, g, cfg.b2)

    def refresh(operands):
        sides, nu = operands
        left = right = None
        if sides.left is not None:
            left, nu = _refreshed(sides.left, nu, axis=1)
        if sides.right is not None:
            right, nu = _refreshed(sides.right, nu, axis=2)
        return Sides(left, right), nu

    sides, nu = jax.lax.cond(step % cfg.soap.precondition_every == 0, refresh, lambda o: o, (sides, nu))
    return update, mu, nu, sides


def _empty_sides(m3: jax.Array, max_dim: int) -> Sides:
    B, M, N = m3.shape

    def side(k: int) -> Factors | None:
        return None if k > max_dim else Factors(jnp.zeros((B, k, k), jnp.float32), jnp.zeros((B, k, k), jnp.float32))

    return Sides(side(M), side(N))


def scale_by_soap(cfg: OptimConfig, model: ModelConfig) -> optax.GradientTransformation:
    """SOAP's step (before the learning rate and weight decay, which follow in the chain) for a tree
    of hidden matrices (the SOAP group), each cut into its matrices by `layout`, in float32."""

    def layout_of(path, x):
        lay = layout(model, str(path[-1].key), x.shape)
        assert lay is not None, f"{jax.tree_util.keystr(path)} is not a hidden matrix"
        return lay

    def init(params):
        def sides(path, p):
            lay = layout_of(path, p)
            return tuple(_empty_sides(as_matrices(piece, lay), cfg.soap.max_precond_dim) for piece in pieces(p, lay))

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return SoapState(jnp.zeros([], jnp.int32), zeros, zeros, jax.tree_util.tree_map_with_path(sides, params))

    def update(updates, state: SoapState, params=None):
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
        results = [
            _parameter_step(
                g, _at(state.mu, path), _at(state.nu, path), _at(state.sides, path), layout_of(path, g), state.step, cfg
            )
            for path, g in flat
        ]
        steps, mu, nu, sides = (jax.tree_util.tree_unflatten(treedef, [r[i] for r in results]) for i in range(4))
        return steps, SoapState(optax.safe_increment(state.step), mu, nu, sides)

    return optax.GradientTransformation(init, update)


def _at(tree, path):
    """The subtree of a (nested dict) tree at a parameter's path."""
    for key in path:
        tree = tree[key.key]
    return tree


def _parameter_step(g, mu, nu, sides: tuple[Sides, ...], lay, step, cfg: OptimConfig):
    """(the step, mu, nu, sides) of one parameter, piece by piece."""
    out: tuple[list, list, list, list] = ([], [], [], [])
    for g_piece, mu_piece, nu_piece, piece_sides in zip(pieces(g, lay), pieces(mu, lay), pieces(nu, lay), sides):
        operands = (*(as_matrices(x.astype(jnp.float32), lay) for x in (g_piece, mu_piece, nu_piece)), piece_sides)
        result = jax.lax.cond(
            step == 0,
            lambda o: _first_step(o[0], o[1], o[2], o[3], cfg),
            lambda o: _later_step(o[0], o[1], o[2], o[3], step, cfg),
            operands,
        )
        for i, (value, like) in enumerate(zip(result[:3], (g_piece, mu_piece, nu_piece))):
            out[i].append(value.reshape(like.shape).astype(like.dtype))
        out[3].append(result[3])
    return joined(out[0], lay), joined(out[1], lay), joined(out[2], lay), tuple(out[3])
