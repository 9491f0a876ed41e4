"""Multi-head latent attention against GQA: KV-cache bytes, and training step time as a ratio.

    python benchmarks/mla.py [--config configs/default.yaml] [--context 1024] [--steps 8] [--rounds 5]
                             [key.path=value ...]

KV cache: the bytes of the cache the model allocates for `--context` tokens (shapes only, nothing
allocated) for MHA, GQA (2 kv heads), MQA and MLA, beside the closed forms 2*L*K*H*bytes and
L*(kv_lora_rank + qk_rope_head_dim)*bytes per token. MLA is sized to GQA's cache: a rope key of
head_dim/2 and a latent of 4*head_dim minus that (2 kv heads x K and V x head_dim numbers).

Step time: GQA's and MLA's train steps (random batches) are timed in alternating rounds of
`--steps` steps each, so that load from other processes falls on both alike; the ratio is the
median over rounds of MLA's median step over GQA's median step of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import Stepper

from transformer.accelerator import resolve
from transformer.config import Config
from transformer.config_loader import load_config
from transformer.model import Transformer
from transformer.model.summary import count_params, kv_cache_bytes_per_token


def variants(head_dim: int) -> dict[str, list[str]]:
    rope = head_dim // 2
    return {
        "MHA": [],
        "GQA K=2": ["model.n_kv_heads=2"],
        "MQA": ["model.n_kv_heads=1"],
        "MLA": ["model.attention=mla", f"model.qk_rope_head_dim={rope}", f"model.kv_lora_rank={4 * head_dim - rope}"],
    }


def cache_bytes(cfg: Config, context: int) -> int:
    """Bytes of every cached array but the positions, for a batch of one."""
    caches = jax.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)).init_cache(1, context))
    return sum(a.size * a.dtype.itemsize for layer in caches for name, a in layer.items() if name != "pos")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    base = resolve(load_config(args.config, args.overrides))  # the dtype and attention this machine runs
    configs = {
        name: resolve(load_config(args.config, [*args.overrides, *extra]))
        for name, extra in variants(base.model.head_dim).items()
    }

    print(f"KV cache at {args.context} tokens ({base.model.n_layers} layers, {base.model.compute_dtype}):")
    for name, cfg in configs.items():
        m = cfg.model
        form = "L*(R+E)*bytes*T" if m.attention == "mla" else "2*L*K*H*bytes*T"
        print(
            f"  {name:<8} {cache_bytes(cfg, args.context):>11,} bytes; closed form {form:<16} = "
            f"{kv_cache_bytes_per_token(m) * args.context:>11,}   ({count_params(m):,} parameters)"
        )

    gqa, mla = Stepper(configs["GQA K=2"]), Stepper(configs["MLA"])
    rounds = []
    for _ in range(args.rounds):
        g, m = statistics.median(gqa.steps(args.steps)), statistics.median(mla.steps(args.steps))
        rounds.append((g, m))
    ratios = [m / g for g, m in rounds]
    print(
        f"train step, batch {base.train.batch_size} x {base.data.seq_len}, {args.rounds} alternating rounds of "
        f"{args.steps} steps: MLA / GQA = {statistics.median(ratios):.2f} (median; rounds "
        f"{', '.join(f'{r:.2f}' for r in ratios)}); GQA {1e3 * statistics.median(g for g, _ in rounds):.0f} ms, "
        f"MLA {1e3 * statistics.median(m for _, m in rounds):.0f} ms"
    )


if __name__ == "__main__":
    main()
