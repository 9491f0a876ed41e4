"""The projections' matmuls of a `vs_pytorch.py` shape under each dot library XLA:CPU can hand them
to, against PyTorch's: how much of the gap to PyTorch the dot library alone accounts for (issue 36).

    python benchmarks/projections.py [--shape t128] [--rounds 5] [--reps 10]

For every projection of the shape's model (qkv, attention out, FFN in and out, the tied head), its
three GEMMs of a training step, row-major [M, K] x [K, N]: forward (tokens x in -> out), input
gradient (tokens x out -> in) and weight gradient (in x tokens -> out). Each computed by
- `ynnpack`: a jitted `a @ b` as XLA:CPU compiles it by default (a YNNPACK fusion);
- `xla`: the same without YNNPACK fusions (`accelerator.CPU_COMPILER_OPTIONS`: XLA's own dot, Eigen's);
- `onednn`: the same with oneDNN's, engaged only by three options together (`ONEDNN_OPTIONS`);
- `torch`: `torch.mm`, where PyTorch is installed (optional; MKL's or oneDNN's, as PyTorch picks).
Figures: GFLOP/s, the median over rounds of each round's best of `--reps` calls, and per library the
step's projection matmuls in ms (their FLOPs over those rates, summed), beside the float32 matmul
peak measured in the same process (`train/metrics.py`). The GEMMs only: the step's other work,
and what each library costs it (a library's dots fused with their neighbours, or not), is the step
benchmarks' (`vs_pytorch.py`, benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from transformer.accelerator import CPU_COMPILER_OPTIONS
from transformer.train.metrics import measure_cpu_matmul_peak

VOCAB = 320  # vs_pytorch.py's: the byte tokenizer's, padded
# name: (layers, d_model, heads, seq_len, batch), as vs_pytorch.SHAPES (which imports PyTorch)
SHAPES = {
    "small": (4, 128, 4, 64, 12),
    "medium": (6, 384, 6, 256, 8),
    "t128": (4, 256, 4, 128, 32),
    "t512": (4, 256, 4, 512, 8),
    "t2048": (4, 256, 4, 2048, 2),
}
ONEDNN_OPTIONS = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
    **CPU_COMPILER_OPTIONS,
}


def gemms(shape: tuple[int, ...]) -> list[tuple[str, int, int, int, int]]:
    """(name, M, K, N, count a step) of the step's projection GEMMs."""
    layers, d, _, T, B = shape
    tokens = B * T
    out = []
    for name, fan_in, fan_out, count in (
        ("qkv", d, 3 * d, layers),
        ("attn out", d, d, layers),
        ("ffn in", d, 4 * d, layers),
        ("ffn out", 4 * d, d, layers),
        ("head", d, VOCAB, 1),
    ):
        out += [
            (f"{name} fwd", tokens, fan_in, fan_out, count),
            (f"{name} dx", tokens, fan_out, fan_in, count),
            (f"{name} dw", fan_in, tokens, fan_out, count),
        ]
    return out


def rate(fn, a, b, rounds: int, reps: int) -> float:
    """GFLOP/s of `fn(a, b)`: the median over rounds of each round's best of `reps` calls."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    for _ in range(2):
        fn(a, b)
    best = []
    for _ in range(rounds):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn(a, b)
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return flops / statistics.median(best) / 1e9


def libraries() -> dict:
    """name -> (f(a, b) computing a @ b to completion, its operands made of two numpy arrays), for
    each library at hand."""
    out = {}
    for name, options in (("ynnpack", None), ("xla", CPU_COMPILER_OPTIONS), ("onednn", ONEDNN_OPTIONS)):
        f = jax.jit(lambda a, b: a @ b, compiler_options=options)
        out[name] = (lambda a, b, f=f: f(a, b).block_until_ready(), lambda a, b: (jax.device_put(a), jax.device_put(b)))
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = (torch.mm, lambda a, b: (torch.from_numpy(a), torch.from_numpy(b)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="t128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    libs = libraries()
    peak = measure_cpu_matmul_peak() / 1e9
    print(f"{args.shape} {SHAPES[args.shape]}: float32 matmul peak {peak:.0f} GFLOP/s; GFLOP/s (fraction of it)")
    print(f"{'GEMM':<14} {'M x K x N':>18} " + " ".join(f"{name:>13}" for name in libs))
    step_ms = dict.fromkeys(libs, 0.0)
    for name, M, K, N, count in gemms(SHAPES[args.shape]):
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((M, K), np.float32), rng.standard_normal((K, N), np.float32)
        cells = []
        for lib, (fn, operands) in libs.items():
            r = rate(fn, *operands(a, b), args.rounds, args.reps)
            step_ms[lib] += count * 2 * M * K * N / r / 1e6
            cells.append(f"{r:6.1f} ({r / peak:3.0%})")
        print(f"{name:<14} {f'{M} x {K} x {N}':>18} " + " ".join(f"{c:>13}" for c in cells))
    print(f"{'step (ms)':<14} {'':>18} " + " ".join(f"{ms:13.1f}" for ms in step_ms.values()))


if __name__ == "__main__":
    main()
