"""The chunked cross-entropy equals the plain one, in value and in gradient, with its options."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.config import Config, DataConfig, ModelConfig, TrainConfig
from transformer.model import Transformer
from transformer.train.loss import chunked_cross_entropy, cross_entropy, objective


def _model(**model):
    m = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=300, vocab_multiple=64, **model)
    return Transformer(m, rngs=nnx.Rngs(0))


def _batch(B=3, T=13, V=300, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (B, T + 1)), jnp.int32)
    weights = jnp.asarray(rng.random((B, T)) > 0.2, jnp.float32)  # some tokens masked out
    return tokens[:, :-1], tokens[:, 1:], weights


def _loss_and_grad(model, chunk, z_loss):
    inputs, targets, weights = _batch()
    graphdef, params = nnx.split(model, nnx.Param)

    def f(params):
        m = nnx.merge(graphdef, params)
        obj, nll, count, correct = objective(m.forward(inputs)[0], m.logits, targets, weights, z_loss, chunk)
        return obj / count, (nll, count, correct)

    return jax.value_and_grad(f, has_aux=True)(params)


@pytest.mark.parametrize(
    ("model", "z_loss"),
    [({}, 0.0), ({"logit_softcap": 5.0, "tie_embeddings": False}, 1e-3)],
    ids=["tied", "softcap-untied-zloss"],
)
@pytest.mark.parametrize("chunk", [6, 12, 39])  # 2, 4 (padded: 13 is not a multiple) and 13 positions
def test_chunked_equals_plain_in_loss_and_gradient(model, z_loss, chunk):
    m = _model(**model)
    (plain, (nll, count, correct)), g_plain = _loss_and_grad(m, 0, z_loss)
    (chunked, (nll_c, count_c, correct_c)), g_chunked = _loss_and_grad(m, chunk, z_loss)
    assert float(count) == float(count_c)
    assert float(correct) == float(correct_c)
    np.testing.assert_allclose(chunked, plain, rtol=1e-6)
    np.testing.assert_allclose(nll_c, nll, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_chunked_matches_by_hand_and_ignores_padding_vocab():
    """Against the formula on explicit logits: padding positions and zero weights count nothing."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, (2, 5)), jnp.int32)
    weights = jnp.asarray([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], jnp.float32)
    x = logits  # identity "projection": the hidden states are the logits
    got = chunked_cross_entropy(x, lambda h: h, targets, weights, 0.5, positions=2)
    want = cross_entropy(logits, targets, weights, 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    log_p = jax.nn.log_softmax(logits)
    nll = -jnp.sum(jnp.take_along_axis(log_p, targets[..., None], -1)[..., 0] * weights)
    np.testing.assert_allclose(got[1], nll, rtol=1e-6)
    np.testing.assert_array_equal(got[3], jnp.sum((jnp.argmax(logits, -1) == targets) * weights))


def test_chunked_never_forms_the_whole_logits():
    """The point of chunking: the compiled gradient's temporaries shrink (a large vocab, few chunks)."""
    m = _model()
    inputs, targets, weights = _batch(B=4, T=64)
    graphdef, params = nnx.split(m, nnx.Param)
    big = jnp.zeros((1, 16384 - 300), jnp.float32)  # a wide head: logits dominate memory

    def temp(chunk):
        def f(params):
            mm = nnx.merge(graphdef, params)
            logits = lambda h: jnp.concatenate([mm.logits(h), jnp.broadcast_to(big, h.shape[:-1] + big.shape[1:])], -1)
            return objective(mm.forward(inputs)[0], logits, targets, weights, 0.0, chunk)[0]

        return jax.jit(jax.grad(f)).lower(params).compile().memory_analysis().temp_size_in_bytes

    whole = 4 * 64 * 16384 * 4
    assert temp(0) >= whole
    assert temp(32) < whole / 2


def test_auto_chunks_only_large_vocabularies():
    small = Config(model=ModelConfig(vocab_size=259), data=DataConfig(seq_len=32))
    large = Config(model=ModelConfig(vocab_size=50257), data=DataConfig(seq_len=32))
    assert small.loss_chunk == 0
    assert large.loss_chunk > 0
    off = dataclasses.replace(large, train=TrainConfig(loss_chunk=0))
    assert off.loss_chunk == 0


def test_the_memory_bound_counts_one_chunk_of_logits():
    """The refusal before anything is built (limits.training_bytes) must stay a lower bound."""
    from transformer.limits import training_bytes

    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    cfg = Config(model=ModelConfig(vocab_size=50257), data=DataConfig(seq_len=8192), train=TrainConfig(batch_size=2))
    plain = dataclasses.replace(cfg, train=TrainConfig(batch_size=2, loss_chunk=0))
    assert cfg.loss_chunk == 4096
    assert 4 * training_bytes(cfg, sizes)["logits"][1] == training_bytes(plain, sizes)["logits"][1]
