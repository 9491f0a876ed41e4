"""What one device computes and exchanges in an MoE train step, per mesh: the compiled program's
flops per device (XLA's count) and its collectives, on fake CPU devices (nothing runs).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/moe_mesh.py [key.path=value ...]

With expert parallelism a device on an expert axis of n computes 1/n of the step, as on a data axis
of n; where the expert axis split only the weights, every device computed the whole batch outside the
experts. The model: 2 layers of width 64, 4 experts, top-2, T=64, B=16; capacity (1.25) and dropless.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import sharding
from transformer.config_loader import load_config
from transformer.train import preflight
from transformer.train.trainer import Trainer

MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_experts=4", "model.top_k=2"]
MODEL += ["model.moe_d_ff=64", "data.seq_len=64", "train.batch_size=16"]
MESHES = [{}, {"data": 4}, {"expert": 4}, {"data": 2, "expert": 2}, {"fsdp": 2, "expert": 2}]


def step_counts(overrides: list[str], mesh_axes: dict[str, int]) -> tuple[float, dict[str, int]]:
    """(flops per device, {collective: ops}) of the compiled train step on this mesh."""
    cfg = load_config(None, [*overrides, *(f"mesh.{k}={v}" for k, v in mesh_axes.items())]).with_vocab(259)
    n = math.prod(mesh_axes.values())
    mesh = sharding.make_mesh(cfg, jax.devices()[:n])
    compiled, _ = preflight.compile_step(Trainer(cfg, mesh), preflight.abstract_batch(cfg, mesh))
    return preflight.step_flops(compiled), preflight.collectives(compiled)


def main() -> None:
    extra = sys.argv[1:]
    print("| dispatch | mesh | GFLOP per device | of one device's | all-to-all | all-gather | all-reduce |")
    print("|---|---|---|---|---|---|---|")
    for dispatch, flag in (("capacity 1.25", []), ("dropless", ["model.capacity_factor=null"])):
        one = None
        for axes in MESHES:
            flops, ops = step_counts([*MODEL, *flag, *extra], axes)
            one = one or flops
            mesh = " x ".join(f"{k}={v}" for k, v in axes.items()) or "1 device"
            cells = [dispatch, mesh, f"{flops / 1e9:.3f}", f"{flops / one:.2f}"]
            cells += [str(ops[op]) for op in ("all-to-all", "all-gather", "all-reduce")]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
