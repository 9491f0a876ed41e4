"""QK-clip (model/qk_clip.py, `model.qk_clip`): the per-head largest logit against numpy, the clip
bringing exactly the heads above the threshold down to it and leaving the others' logits as they
were, for every attention layout; the train step applying it after the update; the refusals. Also
the step's other per-layer statistics against their direct computation (its resume bit for bit is
tests/test_checkpoint.py's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build, tiny
from flax import nnx

from transformer import sharding
from transformer.config import ConfigError
from transformer.config_loader import load_config
from transformer.model import clip_qk, layer_slots
from transformer.model.attention import Keys, attention_mask, head_logit_max
from transformer.model.qk_clip import clip_factors
from transformer.train import Trainer
from transformer.train.trainer import default_controls

LAYOUTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "bias_alibi": dict(n_kv_heads=2, qkv_bias=True, position="alibi"),
    "mla": dict(attention="mla", n_kv_heads=None, position="rope"),
    "mla_q_lora": dict(attention="mla", n_kv_heads=None, position="rope", q_lora_rank=24),
    "moe_pattern": dict(
        n_kv_heads=2, n_layers=4, n_experts=2, moe_every=2, window=5, attention_pattern=("local", "global")
    ),
}


def _numpy_head_max(q, k, mask, scale):
    """[K*G]: max over batch and allowed (t, s) of scale * q_t . k_s, written out in float64."""
    scores = np.einsum("btkgh,bskh->bkgts", q.astype(np.float64), k.astype(np.float64)) * scale
    scores = np.where(mask[:, None, None], scores, -np.inf)
    return scores.max(axis=(0, 3, 4)).reshape(-1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [4, 256], ids=["chunked", "whole"])
def test_head_logit_max_equals_numpy(window, causal, block):
    cfg = tiny(n_kv_heads=2)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 16, 2, 2, 8)).astype(np.float32)  # B T K G H
    k = rng.standard_normal((2, 16, 2, 8)).astype(np.float32)
    keys = Keys(jnp.asarray(k), jnp.asarray(k), jnp.zeros((2, 16), jnp.int32), None, True)
    mask = np.asarray(attention_mask(jnp.arange(16), jnp.arange(16), window, causal=causal))
    got = head_logit_max(jnp.asarray(q), keys, window, causal, cfg, block=block)
    np.testing.assert_allclose(
        np.asarray(got), _numpy_head_max(q, k, np.broadcast_to(mask, (2, 16, 16)), cfg.scale), rtol=1e-5
    )
    # an explicit mask (documents): pairs across a document boundary never count
    segments = jnp.asarray(np.repeat([[1] * 6 + [2] * 10], 2, axis=0))
    doc_mask = attention_mask(jnp.arange(16), jnp.arange(16), window, segments, segments, causal)
    got = head_logit_max(
        jnp.asarray(q), keys._replace(mask_BxTxS=doc_mask, static=False), window, causal, cfg, block=block
    )
    np.testing.assert_allclose(np.asarray(got), _numpy_head_max(q, k, np.asarray(doc_mask), cfg.scale), rtol=1e-5)


def test_clip_factors():
    got = clip_factors(jnp.asarray([50.0, 100.0, 400.0, jnp.inf, jnp.nan]), 100.0)
    np.testing.assert_array_equal(np.asarray(got), [1.0, 1.0, 0.25, 1.0, 1.0])


def _attn_head_max(model, i: int, h_BxTxD) -> np.ndarray:
    """Layer i's heads' largest logits [N] on the attention input h (after the block's input norm)."""
    attn, window = model.layer_block(i).attn, model.cfg.layer_windows[i]
    positions = jnp.broadcast_to(jnp.arange(h_BxTxD.shape[1]), h_BxTxD.shape[:2])
    q, entries = attn.project(h_BxTxD, positions)
    keys, _ = attn.keys_and_mask(entries, positions, None, window, None, 0)
    return np.asarray(head_logit_max(q, keys, window, attn.causal, model.cfg))


def _inputs_by_layer(model, tokens) -> list:
    """Each layer's attention input, the blocks run one by one in layer order."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x, inputs = model.embed_tokens(tokens, positions), []
    for i, window in enumerate(model.cfg.layer_windows):
        block = model.layer_block(i)
        inputs.append(block.sublayer_input(x, block.attn_norm))
        x = block(x, positions, None, window)[0]
    return inputs


def _perturbed(params: dict) -> dict:
    """Nonzero biases and norm gains, so that the clip must scale the projections whole."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_reports_each_layers_heads_in_layer_order(layout):
    """The forward pass's `head_logit_max` [L, N] is each layer's own, in layer order, whichever
    way the layers ran (one stack scanned, dense and MoE stacks interleaved in groups)."""
    cfg = tiny(qk_clip=1.0, **LAYOUTS[layout])
    model = build(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    expected = [_attn_head_max(model, i, h) for i, h in enumerate(_inputs_by_layer(model, tokens))]
    np.testing.assert_allclose(np.asarray(model.forward(tokens)[1]["head_logit_max"]), expected, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clip_brings_exactly_the_heads_above_the_threshold_down_to_it(layout):
    """On the same attention inputs, each head's largest logit after the clip is min(before,
    threshold): the heads above it are brought to it (every logit scaled by the head's own gamma),
    the others untouched, also in a group whose key another head's clip rescaled (GQA, MQA).
    Values and output projections stay as they were."""
    overrides = LAYOUTS[layout]
    model = build(tiny(qk_clip=1.0, **overrides))
    graphdef, state = nnx.split(model)
    params = _perturbed(nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    h = jax.random.normal(jax.random.key(2), (2, 16, model.cfg.d_model))
    before = np.stack([_attn_head_max(model, i, h) for i in range(model.cfg.n_layers)])
    threshold = float(np.median(before))
    cfg = tiny(qk_clip=threshold, **overrides)
    clipped, count = clip_qk(cfg, params, jnp.asarray(before))
    nnx.replace_by_pure_dict(state, clipped)
    model = nnx.merge(graphdef, state)
    after = np.stack([_attn_head_max(model, i, h) for i in range(cfg.n_layers)])
    np.testing.assert_allclose(after, np.minimum(before, threshold), rtol=2e-5)
    assert int(count) == int(np.sum(before > threshold)) > 0
    for stack in ("blocks", "moe_blocks"):
        for name in ("out", "wv_up", "wk_rope", "wkv_down", "wq_down"):
            if stack in params and name in params[stack]["attn"]:
                np.testing.assert_array_equal(clipped[stack]["attn"][name], params[stack]["attn"][name])
    if "qkv" in params["blocks"]["attn"]:  # the value slice of the fused weight
        v = cfg.n_kv_groups + 1
        np.testing.assert_array_equal(
            clipped["blocks"]["attn"]["qkv"][..., v, :], params["blocks"]["attn"]["qkv"][..., v, :]
        )
    assert jax.tree.map(lambda a: a.dtype, clipped) == jax.tree.map(lambda a: a.dtype, params)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(qk_clip=0.0), "must be > 0"),
        (dict(qk_clip=10.0, qk_norm=True), "qk_norm normalises away"),
        (dict(qk_clip=10.0, arch="encoder_decoder"), "encoder-decoder"),
    ],
)
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        tiny(**overrides)
    assert "qk_clip" in str(e.value) and message in str(e.value)


def _trainer(*overrides: str) -> Trainer:
    run = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_multiple=16"]
    run += ["model.vocab_multiple=16", "data.seq_len=16", "train.batch_size=4", "optim.lr=0.03", *overrides]
    cfg = load_config(None, run).with_vocab(61)
    return Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))


def _batch(trainer: Trainer) -> dict:
    tokens = np.random.default_rng(0).integers(0, 61, (4, 17)).astype(np.int32)
    return trainer.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, 4)


def test_the_step_clips_after_the_update_from_its_own_forward_pass():
    """A train step under QK-clip is the plain step's update followed by `clip_qk` with the heads'
    largest logits of the step's forward pass (over all micro-batches); a threshold no head reaches
    leaves the step bit for bit the plain one. It logs the step's largest logit and the clipped heads."""
    plain, measuring = _trainer("train.grad_accum=2"), _trainer("model.qk_clip=1e9")
    batch = _batch(plain)
    head_max = np.stack(
        [  # the two micro-batches (rows r % 2) measured apart, then their maximum
            np.asarray(measuring.gradients(plain.initial_state(), {k: v[i::2] for k, v in batch.items()})[4])
            for i in range(2)
        ]
    ).max(axis=0)
    unclipped, _ = plain.train_step(plain.initial_state(), batch, default_controls())  # donates its state
    threshold = float(np.median(head_max))
    for qk_clip, expected in ((1e9, unclipped.params), (threshold, None)):
        trainer = _trainer("train.grad_accum=2", f"model.qk_clip={qk_clip}")
        stepped, metrics = trainer.train_step(trainer.initial_state(), batch, default_controls())
        if expected is None:
            expected, count = clip_qk(trainer.cfg.model, unclipped.params, jnp.asarray(head_max))
            assert metrics["qk_clipped_heads"] == int(count) == int(np.sum(head_max > threshold)) > 0
        assert metrics["qk_max_logit"] == pytest.approx(float(head_max.max()), rel=1e-6)
        jax.tree.map(np.testing.assert_array_equal, stepped.params, expected)


def test_the_steps_per_layer_statistics_are_their_direct_computations():
    """`update_ratio` [L] is each layer's update norm over its parameter norm before the step, and
    `grad_norm_attn` / `grad_norm_ffn` each layer's gradient norms, computed here from the step's
    own parameters and gradients (in layer order across the dense and MoE stacks)."""
    trainer = _trainer("model.n_layers=4", "model.n_experts=2", "model.moe_every=2", "monitor.stats_every=1")
    batch = _batch(trainer)
    grads = jax.device_get(trainer.gradients(trainer.initial_state(), batch)[0])
    before = jax.device_get(trainer.initial_state().params)
    after, metrics = trainer.train_step(trainer.initial_state(), batch, default_controls())
    after = jax.device_get(after.params)

    def norm(tree, j):
        return np.sqrt(sum(np.sum(np.square(np.asarray(x[j], np.float64))) for x in jax.tree.leaves(tree)))

    for i, (stack, j) in enumerate(layer_slots(trainer.cfg.model)):
        update = jax.tree.map(lambda a, b: a - b, after[stack], before[stack])
        assert float(metrics["update_ratio"][i]) == pytest.approx(norm(update, j) / norm(before[stack], j), rel=1e-4)
        for part in ("attn", "ffn"):
            assert float(metrics[f"grad_norm_{part}"][i]) == pytest.approx(norm(grads[stack][part], j), rel=1e-5)
