"""Blocked attention: the queries in blocks, each block against only the keys its mask can reach.

`jax.nn.dot_product_attention(implementation="xla")` materialises, masks and keeps for the backward
pass the whole T x S score matrix. Here the queries go in static blocks of `block` rows; a block's
key range is cut statically to the keys a causal and/or windowed mask lets it see, so the fully
masked part of the matrix is never computed (half of it for a causal mask, nearly all of it for a
narrow window). The backward pass (a custom VJP) recomputes each block's probabilities from the
saved log-sum-exp instead of keeping them, as flash attention does: memory stays O(T) per head
beyond the block at hand.

Layout. The interface is the GQA one of attention.py: q [B, T, K, G, H], k and v [B, S, K, H];
query head n = k*G + g. Inside, everything is head-major, transposed once on the way in and once
on the way out: queries [B, K, G, T, H], values [B, K, S, H], and keys [B, K, H, S] (and, in the
backward pass, also [B, K, S, H]). Then every block's product is a batched matmul over (B, K) whose
operands are already in the row-major form XLA:CPU's dot wants (a block's keys are still sliced, a
strided copy, but no longer transposed); laid out as the interface is, XLA transposed each block's
keys again, a cost that grows with the square of the length. The key and value gradients are
kept transposed, [B, K, H, S], for the same reason (their blocks' products then contract over
queries without transposing the [T, S] probabilities). Measured on XLA:CPU: benchmarks/README.md.

Long sequences on a CPU (some block's products large enough that YNNPACK threads them itself,
`THREADED_ITEM_FLOPS`): the head-major inputs are put in memory once, and the blocks run one after
another (`_after`); the backward pass goes over blocks of keys (`_bwd`). Left to itself XLA fuses
the head-major transpose into every block's slice, and runs the independent blocks at once, where
they compete for the same cores.

Masks: causal (key s <= query t) or bidirectional, optionally a window (causal: t - s < window;
bidirectional: |t - s| < window). Explicit masks and biases (documents, ALiBi) are not handled here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from transformer.model import flash_cpu, layers

# The same finite stand-in for -inf as attention.MASK_VALUE (every row here keeps its diagonal, so
# no row is fully masked).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
BLOCK = 128  # query rows per block: measured on XLA:CPU (see benchmarks/README.md)
# YNNPACK (XLA:CPU's dots) runs a batched dot's items each on one thread up to 8.4 MFLOP and threads
# them from 16.8 (2-core Zen 4, benchmarks/README.md): a sequence with a block's item this large is long
THREADED_ITEM_FLOPS = 16e6


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

    def query_range(self, s0: int, s1: int, T: int) -> tuple[int, int]:
        """The queries [qlo, qhi) that may see some of keys s0..s1-1: outside it, every entry is masked."""
        qlo, qhi = 0, T
        if self.window is not None:
            qhi = min(T, s1 + self.window - 1)
            if not self.causal:
                qlo = max(0, s0 - self.window + 1)
        if self.causal:
            qlo = min(T, s0)
        return qlo, qhi

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


def _logits(q_BxKxGxTxH, k_BxKxHxS, scale, mask: Mask, q0, q1, lo, hi):
    """Scaled, masked float32 logits of queries q0..q1-1 (`q_BxKxGxTxH` holds just those) against
    keys lo..hi-1 (`k_BxKxHxS` holds all keys): [B, K, G, q1-q0, hi-lo]."""
    scores = jnp.einsum("BKGTH,BKHS->BKGTS", q_BxKxGxTxH, k_BxKxHxS[..., lo:hi], preferred_element_type=jnp.float32)
    logits_BxKxGxTxS = scores * scale
    allowed_TxS = mask.allowed(q0, q1, lo, hi)
    if allowed_TxS is not None:
        logits_BxKxGxTxS = jnp.where(allowed_TxS, logits_BxKxGxTxS, MASK_VALUE)
    return logits_BxKxGxTxS


def _after(x: jax.Array, previous: jax.Array, long: bool) -> jax.Array:
    """`x`, on a CPU made after `previous` where the sequence is `long`. The blocks are independent
    and XLA:CPU runs independent ops at once: products YNNPACK threads itself then compete for the
    same cores (`benchmarks/concurrent_dots.py`, 16 pairs of a block's two products, 4 heads x 128
    queries: at 2048 keys 2.7-2.8 ms a pair at once, 1.6 one after another; at 1024 keys alike; at
    256, items YNNPACK runs one a thread, 0.25 at once against 0.33: there at once is the faster)."""
    return layers.in_memory_on_cpu(x, after=previous) if long else x


def _head_major(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, long: bool):
    """The inputs in the layout the blocks compute in: q [B, K, G, T, H], k [B, K, H, S], v [B, K, S, H];
    where `long`, on a CPU each put in memory once: left to itself XLA fuses the transpose into every
    block's slice, a strided gather repeated for each block (at T=2048, 16 blocks, most of the
    forward pass's copying)."""
    arrays = q_BxTxKxGxH.transpose(0, 2, 3, 1, 4), k_BxSxKxH.transpose(0, 2, 3, 1), v_BxSxKxH.transpose(0, 2, 1, 3)
    return tuple(layers.in_memory_on_cpu(a) for a in arrays) if long else arrays


def _is_long(T: int, S: int, H: int, mask: Mask, block: int) -> bool:
    """Does YNNPACK thread some block's products (see `_after`)?"""
    return any(2 * (q1 - q0) * (hi - lo) * H >= THREADED_ITEM_FLOPS for q0, q1, lo, hi in blocks(T, S, mask, block))


def _forward(q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH, scale, mask: Mask, block: int, long: bool):
    """(out [B, K, G, T, H], log-sum-exp of each query's logits [B, K, G, T])."""
    outs: list[jax.Array] = []
    lses: list[jax.Array] = []
    for q0, q1, lo, hi in blocks(q_BxKxGxTxH.shape[3], k_BxKxHxS.shape[3], mask, block):
        q_block = q_BxKxGxTxH[:, :, :, q0:q1]
        if outs:
            q_block = _after(q_block, outs[-1], long)
        logits_BxKxGxTxS = _logits(q_block, k_BxKxHxS, scale, mask, q0, q1, lo, hi)
        max_BxKxGxT = jnp.max(logits_BxKxGxTxS, axis=-1)
        e_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - max_BxKxGxT[..., None])
        sum_BxKxGxT = jnp.sum(e_BxKxGxTxS, axis=-1)
        out = jnp.einsum("BKGTS,BKSH->BKGTH", e_BxKxGxTxS.astype(v_BxKxSxH.dtype), v_BxKxSxH[:, :, lo:hi])
        outs.append(out / sum_BxKxGxT[..., None].astype(out.dtype))
        lses.append(max_BxKxGxT + jnp.log(sum_BxKxGxT))
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def blocked_attention(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale: float, mask: Mask, block: int = BLOCK):
    """softmax(q k^T * scale, masked by `mask`) v per query head: out [B, T, K, G, H]."""
    return _fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask, block)[0]


def _fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask, block):
    long = _is_long(q_BxTxKxGxH.shape[1], k_BxSxKxH.shape[1], q_BxTxKxGxH.shape[4], mask, block)
    q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH = _head_major(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, long)
    out_BxKxGxTxH, lse_BxKxGxT = _forward(q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH, scale, mask, block, long)
    residuals = (q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH, out_BxKxGxTxH, lse_BxKxGxT)
    return out_BxKxGxTxH.transpose(0, 3, 1, 2, 4), residuals


def _bwd(scale, mask, block, residuals, dout_BxTxKxGxH):
    """Flash attention's backward: each block's probabilities recomputed from the log-sum-exp. Long
    sequences go over blocks of keys, the rest over blocks of queries: in the train step at T=2048
    the first was the faster (new/old 0.92-0.95, three runs), at T=256 and 512 alike;
    alone, attention at T=256 and 512 took 1.08-1.18x as long over keys (benchmarks/README.md)."""
    q_BxKxGxTxH, k_BxKxHxS = residuals[:2]
    if _is_long(q_BxKxGxTxH.shape[3], k_BxKxHxS.shape[3], q_BxKxGxTxH.shape[4], mask, block):
        return _bwd_over_keys(scale, mask, block, residuals, dout_BxTxKxGxH)
    return _bwd_over_queries(scale, mask, block, residuals, dout_BxTxKxGxH)


def _bwd_over_queries(scale, mask, block, residuals, dout_BxTxKxGxH):
    """Over blocks of queries, each against the keys it sees; the key and value gradients accumulated."""
    q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH, out_BxKxGxTxH, lse_BxKxGxT = residuals
    dout_BxKxGxTxH = dout_BxTxKxGxH.transpose(0, 2, 3, 1, 4)
    k_BxKxSxH = k_BxKxHxS.transpose(0, 1, 3, 2).astype(jnp.float32)
    # rowsum(dP * P) = rowsum(dout * out): the softmax's correction term, one number per query.
    delta_BxKxGxT = jnp.einsum("BKGTH,BKGTH->BKGT", dout_BxKxGxTxH, out_BxKxGxTxH, preferred_element_type=jnp.float32)
    dk_BxKxHxS = jnp.zeros(k_BxKxHxS.shape, jnp.float32)
    dv_BxKxHxS = jnp.zeros(k_BxKxHxS.shape[:2] + (v_BxKxSxH.shape[3], k_BxKxHxS.shape[3]), jnp.float32)
    dqs = []
    for q0, q1, lo, hi in blocks(q_BxKxGxTxH.shape[3], k_BxKxHxS.shape[3], mask, block):
        logits_BxKxGxTxS = _logits(q_BxKxGxTxH[:, :, :, q0:q1], k_BxKxHxS, scale, mask, q0, q1, lo, hi)
        p_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - lse_BxKxGxT[..., q0:q1, None])
        dout = dout_BxKxGxTxH[:, :, :, q0:q1]
        dv_BxKxHxS = dv_BxKxHxS.at[..., lo:hi].add(
            jnp.einsum("BKGTH,BKGTS->BKHS", dout, p_BxKxGxTxS, preferred_element_type=jnp.float32)
        )
        dp_BxKxGxTxS = jnp.einsum("BKGTH,BKSH->BKGTS", dout, v_BxKxSxH[:, :, lo:hi], preferred_element_type=jnp.float32)
        ds_BxKxGxTxS = p_BxKxGxTxS * (dp_BxKxGxTxS - delta_BxKxGxT[..., q0:q1, None]) * scale
        dqs.append(jnp.einsum("BKGTS,BKSH->BKGTH", ds_BxKxGxTxS, k_BxKxSxH[:, :, lo:hi]))
        dk_BxKxHxS = dk_BxKxHxS.at[..., lo:hi].add(
            jnp.einsum("BKGTH,BKGTS->BKHS", q_BxKxGxTxH[:, :, :, q0:q1].astype(jnp.float32), ds_BxKxGxTxS)
        )
    dq_BxTxKxGxH = jnp.concatenate(dqs, axis=3).transpose(0, 3, 1, 2, 4)
    return (
        dq_BxTxKxGxH.astype(q_BxKxGxTxH.dtype),
        dk_BxKxHxS.transpose(0, 3, 1, 2).astype(k_BxKxHxS.dtype),
        dv_BxKxHxS.transpose(0, 3, 1, 2).astype(v_BxKxSxH.dtype),
    )


def _bwd_over_keys(scale, mask, block, residuals, dout_BxTxKxGxH):
    """Over blocks of keys (FlashAttention-2's order), each against the queries that see it: a key
    block's gradients are contracted over all those queries in one product, and only the query
    gradient is accumulated; on a CPU the blocks one after another and the operands in memory."""
    q_BxKxGxTxH, k_BxKxHxS, v_BxKxSxH, out_BxKxGxTxH, lse_BxKxGxT = residuals
    T, S = q_BxKxGxTxH.shape[3], k_BxKxHxS.shape[3]
    keep = layers.in_memory_on_cpu
    dout_BxKxGxTxH = keep(dout_BxTxKxGxH.transpose(0, 2, 3, 1, 4))
    # the products contracted over queries take them transposed, [.., H, T], as YNNPACK wants
    doutT_BxKxGxHxT = keep(dout_BxKxGxTxH.swapaxes(3, 4).astype(jnp.float32))
    qT_BxKxGxHxT = keep(q_BxKxGxTxH.swapaxes(3, 4).astype(jnp.float32))
    k_BxKxSxH = keep(k_BxKxHxS.transpose(0, 1, 3, 2).astype(jnp.float32))
    # rowsum(dP * P) = rowsum(dout * out): the softmax's correction term, one number per query.
    delta_BxKxGxT = jnp.einsum("BKGTH,BKGTH->BKGT", dout_BxKxGxTxH, out_BxKxGxTxH, preferred_element_type=jnp.float32)
    dq_BxKxGxTxH = jnp.zeros(q_BxKxGxTxH.shape, jnp.float32)
    dks, dvs = [], []
    for s0 in range(0, S, block):
        s1 = min(S, s0 + block)
        q0, q1 = mask.query_range(s0, s1, T)
        q_block = q_BxKxGxTxH[:, :, :, q0:q1]
        if dks:
            q_block = layers.in_memory_on_cpu(q_block, after=dks[-1])
        logits_BxKxGxTxS = _logits(q_block, k_BxKxHxS, scale, mask, q0, q1, s0, s1)
        p_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - lse_BxKxGxT[..., q0:q1, None])
        dvs.append(jnp.einsum("BKGHT,BKGTS->BKHS", doutT_BxKxGxHxT[..., q0:q1], p_BxKxGxTxS))
        dp_BxKxGxTxS = jnp.einsum(
            "BKGTH,BKSH->BKGTS",
            dout_BxKxGxTxH[:, :, :, q0:q1],
            v_BxKxSxH[:, :, s0:s1],
            preferred_element_type=jnp.float32,
        )
        ds_BxKxGxTxS = p_BxKxGxTxS * (dp_BxKxGxTxS - delta_BxKxGxT[..., q0:q1, None]) * scale
        dks.append(jnp.einsum("BKGHT,BKGTS->BKHS", qT_BxKxGxHxT[..., q0:q1], ds_BxKxGxTxS))
        dq_BxKxGxTxH = dq_BxKxGxTxH.at[:, :, :, q0:q1].add(
            jnp.einsum("BKGTS,BKSH->BKGTH", ds_BxKxGxTxS, k_BxKxSxH[:, :, s0:s1])
        )
    dk_BxKxHxS, dv_BxKxHxS = jnp.concatenate(dks, axis=3), jnp.concatenate(dvs, axis=3)
    return (
        dq_BxKxGxTxH.transpose(0, 3, 1, 2, 4).astype(q_BxKxGxTxH.dtype),
        dk_BxKxHxS.transpose(0, 3, 1, 2).astype(k_BxKxHxS.dtype),
        dv_BxKxHxS.transpose(0, 3, 1, 2).astype(v_BxKxSxH.dtype),
    )


blocked_attention.defvjp(_fwd, _bwd)

CPU_CHAINS = 2  # independent calls a CPU runs the batch's rows in (see `attend_in_chains`)


def attend_blocked(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale: float, mask: Mask, block: int = BLOCK) -> jax.Array:
    """The model's blocked attention: the fused CPU kernel where it computes the call
    (`flash_cpu.supports`: float32 on a CPU, head widths a multiple of its vectors), in both passes
    1.8-3.0x faster than XLA's blocks, each device on its own rows and kv heads; else `attend_in_chains`."""
    if flash_cpu.supports(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH):
        q_axes, kv_axes = ("batch", None, "kv_heads", None, None), ("batch", None, "kv_heads", None)
        return layers.on_each_device(
            lambda q, k, v: flash_cpu.attention(q, k, v, scale, mask),
            (q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH),
            (q_axes, kv_axes, kv_axes),
            q_axes,
        )
    return attend_in_chains(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask, block)


def attend_in_chains(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale: float, mask: Mask, block: int = BLOCK) -> jax.Array:
    """`blocked_attention`; on a CPU, of the batch's rows in CPU_CHAINS interleaved groups (rows
    r, r + n, ...) computed as independent calls, then put back in order: bit for bit the same.
    YNNPACK, the library XLA:CPU hands dots to, runs a batched dot's items one after another on
    one thread when they are small (a query block against its keys at short lengths); two
    independent chains of them the thunk executor runs at once, one a core. Attention alone at
    B8/T256/6 heads, forward and backward, took 30 ms in two chains against 47 in one; at T2048
    no change, whose items YNNPACK threads itself (2-core Zen 4, benchmarks/README.md, issue 36).
    Interleaved rather than halves, so a device's rows stay on it when the batch is sharded (each
    device's block of rows splits the same way when it holds a multiple of CPU_CHAINS rows).
    Measured on 2 cores only, hence 2."""
    B = q_BxTxKxGxH.shape[0]

    def whole(q, k, v):
        return blocked_attention(q, k, v, scale, mask, block)

    def chains(q, k, v):
        n = CPU_CHAINS
        q, k, v = (a.reshape(B // n, n, *a.shape[1:]) for a in (q, k, v))  # [B/n, n, ...]: row b*n + i
        outs = [whole(q[:, i], k[:, i], v[:, i]) for i in range(n)]
        return jnp.stack(outs, axis=1).reshape(B, *outs[0].shape[1:])

    if B % CPU_CHAINS:
        return whole(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH)
    return jax.lax.platform_dependent(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, cpu=chains, default=whole)
