"""Mixture of experts: equal to the dense FFN with one expert, to a plain per-token loop without
drops, the balancing loss's closed forms, capacity drops, router gradients, exact resume, and
parameter counts against the real tree. Identical losses on meshes with an expert axis are part of
test_trainer.py's mesh test (its model interleaves a dense and a MoE layer)."""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, assert_bitwise_equal, build, final_params, logged, tiny, tiny_run_overrides, write_corpus
from flax import nnx

from transformer.config import ConfigError, MonitorConfig
from transformer.config_loader import load_config
from transformer.model.layers import ACTIVATIONS, FFN
from transformer.model.moe import MoE, capacity, capacity_slots
from transformer.model.summary import abstract_model, active_params, count_params, expert_params
from transformer.train.job import run
from transformer.train.monitor import Monitor

T = 16


def moe_cfg(**kw):
    return tiny(**{"n_experts": 4, "top_k": 2, **kw})


def run_moe(moe: MoE, x_BxTxD: jax.Array) -> tuple[jax.Array, dict]:
    """The layer's output and what it sowed, by name."""
    y, sown = nnx.capture(lambda m: m(x_BxTxD), nnx.Intermediate)(moe)
    return y, {str(path[-1]): v.get_value()[0] for path, v in nnx.to_flat_state(sown)}


def random_x(cfg, seed=0, B=2):
    return jax.random.normal(jax.random.key(seed), (B, T, cfg.d_model))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("ffn", ["swiglu", "gelu"])
def test_one_expert_top1_is_the_dense_ffn(capacity_factor, ffn):
    """One expert, top-1: every token goes to it with gate softmax = 1 and capacity T holds all."""
    cfg = tiny(n_experts=1, top_k=1, ffn=ffn, capacity_factor=capacity_factor)
    moe, dense = MoE(cfg, rngs=nnx.Rngs(0)), FFN(cfg, rngs=nnx.Rngs(1))
    moe.w_in[...] = dense.w_in[...][None]
    moe.w_out[...] = dense.w_out[...][None]
    x = random_x(cfg)
    y, sown = run_moe(moe, x)
    np.testing.assert_allclose(y, dense(x), rtol=1e-5, atol=1e-6)
    assert float(sown["layer_dropped_fraction"]) == 0.0


def choice_scores(moe: MoE, scores: np.ndarray) -> np.ndarray:
    """DeepSeek's choosing, written plainly for one token: the scores plus the choice bias; every
    expert outside the token's best groups (by their best, or their two best summed) at -inf."""
    cfg = moe.cfg
    choice = scores + (0.0 if moe.router_bias is None else np.asarray(moe.router_bias[...], np.float64))
    groups = choice.reshape(cfg.router_groups, -1)
    top = 1 if cfg.router_group_score == "max" else 2
    group_scores = np.sort(groups, axis=-1)[:, ::-1][:, :top].sum(-1)
    best = np.argsort(-group_scores)[: cfg.router_topk_groups]
    return np.where(np.isin(np.arange(cfg.router_groups), best)[:, None], groups, -np.inf).reshape(-1)


def loop_reference(moe: MoE, x_BxTxD) -> np.ndarray:
    """The mixture written plainly: for each token, score the experts, take the top k, weigh each
    chosen expert's FFN output by its gate (renormalised over the k when k > 1 unless the config
    says not), plus the shared experts' output (times sigmoid(x . w) where gated)."""
    cfg = moe.cfg
    router = np.asarray(moe.router[...], np.float64)
    w_in, w_out = np.asarray(moe.w_in[...], np.float64), np.asarray(moe.w_out[...], np.float64)
    act = ACTIVATIONS[cfg.ffn]
    x = np.asarray(x_BxTxD, np.float64)
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            logits = x[b, t] @ router
            if cfg.router == "softmax":
                scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            else:
                scores = 1 / (1 + np.exp(-logits))
            chosen = np.argsort(-choice_scores(moe, scores))[: cfg.top_k]
            gates = scores[chosen] / (scores[chosen].sum() if cfg.top_k > 1 and cfg.renormalize_gates else 1.0)
            gates = gates * cfg.routed_scale
            for e, g in zip(chosen, gates):
                if cfg.gated_ffn:
                    h = np.asarray(act(x[b, t] @ w_in[e, :, 0])) * (x[b, t] @ w_in[e, :, 1])
                else:
                    h = np.asarray(act(x[b, t] @ w_in[e]))
                out[b, t] += g * (h @ w_out[e])
    if moe.shared is not None:
        gate = 1.0
        if moe.shared_gate is not None:
            gate = 1 / (1 + np.exp(-(x @ np.asarray(moe.shared_gate[...], np.float64))))[..., None]
        out += gate * np.asarray(moe.shared(x_BxTxD), np.float64)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=1, capacity_factor=None),
        dict(top_k=2, capacity_factor=None, router="sigmoid"),
        dict(top_k=2, capacity_factor=100.0, ffn="gelu"),
        dict(top_k=3, capacity_factor=100.0, router="sigmoid", n_shared_experts=1),
        # Qwen-MoE: the top-k scores as they are, and a gated shared expert
        dict(top_k=2, capacity_factor=None, renormalize_gates=False, n_shared_experts=2, shared_expert_gate=True),
        # DeepSeek-V2: group-limited (each group by its best), scaled gates; V3: sigmoid, a bias for choosing,
        # groups by their two best
        dict(n_experts=8, top_k=3, capacity_factor=None, router_groups=4, router_topk_groups=2, routed_scale=2.5),
        dict(
            n_experts=8,
            top_k=2,
            capacity_factor=None,
            router="sigmoid",
            router_bias=True,
            router_groups=2,
            router_topk_groups=1,
            router_group_score="top2",
            n_shared_experts=1,
        ),
    ],
    ids=[
        "top1-dropless",
        "top2-sigmoid-dropless",
        "top2-capacity-inf-gelu",
        "top3-sigmoid-capacity-inf-shared",
        "top2-unnormalised-gated-shared",
        "top3-grouped-scaled",
        "top2-sigmoid-biased-grouped-by-two",
    ],
)
def test_without_drops_the_output_is_the_per_token_loop(kw):
    cfg = moe_cfg(**kw)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router[...] = moe.router[...] * 50  # distinct scores, so ties cannot reorder the choice
    if moe.router_bias is not None:  # a bias that moves the choice (sigmoid scores are in (0, 1))
        moe.router_bias[...] = jax.random.uniform(jax.random.key(3), moe.router_bias.shape, minval=-0.5, maxval=0.5)
    if moe.shared_gate is not None:  # gates well away from 1/2 and from each other
        moe.shared_gate[...] = moe.shared_gate[...] * 50
    x = random_x(cfg)
    y, sown = run_moe(moe, x)
    np.testing.assert_allclose(np.asarray(y), loop_reference(moe, x), rtol=1e-4, atol=1e-6)
    assert float(sown["layer_dropped_fraction"]) == 0.0


def test_the_choice_bias_chooses_but_never_gates_and_nothing_moves_it():
    """DeepSeek-V3's bias: a large one on expert 2 sends every token there, gated by its unbiased
    sigmoid score; no gradient reaches the bias, and weight decay is masked off it (so no optimiser,
    whose update from a zero gradient is zero, moves it)."""
    from transformer.train.optim import decay_mask

    cfg = moe_cfg(top_k=1, router="sigmoid", router_bias=True, capacity_factor=None, n_layers=1)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router_bias[...] = jnp.asarray([0.0, 0.0, 10.0, 0.0])
    x = random_x(cfg)
    y, sown = run_moe(moe, x)
    assert float(sown["expert_load_2"]) == 1.0
    np.testing.assert_allclose(np.asarray(y), loop_reference(moe, x), rtol=1e-4, atol=1e-6)
    graphdef, params = nnx.split(moe, nnx.Param)
    grads = jax.grad(lambda p: jnp.sum(run_moe(nnx.merge(graphdef, p), x)[0] ** 2))(params)
    assert not np.any(np.asarray(grads["router_bias"][...])) and np.any(np.asarray(grads["router"][...]))
    mask = decay_mask(nnx.to_pure_dict(params), decay_embeddings=False)
    assert mask["router_bias"] is False and mask["router"] is True


def test_dense_layers_first_then_moe_scanned_equal_unrolled():
    """model.moe_first_dense: layer 0 dense, 1 and 2 MoE, each run a scan of its own stack."""
    kw = dict(moe_first_dense=1, n_layers=3, window=3, attention_pattern=("local", "global"), capacity_factor=None)
    model, unrolled = build(moe_cfg(**kw)), build(moe_cfg(**kw, scan_layers=False))
    assert model.cfg.moe_layers == (False, True, True)
    tokens = jnp.arange(2 * T).reshape(2, T) % model.cfg.vocab_size
    (a, ra), (b, rb) = model.forward(tokens), unrolled.forward(tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert ra.keys() == rb.keys() and ra
    sa, sb = model.stability_stats(tokens), unrolled.stability_stats(tokens)
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert sa["residual_rms"].shape == (3,) and sa["router_entropy"].shape == (2,)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_balancing_loss_closed_forms(router):
    """Uniform probabilities: E * sum_e f_e / E = 1 whatever the choices, and z-loss = log(E)^2
    (softmax); every token sure of expert 0: f_0 = P_0 = 1, loss E."""
    cfg = moe_cfg(router=router, top_k=1)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router[...] = jnp.zeros_like(moe.router[...])
    _, sown = run_moe(moe, random_x(cfg))
    assert float(sown["layer_moe_aux_loss"]) == pytest.approx(1.0, rel=1e-6)
    E = cfg.n_experts
    zero_logit_lse = math.log(E)  # logsumexp of E zeros
    assert float(sown["layer_router_z_loss"]) == pytest.approx(zero_logit_lse**2, rel=1e-6)
    if router == "softmax":
        moe.router[...] = jnp.zeros_like(moe.router[...]).at[:, 0].set(100.0)
        x = jnp.abs(random_x(cfg)) + 0.1  # positive features: expert 0's logit dominates
        _, sown = run_moe(moe, x)
        assert float(sown["layer_moe_aux_loss"]) == pytest.approx(E, rel=1e-4)
        assert float(sown["layer_expert_load_max"]) == 1.0


def test_tokens_over_capacity_are_dropped_and_counted():
    """All tokens choose expert 0; a row's capacity is C = ceil(1.0 * T * 1 / 4) = 4: the first four
    tokens of each row get the expert's output, the other twelve get zero (the residual passes)."""
    cfg = moe_cfg(top_k=1, capacity_factor=1.0)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router[...] = jnp.zeros_like(moe.router[...]).at[:, 0].set(100.0)
    x = jnp.abs(random_x(cfg)) + 0.1
    y, sown = run_moe(moe, x)
    C = 4
    expected = loop_reference(moe, x)
    np.testing.assert_allclose(np.asarray(y[:, :C]), expected[:, :C], rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(y[:, C:]) == 0.0)
    assert float(sown["layer_dropped_fraction"]) == pytest.approx((T - C) / T)
    assert float(sown["expert_load_0"]) == 1.0


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_k=2, router="sigmoid", capacity_factor=None)])
def test_router_gets_gradients_from_the_output(kw):
    cfg = moe_cfg(**kw)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = random_x(cfg)
    target = random_x(cfg, seed=1)
    graphdef, params = nnx.split(moe, nnx.Param)

    def loss(p):
        return jnp.sum(run_moe(nnx.merge(graphdef, p), x)[0] * target)  # the output alone: no balancing loss

    grads = jax.grad(loss)(params)
    assert float(jnp.linalg.norm(grads["router"][...])) > 1e-4


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(moe_every=2, n_layers=4, n_shared_experts=1, moe_d_ff=24),
        dict(n_shared_experts=2, shared_expert_gate=True),
        dict(ffn="gelu", top_k=1, n_experts=3, moe_every=3, n_layers=3),
        dict(n_layers=3, moe_first_dense=2, router_bias=True, router="sigmoid"),
    ],
)
def test_total_and_active_parameters_match_the_tree(kw):
    cfg = moe_cfg(**kw)
    leaves = nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param))
    total = sum(math.prod(v.get_value().shape) for _, v in leaves)
    routed = sum(
        math.prod(v.get_value().shape)
        for path, v in leaves
        if str(path[-1]) in ("w_in", "w_out") and "moe_blocks" in path and "shared" not in path
    )
    assert count_params(cfg) == total
    assert routed == sum(cfg.moe_layers) * cfg.n_experts * expert_params(cfg)
    assert active_params(cfg) == total - routed * (cfg.n_experts - cfg.top_k) // cfg.n_experts


def test_mixed_layers_scanned_equal_unrolled():
    """Dense and MoE layers interleaved (layers 1 and 3 MoE), with a per-layer window pattern."""
    kw = dict(moe_every=2, n_layers=4, window=3, attention_pattern=("local", "global"))
    model, unrolled = build(moe_cfg(**kw)), build(moe_cfg(**kw, scan_layers=False))
    cfg = model.cfg
    tokens = jnp.arange(2 * T).reshape(2, T) % cfg.vocab_size
    a, ra = model.forward(tokens)
    b, rb = unrolled.forward(tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert ra.keys() == rb.keys() and ra
    sa, sb = model.stability_stats(tokens), unrolled.stability_stats(tokens)
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)
    positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    _, training = model.run_blocks(model.embed_tokens(tokens, positions), positions)
    assert "layer_moe_aux_loss" in training and "attn_entropy" not in training  # no statistics pass per step
    assert sa["residual_rms"].shape == (4,) and sa["router_entropy"].shape == sa["layer_moe_aux_loss"].shape == (2,)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.top_k=5", "model.top_k"),
        ("model.moe_every=0", "model.moe_every"),
        ("model.moe_every=3", "model.moe_every"),  # 2 layers
        ("model.capacity_factor=0", "model.capacity_factor"),
        ("mesh.expert=3", "mesh.expert"),
        ("model.shared_expert_gate=true", "model.shared_expert_gate"),  # no shared experts to gate
        ("model.router_groups=3", "model.router_groups"),  # 4 experts
        ("model.router_topk_groups=2", "model.router_topk_groups"),  # of 1 group
        ("model.router_groups=4", "model.top_k"),  # 2 experts from 1 group of 1
        ("model.router_groups=4 model.router_topk_groups=2 model.router_group_score=top2", "model.router_group_score"),
        ("model.moe_first_dense=2", "model.moe_first_dense"),  # of 2 layers
        ("model.moe_first_dense=1 model.moe_every=2", "model.moe_first_dense"),
        ("model.routed_scale=0", "model.routed_scale"),
    ],
)
def test_impossible_moe_sizes_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.n_layers=2", "model.n_experts=4", "model.top_k=2", *override.split()])
    assert e.value.key == key


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("mesh.expert=2", "mesh.expert"),
        ("model.moe_d_ff=64", "model.moe_d_ff"),
        ("model.renormalize_gates=false", "model.renormalize_gates"),
        ("model.router_bias=true", "model.router_bias"),
        ("model.router_groups=2", "model.router_groups"),
        ("model.moe_first_dense=1", "model.moe_first_dense"),
        ("model.routed_scale=2.5", "model.routed_scale"),
    ],
)
def test_expert_settings_without_experts_are_refused(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.key == key


# --- training --------------------------------------------------------------------------------------

MOE_RUN = ("model.n_experts=4", "model.top_k=2", "model.moe_d_ff=32", "monitor.stats_every=5")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("moe-corpus") / "docs.jsonl", seed=3)


def moe_run(corpus, workdir, *extra):
    overrides = tiny_run_overrides(
        corpus,
        workdir.parent / "cache",
        "checkpoint.every=5",
        "train.eval_every=10",
        "optim.warmup_steps=2",
        "optim.schedule=constant",  # the same learning rate at a step whatever train.steps is
        *MOE_RUN,
        *extra,
    )
    return run(load_config(None, overrides), workdir, log=lambda _: None)


@pytest.mark.slow
def test_moe_run_logs_routing_and_resumes_bitwise(corpus, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    moe_run(corpus, reference, "train.steps=10")
    moe_run(corpus, resumed, "train.steps=5")
    moe_run(corpus, resumed, "train.steps=10")
    assert logged(resumed, "loss") == logged(reference, "loss")
    assert_bitwise_equal(final_params(resumed), final_params(reference))
    for name in ("moe_aux_loss", "router_z_loss", "dropped_fraction", "expert_load_max"):
        assert sorted(logged(reference, name)) == list(range(1, 11)), name
    assert 0.9 < logged(reference, "moe_aux_loss")[10] < 2.0
    loads = [logged(reference, f"expert_load_{e}")[10] for e in range(4)]
    assert all(len(v) == 2 for v in loads)
    np.testing.assert_allclose(np.sum(loads, axis=0), 2.0, rtol=1e-5)  # top-2: loads sum to k
    assert len(logged(reference, "router_entropy")[10]) == 2
    assert len(logged(reference, "layer_dropped_fraction")[10]) == 2


def test_router_collapse_is_reported_when_it_happens_and_again_after_recovery():
    monitor = Monitor(MonitorConfig())
    loads = [0.5, 0.95, 0.97, 0.6, 0.92]
    assert [monitor.router_collapse(x, n_experts=4, top_k=1) for x in loads] == [False, True, False, False, True]
    restored = Monitor(MonitorConfig(), monitor.state())  # a resumed run does not report it again
    assert not restored.router_collapse(0.99, n_experts=4, top_k=1)
    assert not Monitor(MonitorConfig()).router_collapse(1.0, n_experts=2, top_k=2)  # every expert sees every token


@pytest.mark.slow
def test_cli_refuses_impossible_experts_in_one_line_with_exit_2():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "train.py", "model.n_experts=2", "model.top_k=3", "--dry-run"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.top_k" in lines[0]


def test_dropless_moe_decodes_from_the_cache_as_the_full_forward():
    """Dropless routing is per token, so prefill and one-token steps equal the full forward (with a
    capacity they need not: drops depend on the other tokens of the row)."""
    from test_generate import check_cached_equals_full

    check_cached_equals_full(moe_cfg(capacity_factor=None, moe_every=2, n_layers=4, n_shared_experts=1))


def _dropping_model():
    """A capacity-trained MoE (top-2 at capacity 1.0) whose router sends every token to experts 0
    and 1, so that each row drops most of its assignments."""
    cfg = moe_cfg(capacity_factor=1.0, moe_every=2, n_layers=2, max_seq_len=T)
    model = build(cfg)
    router = model.moe_blocks.ffn.router
    router[...] = jnp.zeros_like(router[...]).at[:, :, 0].set(3.0).at[:, :, 1].set(2.0)
    return cfg, model


def test_inference_computes_the_capacity_model_without_drops_and_decoding_equals_it():
    """Evaluation and generation compute ModelConfig.at_inference (no drops), whose cached decoding
    equals its full forward; the training function keeps its capacity and differs."""
    from test_generate import prefill_then_decode

    from transformer.model import for_inference

    cfg, model = _dropping_model()
    inference = for_inference(model)
    assert inference.cfg == dataclasses.replace(cfg, capacity_factor=None) and for_inference(inference) is inference
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
    dropless = nnx.merge(nnx.split(build(inference.cfg))[0], nnx.state(model))
    full = np.asarray(inference(tokens))
    assert_bitwise_equal(full, np.asarray(dropless(tokens)))
    assert np.abs(full - np.asarray(model(tokens))).max() > 1e-3  # the capacity model drops
    cached = prefill_then_decode(*nnx.split(inference), tokens, 5)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


def test_validation_scores_the_inference_model_and_the_monitor_judges_by_the_training_one():
    from transformer import sharding
    from transformer.train import Trainer

    cfg = load_config(None, ["model.n_experts=4", "model.top_k=2", "model.capacity_factor=1.0", "data.seq_len=16"])
    cfg = cfg.with_vocab(61)
    trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    params = trainer.init(jax.random.key(0)).params
    rows = np.random.default_rng(0).integers(0, 61, (2, 17)).astype(np.int32)
    batch = trainer.put_batch({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, 2)
    inference = nnx.merge(trainer.inference_graphdef, params)
    training = nnx.merge(trainer.graphdef, params)
    assert inference.cfg.capacity_factor is None and training.cfg.capacity_factor == 1.0

    def nll(m):
        logp = jax.nn.log_softmax(m(jnp.asarray(rows[:, :-1]))[..., :61].astype(jnp.float32))
        return -float(jnp.sum(jnp.take_along_axis(logp, jnp.asarray(rows[:, 1:])[..., None], -1)))

    validation, judged = float(trainer.eval_step(params, batch)[0]), float(trainer.judge_step(params, batch)[0])
    assert validation == pytest.approx(nll(inference), rel=1e-5) and judged == pytest.approx(nll(training), rel=1e-5)
    assert validation != judged


def test_aux_loss_free_balancing_moves_each_choice_bias_by_the_rate_toward_balance():
    """model.router_bias_rate: the step is the same step without it, then each MoE layer's choice
    bias moved by +-rate: up for an expert below the mean load top_k / E over the step's tokens (all
    micro-batches), down above it. With the rate 0 the bias never moves."""
    from transformer import sharding
    from transformer.model import balance_router_bias
    from transformer.train import Trainer
    from transformer.train.trainer import default_controls

    def trainer(rate: float) -> Trainer:
        run = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_experts=4", "model.top_k=2"]
        run += ["model.router=sigmoid", "model.router_bias=true", f"model.router_bias_rate={rate}"]
        run += ["model.capacity_factor=null", "data.seq_len=16", "train.batch_size=4", "train.grad_accum=2"]
        cfg = load_config(None, run).with_vocab(61)
        return Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))

    fixed, balancing = trainer(0.0), trainer(0.01)
    tokens = np.random.default_rng(0).integers(0, 61, (4, 17)).astype(np.int32)
    batch = fixed.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, 4)
    load_LxE = np.asarray(balancing.gradients(balancing.initial_state(), batch)[3]["expert_load"])
    np.testing.assert_allclose(load_LxE.sum(axis=1), 2.0, rtol=1e-6)  # top-2: each token counted twice
    plain, _ = fixed.train_step(fixed.initial_state(), batch, default_controls())
    before = np.asarray(balancing.initial_state().params["moe_blocks"]["ffn"]["router_bias"])
    assert not np.any(before) and not np.any(np.asarray(plain.params["moe_blocks"]["ffn"]["router_bias"]))
    stepped, metrics = balancing.train_step(balancing.initial_state(), batch, default_controls())
    assert "expert_load" not in metrics
    expected = balance_router_bias(balancing.cfg.model, jax.device_get(plain.params), jnp.asarray(load_LxE))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(stepped.params), expected)
    moved = np.asarray(stepped.params["moe_blocks"]["ffn"]["router_bias"])
    np.testing.assert_array_equal(moved, 0.01 * np.sign(0.5 - load_LxE).astype(np.float32))
    assert np.any(moved < 0) and np.any(moved > 0)


def test_the_balancing_rate_needs_the_choice_bias():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.n_experts=4", "model.router_bias_rate=0.001"])
    assert e.value.key == "model.router_bias_rate"


@pytest.mark.parametrize("loads", [(5, 0, 27, 0), (32, 0, 0, 0), (8, 8, 8, 8), (1, 2, 3, 26)])
def test_expert_blocks_equal_ragged_dot_whatever_the_loads(loads):
    """Dropless on a CPU: each row's assignments through their experts in blocks (sorted by expert,
    padded runs, at most (M + E (b - 1)) / b blocks, which the last loads fill) give ragged_dot's
    products and gradients, empty experts and a single busy one included."""
    from transformer.model.moe import expert_blocks

    E, D, C, K = 4, 8, 6, 2
    S = sum(loads) // K
    expert_SxK = jax.random.permutation(jax.random.key(3), jnp.repeat(jnp.arange(E), jnp.asarray(loads))).reshape(S, K)
    x_SxD = jax.random.normal(jax.random.key(0), (S, D))
    w_ExDxC = jax.random.normal(jax.random.key(1), (E, D, C))
    probe_SxKxC = jax.random.normal(jax.random.key(2), (S, K, C))

    def blocks(x, w):
        return expert_blocks(x, expert_SxK, E, lambda x, w: jnp.einsum("NbD,NDC->NbC", x, w[0]), (w,))

    def ragged(x, w):
        expert_M = expert_SxK.reshape(-1)
        order_M = jnp.argsort(expert_M, stable=True)
        y_MxC = jax.lax.ragged_dot(x[order_M // K], w, jnp.bincount(expert_M, length=E).astype(jnp.int32))
        return jnp.zeros_like(y_MxC).at[order_M].set(y_MxC).reshape(S, K, C)

    np.testing.assert_allclose(blocks(x_SxD, w_ExDxC), ragged(x_SxD, w_ExDxC), rtol=1e-6, atol=1e-6)

    def probed(x, w, f):
        return jnp.sum(f(x, w) * probe_SxKxC)

    grads = [jax.grad(probed, (0, 1))(x_SxD, w_ExDxC, f) for f in (blocks, ragged)]
    for ours, theirs in zip(*grads):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("E", [4, 64])
def test_ranks_in_expert_by_count_equal_the_stable_sort(E, monkeypatch):
    """Each assignment's block row comes from how many before it chose its expert: the count (few
    experts) and the sort (many) give its rank in a stable sort by expert, and the same loads."""
    from transformer.model import moe

    expert_M = jax.random.randint(jax.random.key(E), (1000,), 0, E).at[:300].set(E - 1)
    order_M = np.argsort(np.asarray(expert_M), kind="stable")
    expected_M = np.zeros(1000, np.int64)
    expected_M[order_M] = np.arange(1000) - np.searchsorted(
        np.asarray(expert_M)[order_M], np.asarray(expert_M)[order_M]
    )
    for counted in (E, E - 1):  # the count, then the sort
        monkeypatch.setattr(moe, "COUNTED_EXPERTS", counted)
        ahead_M, sizes_E = moe.ahead_in_expert(expert_M, E)
        np.testing.assert_array_equal(ahead_M, expected_M)
        np.testing.assert_array_equal(sizes_E, np.bincount(np.asarray(expert_M), minlength=E))


def every_expert_on_every_token(moe: MoE, x_BxTxD: jax.Array) -> jax.Array:
    """The routed mixture without dispatch, differentiable: every expert's FFN on every token,
    weighed by the token's gate for it (0 where not chosen, and where a capacity drops the choice)."""
    r = moe.route(x_BxTxD)
    B, T, D = x_BxTxD.shape
    E = moe.cfg.n_experts
    x_ExMxD = jnp.broadcast_to(x_BxTxD.reshape(1, B * T, D), (E, B * T, D))
    y_ExBxTxD = moe.experts(x_ExMxD).reshape(E, B, T, D)
    gate_BxTxK = r.gate_BxTxK
    if moe.cfg.capacity_factor is not None:
        X = capacity(moe.cfg, T)
        gate_BxTxK = jnp.where(capacity_slots(r.expert_BxTxK, E, X) < E * X, gate_BxTxK, 0.0)
    gate_BxTxE = jnp.einsum("BTKE,BTK->BTE", jax.nn.one_hot(r.expert_BxTxK, E), gate_BxTxK)
    return jnp.einsum("EBTD,BTE->BTD", y_ExBxTxD, gate_BxTxE)


@pytest.mark.parametrize("capacity_factor,backend", [(None, "cpu"), (None, "gpu"), (100.0, "cpu"), (0.5, "cpu")])
def test_dispatch_gradients_equal_every_expert_on_every_token(capacity_factor, backend, monkeypatch):
    """The layer's gradients (input, router, experts' weights) through its dispatch equal those of
    the mixture computed without one: dropless (rows sorted, in blocks on a CPU, by ragged_dot on
    the other backends, which this test runs on the CPU) and capacity (slot gathers; a factor that
    drops nothing, X = T, and one that drops, whose dropped choices weigh nothing)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    cfg = moe_cfg(top_k=2, capacity_factor=capacity_factor)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(moe, nnx.Param)
    x = jax.random.normal(jax.random.key(3), (2, 7, cfg.d_model))
    probe = jax.random.normal(jax.random.key(4), x.shape)
    if capacity_factor == 0.5:  # X = 2 slots an expert, for 14 choices among 4 experts: some drop
        assert float(run_moe(moe, x)[1]["layer_dropped_fraction"]) > 0.0

    def loss(p, x, fn):
        return jnp.sum(fn(nnx.merge(graphdef, p), x) * probe)

    ours = jax.grad(loss, (0, 1))(params, x, lambda m, x: run_moe(m, x)[0])
    theirs = jax.grad(loss, (0, 1))(params, x, every_expert_on_every_token)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_dropless_within_row_groups_equals_one_group(backend, monkeypatch):
    """Dropless dispatch within each device's rows (`row_groups`, as a mesh's placer gives them)
    computes what it does over the whole batch: in the CPU's blocks, and by ragged_dot (the other
    backends'; vmapped over the groups with the weights tiled), which this test runs on the CPU."""
    from transformer.model.layers import Placer, placing

    cfg = moe_cfg(capacity_factor=None)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = random_x(cfg, B=4)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    whole, _ = run_moe(moe, x)
    with placing(Placer(pin=lambda x, axes: x, row_groups=2, each_device=lambda f, args, axes, out: f(*args))):
        grouped, _ = run_moe(moe, x)
    np.testing.assert_allclose(grouped, whole, rtol=1e-6, atol=1e-6)
