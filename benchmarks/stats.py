"""Cost of the per-layer stability statistics.

    python benchmarks/stats.py [--steps 200] [--every 100] [--repeats 3]

Mean train-step time of the default config with `monitor.stats_every` 0 (off) and `--every`, where
the statistics add per-layer gradient / update norms to every step and one extra forward pass every
`--every` steps. Random batches; medians over `--repeats` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import random_batch

from transformer import sharding
from transformer.config_loader import load_config
from transformer.train.trainer import Trainer, default_controls


def mean_step(every: int, steps: int) -> float:
    cfg = load_config(None, [f"monitor.stats_every={every}"])
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    state = trainer.init(jax.random.key(0))
    batch = trainer.put_batch(random_batch(cfg, np.random.default_rng(0)), cfg.train.batch_size)
    controls = default_controls()
    state, metrics = trainer.train_step(state, batch, controls)  # compile
    if every:
        jax.block_until_ready(trainer.stats_step(state.params, batch))
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        state, metrics = trainer.train_step(state, batch, controls)
        if every and step % every == 0:
            jax.device_get((metrics, trainer.stats_step(state.params, batch)))
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    off = [mean_step(0, args.steps) for _ in range(args.repeats)]
    on = [mean_step(args.every, args.steps) for _ in range(args.repeats)]
    a, b = statistics.median(off), statistics.median(on)
    print(
        f"default config, {args.steps} steps: stats off {1e3 * a:.1f} ms/step; stats_every={args.every} "
        f"{1e3 * b:.1f} ms/step ({100 * (b / a - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
