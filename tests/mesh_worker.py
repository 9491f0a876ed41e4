"""Trains one tiny config on several meshes in one process (fake CPU devices); prints JSON results.

Run by tests/test_trainer.py in a subprocess, because the device count must be fixed before JAX starts:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_worker.py CORPUS CACHE MESHES_JSON \
        [CONFIG [OVERRIDES_JSON]]
    XLA_FLAGS=... python tests/mesh_worker.py --compiled MESHES_JSON OVERRIDES_JSON
The second form compiles the train step on each mesh (nothing runs) and prints, per device, the bytes
of temporaries XLA plans, the flops it counts, and how many of each collective the program holds.
"""

import json
import sys

import jax

from transformer import sharding
from transformer.config_loader import load_config
from transformer.data import prepare
from transformer.train import preflight
from transformer.train.loop import train
from transformer.train.trainer import Trainer


def main(corpus: str, cache: str, meshes: list[dict], steps: int = 20) -> None:
    results = []
    for mesh_cfg in meshes:
        n = mesh_cfg.pop("devices")
        overrides = [f"mesh.{k}={v}" for k, v in mesh_cfg.items()]
        cfg = load_config(
            sys.argv[4] if len(sys.argv) > 4 else None,
            [
                f"data.source=files:{corpus}",
                f"data.cache_dir={cache}",
                "data.seq_len=32",
                "data.val_windows=8",
                "model.d_model=64",
                "model.n_layers=2",
                "model.n_heads=8",
                "model.n_kv_heads=4",
                "model.ffn_multiple=16",
                "train.batch_size=8",
                f"train.steps={steps}",
                f"train.eval_every={steps}",
                "logging.every=1",
                "logging.progress=false",
                "logging.tensorboard=false",
                "optim.warmup_steps=5",
                *(json.loads(sys.argv[5]) if len(sys.argv) > 5 else []),
                *overrides,
            ],
        )
        data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
        cfg = cfg.with_vocab(data.vocab_size)
        mesh = sharding.make_mesh(cfg, jax.devices()[:n])
        losses, clipped = [], []

        def on_metrics(step, m, losses=losses, clipped=clipped):
            losses.append(m["loss"])
            clipped.append(m.get("qk_clipped_heads", 0.0))  # under model.qk_clip

        train(cfg, data, None, mesh, log=lambda _: None, on_metrics=on_metrics)
        specs = Trainer(cfg, mesh).state_shardings.params
        attn = specs["blocks"]["attn"]
        named = {name: str(attn[name].spec) for name in ("qkv", "out", "wk_up", "wv_up") if name in attn}
        named |= {"w_in": str(specs["blocks"]["ffn"]["w_in"].spec), "embed": str(specs["embed"].spec)}
        if "encoder_blocks" in specs:  # an encoder-decoder: its encoder stack and cross-attention
            named["encoder_qkv"] = str(specs["encoder_blocks"]["attn"]["qkv"].spec)
            named["cross_qkv"] = str(specs["blocks"]["cross_attn"]["qkv"].spec)
        if "moe_blocks" in specs:  # a config with interleaved mixture-of-experts layers
            named["experts"] = str(specs["moe_blocks"]["ffn"]["w_in"].spec)
        results.append({"mesh": dict(mesh.shape), "losses": losses, "clipped": clipped, "specs": named})
    print(json.dumps(results))


def compiled(meshes: list[dict], overrides: list[str]) -> None:
    results = []
    for mesh_cfg in meshes:
        n = mesh_cfg.pop("devices")
        cfg = load_config(None, [*overrides, *(f"mesh.{k}={v}" for k, v in mesh_cfg.items())]).with_vocab(259)
        mesh = sharding.make_mesh(cfg, jax.devices()[:n])
        step, _ = preflight.compile_step(Trainer(cfg, mesh), preflight.abstract_batch(cfg, mesh))
        results.append(
            {
                "mesh": dict(mesh.shape),
                "temporaries": step.memory_analysis().temp_size_in_bytes,
                "flops": preflight.step_flops(step),
                "collectives": preflight.collectives(step),
            }
        )
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "--compiled":
        compiled(json.loads(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
