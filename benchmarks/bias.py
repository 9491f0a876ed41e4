"""The train step with and without biases, with and without `cotangent_once` (issue 36's anomaly).

    python benchmarks/bias.py [--rounds 4] [--steps 3] [key.path=value ...]

The issue-17 `medium` shape (6 layers, d_model 384, 6 heads, seq 256, batch 8, LayerNorm, GELU,
tied, float32, the attention `auto` picks) unless overridden, with `model.use_bias` true and false.
Each variant is compiled once; `-plain` variants are traced with `model/layers.py`'s
`cotangent_once` replaced by the identity, as the FFN was before it. Rounds alternate the order;
the figure is the median step over all rounds, and the ratio is each variant's over `bias`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import Stepper

from transformer import accelerator
from transformer.config_loader import load_config
from transformer.model import layers

MEDIUM = [
    "model.n_layers=6", "model.d_model=384", "model.n_heads=6", "model.n_kv_heads=6", "model.position=learned",
    "model.norm=layernorm", "model.norm_position=pre", "model.ffn=gelu", "model.tie_embeddings=true",
    "model.dtype=float32", "data.seq_len=256", "train.batch_size=8",
]  # fmt: skip
VARIANTS = {  # name: (use_bias, cotangent_once kept)
    "bias": (True, True),
    "no bias": (False, True),
    "bias-plain": (True, False),
    "no bias-plain": (False, False),
}


def stepper(use_bias: bool, once: bool, overrides: list[str]) -> Stepper:
    cfg = accelerator.resolve(load_config(None, [*MEDIUM, f"model.use_bias={use_bias}", *overrides]).with_vocab(259))
    kept = layers.cotangent_once
    if not once:
        layers.cotangent_once = lambda y: y  # type: ignore[assignment]
    try:
        return Stepper(cfg)  # compiles (traces) here
    finally:
        layers.cotangent_once = kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    runs = {name: stepper(*flags, args.overrides) for name, flags in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            times[name] += runs[name].steps(args.steps)
    cfg = runs["bias"].cfg.model
    print(
        f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.ffn}, {cfg.norm}, attention {cfg.attention_impl}, "
        f"{args.rounds} alternated rounds of {args.steps} steps"
    )
    base = statistics.median(times["bias"])
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"  {name:<14} {1e3 * ms:7.0f} ms  {ms / base:5.2f}x")


if __name__ == "__main__":
    main()
