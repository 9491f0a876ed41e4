"""Trainer: identical losses across meshes and processes, accumulation, optimiser pieces, the CLI job."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_run_overrides, write_corpus

from transformer import accelerator, sharding
from transformer.config import ConfigError, OptimConfig
from transformer.config_loader import load_config
from transformer.data import prepare
from transformer.model.summary import count_params
from transformer.train.loop import train
from transformer.train.loss import cross_entropy
from transformer.train.optim import decay_mask, schedule


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl", seed=0)


def tiny_run(corpus: Path, cache: Path, *overrides: str):
    return load_config(
        None,
        tiny_run_overrides(corpus, cache, "train.steps=6", "train.eval_every=6", "optim.warmup_steps=2", *overrides),
    )


def run_tiny(cfg):
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
    cfg = cfg.with_vocab(data.vocab_size)
    mesh = sharding.make_mesh(cfg, jax.devices()[:1])
    losses = []
    result = train(cfg, data, None, mesh, log=lambda _: None, on_metrics=lambda s, m: losses.append(m["loss"]))
    return losses, result


@pytest.mark.slow
def test_losses_identical_across_meshes(corpus, tmp_path):
    meshes = [
        {"devices": 1},
        {"devices": 8, "data": 8},
        {"devices": 8, "data": 1, "fsdp": 8},
        {"devices": 8, "data": 2, "fsdp": 2, "tensor": 2},
        {"devices": 8, "data": 2, "tensor": 4},
        {"devices": 8, "data": 1, "fsdp": 2, "tensor": 2, "expert": 2},
        {"devices": 8, "data": 2, "expert": 4},
    ]
    # layer 0 dense, layer 1 a mixture of experts (both stacks, and the group scan, on every mesh)
    config = tmp_path / "moe.yaml"
    config.write_text("model:\n  n_experts: 4\n  top_k: 2\n  moe_d_ff: 32\n  moe_every: 2\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    worker = [str(ROOT / "tests" / "mesh_worker.py"), str(corpus), str(tmp_path), json.dumps(meshes), str(config)]
    out = subprocess.run(
        [sys.executable, *worker],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    reference = results[0]["losses"]
    assert len(reference) == 20
    for r in results[1:]:
        # equal to float32 rounding: on a CPU a model with experts computes its dots by XLA's Eigen
        # (accelerator.compiler_options), which splits a product over threads by its size, so the
        # per-device batch changes the summation order (up to 1.4e-5 seen; 1e-6 with YNNPACK's)
        np.testing.assert_allclose(r["losses"], reference, rtol=3e-5, err_msg=str(r["mesh"]))
    by_mesh = {tuple(r["mesh"].values()): r["specs"] for r in results}  # (data, fsdp, tensor, expert)
    assert by_mesh[(1, 8, 1, 1)]["embed"] == "P(None, 'fsdp')"
    assert by_mesh[(1, 8, 1, 1)]["qkv"] == "P(None, 'fsdp', None, None, None)"
    assert by_mesh[(2, 2, 2, 1)]["qkv"] == "P(None, 'fsdp', 'tensor', None, None)"
    assert by_mesh[(2, 2, 2, 1)]["out"] == "P(None, 'tensor', None, 'fsdp')"
    assert by_mesh[(2, 1, 4, 1)]["w_in"] == "P(None, None, None, 'tensor')"
    assert by_mesh[(2, 1, 4, 1)]["embed"] == "P('tensor', None)"
    assert by_mesh[(8, 1, 1, 1)]["qkv"] == "P(None, None, None, None, None)"
    assert by_mesh[(2, 1, 1, 4)]["experts"] == "P(None, 'expert', None, None, None)"
    assert by_mesh[(1, 2, 2, 2)]["experts"] == "P(None, 'expert', 'fsdp', None, 'tensor')"


@pytest.mark.slow
def test_fsdp_splits_activations_by_the_batch():
    """fsdp splits the batch as data parallelism does, and the weights besides: the temporaries of
    its compiled step per device are data=4's plus at most one layer's weights gathered (here a
    layer's share of all the float32 parameters), and under half of one device's. (Left to itself,
    XLA's propagation had followed the fsdp-split weights instead: the whole batch on every device,
    each projection's output all-reduced; 1.66x data=4's temporaries here.)"""
    overrides = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
    overrides += ["data.seq_len=64", "train.batch_size=16"]  # activations well above the weights
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "data": 1, "fsdp": 4}]
    one, data, fsdp = (r["temporaries"] for r in _compiled_steps(meshes, overrides))
    model = load_config(None, overrides).with_vocab(259).model
    assert fsdp - data <= 4 * count_params(model) / model.n_layers, (one, data, fsdp)
    assert fsdp < one / 2, (one, data, fsdp)


@pytest.mark.slow
def test_the_expert_axis_splits_the_work_and_moves_tokens_by_all_to_all():
    """Expert parallelism: on an expert axis of 4 a device computes its own expert on every device's
    tokens, and a quarter of the batch's rows elsewhere, so its step counts data=4's flops; the tokens
    reach their experts by all-to-all, of which data=4 has none. (Before, the expert axis split the
    weights only and every device computed the whole batch outside the experts: 2.6x data=4's flops.)"""
    overrides = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_experts=4", "model.top_k=2"]
    overrides += ["model.moe_d_ff=64", "data.seq_len=64", "train.batch_size=16"]
    meshes = [
        {"devices": 1},
        {"devices": 4, "data": 4},
        {"devices": 4, "expert": 4},
        {"devices": 4, "data": 2, "expert": 2},
    ]
    one, data, *experts = _compiled_steps(meshes, overrides)
    assert data["flops"] < 0.3 * one["flops"] and data["collectives"]["all-to-all"] == 0, (one, data)
    for r in experts:
        assert r["flops"] < 1.05 * data["flops"], (r, data)
        assert r["collectives"]["all-to-all"] >= 4, r  # to the experts and back, in both passes
    # dropless: each device sorts and computes its own rows (before, every device computed the whole
    # batch's assignments on any mesh: 2.3x data=4's flops here)
    one, data, expert = _compiled_steps(meshes[:3], [*overrides, "model.capacity_factor=null"])
    assert data["flops"] < 0.3 * one["flops"] and expert["flops"] < 1.05 * data["flops"], (one, data, expert)


def _compiled_steps(meshes: list[dict], overrides: list[str]) -> list[dict]:
    """tests/mesh_worker.py --compiled on 4 fake CPU devices: the train step compiled on each mesh,
    its temporaries, flops and collectives per device."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    worker = [str(ROOT / "tests" / "mesh_worker.py"), "--compiled", json.dumps(meshes), json.dumps(overrides)]
    out = subprocess.run([sys.executable, *worker], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same_losses_across_meshes(corpus, tmp_path, meshes: list[dict], config: str, extra: list[str] | None = None):
    """tests/mesh_worker.py on 4 fake CPU devices with the model section `config` (YAML) and `extra`
    overrides: each mesh's losses equal the first's (rtol 1e-5); the worker's results returned."""
    results = _runs_across_meshes(corpus, tmp_path, meshes, config, extra)
    for r in results[1:]:
        np.testing.assert_allclose(r["losses"], results[0]["losses"], rtol=1e-5, err_msg=str(r["mesh"]))
    return results


def _runs_across_meshes(corpus, tmp_path, meshes: list[dict], config: str, extra: list[str] | None = None):
    """tests/mesh_worker.py's results on 4 fake CPU devices with the model section `config` (YAML)
    and `extra` overrides."""
    path = tmp_path / "mesh.yaml"
    path.write_text(config)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    worker = [str(ROOT / "tests" / "mesh_worker.py"), str(corpus), str(tmp_path), json.dumps(meshes), str(path)]
    worker += [json.dumps(extra)] if extra else []
    out = subprocess.run([sys.executable, *worker], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_mup_with_depth_scaling_and_experts_trains_to_the_same_losses_across_meshes(corpus, tmp_path):
    """µP away from its base shape, CompleteP at twice its base depth, an MoE layer: the per-parameter
    multipliers are elementwise, so every mesh (data, fsdp x tensor, experts) takes the same steps."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "tensor": 2}]
    meshes += [{"devices": 4, "data": 2, "expert": 2}]
    config = "model:\n  parametrization: mup\n  mup_base_d_model: 32\n  mup_base_n_heads: 4\n"
    config += "  depth_scaling: complete_p\n  mup_base_n_layers: 1\n  n_experts: 2\n  moe_every: 2\n"
    _same_losses_across_meshes(corpus, tmp_path, meshes, config)


@pytest.mark.slow
def test_dropless_experts_train_to_the_same_losses_across_meshes(corpus, tmp_path):
    """Dropless dispatch sorts each device's rows by expert (`row_groups`): every mesh takes the
    steps one device does, with the experts split over an expert axis or over fsdp x expert."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "expert": 2}]
    meshes += [{"devices": 4, "expert": 4}]
    config = "model:\n  n_experts: 4\n  top_k: 2\n  moe_d_ff: 32\n  capacity_factor: null\n  moe_every: 2\n"
    _same_losses_across_meshes(corpus, tmp_path, meshes, config)


@pytest.mark.slow
def test_muon_trains_to_the_same_losses_across_meshes(corpus, tmp_path):
    """Muon's Newton-Schulz matmuls run on the sharded matrices (layers, fsdp's D, tensor's heads and
    FFN width, the expert axis's experts): XLA's partitioner gathers what each Gram product needs, and
    every mesh takes the same steps. GQA (the fused q of two heads per kv head, k, v) and an MoE layer.
    With QK-clip, as MuonClip: the heads' largest logits are reduced over the batch's shards and
    the same heads are clipped on every mesh."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "tensor": 2}]
    meshes += [{"devices": 4, "data": 2, "expert": 2}]
    config = "model:\n  n_experts: 2\n  moe_every: 2\n  qk_clip: 0.12\noptim:\n  name: muon\n"
    results = _same_losses_across_meshes(corpus, tmp_path, meshes, config)
    assert sum(results[0]["clipped"]) > 0
    assert all(r["clipped"] == results[0]["clipped"] for r in results), [r["clipped"] for r in results]


@pytest.mark.slow
def test_soap_trains_alike_across_meshes(corpus, tmp_path):
    """SOAP's factors and bases are replicated per matrix, its moments sharded like the parameters:
    it runs on one device, data=4, fsdp2 x tensor2 and an expert axis (it deadlocked on several CPU
    devices before the eigendecompositions ran one matrix at a time), and the losses agree to
    0.5%, not to float rounding: a factor such as the key projection's G G^T (64 x 64, rank 32)
    has a degenerate null space whose eigenbasis any rounding difference (another mesh's
    reduction order) picks differently, and Adam's second moment there with it. The losses before
    the first rotated step are the same to float rounding."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "tensor": 2}]
    meshes += [{"devices": 4, "data": 2, "expert": 2}]
    config = "model:\n  n_experts: 2\n  moe_every: 2\noptim:\n  name: soap\n  soap:\n    precondition_every: 4\n"
    results = _runs_across_meshes(corpus, tmp_path, meshes, config)
    for r in results[1:]:
        np.testing.assert_allclose(r["losses"][:2], results[0]["losses"][:2], rtol=1e-5, err_msg=str(r["mesh"]))
        np.testing.assert_allclose(r["losses"], results[0]["losses"], rtol=5e-3, err_msg=str(r["mesh"]))


@pytest.mark.slow
def test_mla_losses_identical_across_meshes(corpus, tmp_path):
    """MLA's latents and up-projections shard by their logical axes like every other layer."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "tensor": 2}]
    config = "model:\n  attention: mla\n  position: rope\n  kv_lora_rank: 16\n  q_lora_rank: 24\n"
    extra = ["model.n_kv_heads=8"]  # MLA has no kv heads: the worker's GQA default must go
    results = _same_losses_across_meshes(corpus, tmp_path, meshes, config, extra)
    assert results[2]["specs"]["wk_up"] == "P(None, None, 'tensor', None)"  # heads split over tensor


@pytest.mark.slow
def test_fused_cpu_attention_trains_to_the_same_losses_across_meshes(corpus, tmp_path):
    """Heads 16 wide, which the fused CPU kernel (model/flash_cpu.cc) takes: inside the layer scan,
    under remat and the gradient, each device runs it on its own rows and kv heads."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "tensor": 2}]
    _same_losses_across_meshes(corpus, tmp_path, meshes, "{}", ["model.n_heads=4", "model.n_kv_heads=2"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_other_families_train_to_the_same_losses_across_meshes(arch, corpus, tmp_path):
    """An encoder (MLM) and an encoder-decoder (span corruption, its encoder stack and cross-attention
    sharded by the same table) train alike on one device, data=4 and fsdp2 x tensor2."""
    meshes = [{"devices": 1}, {"devices": 4, "data": 4}, {"devices": 4, "fsdp": 2, "tensor": 2}]
    config = f"base: {ROOT / 'configs' / 'default.yaml'}\nmodel:\n  arch: {arch}\n"
    results = _same_losses_across_meshes(corpus, tmp_path, meshes, config)
    split = "P(None, 'fsdp', 'tensor', None, None)"  # layers, embed over fsdp, kv heads over tensor
    kinds = ("qkv", "encoder_qkv", "cross_qkv") if arch == "encoder_decoder" else ("qkv",)
    assert [results[2]["specs"][k] for k in kinds] == [split] * len(kinds)


@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch(corpus, tmp_path):
    one, r1 = run_tiny(tiny_run(corpus, tmp_path, "train.grad_accum=1"))
    four, r4 = run_tiny(tiny_run(corpus, tmp_path, "train.grad_accum=4"))
    np.testing.assert_allclose(four, one, rtol=1e-5)
    # Adam divides by the gradient's running RMS, so where a gradient is near zero a rounding-level
    # difference (the order of the additions) moves a parameter by up to ~2e-6 after the run
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-6), r1.params, r4.params)


@pytest.mark.slow
def test_dropout_run_is_reproducible_and_differs_from_no_dropout(corpus, tmp_path):
    a, _ = run_tiny(tiny_run(corpus, tmp_path, "model.dropout=0.2"))
    b, _ = run_tiny(tiny_run(corpus, tmp_path, "model.dropout=0.2"))
    c, _ = run_tiny(tiny_run(corpus, tmp_path))
    assert a == b
    assert a != c


def test_weight_decay_mask():
    params = {
        "embed": 1,
        "pos_embed": 1,
        "head": 1,
        "blocks": {
            "attn": {"qkv": 1, "out": 1, "qkv_bias": 1, "out_bias": 1, "q_norm": {"scale": 1}},
            "ffn": {"w_in": 1, "w_out": 1, "b_in": 1, "b_out": 1},
            "attn_norm": {"scale": 1, "bias": 1},
        },
        "final_norm": {"scale": 1},
    }
    mask = decay_mask(params, decay_embeddings=False)
    assert mask["blocks"]["attn"] == {
        "qkv": True,
        "out": True,
        "qkv_bias": False,
        "out_bias": False,
        "q_norm": {"scale": False},
    }
    assert mask["blocks"]["ffn"] == {"w_in": True, "w_out": True, "b_in": False, "b_out": False}
    assert mask["blocks"]["attn_norm"] == {"scale": False, "bias": False}
    assert (mask["embed"], mask["pos_embed"], mask["head"], mask["final_norm"]["scale"]) == (False, False, True, False)
    assert decay_mask(params, decay_embeddings=True)["embed"] is True


@pytest.mark.slow
def test_decay_touches_matrices_only_in_the_real_parameter_tree():
    """Zero gradients: AdamW's update is then exactly -lr * wd * w where decay applies, else 0."""
    from flax import nnx

    from transformer.model import Transformer
    from transformer.train.optim import make_optimizer

    cfg = load_config(
        None,
        [
            "model.use_bias=true",
            "model.norm=layernorm",
            "model.qk_norm=true",
            "model.tie_embeddings=false",
            "model.d_model=32",
            "model.n_layers=1",
        ],
    )
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param))
    opt_cfg = OptimConfig(lr=0.5, weight_decay=0.1, warmup_steps=0, schedule="constant", clip_norm=None)
    tx = make_optimizer(opt_cfg, 10, params)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    flat = {
        "/".join(str(k.key) for k in path): (u, p)
        for (path, u), p in zip(jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree.leaves(params))
    }
    decayed = sorted(name for name, (u, p) in flat.items() if np.any(u != 0))
    assert decayed == ["blocks/attn/out", "blocks/attn/qkv", "blocks/ffn/w_in", "blocks/ffn/w_out", "head"]
    for name in decayed:
        u, p = flat[name]
        np.testing.assert_allclose(u, -0.5 * 0.1 * p, rtol=1e-6)


@pytest.mark.parametrize(
    "kind, step, want",
    [
        ("cosine", 0, 0.1),
        ("cosine", 9, 1.0),
        ("cosine", 55, 0.1 + 0.9 * 0.5),
        ("cosine", 100, 0.1),
        ("cosine", 500, 0.1),
        ("linear", 55, 0.1 + 0.9 * 0.5),
        ("linear", 100, 0.1),
        ("constant", 80, 1.0),
        ("wsd", 50, 1.0),
        ("wsd", 80, 1.0),
        ("wsd", 90, 1 - 0.9 * 0.5),
        ("wsd", 100, 0.1),
    ],
)
def test_schedule_values(kind, step, want):
    cfg = OptimConfig(lr=2.0, schedule=kind, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    assert float(schedule(cfg, 100)(step)) == pytest.approx(2.0 * want, rel=1e-5)


def test_cross_entropy_and_z_loss_by_hand():
    logits = jnp.asarray([[[0.0, math.log(3.0)], [2.0, 2.0]]])
    targets = jnp.asarray([[1, 0]])
    weights = jnp.asarray([[1.0, 0.0]])  # the second token is padding
    objective, nll, count, correct = cross_entropy(logits, targets, weights, z_loss=0.5)
    log_z = math.log(1 + 3)
    assert float(nll) == pytest.approx(log_z - math.log(3.0))
    assert float(count) == 1.0
    assert float(correct) == 1.0  # the weighted token's target is its argmax; the padding's is not counted
    assert float(objective) == pytest.approx(log_z - math.log(3.0) + 0.5 * log_z**2)


@pytest.mark.parametrize(
    "overrides, devices, fragment",
    [
        (["mesh.data=3"], 8, "mesh: data=3 x fsdp=1 x tensor=1 x expert=1 = 3 devices, but 8 are available"),
        (["mesh.data=3", "mesh.fsdp=-1"], 8, "mesh.fsdp: cannot fill: 8 devices are not divisible by 3"),
        (["mesh.data=1", "mesh.tensor=8"], 8, "mesh.tensor: 8 does not divide model.n_heads = 4"),
        (["model.n_heads=8", "model.n_kv_heads=2", "mesh.data=2", "mesh.tensor=4"], 8, "model.n_kv_heads = 2"),
        (["model.d_ff=99", "mesh.data=4", "mesh.tensor=2"], 8, "model.d_ff = 99"),
        (
            ["model.vocab_multiple=1", "model.vocab_size=259", "mesh.data=4", "mesh.tensor=2"],
            8,
            "padded vocab (model.vocab_multiple) = 259",
        ),
        (["train.batch_size=12", "mesh.data=8"], 8, "train.batch_size: 12 is not divisible by data x fsdp"),
    ],
)
def test_invalid_meshes_are_refused(overrides, devices, fragment):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(None, overrides)
        sharding.mesh_shape(cfg, devices)
    assert fragment in str(e.value)


def cli(*args, env=None, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_invalid_mesh_exits_2_from_the_cli(tmp_path):
    out = cli(
        "mesh.data=3", "--workdir", str(tmp_path / "run"), env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "train.py: error: config: mesh: data=3 x fsdp=1 x tensor=1 x expert=1 = 3 devices, but 8 are available"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_cli_end_to_end(corpus, tmp_path):
    workdir = tmp_path / "run"
    out = cli(
        f"data.source=files:{corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=64",
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "train.batch_size=8",
        "train.steps=30",
        "train.eval_every=15",
        "logging.every=5",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        "--workdir",
        str(workdir),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert {"config.yaml", "metrics.jsonl", "events.jsonl", "tb"} <= {p.name for p in workdir.iterdir()}
    assert any(p.name.startswith("events.out.tfevents") for p in (workdir / "tb").iterdir())
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    val_records = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_records] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in val_records] == [15, 30]
    for key in ("grad_norm", "param_norm", "update_norm", "lr", "step_time", "tokens_per_s", "mfu"):
        assert all(key in r for r in train_records[1:]), key
    assert train_records[-1]["loss"] < 0.7 * train_records[0]["loss"]
    assert val_records[-1]["val_loss"] < val_records[0]["val_loss"]
    assert "val_bits_per_byte" in val_records[-1] and "val_perplexity" in val_records[-1]
    saved = load_config(workdir / "config.yaml")
    assert saved.model.vocab_size == 259 and saved.train.steps == 30
    assert saved.model.dtype == "float32"  # what auto chose here, recorded: a resume elsewhere computes in it
    events = [json.loads(line)["event"] for line in (workdir / "events.jsonl").read_text().splitlines()]
    assert events == ["start", "end"]
    assert "unigram baseline" in out.stdout and "MFU" in out.stdout
    # train.py restarted itself with malloc's huge pages where they do something here, and says so
    tunables = accelerator.malloc_tunables({**os.environ, "JAX_PLATFORMS": "cpu"})
    pages = f"transparent huge pages (GLIBC_TUNABLES={tunables})" if tunables else "host memory in"
    assert pages in out.stdout
    if accelerator._glibc_version() is not None:  # and malloc keeps the tiny step's buffer
        assert "temporaries (" in out.stdout and ") kept by malloc between steps" in out.stdout
    # the same directory with a different config is refused (it would resume a different run)
    again = cli(f"data.source=files:{corpus}", "--workdir", str(workdir))
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=2", "mesh.fsdp=2"],
        # experts split across the processes: the all-to-all crosses them
        ["mesh.data=2", "mesh.expert=2", "model.n_experts=2", "model.top_k=2", "model.moe_every=2"],
    ],
    ids=["data-fsdp", "data-expert"],
)
def test_two_processes_match_one_process(corpus, tmp_path, mesh):
    common = [
        f"data.source=files:{corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=32",
        "data.val_windows=8",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "train.batch_size=8",
        "train.steps=8",
        "train.eval_every=8",
        "logging.every=1",
        "logging.progress=false",
        *mesh,
    ]
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    single = cli(*common, "--workdir", str(tmp_path / "one"), env=flags)
    assert single.returncode == 0, single.stderr[-3000:]
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "train.py",
                *common,
                "--workdir",
                str(tmp_path / "two"),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]

    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if '"loss"' in line]

    assert len(losses("one")) == 8
    np.testing.assert_allclose(losses("two"), losses("one"), rtol=1e-5)


def test_adafactor_state_is_sharded_by_shape_and_trains():
    """Adafactor keeps factored moments (one dimension fewer than their parameter) in the
    parameter's place: each gets a sharding of its own rank, and a step runs (it crashed at init)."""
    from transformer.train.trainer import Trainer, default_controls

    cfg = load_config(
        None,
        [
            "optim.name=adafactor",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.ffn_multiple=16",
            "data.seq_len=16",
            "train.batch_size=2",
        ],
    )
    trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert len(s.spec) <= leaf.ndim
    tokens = np.zeros((2, 16), np.int32)
    batch = trainer.put_batch({"inputs": tokens, "targets": tokens}, 2)
    state, metrics = trainer.train_step(state, batch, default_controls())
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
