"""Per-layer stability statistics: right on hand-checkable cases, and written by a training run."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build, tiny

from transformer.model.attention import attention_mask, attention_stats


def test_uniform_attention_has_entropy_log_of_the_keys_seen():
    T = 6
    logits = jnp.zeros((1, 1, 1, T, T))  # every allowed key equally likely
    mask = attention_mask(jnp.arange(T), jnp.arange(T), None)
    stats = attention_stats(logits, mask)
    assert float(stats["attn_entropy"]) == pytest.approx(np.mean([math.log(t + 1) for t in range(T)]), rel=1e-6)
    assert float(stats["attn_logit_max"]) == 0.0 and float(stats["attn_logit_mean"]) == 0.0
    windowed = attention_stats(logits, attention_mask(jnp.arange(T), jnp.arange(T), 2))
    assert float(windowed["attn_entropy"]) == pytest.approx((0 + 5 * math.log(2)) / T, rel=1e-6)


def test_logit_max_and_mean_ignore_masked_entries():
    logits = jnp.asarray([[[[[1.0, 100.0], [3.0, 5.0]]]]])  # 100 sits above the diagonal: masked
    stats = attention_stats(logits, attention_mask(jnp.arange(2), jnp.arange(2), None))
    assert float(stats["attn_logit_max"]) == 5.0
    assert float(stats["attn_logit_mean"]) == pytest.approx((1 + 3 + 5) / 3)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_model_statistics_on_a_known_case(scan_layers):
    """Zero query/key weights make attention uniform; zero output projections make every pre-LN
    block the identity, so the residual RMS after each block is the embedding's RMS."""
    cfg = tiny(position="none", scan_layers=scan_layers, n_kv_heads=2, attention_impl="xla")
    model = build(cfg)
    G = cfg.n_kv_groups
    model.blocks.attn.qkv[...] = model.blocks.attn.qkv[...].at[:, :, :, : G + 1].set(0.0)
    model.blocks.attn.out[...] = jnp.zeros_like(model.blocks.attn.out[...])
    model.blocks.ffn.w_out[...] = jnp.zeros_like(model.blocks.ffn.w_out[...])
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    stats = model.stability_stats(tokens)
    L = cfg.n_layers
    assert {k: np.shape(v) for k, v in stats.items() if k != "log_z_mean"} == {
        "attn_logit_max": (L,),
        "attn_logit_mean": (L,),
        "attn_logit_rms": (L,),
        "attn_entropy": (L,),
        "attn_out_rms": (L,),
        "ffn_out_rms": (L,),
        "residual_rms": (L,),
    }
    np.testing.assert_allclose(stats["attn_entropy"], np.mean([math.log(t + 1) for t in range(8)]), rtol=1e-5)
    np.testing.assert_allclose(stats["attn_logit_max"], 0.0, atol=1e-7)
    for name in ("attn_logit_rms", "attn_out_rms", "ffn_out_rms"):  # zero logits, nothing written
        np.testing.assert_allclose(stats[name], 0.0, atol=1e-7)
    embedded = model.embed_tokens(tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)))
    np.testing.assert_allclose(stats["residual_rms"], float(jnp.sqrt(jnp.mean(embedded**2))), rtol=1e-5)
    logits = model(tokens)
    assert float(stats["log_z_mean"]) == pytest.approx(float(jnp.mean(jax.nn.logsumexp(logits, -1))), rel=1e-5)


@pytest.mark.slow
def test_training_writes_per_layer_statistics(tmp_path):
    from transformer.config_loader import load_config
    from transformer.train.job import run

    corpus = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(list("abcdefgh"), 200))}) + "\n" for _ in range(200))
    )
    cfg = load_config(
        None,
        [
            f"data.source=files:{corpus}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.seq_len=32",
            "data.val_windows=4",
            "model.d_model=32",
            "model.n_layers=3",
            "model.n_heads=4",
            "train.batch_size=8",
            "train.steps=10",
            "train.eval_every=10",
            "monitor.stats_every=5",
            "logging.progress=false",
        ],
    )
    run(cfg, tmp_path / "run", log=lambda _: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stats = [r for r in records if "attn_entropy" in r]
    assert [r["step"] for r in stats] == [5, 10]
    for r in stats:
        for key in (
            "attn_logit_max",
            "attn_logit_mean",
            "attn_entropy",
            "residual_rms",
            "grad_norm_attn",
            "grad_norm_ffn",
            "update_ratio",
        ):
            assert len(r[key]) == 3 and all(math.isfinite(x) for x in r[key]), key
        assert 0 < max(r["attn_entropy"]) <= math.log(32)
        assert math.isfinite(r["log_z_mean"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(tmp_path / "run" / "tb")).Reload().Tags()["scalars"]
    assert {"attn_entropy/layer_0", "attn_entropy/layer_2", "residual_rms/layer_1", "log_z_mean"} <= set(tags)


def test_throughput_overall_is_the_whole_training_time_not_the_last_reading(monkeypatch):
    """A reading over one step can be near zero (a CPU step that ran inside its dispatch puts its
    time on the reading before); the run's figure is all training steps over all training time,
    with what `restart` leaves out (evaluation, saving) not counted."""
    from transformer.train import metrics

    clock = iter([0.0, 10.0, 10.001, 50.0, 60.0])  # start; step 10; step 11 at once; restart; step 20
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    meter = metrics.Throughput(tokens_per_step=100, flops_per_step=1e9, devices=2, peak=1e9)
    meter.measure(10)
    meter.measure(11)
    assert meter.tokens_per_s == pytest.approx(100 / 0.001)  # the last reading alone: absurd
    meter.restart(11)  # 40 s of evaluation
    meter.measure(20)
    tokens_per_s, mfu = meter.overall()
    assert tokens_per_s == pytest.approx(100 * 20 / 20.001)
    assert mfu == pytest.approx(1e9 * 20 / 20.001 / 2 / 1e9)


def test_collapsed_attention_has_entropy_zero_not_nan():
    """Attention-logit growth ends in one-hot attention: every other key's probability underflows to
    exactly 0, and 0 * log 0 must count as 0 (the Wortsman study's runs at high learning rates logged
    nan here, hiding the collapse it measures)."""
    T = 4
    logits = jnp.where(jnp.eye(T, dtype=bool), 1e4, 0.0)[None, None, None]  # each query on itself, by far
    stats = attention_stats(logits, attention_mask(jnp.arange(T), jnp.arange(T), None))
    assert float(stats["attn_entropy"]) == 0.0
    half = jnp.where(jnp.arange(T)[None, :] <= 1, 1e4, 0.0) * jnp.ones((T, 1))  # keys 0 and 1 tie, far above
    stats = attention_stats(half[None, None, None], attention_mask(jnp.arange(T), jnp.arange(T), None))
    assert float(stats["attn_entropy"]) == pytest.approx((0 + 3 * math.log(2)) / T, rel=1e-6)
