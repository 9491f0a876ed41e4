"""Blocked attention: the queries in blocks, each block against only the keys its mask can reach.

`jax.nn.dot_product_attention(implementation="xla")` materialises, masks and keeps for the backward
pass the whole T x S score matrix. Here the queries go in static blocks of `block` rows; a block's
key range is cut statically to the keys a causal and/or windowed mask lets it see, so the fully
masked part of the matrix is never computed (half of it for a causal mask, nearly all of it for a
narrow window). The backward pass (a custom VJP) recomputes each block's probabilities from the
saved log-sum-exp instead of keeping them, as flash attention does: memory stays O(T) per head
beyond the block at hand, at the speed of plain autodiff through the blocks (measured equal on
XLA:CPU, which keeps the probabilities of every block).

Layout is the GQA one of attention.py: q [B, T, K, G, H], k and v [B, S, K, H]; query head n = k*G + g.
Masks: causal (key s <= query t) or bidirectional, optionally a window (causal: t - s < window;
bidirectional: |t - s| < window). Explicit masks and biases (documents, ALiBi) are not handled here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# The same finite stand-in for -inf as attention.MASK_VALUE (every row here keeps its diagonal, so
# no row is fully masked).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
BLOCK = 128  # query rows per block: measured on XLA:CPU (see benchmarks/README.md)


class Mask(NamedTuple):
    """The static mask: causal or bidirectional, with an optional window (None: unlimited)."""

    causal: bool
    window: int | None

    def key_range(self, q0: int, q1: int, S: int) -> tuple[int, int]:
        """The keys [lo, hi) that queries q0..q1-1 may see: outside it, every entry is masked."""
        lo, hi = 0, S
        if self.window is not None:
            lo = max(0, q0 - self.window + 1)
            if not self.causal:
                hi = min(S, q1 + self.window - 1)
        if self.causal:
            hi = min(S, q1)
        return lo, hi

    def allowed(self, q0: int, q1: int, lo: int, hi: int) -> jax.Array | None:
        """[q1-q0, hi-lo] booleans of the block, or None where all are allowed."""
        t_T, s_S = jnp.arange(q0, q1)[:, None], jnp.arange(lo, hi)[None, :]
        parts = []
        if self.causal and hi > q0 + 1:
            parts.append(s_S <= t_T)
        if self.window is not None:
            d = t_T - s_S if self.causal else jnp.abs(t_T - s_S)
            parts.append(d < self.window)
        return functools.reduce(jnp.logical_and, parts) if parts else None


def blocks(T: int, S: int, mask: Mask, block: int) -> list[tuple[int, int, int, int]]:
    """(q0, q1, lo, hi) of each query block and the keys it may see."""
    return [(q0, min(T, q0 + block), *mask.key_range(q0, min(T, q0 + block), S)) for q0 in range(0, T, block)]


def _logits(q_BxTxKxGxH, k_BxSxKxH, scale, mask: Mask, q0, q1, lo, hi):
    """Scaled, masked float32 logits of one block: [B, K, G, q1-q0, hi-lo]."""
    scores = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BxTxKxGxH[:, q0:q1], k_BxSxKxH[:, lo:hi], preferred_element_type=jnp.float32
    )
    logits_BxKxGxTxS = scores * scale
    allowed_TxS = mask.allowed(q0, q1, lo, hi)
    if allowed_TxS is not None:
        logits_BxKxGxTxS = jnp.where(allowed_TxS, logits_BxKxGxTxS, MASK_VALUE)
    return logits_BxKxGxTxS


def _forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask: Mask, block: int):
    """(out [B, T, K, G, H], log-sum-exp of each query's logits [B, K, G, T])."""
    outs, lses = [], []
    for q0, q1, lo, hi in blocks(q_BxTxKxGxH.shape[1], k_BxSxKxH.shape[1], mask, block):
        logits_BxKxGxTxS = _logits(q_BxTxKxGxH, k_BxSxKxH, scale, mask, q0, q1, lo, hi)
        max_BxKxGxT = jnp.max(logits_BxKxGxTxS, axis=-1)
        e_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - max_BxKxGxT[..., None])
        sum_BxKxGxT = jnp.sum(e_BxKxGxTxS, axis=-1)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", e_BxKxGxTxS.astype(v_BxSxKxH.dtype), v_BxSxKxH[:, lo:hi])
        outs.append(out / jnp.moveaxis(sum_BxKxGxT, -1, 1)[..., None].astype(out.dtype))
        lses.append(max_BxKxGxT + jnp.log(sum_BxKxGxT))
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def blocked_attention(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale: float, mask: Mask, block: int = BLOCK):
    """softmax(q k^T * scale, masked by `mask`) v per query head: out [B, T, K, G, H]."""
    return _forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask, block)[0]


def _fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask, block):
    out_BxTxKxGxH, lse_BxKxGxT = _forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask, block)
    return out_BxTxKxGxH, (q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, out_BxTxKxGxH, lse_BxKxGxT)


def _bwd(scale, mask, block, residuals, dout_BxTxKxGxH):
    """Flash attention's backward: each block's probabilities recomputed from the log-sum-exp."""
    q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, out_BxTxKxGxH, lse_BxKxGxT = residuals
    # rowsum(dP * P) = rowsum(dout * out): the softmax's correction term, one number per query.
    delta_BxKxGxT = jnp.einsum("BTKGH,BTKGH->BKGT", dout_BxTxKxGxH, out_BxTxKxGxH, preferred_element_type=jnp.float32)
    dk_BxSxKxH = jnp.zeros(k_BxSxKxH.shape, jnp.float32)
    dv_BxSxKxH = jnp.zeros(v_BxSxKxH.shape, jnp.float32)
    dqs = []
    for q0, q1, lo, hi in blocks(q_BxTxKxGxH.shape[1], k_BxSxKxH.shape[1], mask, block):
        logits_BxKxGxTxS = _logits(q_BxTxKxGxH, k_BxSxKxH, scale, mask, q0, q1, lo, hi)
        p_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - lse_BxKxGxT[..., q0:q1, None])
        dout = dout_BxTxKxGxH[:, q0:q1]
        dv_BxSxKxH = dv_BxSxKxH.at[:, lo:hi].add(
            jnp.einsum("BKGTS,BTKGH->BSKH", p_BxKxGxTxS, dout, preferred_element_type=jnp.float32)
        )
        dp_BxKxGxTxS = jnp.einsum("BTKGH,BSKH->BKGTS", dout, v_BxSxKxH[:, lo:hi], preferred_element_type=jnp.float32)
        ds_BxKxGxTxS = p_BxKxGxTxS * (dp_BxKxGxTxS - delta_BxKxGxT[..., q0:q1, None]) * scale
        dqs.append(jnp.einsum("BKGTS,BSKH->BTKGH", ds_BxKxGxTxS, k_BxSxKxH[:, lo:hi].astype(jnp.float32)))
        dk_BxSxKxH = dk_BxSxKxH.at[:, lo:hi].add(
            jnp.einsum("BKGTS,BTKGH->BSKH", ds_BxKxGxTxS, q_BxTxKxGxH[:, q0:q1].astype(jnp.float32))
        )
    dq_BxTxKxGxH = jnp.concatenate(dqs, axis=1)
    return (
        dq_BxTxKxGxH.astype(q_BxTxKxGxH.dtype),
        dk_BxSxKxH.astype(k_BxSxKxH.dtype),
        dv_BxSxKxH.astype(v_BxSxKxH.dtype),
    )


blocked_attention.defvjp(_fwd, _bwd)
