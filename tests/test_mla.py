"""Multi-head latent attention: the DeepSeek-V2 equations in numpy, causality, cached decoding, the
cache's size, scan, the closed-form summary, bad sizes, and exact resume."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, assert_bitwise_equal, build, final_params, logged, tiny, tiny_run_overrides, write_corpus
from flax import nnx
from test_attention import embeddings, input_jacobian
from test_generate import check_cached_equals_full

from transformer.config import ConfigError
from transformer.config_loader import load_config
from transformer.eval.generate import SamplingConfig, generate
from transformer.model.attention import Attention
from transformer.model.mla import MultiHeadLatentAttention
from transformer.model.summary import (
    count_params,
    flops_per_token,
    kv_cache_bytes_per_token,
    mean_attended_keys,
    params_by_component,
)
from transformer.train.job import run

# The shapes MLA is checked over: full-rank and low-rank queries, values narrower and wider than
# the query/key heads (H = 8 + 4 = 12 here), a latent smaller than the heads' width.
VARIANTS = {
    "full-rank": dict(),
    "q-latent": dict(q_lora_rank=16),
    "narrow-v": dict(v_head_dim=4, kv_lora_rank=12),
    "wide-v": dict(v_head_dim=16, q_lora_rank=8, qk_rope_head_dim=2),
}


def mla(**overrides):
    return tiny(attention="mla", **overrides)


# --- the equations, written out ------------------------------------------------------------------


def rms_norm(x, gain, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * gain


def rotate(x_TxE, theta):
    """RoPE on (first half, second half) pairs at positions 0..T-1, the convention of positions.rope."""
    T_, E = x_TxE.shape
    half = E // 2
    angle = np.arange(T_)[:, None] * theta ** (-np.arange(half) / half)[None, :]
    x1, x2 = x_TxE[:, :half], x_TxE[:, half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


def reference_mla(module, x_TxD, window=None, softcap=None):
    """DeepSeek-V2 eq. 9-19 for one sequence, head by head, in float64 from the module's weights."""
    cfg = module.cfg
    w = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(module, nnx.Param)).items() if k[0] == "w"}
    x = np.asarray(x_TxD, np.float64)
    A, eps, theta = cfg.qk_nope_head_dim, cfg.norm_eps, cfg.rope_theta
    if cfg.q_lora_rank is None:
        q_TxNxH = np.einsum("td,dnh->tnh", x, w["wq"])
    else:
        c_q = rms_norm(x @ w["wq_down"], np.asarray(module.q_latent_norm.scale[...]), eps)
        q_TxNxH = np.einsum("tq,qnh->tnh", c_q, w["wq_up"])
    c_kv = rms_norm(x @ w["wkv_down"], np.asarray(module.kv_latent_norm.scale[...]), eps)
    k_rope = rotate(x @ w["wk_rope"], theta)  # one rope key for every head
    out = np.zeros_like(x)
    t, s = np.indices((x.shape[0], x.shape[0]))
    allowed = (s <= t) & ((t - s < window) if window else True)
    for n in range(cfg.n_heads):
        q = np.concatenate([q_TxNxH[:, n, :A], rotate(q_TxNxH[:, n, A:], theta)], -1)
        k = np.concatenate([c_kv @ w["wk_up"][:, n], k_rope], -1)
        v = c_kv @ w["wv_up"][:, n]
        scores = q @ k.T / np.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out += (p / p.sum(-1, keepdims=True)) @ v @ np.asarray(module.out[...], np.float64)[n]
    return out


@pytest.mark.parametrize(
    "variant, extra",
    [
        ("full-rank", dict()),
        ("q-latent", dict(attention_impl="einsum", window=3)),
        ("narrow-v", dict(window=4)),
        ("wide-v", dict(attention_impl="einsum", attn_softcap=2.0)),
    ],
)
def test_equals_the_deepseek_v2_equations(variant, extra):
    cfg = mla(**VARIANTS[variant], **extra)
    module = MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(3))
    module.kv_latent_norm.scale[...] = jax.random.uniform(jax.random.key(1), (cfg.kv_lora_rank,), minval=0.5)
    x_BxTxD = jax.random.normal(jax.random.key(2), (1, 10, cfg.d_model))
    positions_BxT = jnp.arange(10)[None]
    y_BxTxD, _ = module(x_BxTxD, positions_BxT, None, cfg.window)
    want = reference_mla(module, x_BxTxD[0], cfg.window, cfg.attn_softcap)
    np.testing.assert_allclose(np.asarray(y_BxTxD[0]), want, atol=2e-6, rtol=1e-5)


# --- the model: causality, windows, scan ----------------------------------------------------------


@pytest.mark.parametrize("variant, impl", zip(VARIANTS, ["xla", "einsum", "xla", "einsum"]))
def test_causal_by_gradient(variant, impl):
    cfg = mla(attention_impl=impl, **VARIANTS[variant])
    dep = input_jacobian(build(cfg), embeddings(cfg))
    T_ = dep.shape[0]
    assert np.all(dep[np.triu_indices(T_, k=1)] == 0.0), "an output depends on a later input"
    assert np.all(dep[np.diag_indices(T_)] > 0)


@pytest.mark.parametrize("impl", ["xla", "einsum"])
def test_sliding_window_reach(impl):
    """One layer, window 3: out[t] depends on exactly x[t-2 .. t]."""
    cfg = mla(n_layers=1, window=3, attention_impl=impl)
    dep = input_jacobian(build(cfg), embeddings(cfg, T_=10))
    t, s = np.indices(dep.shape)
    inside = (s <= t) & (t - s < 3)
    assert np.all(dep[~inside] == 0.0) and np.all(dep[inside] > 0.0)


@pytest.mark.parametrize(
    "extra", [dict(), dict(window=3, attention_pattern=("local", "global"), remat="full", q_lora_rank=16)]
)
def test_scan_equals_unrolled(extra):
    """Same parameters through lax.scan and a Python loop: the same logits and per-layer statistics
    (the pattern's windows are traced inside the scan, static when unrolled)."""
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 61)
    scanned, unrolled = build(mla(**extra)), build(mla(scan_layers=False, **extra))
    np.testing.assert_allclose(scanned(tokens), unrolled(tokens), atol=1e-6, rtol=1e-6)
    stats_scan, stats_unrolled = scanned.stability_stats(tokens), unrolled.stability_stats(tokens)
    assert stats_scan.keys() == stats_unrolled.keys() >= {"attn_entropy", "attn_logit_max", "attn_logit_mean"}
    for name in stats_scan:
        np.testing.assert_allclose(stats_scan[name], stats_unrolled[name], atol=1e-6, rtol=1e-6)


def test_attention_entropy_is_that_of_the_attention_weights():
    """One layer, one head: the sown entropy is that of the reference's softmax rows."""
    cfg = mla(n_layers=1, n_heads=1, d_model=16, kv_lora_rank=8)
    model = build(cfg)
    tokens, positions = jnp.arange(6)[None], jnp.arange(6)[None]
    entropy = model.stability_stats(tokens)["attn_entropy"]
    graphdef, state = nnx.split(model.blocks)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))  # the one layer, unstacked
    q, entries = block.attn.project(block.attn_norm(model.embed_tokens(tokens, positions)), positions)
    k, _ = block.attn.kv_of(entries)
    scores = np.asarray(jnp.einsum("BTNGH,BSNH->BTS", q, k)) * cfg.scale
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores[0], -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -np.mean(np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1))
    np.testing.assert_allclose(entropy[0], want, rtol=1e-5)


# --- the cache -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(q_lora_rank=16, v_head_dim=4, attention_impl="einsum"),
        dict(window=4, attention_pattern=("local", "global")),
    ],
)
def test_prefill_and_decode_equal_the_full_forward(extra):
    check_cached_equals_full(mla(max_seq_len=32, **extra), T=20, prefill=6)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "extra", [dict(), dict(window=3), dict(attn_softcap=2.0, attention_impl="einsum"), dict(dtype="bfloat16")]
)
def test_absorbed_decoding_equals_the_expanded_form(variant, extra):
    """Each decoding step in the absorbed form (W^UK into the queries, W^UV after the weighted
    latents) gives the expanded form's output to float rounding (a few bfloat16 ulps in bfloat16);
    past a window of 3 the ring buffer wraps. (Both write the cache through `write_cache`: the
    cache check guards the absorbed path's own bookkeeping, not the arithmetic.)"""
    cfg = mla(max_seq_len=32, **VARIANTS[variant], **extra)
    module = MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(1))
    B, prompt, steps = 2, 7, 4
    x_BxTxD = jax.random.normal(jax.random.key(0), (B, prompt + steps, cfg.d_model))
    positions_BxT = jnp.broadcast_to(jnp.arange(prompt + steps), (B, prompt + steps))
    size = cfg.window or cfg.max_seq_len
    _, cache = module(
        x_BxTxD[:, :prompt], positions_BxT[:, :prompt], None, cfg.window, cache=module.empty_cache(B, size)
    )
    for t in range(prompt, prompt + steps):
        assert module.absorbs(1, size)
        q_BxTxNx1xH, entries = module.project(x_BxTxD[:, t : t + 1], positions_BxT[:, t : t + 1])
        args = (q_BxTxNx1xH, entries, positions_BxT[:, t : t + 1], cfg.window, cache, t)
        got, got_cache = module.attend_cached(*args)
        want, want_cache = Attention.attend_cached(module, *args)
        tol = dict(rtol=2e-2, atol=2e-3) if cfg.dtype == "bfloat16" else dict(rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
        assert_bitwise_equal(got_cache, want_cache)
        cache = got_cache


def test_absorbing_is_chosen_by_multiply_adds():
    """DeepSeek-V2-like proportions (R = 4 d_h, E = d_h / 2), `absorbs(T new tokens, cache slots)`:
    one new token absorbs against a cache of any size but none; a prompt into a 4,096-slot cache
    (how generation prefills) absorbs while short and expands from some 21 tokens on; T tokens with
    no cache slots at all expand, since attention over R-wide latents then costs more than making
    the heads once."""
    module = MultiHeadLatentAttention(mla(d_model=64, n_heads=4, max_seq_len=4096), rngs=nnx.Rngs(0))
    assert module.cfg.kv_lora_rank == 4 * module.cfg.head_dim
    assert all(module.absorbs(1, cached) for cached in (1, 15, 4095))
    assert not module.absorbs(1, 0)
    assert module.absorbs(8, 4096) and not module.absorbs(64, 4096)
    assert not any(module.absorbs(T, 0) for T in (64, 512, 4096))


def test_decoding_far_past_the_window():
    cfg = mla(window=3, max_seq_len=64, v_head_dim=16)
    check_cached_equals_full(cfg, T=40, prefill=7)
    assert all(layer["latent"].shape[1] == 3 for layer in build(cfg).init_cache(2, 40))


def greedy_by_full_forward(model, prompt, n):
    """Greedy tokens from the uncached forward pass, compiled once: the sequence is laid in a
    fixed-length buffer, and what follows position t cannot change its logits (causality)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    buffer = np.zeros((1, len(prompt) + n), np.int32)
    buffer[0, : len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        buffer[0, t] = int(jnp.argmax(forward(params, jnp.asarray(buffer))[0, t - 1]))
    return buffer[0, len(prompt) :].tolist()


def test_generation_with_the_cache_equals_greedy_without_it():
    """The generate.py path (left-padded prompts of different lengths, prefill, a compiled decode
    loop) picks the tokens the uncached full forward picks."""
    model = build(mla(max_seq_len=32, q_lora_rank=16), seed=3)
    prompts = [[5, 9, 2, 7, 1, 4], [3], [8, 8, 6]]
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    got = generate(model, prompts, eos_id=999, pad_id=0, cfg=sampling)
    assert got == [greedy_by_full_forward(model, p, 8) for p in prompts]


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_cache_bytes_equal_the_closed_form(dtype, itemsize):
    cfg = mla(dtype=dtype, kv_lora_rank=12, qk_rope_head_dim=6)
    cache = build(cfg).init_cache(1, 10)
    held = sum(a.nbytes for layer in cache for name, a in layer.items() if name != "pos")
    assert held == 10 * kv_cache_bytes_per_token(cfg) == 10 * cfg.n_layers * (12 + 6) * itemsize
    # against the MHA it replaces: 2*N*H = 64 numbers per token and layer, here 18
    assert kv_cache_bytes_per_token(tiny(dtype=dtype)) / kv_cache_bytes_per_token(cfg) == 64 / 18


# --- the summary -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "extra", [dict(), dict(norm="layernorm", norm_position="sandwich", tie_embeddings=False, ffn="gelu")]
)
def test_closed_form_equals_parameter_tree(variant, extra):
    cfg = mla(**VARIANTS[variant], **extra)
    assert count_params(cfg) == sum(params_by_component(cfg).values())


def test_flops_per_token_by_hand():
    """The attention component of the real tree is MLA's matmul weights (its latent norms count as
    norms); each costs 2 FLOPs per token, and each attended key 2*N*(A + E) + 2*N*Y."""
    cfg = mla(q_lora_rank=16, v_head_dim=4, ffn="gelu", window=5)
    by_component = params_by_component(cfg)
    N, L, T_ = cfg.n_heads, cfg.n_layers, 16
    matmuls = by_component["attention"] + by_component["ffn"] + by_component["embedding"]
    per_key = 2 * N * (8 + 4) + 2 * N * 4
    assert flops_per_token(cfg, T_) == 3 * (2 * matmuls + L * per_key * mean_attended_keys(cfg, T_))


# --- bad input -------------------------------------------------------------------------------------

BAD = [
    (["model.kv_lora_rank=16"], "model.kv_lora_rank", "model.attention=mla"),
    (["model.q_lora_rank=16"], "model.q_lora_rank", "model.attention=mla"),
    (["model.v_head_dim=16"], "model.v_head_dim", "model.attention=mla"),
    (["model.attention=mla", "model.kv_lora_rank=0"], "model.kv_lora_rank", ">= 1"),
    (["model.attention=mla", "model.q_lora_rank=-4"], "model.q_lora_rank", ">= 1"),
    (["model.attention=mla", "model.qk_nope_head_dim=0"], "model.qk_nope_head_dim", ">= 1"),
    (["model.attention=mla", "model.qk_rope_head_dim=5"], "model.qk_rope_head_dim", "even"),
    (["model.attention=mla", "model.kv_lora_rank=4097"], "model.kv_lora_rank", "compresses nothing"),
    (["model.attention=mla", "model.q_lora_rank=100000"], "model.q_lora_rank", "compresses nothing"),
    (["model.attention=mla", "model.position=alibi"], "model.position", "rope"),
    (["model.attention=mla", "model.n_kv_heads=1"], "model.n_kv_heads", "n_heads"),
    (["model.attention=mla", "model.qk_norm=true"], "model.qk_norm", "latents"),
    (["model.attention=mla", "model.use_bias=true"], "model.use_bias", "bias"),
    (["model.attention=mla", "model.attention_impl=cudnn", "model.dtype=bfloat16"], "model.attention_impl", "cudnn"),
    (["model.attention=mqa"], "model.attention", "mha, mla"),
]


@pytest.mark.parametrize("overrides, key, fragment", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_sizes_name_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key and fragment in info.value.message
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_cli_dry_run_gives_the_closed_forms_and_refuses_bad_sizes():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def train(*args):
        return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)

    bad = train("model.attention=mla", "model.kv_lora_rank=0", "--dry-run")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "model.kv_lora_rank" in bad.stderr
    good = train("model.attention=mla", "model.kv_lora_rank=32", "--dry-run")
    assert good.returncode == 0, good.stderr
    cfg = load_config(None, ["model.attention=mla", "model.kv_lora_rank=32"]).model
    assert f"KV cache per token: {kv_cache_bytes_per_token(cfg):,} bytes" in good.stdout
    assert f"{'total':<12} {count_params(cfg):>15,}" in good.stdout


# --- training -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_resumes_bitwise(tmp_path):
    """MLA through the whole trainer (low-rank queries, stability statistics on): 8 steps in one go
    equal 4 steps, a stop, and 4 more, bit for bit."""
    corpus = write_corpus(tmp_path / "docs.jsonl", seed=2, n=100)
    overrides = tiny_run_overrides(
        corpus,
        tmp_path / "cache",
        "model.attention=mla",
        "model.q_lora_rank=16",
        "checkpoint.every=4",
        "train.eval_every=8",
        "monitor.stats_every=4",
        "optim.schedule=constant",
    )

    def train(workdir, steps):
        run(load_config(None, [*overrides, f"train.steps={steps}"]), workdir, log=lambda _: None)

    train(tmp_path / "straight", 8)
    train(tmp_path / "resumed", 4)
    train(tmp_path / "resumed", 8)
    assert logged(tmp_path / "resumed", "loss") == logged(tmp_path / "straight", "loss")
    assert_bitwise_equal(final_params(tmp_path / "resumed"), final_params(tmp_path / "straight"))
    entropy = logged(tmp_path / "straight", "attn_entropy")  # per layer, every 4 steps
    assert sorted(entropy) == [4, 8] and all(len(e) == 2 and min(e) > 0 for e in entropy.values())
