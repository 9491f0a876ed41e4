"""Hugging Face checkpoints in and out (transformer/io/hf.py), against the tiny fixtures that
scripts/make_hf_fixtures.py made with transformers: same logits, exact round trips, one-line refusals."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
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
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family):
    ref = load_file(str(FIXTURES / family / "reference.safetensors"))
    m, model = hf.load_model(FIXTURES / family)
    logits = np.asarray(model(ref["input_ids"]))[..., : m.vocab_size]
    np.testing.assert_allclose(logits, ref["logits"], atol=2e-5, rtol=1e-5)


def test_llama3_rope_scaling_matters_in_the_fixture():
    """The llama fixture's logits pin down the llama3 frequencies: without them they are far off."""
    ref = load_file(str(FIXTURES / "llama" / "reference.safetensors"))
    m, model = hf.load_model(FIXTURES / "llama")
    model.cfg = dataclasses.replace(m, rope_scaling="none")
    plain = Transformer(model.cfg, rngs=nnx.Rngs(0))
    nnx.update(plain, nnx.state(model, nnx.Param))
    assert np.abs(np.asarray(plain(ref["input_ids"])) - ref["logits"]).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_gives_byte_identical_tensors(family, tmp_path):
    m, model = hf.load_model(FIXTURES / family)
    hf.save(m, _params(model), tmp_path)
    with safe_open(FIXTURES / family / hf.WEIGHTS, "numpy") as a, safe_open(tmp_path / hf.WEIGHTS, "numpy") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    assert hf.model_config(tmp_path) == m


# this framework's kinds of model that have an HF equivalent, and the family each exports as
EXPORTABLE = {
    "llama": dict(),
    "llama-untied-biases-geglu": dict(tie_embeddings=False, use_bias=True, ffn="geglu"),
    "llama-llama3-rope": dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=32),
    "mistral": dict(window=5, n_kv_heads=1),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=16),
    "gpt2": dict(position="learned", norm="layernorm", ffn="gelu_exact", use_bias=True, n_kv_heads=4),
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
    tensors = load_file(str(FIXTURES / "qwen3" / hf.WEIGHTS))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / hf.WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(FIXTURES / "qwen3" / hf.CONFIG_JSON, tmp_path)
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
        (dict(arch="encoder_decoder"), "model.arch=encoder_decoder"),
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
        ("llama", {"rope_parameters.rope_type": "yarn"}, "rope_parameters.rope_type"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gpt2", {"activation_function": "swish"}, "activation_function"),
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
