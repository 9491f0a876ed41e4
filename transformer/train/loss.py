"""The training objective: float32 cross-entropy over real target tokens, plus PaLM's z-loss.

Plain, it projects every position to float32 logits [B, T, V] at once: with a large vocabulary
(GPT-2's 50k, Llama's 128k) that is one of the step's largest buffers, and its gradient another.
Chunked (`train.loss_chunk`, see `Config.loss_chunk`), it projects a few positions of every row at a
time inside a `lax.map`, each chunk rematerialised in the backward pass, so only one chunk's logits
ever exist; the sums are the same up to float rounding (the order of the additions differs).
Chunks run along the sequence with all rows, so each keeps the batch's sharding.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Logits = Callable[[jax.Array], jax.Array]  # hidden states [..., D] -> float32 logits [..., V]


def cross_entropy(logits_BxTxV, targets_BxT, weights_BxT, z_loss: float):
    """(objective sum, nll sum, weight sum, weighted count of targets predicted right): float32
    cross-entropy summed over real target tokens, plus z_loss * log(Z)^2 (PaLM), which keeps the
    softmax normaliser near 1. (Only evaluation reads the count; a training step never computes it.)"""
    nll_sum, z_sum, correct = _sums(logits_BxTxV, targets_BxT, weights_BxT)
    return nll_sum + z_loss * z_sum, nll_sum, jnp.sum(weights_BxT), correct


def _sums(logits_BxTxV, targets_BxT, weights_BxT) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weighted sum of -log p(target), weighted sum of log(Z)^2, weighted count of argmax == target)."""
    logits = logits_BxTxV.astype(jnp.float32)
    log_z_BxT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    correct_BxT = jnp.argmax(logits, axis=-1) == targets_BxT
    return (
        jnp.sum((log_z_BxT - target_logit_BxT) * weights_BxT),
        jnp.sum(jnp.square(log_z_BxT) * weights_BxT),
        jnp.sum(jnp.where(correct_BxT, weights_BxT, 0.0)),
    )


def objective(x_BxTxD, logits: Logits, targets_BxT, weights_BxT, z_loss: float, chunk: int):
    """`cross_entropy` of the logits of hidden states x: formed whole (chunk 0, or a chunk holding
    the whole batch), else `chunk` tokens at a time (the one switch between the two forms)."""
    B, T, _ = x_BxTxD.shape
    if not chunk or chunk >= B * T:
        return cross_entropy(logits(x_BxTxD), targets_BxT, weights_BxT, z_loss)
    return chunked_cross_entropy(x_BxTxD, logits, targets_BxT, weights_BxT, z_loss, max(1, chunk // B))


def chunked_cross_entropy(x_BxTxD, logits: Logits, targets_BxT, weights_BxT, z_loss: float, positions: int):
    """`cross_entropy` computed `positions` sequence positions (of every row) at a time. The
    sequence is padded to a multiple of it with zero-weight tokens."""
    B, T, D = x_BxTxD.shape
    pad = -T % positions
    if pad:
        x_BxTxD = jnp.pad(x_BxTxD, ((0, 0), (0, pad), (0, 0)))
        targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
        weights_BxT = jnp.pad(weights_BxT, ((0, 0), (0, pad)))
    n = (T + pad) // positions
    x_NxBxCxD = x_BxTxD.reshape(B, n, positions, D).swapaxes(0, 1)
    targets_NxBxC = targets_BxT.reshape(B, n, positions).swapaxes(0, 1)
    weights_NxBxC = weights_BxT.reshape(B, n, positions).swapaxes(0, 1)

    # rematerialised: the backward pass forms each chunk's logits again instead of keeping them all
    @jax.checkpoint
    def one(chunk):
        x_BxCxD, targets_BxC, weights_BxC = chunk
        return _sums(logits(x_BxCxD), targets_BxC, weights_BxC)

    nll_N, z_N, correct_N = jax.lax.map(one, (x_NxBxCxD, targets_NxBxC, weights_NxBxC))
    nll_sum, z_sum = jnp.sum(nll_N), jnp.sum(z_N)
    return nll_sum + z_loss * z_sum, nll_sum, jnp.sum(weights_BxT), jnp.sum(correct_N)
