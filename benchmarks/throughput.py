"""Training throughput and compile time on the current backend.

    python benchmarks/throughput.py [--presets default cpu-6l384] [--steps 10] [--repeats 3]
                                    [--compile-layers 2 8 32] [key.path=value ...]

For each preset: median step time over `--steps` timed steps (after one warm-up step) in each of
`--repeats` rounds, tokens/s, achieved TFLOP/s and MFU against the device peak (on CPU, a float32
matmul peak measured at start-up). Then compile time of the train step for 2, 8 and 32 layers,
scanned one layer an iteration and with the platform's default `model.scan_unroll`.
Batches are random tokens: this measures the step, not the data pipeline.
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

from transformer import sharding
from transformer.accelerator import keep_step_buffers
from transformer.config import DEFAULT_CONFIG
from transformer.config_loader import load_config
from transformer.model.summary import count_params, flops_per_token
from transformer.train.metrics import device_peak_flops
from transformer.train.trainer import Trainer, default_controls

PRESETS = Path(__file__).resolve().parent.parent / "configs" / "presets"


def preset_path(name: str) -> Path:
    return DEFAULT_CONFIG if name == "default" else PRESETS / f"{name}.yaml"


def random_batch(cfg, rng):
    B, T = cfg.train.batch_size, cfg.data.seq_len
    rows = rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


class Stepper:
    """One config's trainer, state and random batch, compiled (`first`: compile + one step, seconds),
    then timed a few steps at a time; the benchmarks that compare variants interleave their rounds."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.trainer = Trainer(cfg, sharding.make_mesh(cfg))
        self.state = self.trainer.init(jax.random.key(0))
        self.batch = self.trainer.put_batch(random_batch(cfg, np.random.default_rng(0)), cfg.train.batch_size)
        self.first = sum(self.steps(1))
        self.buffers = None  # on a CPU, as train.py decides it: whether malloc keeps the step's buffer
        if jax.default_backend() == "cpu":
            compiled = self.trainer.train_step.lower(self.state, self.batch, default_controls()).compile()
            self.buffers = keep_step_buffers(compiled.memory_analysis().temp_size_in_bytes, jax.local_device_count())

    def steps(self, n: int) -> list[float]:
        """Seconds of each of `n` more steps."""
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.state, metrics = self.trainer.train_step(self.state, self.batch, default_controls())
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return times


def time_steps(cfg, steps: int, repeats: int) -> tuple[list[float], float]:
    stepper = Stepper(cfg)
    return [statistics.median(stepper.steps(steps)) for _ in range(repeats)], stepper.first


def compile_seconds(cfg) -> float:
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    state = jax.eval_shape(trainer.init, jax.random.key(0))
    B, T = cfg.train.batch_size, cfg.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32) for k in ("inputs", "targets")}
    start = time.perf_counter()
    trainer.train_step.lower(state, batch, default_controls()).compile()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["default", "cpu-6l384"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile-layers", nargs="*", type=int, default=[2, 8, 32])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    peak, source = device_peak_flops()
    n = jax.device_count()
    print(
        f"backend {jax.default_backend()}, {n} device(s) {jax.devices()[0].device_kind}; "
        f"peak {peak / 1e9:.1f} GFLOP/s per device ({source})"
    )
    print(f"{'preset':<12} {'params':>11} {'step ms':>9} {'tokens/s':>10} {'GFLOP/s':>9} {'MFU':>6}  rounds (ms)")
    for name in args.presets:
        cfg = load_config(preset_path(name), args.overrides)
        medians, _ = time_steps(cfg, args.steps, args.repeats)
        step = statistics.median(medians)
        tokens = cfg.train.batch_size * cfg.data.seq_len
        flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens / step
        print(
            f"{name:<12} {count_params(cfg.model):>11,} {1e3 * step:>9.1f} {tokens / step:>10,.0f} "
            f"{flops / 1e9:>9.1f} {100 * flops / (peak * n):>5.1f}%  {', '.join(f'{1e3 * m:.1f}' for m in medians)}"
        )
    if args.compile_layers:
        base = load_config(preset_path(args.presets[0]), args.overrides)
        # the scan one layer an iteration (flat in depth), and this platform's default scan_unroll
        # (on a CPU the whole stack unrolled: faster steps, compile time growing with depth)
        for unroll, what in (("1", "scan over layers, one an iteration"), ("null", "this platform's scan_unroll")):
            print(f"compile time of the train step ({what}):")
            times = {}
            for layers in args.compile_layers:
                overrides = [*args.overrides, f"model.n_layers={layers}", f"model.scan_unroll={unroll}"]
                cfg = load_config(preset_path(args.presets[0]), overrides)
                times[layers] = statistics.median(compile_seconds(cfg) for _ in range(args.repeats))
                print(f"  {layers:>3} layers: {times[layers]:.2f} s")
            lo, hi = min(times), max(times)
            print(f"  {hi} layers / {lo} layers: {times[hi] / times[lo]:.2f}x  ({base.model.d_model=})")


if __name__ == "__main__":
    main()
