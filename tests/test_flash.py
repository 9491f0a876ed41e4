"""Blocked attention (model/flash.py): values and gradients equal the einsum reference over GQA
ratios, windows, causal and bidirectional masks and lengths that are not a multiple of the block;
a train step with it equals one with XLA's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_mask

from transformer import sharding
from transformer.config import ModelConfig
from transformer.config_loader import load_config
from transformer.model import flash
from transformer.model.attention import attend_einsum
from transformer.model.flash import CPU_CHAINS, Mask, attend_in_chains, blocked_attention, blocks
from transformer.train.trainer import Trainer, default_controls

T, H, BLOCK = 21, 8, 8  # three query blocks, the last one short


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 5, 30])
@pytest.mark.parametrize(("K", "G"), [(4, 1), (2, 2), (1, 4)])
def test_values_and_gradients_equal_einsum_reference(causal, window, K, G):
    cfg = ModelConfig(d_model=K * G * H, n_heads=K * G, n_kv_heads=K)
    kq, kk, kv, kc = jax.random.split(jax.random.key(K + 10 * (window or 0) + causal), 4)
    q = jax.random.normal(kq, (2, T, K, G, H))
    k, v = jax.random.normal(kk, (2, T, K, H)), jax.random.normal(kv, (2, T, K, H))
    cotangent = jax.random.normal(kc, (2, T, K, G, H))
    mask = Mask(causal, window)

    def blocked(q, k, v):
        return jnp.sum(blocked_attention(q, k, v, cfg.scale, mask, BLOCK) * cotangent)

    def einsum(q, k, v):
        return jnp.sum(attend_einsum(q, k, v, reference_mask(*mask, T), None, cfg, None) * cotangent)

    got = jax.value_and_grad(blocked, argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(einsum, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 9), (False, 9)])
def test_blocks_skip_only_fully_masked_keys(causal, window):
    """Each block's key range holds every key its mask allows and nothing wholly masked at its ends."""
    mask = Mask(causal, window)
    allowed_TxS = np.asarray(reference_mask(*mask, T)[0])
    for q0, q1, lo, hi in blocks(T, T, mask, BLOCK):
        reachable = np.flatnonzero(allowed_TxS[q0:q1].any(axis=0))
        assert (lo, hi) == (reachable[0], reachable[-1] + 1)


@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 9), (False, 9), (False, None)])
def test_key_blocks_reach_only_queries_that_see_them(causal, window):
    """A long sequence's backward pass goes over blocks of keys: each one's query range holds every
    query its mask lets see one of the block's keys, and nothing wholly masked at its ends."""
    mask = Mask(causal, window)
    allowed_TxS = np.asarray(reference_mask(*mask, T)[0])
    for s0 in range(0, T, BLOCK):
        q0, q1 = mask.query_range(s0, min(T, s0 + BLOCK), T)
        reachable = np.flatnonzero(allowed_TxS[:, s0 : s0 + BLOCK].any(axis=1))
        assert (q0, q1) == (reachable[0], reachable[-1] + 1)


@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 5), (False, 5)])
def test_long_sequences_compute_the_same_attention(monkeypatch, causal, window):
    """A long sequence (a block's products ones YNNPACK threads) has its blocks run one after another,
    its head-major inputs put in memory once (on a CPU, behind conditionals) and its backward pass
    over blocks of keys: the same output and gradients as the other path to float rounding, and the
    conditionals are there."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(kq, (2, T, 2, 2, H))
    k, v = jax.random.normal(kk, (2, T, 2, H)), jax.random.normal(kv, (2, T, 2, H))
    cotangent = jax.random.normal(kc, q.shape)
    mask = Mask(causal, window)

    def run():
        forward = jax.jit(lambda q, k, v: blocked_attention(q, k, v, 0.3, mask, BLOCK))
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v) * cotangent), argnums=(0, 1, 2)))
        programs = [f.lower(q, k, v).compile().as_text().count(" conditional(") for f in (forward, grads)]
        return [forward(q, k, v), *grads(q, k, v)], programs

    monkeypatch.setattr(flash, "THREADED_ITEM_FLOPS", float("inf"))
    short, short_conditionals = run()
    monkeypatch.setattr(flash, "THREADED_ITEM_FLOPS", 0.0)
    long, long_conditionals = run()
    for got, want in zip(long, short, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if jax.default_backend() == "cpu":
        assert short_conditionals == [0, 0]
        # the forward pass: q, k and v put in memory, and every block but the first after the one before
        forward, backward = long_conditionals
        assert forward == 3 + len(blocks(T, T, mask, BLOCK)) - 1
        assert backward > forward


def _train_losses(impl: str, window: int | None) -> list[float]:
    overrides = [
        "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=300",
        "train.batch_size=2", f"model.attention_impl={impl}", f"model.window={window or 'null'}",
    ]  # fmt: skip
    cfg = load_config(None, overrides).with_vocab(259)
    trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    rows = np.random.default_rng(0).integers(0, 259, (2, 301)).astype(np.int32)
    batch = trainer.put_batch({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, 2)
    losses = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch, default_controls())
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("window", [None, 7])
def test_train_steps_equal_xla_attention(window):
    """Three AdamW steps (the updates feed back) give XLA's losses to float rounding; T=300 is
    three query blocks, the last one short."""
    np.testing.assert_allclose(_train_losses("blocked", window), _train_losses("xla", window), rtol=1e-5)


@pytest.mark.parametrize("batch", [2 * CPU_CHAINS, 2 * CPU_CHAINS + 1])
def test_attention_in_chains_is_the_blocked_attention_bit_for_bit(batch):
    """`attend_in_chains` (on a CPU the batch's rows in CPU_CHAINS interleaved groups, each its own
    call; one call where the rows do not divide) gives blocked_attention's output and gradients
    bit for bit, each row in its place."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(batch), 4)
    q = jax.random.normal(kq, (batch, T, 2, 2, H))
    k, v = jax.random.normal(kk, (batch, T, 2, H)), jax.random.normal(kv, (batch, T, 2, H))
    cotangent = jax.random.normal(kc, q.shape)
    mask = Mask(causal=True, window=None)
    out = {}
    for name, attend in (("chains", attend_in_chains), ("whole", blocked_attention)):
        forward = jax.jit(lambda q, k, v, attend=attend: attend(q, k, v, 0.3, mask, BLOCK))
        grads = jax.jit(jax.grad(lambda q, k, v, f=forward: jnp.sum(f(q, k, v) * cotangent), argnums=(0, 1, 2)))
        out[name] = (forward(q, k, v), *grads(q, k, v))
    for got, want in zip(out["chains"], out["whole"]):
        np.testing.assert_array_equal(got, want)
