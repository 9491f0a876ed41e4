"""Checkpoint cost: how long a save blocks training, restore time, and size on disk.

    python benchmarks/checkpoint.py [--presets default cpu-6l384] [--repeats 5]

For each preset: the median train-step time; the median time `save` blocks the caller, asynchronous
and synchronous; the median restore time; and the size of one checkpoint against 12 bytes per
parameter (float32 parameters + two Adam moments).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import preset_path, random_batch

from transformer import sharding
from transformer.config_loader import load_config
from transformer.io.checkpoint import Checkpointer, meta_record
from transformer.model.summary import count_params
from transformer.train.trainer import Trainer, default_controls


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["default", "cpu-6l384"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(
        f"{'preset':<10} {'params':>11} {'step ms':>8} {'async save':>11} {'sync save':>10} {'restore':>8} "
        f"{'size MB':>8} {'12 B/param':>10}"
    )
    for name in args.presets:
        cfg = load_config(preset_path(name), ["checkpoint.keep=100", "checkpoint.keep_best=0"])
        trainer = Trainer(cfg, sharding.make_mesh(cfg))
        state = trainer.init(jax.random.key(0))
        batch = trainer.put_batch(random_batch(cfg, np.random.default_rng(0)), cfg.train.batch_size)
        steps = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            state, metrics = trainer.train_step(state, batch, default_controls())
            jax.block_until_ready(metrics)
            steps.append(time.perf_counter() - start)
        blocking = {True: [], False: []}
        restores = []
        abstract = jax.eval_shape(trainer.init, jax.random.key(0))
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, trainer.state_shardings
        )._asdict()
        for use_async in (True, False):
            with tempfile.TemporaryDirectory() as workdir:
                ckpt_cfg = cfg.checkpoint.__class__(every=1, keep=100, keep_best=0, async_=use_async)
                ckpt = Checkpointer(Path(workdir), ckpt_cfg)
                for i in range(args.repeats):
                    start = time.perf_counter()
                    ckpt.save(i + 1, state._asdict(), meta_record(cfg))
                    blocking[use_async].append(time.perf_counter() - start)
                    ckpt.wait()
                size = dir_bytes(Path(workdir) / "checkpoints" / "1")
                if not use_async:
                    for i in range(args.repeats):
                        start = time.perf_counter()
                        _, restored, _ = ckpt.restore(target, step=i + 1)
                        jax.block_until_ready(restored)
                        restores.append(time.perf_counter() - start)
                ckpt.close()
        n = count_params(cfg.model)
        ms = lambda xs: f"{1e3 * statistics.median(xs):.1f}"
        print(
            f"{name:<10} {n:>11,} {ms(steps[1:]):>8} {ms(blocking[True]):>11} {ms(blocking[False]):>10} "
            f"{ms(restores):>8} {size / 1e6:>8.2f} {size / (12 * n):>9.3f}x"
        )


if __name__ == "__main__":
    main()
