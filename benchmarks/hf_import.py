"""Importing a Hugging Face checkpoint: time and peak host memory against the checkpoint's size.

    python benchmarks/hf_import.py [--dir /tmp/hf-1b] [--repeats 3] [--dtype float32|bfloat16]
                                   [--shape llama|mixtral] [--keep]

Writes a ~1B-parameter Llama-shaped checkpoint (or Mixtral-shaped: 8 experts a layer, each a
tensor of its own, which the import stacks layer by layer) of random weights with safetensors'
numpy API (no torch), sharded in four files with an index as the Hub has them, then imports it with
`transformer.io.hf.load_model` in a fresh process per repeat, each reporting its wall time and its peak
resident set (`VmHWM`: the model's own parameters included, since on a CPU they live in host
memory). The target is a peak of at most 1.3x the checkpoint's size: no second full copy. The
checkpoint is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# ~1.0B parameters: Llama-like, GQA, untied embeddings
CONFIG = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=18,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)
# ~1.0B parameters: a mixture of 8 experts of width 1792 in each of 20 layers, top-2
MIXTRAL = CONFIG | dict(
    model_type="mixtral",
    hidden_size=1024,
    intermediate_size=1792,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
)
SHAPES = {"llama": CONFIG, "mixtral": MIXTRAL}
SHARDS = 4


def _ffn_shapes(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's FFN tensors: Llama's MLP, or each of Mixtral's experts."""
    D, F = c["hidden_size"], c["intermediate_size"]
    if c["model_type"] == "llama":
        return {
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    shapes = {p + "block_sparse_moe.gate.weight": (c["num_local_experts"], D)}
    for e in range(c["num_local_experts"]):
        x = f"{p}block_sparse_moe.experts.{e}."
        shapes |= {x + "w1.weight": (F, D), x + "w3.weight": (F, D), x + "w2.weight": (D, F)}
    return shapes


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    D, V = c["hidden_size"], c["vocab_size"]
    H = D // c["num_attention_heads"]
    KH = c["num_key_value_heads"] * H
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (D, D),
            p + "self_attn.k_proj.weight": (KH, D),
            p + "self_attn.v_proj.weight": (KH, D),
            p + "self_attn.o_proj.weight": (D, D),
            **_ffn_shapes(c, p),
        }
    shapes["lm_head.weight"] = (V, D)
    return shapes


def write_checkpoint(path: Path, dtype: str, config: dict) -> int:
    """Random weights of `config` in SHARDS files plus the index; returns the bytes written."""
    from safetensors.numpy import save_file

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config | {"torch_dtype": dtype}))
    shapes = tensor_shapes(config)
    names = list(shapes)
    rng = np.random.default_rng(0)
    weight_map = {}
    for s in range(SHARDS):
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = names[s * len(names) // SHARDS : (s + 1) * len(names) // SHARDS]
        tensors = {n: (0.02 * rng.standard_normal(shapes[n], np.float32)).astype(np_dtype) for n in part}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


# Run in a fresh process per repeat, so that each peak is its own.
MEASURE = """
import json, sys, time

def hwm():  # this process's peak resident set (VmHWM; ru_maxrss would carry the parent's over the fork)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

import jax
from transformer.io import hf
from transformer.model.summary import count_params
base = hwm()
t1 = time.perf_counter()
m, model = hf.load_model(sys.argv[1], param_dtype=sys.argv[2])
jax.block_until_ready(jax.tree.leaves(model))
t2 = time.perf_counter()
print(json.dumps(dict(seconds=t2 - t1, peak=hwm(), baseline=base, params=count_params(m))))
"""


def measure(path: Path, dtype: str) -> dict:
    env_cmd = [sys.executable, "-c", MEASURE, str(path), dtype]
    out = subprocess.run(
        env_cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/hf-1b"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (default: delete it)")
    args = p.parse_args()
    try:
        start = time.perf_counter()
        size = write_checkpoint(args.dir, args.dtype, SHAPES[args.shape])
        print(f"wrote {size / 1e9:.2f} GB ({args.dtype}) in {time.perf_counter() - start:.0f} s to {args.dir}")
        runs = []
        for i in range(args.repeats):
            r = measure(args.dir, args.dtype)
            runs.append(r)
            print(
                f"run {i + 1}: {r['params'] / 1e9:.3f}B parameters in {r['seconds']:.1f} s; peak RSS "
                f"{r['peak'] / 1e9:.2f} GB = {r['peak'] / size:.2f}x the checkpoint (after imports {r['baseline'] / 1e9:.2f} GB)"
            )
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak"] for r in runs)
        print(
            f"median of {len(runs)}: import {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s), "
            f"peak RSS {peak / 1e9:.2f} GB = {peak / size:.2f}x the {size / 1e9:.2f} GB checkpoint (target <= 1.3x)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
