"""What each optimiser's step costs against AdamW's: time and memory per training step.

    python benchmarks/optimizers.py [--preset default] [--rounds 7] [--steps 5] [key.path=value ...]
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/optimizers.py --collectives \
        mesh.fsdp=2 mesh.tensor=2

The second form runs nothing: it compiles each optimiser's train step on the mesh given and counts
the collectives in it (what sharded Newton-Schulz gathers and reduces, beside AdamW's step).

Optimisers (on the preset's model, otherwise its config): AdamW, Lion, AdEMAMix, Muon with Jordan's
Newton-Schulz, Muon with Polar Express, MuonClip (Muon with QK-clip), AdamW with QK-clip (the clip's
own cost: the step's extra q.k pass for each head's largest logit, and the rescale), SOAP,
schedule-free AdamW. Each is a whole train step (forward, backward, clipping,
the optimiser), timed interleaved (round r times every optimiser in turn, `--steps` steps each, after
one compiled warm-up step) so load from other processes falls on all alike; the figure is the median
over rounds of each one's median step, divided by AdamW's. Memory: the optimiser state's bytes and
the temporaries XLA plans for the compiled step. MFU counts the model's FLOPs only (Newton-Schulz's
matmuls are extra work, not model FLOPs), against the device peak (on CPU, a float32 matmul peak
measured at start-up). Random token batches: this measures the step only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import Stepper, preset_path

from transformer import sharding
from transformer.config_loader import load_config
from transformer.model.summary import flops_per_token
from transformer.train.metrics import device_peak_flops
from transformer.train.preflight import abstract_batch
from transformer.train.trainer import Trainer, default_controls

OPTIMIZERS = {
    "adamw": [],
    "lion": ["optim.name=lion"],
    "ademamix": ["optim.name=ademamix"],
    "muon (jordan)": ["optim.name=muon"],
    "muon (polar express)": ["optim.name=muon", "optim.muon.ns=polar_express"],
    "muonclip (muon + qk-clip 100)": ["optim.name=muon", "model.qk_clip=100"],
    "adamw + qk-clip 100": ["model.qk_clip=100"],
    "soap": ["optim.name=soap"],
    "schedule-free adamw": ["optim.name=schedule_free_adamw", "optim.schedule=constant"],
}


def memory(stepper: Stepper) -> tuple[int, int]:
    """(optimiser state bytes, the compiled step's temporary bytes)."""
    state = sum(np.asarray(x).nbytes for x in jax.tree.leaves(stepper.state.opt_state))
    compiled = stepper.trainer.train_step.lower(stepper.state, stepper.batch, default_controls()).compile()
    analysis = compiled.memory_analysis()
    return state, int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(cfg) -> dict[str, int]:
    """How many of each collective the compiled train step of this config holds."""
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    state = jax.eval_shape(trainer.init, jax.random.key(0))
    text = trainer.train_step.lower(state, abstract_batch(cfg, trainer.mesh), default_controls()).compile().as_text()
    return {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in COLLECTIVES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--collectives", action="store_true", help="count each step's collectives on the mesh given")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.collectives:
        for name, extra in OPTIMIZERS.items():
            counts = collectives(load_config(preset_path(args.preset), [*args.overrides, *extra]))
            print(f"  {name:<22} " + "  ".join(f"{op} {n}" for op, n in counts.items()))
        return
    timed = {
        name: Stepper(load_config(preset_path(args.preset), [*args.overrides, *extra]))
        for name, extra in OPTIMIZERS.items()
    }
    medians: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.rounds):
        for name, t in timed.items():
            medians[name].append(statistics.median(t.steps(args.steps)))
    cfg = timed["adamw"].cfg
    m, tokens = cfg.model, cfg.train.batch_size * cfg.data.seq_len
    peak, _ = device_peak_flops()
    print(f"{args.preset}: d_model {m.d_model}, {m.n_layers} layers, batch {cfg.train.batch_size} x {cfg.data.seq_len}")
    print(
        f"{jax.device_count()} {jax.default_backend()} device(s), peak {peak / 1e12:.3f} TFLOP/s; median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    base = statistics.median(medians["adamw"])
    for name, t in timed.items():
        step = statistics.median(medians[name])
        state, temp = memory(t)
        mfu = flops_per_token(t.cfg.model, cfg.data.seq_len) * tokens / step / peak
        print(
            f"  {name:<22} {1000 * step:8.1f} ms/step  x{step / base:5.2f}  MFU {mfu:6.1%}  "
            f"optimiser state {state / 1e6:6.2f} MB  step temporaries {temp / 1e6:7.1f} MB"
        )


if __name__ == "__main__":
    main()
