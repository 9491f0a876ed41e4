"""Hugging Face checkpoints in and out (transformer/io/hf.py), against the tiny fixtures that
scripts/make_hf_fixtures.py made with transformers: same logits, exact round trips, one-line refusals."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from transformer.config import ModelConfig
from transformer.io import hf
from transformer.model import Transformer

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
FAMILIES = (
    *("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text"),
    "gemma3_scaled",
    *("bert", "roberta", "modernbert", "bart", "t5", "t5_v1_0", "deepseek_v2", "deepseek_v3"),
)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
# stored otherwise than read: RoBERTa's one token type joins the positions, its and BART's unused
# position rows are written as zeros
ENCODERS = ("roberta", "bart")


def _logits(model, ids: np.ndarray) -> np.ndarray:
    """The fixture's logits as scripts/make_hf_fixtures.py computes them (an encoder-decoder reads
    `ids` and decodes them reversed)."""
    if model.cfg.arch == "encoder_decoder":
        return np.asarray(model(ids[:, ::-1], encoder_tokens_BxS=ids))[..., : model.cfg.vocab_size]
    return np.asarray(model(ids))[..., : model.cfg.vocab_size]


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family):
    ref = load_file(str(FIXTURES / family / "reference.safetensors"))
    _, model = hf.load_model(FIXTURES / family)
    # Against the exact function (transformers in float64), not its float32 logits: two float32
    # models are each off it by their own rounding, which depends on the CPU (on an Intel Xeon
    # qwen3_moe's float32 logits were 2.6e-5 from transformers' and 3e-6 from the exact ones). A
    # fixture's float32 sensitivity is transformers' own float32 error on it: 1.4e-6 (gpt2) to 1.3e-4
    # (T5's unscaled attention); ours may be four times that, as measured at most 0.55 of this bound
    # (t5_v1_0, Xeon), while a misplaced tensor moves the logits by over 1e-2 (below).
    float32_error = np.abs(ref["logits"] - ref["logits_f64"]).max()
    atol = 2e-5 + 4 * float32_error
    np.testing.assert_allclose(_logits(model, ref["input_ids"]), ref["logits_f64"], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("family", [*MOE_FAMILIES, "gemma2", "gemma3_text"])
def test_imported_models_decode_from_the_cache_as_the_full_forward(family):
    """Gemma's local/global layers (and Gemma 3's thetas), and the mixtures of experts: whatever
    capacity the run trains with, the imported model computes HF's dropless function (load_model's,
    as every inference path's), and cached decoding equals it."""
    from test_generate import prefill_then_decode

    ref = load_file(str(FIXTURES / family / "reference.safetensors"))
    m, model = hf.load_model(FIXTURES / family)
    if family in MOE_FAMILIES:
        assert m.capacity_factor == 1.25 and model.cfg.capacity_factor is None  # the run's, and inference's
    tokens = jnp.asarray(ref["input_ids"][:, :16], jnp.int32)
    full = np.asarray(model(tokens))
    # the DeepSeek fixtures amplify float32 rounding: transformers' own float32 logits differ from its
    # float64 ones by 4.6e-5 and 4.0e-5 there (a few tokens), and MLA decodes in its absorbed form
    atol = 5e-5 if family.startswith("deepseek") else 2e-5
    np.testing.assert_allclose(prefill_then_decode(*nnx.split(model), tokens, 5), full, atol=atol, rtol=2e-5)


def test_the_fixtures_need_their_conventions():
    """Without Qwen2-MoE's shared-expert gate, with Qwen3-MoE's gates left unnormalised, without
    Gemma's embedding scale, its gains' offset or Gemma 3's local theta, the fixtures' logits are far
    off: the tests above pin each convention down."""
    changes = (
        ("qwen2_moe", dict(shared_expert_gate=False)),
        ("qwen3_moe", dict(renormalize_gates=False)),
        ("gemma2", dict(embed_scale=False)),
        ("gemma2", dict(norm_offset=False)),
        ("gemma3_text", dict(rope_local_theta=None)),
        ("t5", dict(rel_max_distance=128)),  # the buckets of the longer distances move
        ("t5_v1_0", dict(scale_head_input=False)),
        ("gemma3_scaled", dict(rope_local_scaling=True)),  # the local layers stretched too
        ("gemma3_scaled", dict(rope_scaling="none", rope_factor=1.0, rope_local_scaling=True)),
        ("modernbert", dict(first_attn_norm=True)),  # layer 0's never-read gain of ones read
        ("modernbert", dict(rope_local_theta=None)),
        ("modernbert", dict(attention_pattern=("global",) * 4)),
        ("deepseek_v2", dict(router_groups=1, router_topk_groups=1)),
        ("deepseek_v2", dict(routed_scale=1.0)),
        ("deepseek_v2", dict(attn_scale=None)),  # YaRN's temperature on all of MLA's logits
        ("deepseek_v3", dict(router_bias=False)),
        ("deepseek_v3", dict(router_group_score="max")),
        ("deepseek_v3", dict(rope_attention_factor=None)),
        ("deepseek_v3", dict(rope_scaling="none", rope_attention_factor=None)),
    )
    for family, change in changes:
        ref = load_file(str(FIXTURES / family / "reference.safetensors"))
        _, model = hf.load_model(FIXTURES / family)
        params = _params(model)
        for off in ("shared_gate", "router_bias"):
            params.get("moe_blocks", {}).get("ffn", {}).pop(off, None)
        other = Transformer(dataclasses.replace(model.cfg, **change), rngs=nnx.Rngs(0))
        nnx.update(other, params)
        assert np.abs(_logits(other, ref["input_ids"]) - ref["logits"]).max() > 1e-2, family


def test_bert_token_types_equal_transformers():
    """model.token_types: the second half of each row of type 1, as transformers computes it, and
    far from the type-0 logits."""
    ref = load_file(str(FIXTURES / "bert" / "reference.safetensors"))
    m, model = hf.load_model(FIXTURES / "bert")
    assert m.token_types == 2
    typed = np.asarray(model(ref["input_ids"], token_types_BxT=ref["token_type_ids"]))[..., : m.vocab_size]
    np.testing.assert_allclose(typed, ref["type_logits"], atol=2e-5, rtol=1e-5)
    assert np.abs(ref["type_logits"] - ref["logits"]).max() > 1e-2


def test_llama3_rope_scaling_matters_in_the_fixture():
    """The llama fixture's logits pin down the llama3 frequencies: without them they are far off."""
    ref = load_file(str(FIXTURES / "llama" / "reference.safetensors"))
    m, model = hf.load_model(FIXTURES / "llama")
    model.cfg = dataclasses.replace(m, rope_scaling="none")
    plain = Transformer(model.cfg, rngs=nnx.Rngs(0))
    nnx.update(plain, nnx.state(model, nnx.Param))
    assert np.abs(np.asarray(plain(ref["input_ids"])) - ref["logits"]).max() > 1e-2


@pytest.mark.parametrize("family", ENCODERS)
def test_an_encoder_exported_again_computes_the_same_logits(family, tmp_path):
    """RoBERTa's one token type joins the position table on import (exact: every input has it), so
    its export is BERT's with a zero type row; its and BART's first two position rows are never read,
    and export as zeros: read back, the same model."""
    ref = load_file(str(FIXTURES / family / "reference.safetensors"))
    m, model = hf.load_model(FIXTURES / family)
    assert hf.save(m, _params(model), tmp_path).name == ("bart" if family == "bart" else "bert")
    again, reloaded = hf.load_model(tmp_path)
    assert again == m
    np.testing.assert_array_equal(_logits(reloaded, ref["input_ids"]), _logits(model, ref["input_ids"]))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ENCODERS])
def test_import_then_export_gives_byte_identical_tensors(family, tmp_path):
    m, model = hf.load_model(FIXTURES / family)
    hf.save(m, _params(model), tmp_path)
    with safe_open(FIXTURES / family / hf.WEIGHTS, "numpy") as a, safe_open(tmp_path / hf.WEIGHTS, "numpy") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    assert hf.model_config(tmp_path) == m


BERT_KIND = dict(
    arch="encoder",
    position="learned",
    norm="layernorm",
    norm_position="post",
    embedding_norm=True,
    ffn="gelu_exact",
    use_bias=True,
    n_kv_heads=4,
    mlm_head=True,
    output_bias=True,
)
MODERNBERT_KIND = dict(
    arch="encoder", n_kv_heads=4, norm="layernorm", embedding_norm=True, first_attn_norm=False, mlm_head=True
)
# this framework's kinds of model that have an HF equivalent, and the family each exports as
EXPORTABLE = {
    "llama": dict(),
    "llama-untied-biases-geglu": dict(tie_embeddings=False, use_bias=True, ffn="geglu"),
    "llama-erf-geglu": dict(ffn="geglu_exact"),
    "llama-llama3-rope": dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=32),
    "llama-yarn-rope": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, rope_beta_slow=2.0),
    "mistral": dict(window=5, n_kv_heads=1),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=16),
    "gpt2": dict(position="learned", norm="layernorm", ffn="gelu_exact", use_bias=True, n_kv_heads=4),
    "gemma2": dict(
        norm_position="sandwich",
        norm_offset=True,
        embed_scale=True,
        ffn="geglu",
        window=5,
        attention_pattern=("local", "global"),
        attn_softcap=50.0,
        logit_softcap=30.0,
        attn_scale=12**-0.5,
    ),
    "gemma3_text": dict(
        norm_offset=True, embed_scale=True, norm_position="sandwich", qk_norm=True, window=4, rope_local_theta=100.0
    ),
    "bert": BERT_KIND,
    "bert-token-types": BERT_KIND | dict(token_types=3),
    "mixtral": dict(n_experts=4, top_k=2, window=5),
    "qwen2_moe": dict(
        n_experts=4, top_k=2, moe_every=2, n_shared_experts=1, shared_expert_gate=True, qkv_bias=True, moe_d_ff=24
    ),
    "qwen3_moe": dict(n_experts=4, top_k=1, qk_norm=True, renormalize_gates=True, moe_aux_loss=0.1),
    "qwen3_moe-unnormalised": dict(n_experts=4, top_k=2, qk_norm=True, renormalize_gates=False),
    "modernbert": MODERNBERT_KIND
    | dict(
        norm_bias=False,
        ffn="geglu_exact",
        mlm_head_bias=False,
        output_bias=True,
        n_layers=3,
        window=4,
        attention_pattern=("global", "local", "local"),
        rope_local_theta=10.0,
    ),
    "modernbert-biases-untied": MODERNBERT_KIND | dict(tie_embeddings=False),
    "deepseek_v2-dense": dict(attention="mla", n_kv_heads=None, q_lora_rank=16),
    "deepseek_v2": dict(
        attention="mla",
        n_kv_heads=None,
        n_layers=3,
        n_experts=8,
        top_k=2,
        n_shared_experts=2,
        moe_first_dense=1,
        renormalize_gates=False,
        router_groups=4,
        router_topk_groups=2,
        routed_scale=16.0,
    ),
    "deepseek_v3": dict(
        attention="mla",
        n_kv_heads=None,
        n_experts=4,
        top_k=1,
        router="sigmoid",
        router_bias=True,
        router_groups=2,
        router_group_score="top2",
        rope_scaling="yarn",
        rope_factor=40.0,
        rope_original_max_len=16,
        rope_attention_factor=1.0,
        attn_scale=0.3,  # YaRN's temperature on all logits: config.json's mscale_all_dim
    ),
}


def _ours(**kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, vocab_multiple=4, max_seq_len=32)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("kind", list(EXPORTABLE))
def test_export_then_import_gives_bitwise_identical_params(kind, tmp_path):
    m = _ours(**EXPORTABLE[kind])
    params = _params(Transformer(m, rngs=nnx.Rngs(1)))
    family = hf.save(m, params, tmp_path)
    assert family.name == kind.partition("-")[0]
    assert all(getattr(hf.model_config(tmp_path), k) == getattr(m, k) for k in hf.ARCHITECTURE)
    again = hf.load_params(tmp_path, m, hf.abstract_params(m))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(again)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), path


def test_a_sharded_checkpoint_reads_as_the_single_file(tmp_path):
    _shard(tmp_path, "qwen3")
    _, whole = hf.load_model(FIXTURES / "qwen3")
    _, sharded = hf.load_model(tmp_path)
    for a, b in zip(jax.tree.leaves(_params(whole)), jax.tree.leaves(_params(sharded))):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(position="alibi"), "model.position=alibi"),
        (dict(norm_position="sandwich"), "model.norm_position=sandwich"),
        (dict(norm_position="deepnorm"), "model.norm_position=deepnorm"),
        (dict(logit_softcap=30.0), "soft-capping"),
        (dict(ffn="gelu"), "model.ffn=gelu"),
        (dict(attn_scale=0.5), "model.attn_scale=0.5"),
        (dict(window=4, use_bias=True), "model.use_bias=True"),
        (dict(window=4, qk_norm=True), "model.window=4: HF qwen3 has no such option"),
        (dict(arch="encoder"), "model.arch=encoder"),
        (dict(arch="encoder_decoder"), "model.ffn=swiglu: BART"),
        (dict(arch="encoder", mlm_head=True, position="learned"), "model.ffn=swiglu: BERT has a plain MLP"),
        (dict(arch="encoder", mlm_head=True, ffn="gelu"), "model.ffn=gelu: MODERNBERT has a gated FFN"),
        (dict(arch="encoder", mlm_head=True, n_kv_heads=4), "model.norm=rmsnorm: HF modernbert"),
        (dict(norm_offset=True, ffn="gelu"), "model.ffn=gelu: GEMMA2 has a gated FFN"),
        (dict(arch="encoder_decoder", position="t5_relative", ffn="geglu_exact"), "model.ffn=geglu_exact: T5's FFNs"),
        (dict(arch="encoder_decoder", ffn="gelu_exact"), "model.n_kv_heads=2: HF bart has no such option"),
        (dict(n_experts=4, top_k=2, router="sigmoid"), "model.router=sigmoid: HF mixtral has no such option"),
        (dict(n_experts=4, top_k=2, renormalize_gates=False), "model.renormalize_gates=False: HF mixtral"),
        (dict(n_experts=4, n_shared_experts=1, qkv_bias=True), "model.shared_expert_gate=False: HF qwen2_moe"),
        (dict(n_experts=4, top_k=2, moe_d_ff=24), "model.moe_d_ff=24: HF mixtral"),
        (dict(n_experts=4, top_k=1), "model.top_k=1: HF mixtral renormalises"),
        (
            dict(attention="mla", n_kv_heads=None, n_experts=4, router="sigmoid"),
            "model.router_bias=False: HF deepseek_v3",
        ),
        (dict(attention="mla", n_kv_heads=None, n_experts=4, top_k=2), "model.renormalize_gates=True: HF deepseek_v2"),
        (
            dict(attention="mla", n_kv_heads=None, n_experts=4, router_groups=2, router_group_score="top2"),
            "model.router_group_score=top2: HF deepseek_v2",
        ),
        (dict(attention="mla", n_kv_heads=None, attn_scale=0.3), "model.attn_scale=0.3: HF deepseek_v2"),
    ],
)
def test_export_of_a_variant_without_hf_equivalent_is_refused_in_one_line(kw, says, tmp_path):
    with pytest.raises(hf.HFError) as e:
        hf.export_family(_ours(**kw))
    assert says in str(e.value) and "\n" not in str(e.value)


def _edited_fixture(tmp_path, family: str, **changes):
    for file in (hf.CONFIG_JSON, hf.WEIGHTS):
        shutil.copy(FIXTURES / family / file, tmp_path)
    config = json.loads((tmp_path / hf.CONFIG_JSON).read_text())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    (tmp_path / hf.CONFIG_JSON).write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("llama", {"model_type": "falcon"}, "model_type"),
        ("llama", {"rope_parameters.rope_type": "longrope"}, "rope_parameters.rope_type"),
        ("modernbert", {"classifier_activation": "silu"}, "classifier_activation"),
        ("modernbert", {"mlp_bias": True}, "mlp_bias"),
        ("deepseek_v2", {"rope_parameters.truncate": False}, "rope_parameters.truncate"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("deepseek_v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ("llama", {"hidden_act": "quick_gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gpt2", {"activation_function": "swish"}, "activation_function"),
        ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("qwen3_moe", {"num_experts_per_tok": 1}, "norm_topk_prob"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 50}, "shared_expert_intermediate_size"),
        ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ("bert", {"is_decoder": True}, "is_decoder"),
        ("roberta", {"pad_token_id": 0}, "pad_token_id"),
        ("bart", {"decoder_ffn_dim": 48}, "encoder_ffn_dim"),
        ("t5", {"feed_forward_proj": "gated-tanh"}, "feed_forward_proj"),
    ],
)
def test_unsupported_config_json_is_refused_naming_the_field(family, changes, field, tmp_path):
    with pytest.raises(hf.HFError) as e:
        hf.load_model(_edited_fixture(tmp_path, family, **changes))
    assert str(e.value).startswith(f"config.json: {field}:") and "\n" not in str(e.value)


def test_a_checkpoint_that_does_not_fit_its_config_is_refused_naming_the_tensor(tmp_path):
    with pytest.raises(hf.HFError, match=r"model.layers.0.self_attn.o_proj.weight \[32, 64\] do not fit"):
        hf.load_model(_edited_fixture(tmp_path, "llama", num_attention_heads=8))


# --- the command-line paths ---------------------------------------------------------------------------


def test_a_pretrained_tokenizer_uses_the_special_tokens_its_directory_names():
    from transformer.data.tokenizer import load_pretrained

    tok = load_pretrained(str(FIXTURES / "llama"))
    end = tok.tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == 320 and tok.eos_id == tok.bos_id == tok.pad_id == end


def _usage_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_init_from_takes_the_architecture_and_tokenizer_from_the_checkpoint(capsys):
    from transformer.cli import train_main

    llama = FIXTURES / "llama"
    # the embedded default's model keys (d_model 128, ...) give way; the user's own values must agree
    assert train_main([f"model.init_from={llama}", "model.n_heads=4", "model.remat=full", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "d_model: 32\n" in out and "rope_scaling: llama3\n" in out and f"tokenizer: pretrained:{llama}\n" in out
    err = _usage_error(capsys, train_main, [f"model.init_from={llama}", "model.d_model=64", "model.ffn=gelu"])
    assert "model.d_model: 64 (config) vs 32 (config.json); model.ffn: 'gelu' (config) vs 'swiglu'" in err


def test_eval_of_an_unsupported_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    from transformer.cli import eval_main

    path = _edited_fixture(tmp_path, "llama", model_type="falcon")
    assert "config.json: model_type: 'falcon' is not supported" in _usage_error(capsys, eval_main, ["--hf", str(path)])
    assert "--step" in _usage_error(capsys, eval_main, ["--hf", str(FIXTURES / "llama"), "--step", "3"])
    assert "--export-hf" in _usage_error(capsys, eval_main, ["--hf", str(path), "--export-hf", str(tmp_path / "o")])


def test_export_of_a_run_without_hf_equivalent_is_one_line_exit_2(tmp_path, capsys):
    from transformer import rundir
    from transformer.cli import eval_main
    from transformer.config_loader import load_config

    rundir.write_config(tmp_path, load_config(None, ["model.position=alibi"]))
    err = _usage_error(capsys, eval_main, ["--workdir", str(tmp_path), "--export-hf", str(tmp_path / "out")])
    assert "model.position=alibi: none of the Hugging Face families" in err


@pytest.mark.slow
def test_fine_tune_from_a_checkpoint_then_export_it(tmp_path, capsys):
    """train.py fine-tunes from the llama fixture; its export, evaluated with --hf, gives the run's loss."""
    from conftest import write_corpus

    from transformer.cli import eval_main

    corpus = write_corpus(tmp_path / "docs.jsonl", seed=3, n=100)
    data = [f"data.source=files:{corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16"]
    data += ["data.val_windows=8", "train.batch_size=4"]
    run = tmp_path / "run"
    argv = [f"model.init_from={FIXTURES / 'llama'}", *data, "train.steps=3", "train.eval_every=3"]
    argv += ["checkpoint.every=3", "logging.tensorboard=false", "logging.progress=false", "--workdir", str(run)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert eval_main(["--workdir", str(run), "--export-hf", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    capsys.readouterr()
    results = []
    for where in (
        ["--workdir", str(run)],
        ["--hf", str(tmp_path / "out"), *data],
        ["--hf", str(FIXTURES / "llama"), *data],
    ):
        assert eval_main([*where, "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    trained, exported, pretrained = (r["loss"] for r in results)
    assert exported == pytest.approx(trained, abs=1e-6) and abs(trained - pretrained) > 1e-4


@pytest.mark.parametrize(("family", "objective"), [("bert", "mlm"), ("modernbert", "mlm"), ("bart", "span")])
def test_an_encoder_or_encoder_decoder_checkpoint_fine_tunes_with_its_objective(family, objective, tmp_path):
    """The objective is checked against the checkpoint's architecture (an encoder's mlm), not the
    default decoder's: train.py fine-tunes, and its export loads back as the same family."""
    from conftest import write_corpus

    from transformer.cli import eval_main, train_main

    corpus = write_corpus(tmp_path / "docs.jsonl", seed=3, n=60)
    run = tmp_path / "run"
    argv = [f"model.init_from={FIXTURES / family}", f"data.objective={objective}", f"data.source=files:{corpus}"]
    argv += [f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16", "data.val_windows=4", "train.batch_size=4"]
    argv += ["train.steps=2", "train.eval_every=2", "checkpoint.every=2", "train.eval_tasks=[]"]
    assert train_main([*argv, "logging.tensorboard=false", "logging.progress=false", "--workdir", str(run)]) == 0
    assert eval_main(["--workdir", str(run), "--export-hf", str(tmp_path / "out")]) == 0
    assert hf.model_config(tmp_path / "out").arch == hf.model_config(FIXTURES / family).arch


def test_the_byte_tokenizer_exports_as_a_hugging_face_tokenizer_of_the_same_ids():
    from transformer.data.tokenizer import ByteTokenizer, HFTokenizer

    byte = ByteTokenizer()
    exported = HFTokenizer(byte.files()["tokenizer.json"])
    text = "héllo wörld \n\t 日本 ~\x7f"
    assert list(exported.encode_batch([text])[0]) == list(byte.encode_batch([text])[0])
    assert (exported.vocab_size, exported.bos_id, exported.eos_id, exported.pad_id) == (259, 256, 257, 258)


def test_tensors_read_in_blocks_of_rows_give_the_same_parameters(monkeypatch):
    _, whole = hf.load_model(FIXTURES / "gpt2")
    monkeypatch.setattr(hf, "READ_BLOCK_BYTES", 1000)  # every matrix in blocks, a last one short
    _, blocks = hf.load_model(FIXTURES / "gpt2")
    for a, b in zip(jax.tree.leaves(_params(whole)), jax.tree.leaves(_params(blocks))):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_a_bfloat16_checkpoint_loads_exactly(param_dtype, tmp_path):
    import ml_dtypes

    tensors = load_file(str(FIXTURES / "qwen2" / hf.WEIGHTS))
    save_file({n: x.astype(ml_dtypes.bfloat16) for n, x in tensors.items()}, str(tmp_path / hf.WEIGHTS))
    shutil.copy(FIXTURES / "qwen2" / hf.CONFIG_JSON, tmp_path)
    _, f32 = hf.load_model(FIXTURES / "qwen2")
    _, bf16 = hf.load_model(tmp_path, param_dtype=param_dtype)
    for a, b in zip(jax.tree.leaves(_params(f32)), jax.tree.leaves(_params(bf16))):
        assert b.dtype == param_dtype
        assert np.array_equal(np.asarray(a).astype(ml_dtypes.bfloat16).astype(param_dtype), np.asarray(b))


# --- hostile files: each a one-line refusal naming the file and the problem (issue 38) ------------------


def _copy(tmp_path, family: str, files=(hf.CONFIG_JSON, hf.WEIGHTS)):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copy(FIXTURES / family / file, tmp_path)
    return tmp_path


def _shard(tmp_path, family: str = "qwen3") -> dict[str, str]:
    """`family`'s fixture as two shards and their index in `tmp_path`; returns the weight map."""
    tensors = load_file(str(FIXTURES / family / hf.WEIGHTS))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    _write_index(tmp_path, {"metadata": {}, "weight_map": weight_map})
    shutil.copy(FIXTURES / family / hf.CONFIG_JSON, tmp_path)
    return weight_map


def _write_index(path, index) -> None:
    data = index if isinstance(index, bytes) else json.dumps(index).encode()
    (path / hf.WEIGHTS_INDEX).write_bytes(data)


def _header(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n])


def _with_header(data: bytes, header: dict) -> bytes:
    n, _ = _header(data)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def _edit_tensor(data: bytes, **entry) -> bytes:
    """The file with its first tensor's header entry changed."""
    _, header = _header(data)
    first = next(k for k in header if k != "__metadata__")
    return _with_header(data, header | {first: header[first] | entry})


def _one_line_refusal(load, path, *says: str) -> str:
    with pytest.raises(hf.HFError) as e:
        load(path)
    message = str(e.value)
    assert "\n" not in message and all(s in message for s in says), message
    return message


WEIGHTS_CORRUPTIONS = {
    "empty": lambda data: b"",
    "truncated in the length": lambda data: data[:5],
    "truncated in the header": lambda data: data[:100],
    "truncated in the data": lambda data: data[:-10],
    "random bytes": lambda data: np.random.default_rng(0).bytes(1000),
    "a header length of 2^62": lambda data: (2**62).to_bytes(8, "little") + data[8:],
    "a shape of [1e9, 1e9]": lambda data: _edit_tensor(data, shape=[10**9, 10**9]),
    "offsets past the end": lambda data: _edit_tensor(data, data_offsets=[0, 10**12]),
    "an unknown dtype": lambda data: _edit_tensor(data, dtype="X9"),
    "a negative size": lambda data: _edit_tensor(data, shape=[-1]),
}


@pytest.mark.parametrize("kind", list(WEIGHTS_CORRUPTIONS))
def test_a_malformed_weights_file_is_refused_naming_it(kind, tmp_path):
    path = _copy(tmp_path, "qwen2")
    (path / hf.WEIGHTS).write_bytes(WEIGHTS_CORRUPTIONS[kind]((FIXTURES / "qwen2" / hf.WEIGHTS).read_bytes()))
    _one_line_refusal(hf.load_model, path, str(path / hf.WEIGHTS))


def test_a_weights_file_linking_to_another_kind_of_file_is_refused_naming_it(tmp_path):
    path = _copy(tmp_path, "qwen2", [hf.CONFIG_JSON])
    (path / hf.WEIGHTS).symlink_to(path / hf.CONFIG_JSON)
    _one_line_refusal(hf.load_model, path, str(path / hf.WEIGHTS), "not a safetensors file")


def _index_cases(weight_map: dict[str, str]) -> dict[str, Any]:
    first = sorted(weight_map)[0]
    other = {"model-00001-of-00002.safetensors": "model-00002-of-00002.safetensors"}
    return {
        "not JSON": b'{"weight_map": ',
        "binary": bytes(range(256)),
        "a list": [weight_map],
        "no weight_map": {"metadata": {}},
        "weight_map a list": {"weight_map": list(weight_map.items())},
        "integer values": {"weight_map": dict.fromkeys(weight_map, 1)},
        "'.' as a file": {"weight_map": dict.fromkeys(weight_map, ".")},
        "an empty name": {"weight_map": weight_map | {first: ""}},
        "a shard that does not exist": {"weight_map": weight_map | {first: "model-00003-of-00002.safetensors"}},
        "a tensor its shard does not hold": {"weight_map": weight_map | {first: other.get(weight_map[first], "x")}},
    }


@pytest.mark.parametrize("kind", list(_index_cases({"a.weight": "model-00001-of-00002.safetensors"})))
def test_a_malformed_index_is_refused_naming_it(kind, tmp_path):
    _write_index(tmp_path, _index_cases(_shard(tmp_path))[kind])
    _one_line_refusal(hf.load_model, tmp_path, str(tmp_path / hf.WEIGHTS_INDEX))


def test_a_shard_that_is_not_a_safetensors_file_is_refused_naming_it(tmp_path):
    weight_map = _shard(tmp_path)
    shard = tmp_path / sorted(weight_map.values())[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    _one_line_refusal(hf.load_model, tmp_path, str(shard))


@pytest.mark.parametrize("where", ["a relative path", "an absolute path", "a link inside to outside"])
def test_an_index_naming_weights_outside_the_model_directory_is_refused(where, tmp_path):
    """The index is data: it must not load weights from elsewhere on the machine."""
    other = _copy(tmp_path / "other", "qwen3")
    model = _copy(tmp_path / "model", "qwen3", [hf.CONFIG_JSON])
    tensors = load_file(str(other / hf.WEIGHTS))
    file = {"a relative path": "../other/model.safetensors", "an absolute path": str(other / hf.WEIGHTS)}.get(where)
    if file is None:
        (model / "model.safetensors.link").symlink_to(other / hf.WEIGHTS)
        file = "model.safetensors.link"
    _write_index(model, {"weight_map": dict.fromkeys(tensors, file)})
    _one_line_refusal(hf.load_model, model, str(model / hf.WEIGHTS_INDEX), "outside")


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_loads(tmp_path):
    """The Hugging Face hub's cache: snapshots/REV/* are links into ../../blobs; those are the model's."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    weight_map = _shard(blobs)
    for file in [*set(weight_map.values()), hf.WEIGHTS_INDEX, hf.CONFIG_JSON]:
        (snapshot / file).symlink_to(Path("..", "..", "blobs", file))
    _, whole = hf.load_model(FIXTURES / "qwen3")
    _, cached = hf.load_model(snapshot)
    for a, b in zip(jax.tree.leaves(_params(whole)), jax.tree.leaves(_params(cached))):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(("dtype", "name"), [("int32", "I32"), ("int64", "I64"), ("uint8", "U8"), ("bool", "BOOL")])
def test_integer_or_bool_weights_are_refused_naming_the_tensor_and_dtype(dtype, name, tmp_path):
    path = _copy(tmp_path, "qwen2", [hf.CONFIG_JSON])
    tensors = load_file(str(FIXTURES / "qwen2" / hf.WEIGHTS))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(dtype)
    save_file(tensors, str(path / hf.WEIGHTS))
    _one_line_refusal(hf.load_model, path, "model.norm.weight", name, str(path / hf.WEIGHTS))


@pytest.mark.parametrize(
    ("family", "changes", "field", "says"),
    [
        ("llama", {"num_attention_heads": 0}, "num_attention_heads", "must be a positive integer below 2^31, got 0"),
        (
            "llama",
            {"num_attention_heads": "4"},
            "num_attention_heads",
            "must be a positive integer below 2^31, got '4'",
        ),
        (
            "llama",
            {"num_attention_heads": True},
            "num_attention_heads",
            "must be a positive integer below 2^31, got True",
        ),
        (
            "llama",
            {"num_attention_heads": 2.5},
            "num_attention_heads",
            "must be a positive integer below 2^31, got 2.5",
        ),
        ("llama", {"num_key_value_heads": 0}, "num_key_value_heads", "must be a positive integer"),
        ("llama", {"hidden_size": [32]}, "hidden_size", "must be a positive integer"),
        ("llama", {"num_hidden_layers": 2**40}, "num_hidden_layers", "must be a positive integer below 2^31"),
        ("llama", {"head_dim": -8}, "head_dim", "must be a positive integer"),
        ("llama", {"rope_parameters": "yes"}, "rope_parameters", "must be an object, got 'yes'"),
        ("llama", {"rope_parameters.factor": "8"}, "rope_parameters.factor", "must be a positive number"),
        ("llama", {"rope_parameters.factor": None}, "rope_parameters.factor", "is missing"),
        ("llama", {"rope_parameters.rope_theta": float("nan")}, "rope_parameters.rope_theta", "positive number"),
        ("llama", {"rope_parameters.rope_type": ["llama3"]}, "rope_parameters.rope_type", "is not supported"),
        (
            "llama",
            {"rope_parameters.original_max_position_embeddings": 2.5},
            "rope_parameters.original_max_position_embeddings",
            "must be a positive integer",
        ),
        ("llama", {"rms_norm_eps": "small"}, "rms_norm_eps", "must be a positive number"),
        ("llama", {"tie_word_embeddings": "no"}, "tie_word_embeddings", "must be true or false"),
        ("llama", {"hidden_act": ["silu"]}, "hidden_act", "is not supported"),
        ("llama", {"model_type": ["llama"]}, "model_type", "is not supported"),
        ("qwen2", {"layer_types": 5}, "layer_types", "must be a list"),
        ("qwen2", {"use_sliding_window": "false"}, "use_sliding_window", "must be true or false"),
        ("mistral", {"sliding_window": "4k"}, "sliding_window", "must be a positive integer"),
        ("gpt2", {"n_head": 0}, "n_head", "must be a positive integer"),
        ("gpt2", {"n_embd": 30}, "n_embd", "a multiple of n_head"),
        ("gpt2", {"layer_norm_epsilon": -1}, "layer_norm_epsilon", "must be a positive number"),
    ],
)
def test_wrong_typed_config_json_values_are_refused_naming_the_field(family, changes, field, says, tmp_path):
    with pytest.raises(hf.HFError) as e:
        hf.model_config(_edited_fixture(tmp_path, family, **changes))
    message = str(e.value)
    assert message.startswith(f"config.json: {field}: ") and says in message and "\n" not in message, message


def test_a_model_whose_vocabulary_cannot_take_the_byte_tokenizer_is_refused(tmp_path):
    from transformer.eval import pretrained

    path = _edited_fixture(tmp_path, "qwen2", vocab_size=200)  # and no tokenizer.json beside it
    _one_line_refusal(pretrained.pretrained_config, path, "tokenizer.json", "byte", "259", "200")


def test_eval_hf_without_tokenizer_json_says_which_tokenizer_it_uses(monkeypatch, capsys):
    from transformer.cli import eval_main
    from transformer.eval import pretrained

    monkeypatch.setattr(pretrained, "evaluate_pretrained", lambda *args: {"loss": 1.0})
    assert eval_main(["--hf", str(FIXTURES / "qwen2"), "--json"]) == 0
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "data.tokenizer=byte" in err, err
    assert eval_main(["--hf", str(FIXTURES / "llama"), "--json"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "text", [b"{not json", b"[]", b'{"eos_token": 5}', b'{"bos_token": {"content": 3}}', b"\xff\xfe"]
)
def test_a_broken_tokenizer_config_is_refused_naming_it(text, tmp_path):
    from transformer.eval import pretrained

    path = _copy(tmp_path, "llama", [hf.CONFIG_JSON, hf.WEIGHTS, hf.TOKENIZER_JSON])
    (path / "tokenizer_config.json").write_bytes(text)
    _one_line_refusal(pretrained.pretrained_config, path, str(path / "tokenizer_config.json"))


@pytest.mark.parametrize("kind", ["a file", "a dangling link", "under a file", "a non-empty directory", "unwritable"])
def test_export_to_an_unusable_out_is_refused_before_anything_is_read(kind, tmp_path, capsys):
    from transformer.cli import eval_main

    out = tmp_path / "out"
    if kind == "a file":
        out.write_text("x")
    elif kind == "a dangling link":
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "under a file":
        out.write_text("x")
        out = out / "model"
    elif kind == "a non-empty directory":
        out.mkdir()
        (out / "x").write_text("x")
    else:
        out = Path("/proc/hf-export-test/model")  # nobody, root included, can make a directory there
    # no run at --workdir: the refusal must come before anything is read
    err = _usage_error(capsys, eval_main, ["--workdir", str(tmp_path / "no-run"), "--export-hf", str(out)])
    assert err.startswith(f"eval.py: error: --export-hf: {out}"), err
    assert not (tmp_path / "nowhere").exists()


def test_save_into_an_unwritable_place_is_refused_in_one_line(tmp_path):
    m = _ours()
    (tmp_path / "file").write_text("x")
    _one_line_refusal(
        lambda out: hf.save(m, _params(Transformer(m, rngs=nnx.Rngs(1))), out), tmp_path / "file", "--export-hf"
    )


# --- fuzzing: deterministic corruptions of a fixture, each loading or refused in one line ----------------


def _fuzzed_weights(data: bytes, rng: np.random.Generator) -> list[tuple[str, bytes, bool]]:
    """(what, the corrupted file, whether it must be refused): a flipped byte in the tensors' data
    cannot be told from a weight, one in the header sometimes leaves a valid file."""
    n, _ = _header(data)
    cases = [(f"truncated at {i}", data[:i], True) for i in (0, 1, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1)]
    cases += [(f"truncated at {i}", data[:i], True) for i in rng.integers(8 + n, len(data), 3)]
    lengths = (0, 1, n - 1, n + 1, len(data), 2**32, 2**62, 2**64 - 1)
    cases += [(f"header length {v}", v.to_bytes(8, "little") + data[8:], True) for v in lengths]
    for where, lo, hi, refused in (("header", 8, 8 + n, False), ("data", 8 + n, len(data), False)):
        for i in rng.integers(lo, hi, 8):
            flipped = bytearray(data)
            flipped[i] ^= int(rng.integers(1, 256))
            cases.append((f"byte {i} of the {where} flipped", bytes(flipped), refused))
    return cases


def test_fuzzed_checkpoints_load_or_are_refused_in_one_line(tmp_path):
    rng = np.random.default_rng(38)
    path = _copy(tmp_path / "single", "qwen2")
    data = (FIXTURES / "qwen2" / hf.WEIGHTS).read_bytes()
    refused = 0
    for what, corrupted, must_refuse in _fuzzed_weights(data, rng):
        (path / hf.WEIGHTS).write_bytes(corrupted)
        try:
            hf.load_model(path)
        except hf.HFError as e:
            assert "\n" not in str(e) and "model.init_from: " in str(e), (what, str(e))
            refused += 1
        else:
            assert not must_refuse, what
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    cases = _index_cases(_shard(sharded))
    index = json.loads((sharded / hf.WEIGHTS_INDEX).read_text())
    text = json.dumps(index).encode()
    cases |= {f"index truncated at {i}": text[:i] for i in rng.integers(0, len(text), 6)}
    for what, case in cases.items():
        _write_index(sharded, case)
        with pytest.raises(hf.HFError) as e:
            hf.load_model(sharded)
        assert "\n" not in str(e.value) and str(sharded) in str(e.value), (what, str(e.value))
        refused += 1
    assert refused >= 40


@pytest.mark.parametrize("kind", ["truncated weights", "an index reaching outside"])
def test_a_hostile_checkpoint_through_eval_py_is_one_line_exit_2(kind, tmp_path):
    path = _copy(tmp_path / "model", "llama", [hf.CONFIG_JSON, hf.TOKENIZER_JSON, "tokenizer_config.json"])
    if kind == "truncated weights":
        (path / hf.WEIGHTS).write_bytes((FIXTURES / "llama" / hf.WEIGHTS).read_bytes()[:-100])
    else:
        tensors = load_file(str(FIXTURES / "llama" / hf.WEIGHTS))
        _write_index(path, {"weight_map": dict.fromkeys(tensors, str(FIXTURES / "llama" / hf.WEIGHTS))})
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "eval.py", "--hf", str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("eval.py: error: model.init_from: ") and str(path) in lines[0], lines[0]


def _bert_tokenizer(out: Path) -> None:
    """A WordPiece of the fixtures' 320 ids with BERT's special tokens, and a tokenizer_config.json
    naming them as BERT's does: [CLS] and [SEP], no BOS or EOS; [MASK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=320, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([p.read_text() for p in sorted((ROOT / "transformer").rglob("*.py"))], trainer=trainer)
    assert tok.get_vocab_size() == 320
    tok.save(str(out / "tokenizer.json"))
    named = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), specials))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", **named}))


def test_an_encoders_own_mask_token_is_the_one_mlm_and_fill_mask_use(tmp_path, capsys):
    """A BERT tokenizer (no BOS or EOS, a [MASK] of its own): [CLS] and [SEP] frame a text, and mlm's
    mask is its [MASK], so the vocabulary stays the checkpoint's; `eval.py --hf PATH --fill-mask`
    fills each <mask> or [MASK] of a text with the model's best tokens; MLM fine-tunes from it."""
    from conftest import write_corpus

    from transformer.cli import eval_main, train_main
    from transformer.data import load_pretrained
    from transformer.data.objectives import Vocab

    for file in (hf.CONFIG_JSON, hf.WEIGHTS):
        shutil.copy(FIXTURES / "bert" / file, tmp_path)
    _bert_tokenizer(tmp_path)
    tok = load_pretrained(str(tmp_path))
    ids = {name: tok.tok.token_to_id(name) for name in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")}
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id, tok.vocab_size) == (*ids.values(), 320)
    vocab = Vocab(tok, n_mask=1)
    assert vocab.size == 320 and vocab.mask_id == ids["[MASK]"] and ids["[MASK]"] not in vocab.ordinary_ids
    assert vocab.encode("a [MASK] b <mask>").count(ids["[MASK]"]) == 2
    fill = ["--fill-mask", "def <mask> (self): [MASK]", "--top-k", "2", "--json", "data.seq_len=16"]
    assert eval_main(["--hf", str(tmp_path), *fill]) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["top"]) == 2 and all(len(top) == 2 for top in result["top"])
    assert "<mask>" not in result["filled"] and "[MASK]" not in result["filled"]
    corpus = write_corpus(tmp_path / "docs.jsonl", seed=3, n=60)
    argv = [f"model.init_from={tmp_path}", "data.objective=mlm", f"data.source=files:{corpus}", "data.seq_len=16"]
    argv += [f"data.cache_dir={tmp_path / 'cache'}", "data.val_windows=4", "train.batch_size=4", "train.steps=2"]
    argv += ["train.eval_every=2", "train.eval_tasks=[]", "logging.tensorboard=false", "logging.progress=false"]
    assert train_main([*argv, "--workdir", str(tmp_path / "run")]) == 0


def test_an_encoder_decoder_checkpoint_generates_from_its_decoder_start_token(monkeypatch):
    """`eval.py --hf PATH --generate`: BART decodes from config.json's decoder_start_token_id (</s>),
    T5 from its pad id; a run of this framework's own decodes from BOS, as it was trained."""
    from transformer.eval import evaluate, pretrained
    from transformer.eval.generate import SamplingConfig

    assert pretrained.decoder_start(FIXTURES / "bart", 320) == 2
    assert pretrained.decoder_start(FIXTURES / "t5", 320) == 0
    starts, real = [], evaluate.generate_seq2seq

    def recording(model, encoded, start, *rest):
        starts.append(start)
        return real(model, encoded, start, *rest)

    monkeypatch.setattr(evaluate, "generate_seq2seq", recording)
    sampling = SamplingConfig(max_new_tokens=2, temperature=0.0)
    out = pretrained.sample_pretrained(FIXTURES / "bart", ["ab"], sampling, ["data.seq_len=16"])
    assert starts == [2] and len(out) == 1
