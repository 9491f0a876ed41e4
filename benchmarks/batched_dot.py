"""XLA:CPU's batched dot on one core and on all of them: the minimal reproduction of issue 36's
limit (the attention's batched matmuls run on one thread).

    python benchmarks/batched_dot.py [--rounds 5] [--reps 20] [--shape 48 128 64 256]

One product of G matrices [M, K] x [K, N] (the default is the attention's at the `medium` shape: 8
sequences x 6 heads, 128-query blocks, head width 64, 256 keys), computed six ways of equal FLOPs:
- `batched`: `einsum('GMK,GKN->GMN')`, the dot the attention compiles to, as XLA:CPU compiles it by
  default (a YNNPACK fusion);
- `xla dot`: the same, compiled with the options the trainer's steps use on a CPU
  (`accelerator.CPU_COMPILER_OPTIONS`: XLA's own dot, which Eigen computes, not YNNPACK's);
- `halves`: the same as two independent batched dots of G/2 (XLA may run independent thunks at once);
- `unrolled`: the same as G independent unbatched dots, stacked;
- `plain`: one unbatched dot `[G*M, K] x [K, N]` (one right-hand side for all: not the same function,
  the same FLOPs), the kind of dot the projections compile to;
- `torch.bmm`, where PyTorch is installed (optional), on as many threads as cores.
Each core count runs in its own process, pinned with `os.sched_setaffinity` before JAX starts, so
XLA sizes its thread pool to it. A dot that is as fast on one core as on two runs on one thread.
Figures: GFLOP/s (median over rounds of each round's best of `--reps` calls) and the fraction of the
float32 matmul peak measured in the same process (512 x 512 in JAX).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COLUMNS = ("batched", "xla dot", "halves", "unrolled", "plain", "torch.bmm")


def child(shape: list[int], rounds: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from transformer.accelerator import CPU_COMPILER_OPTIONS
    from transformer.train.metrics import measure_cpu_matmul_peak

    G, M, K, N = shape
    a = jax.random.normal(jax.random.key(0), (G, M, K), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (G, K, N), jnp.float32)
    h = G // 2

    def halves(a, b):
        top = jnp.einsum("GMK,GKN->GMN", a[:h], b[:h])
        return jnp.concatenate([top, jnp.einsum("GMK,GKN->GMN", a[h:], b[h:])])

    cases = {
        "batched": (jax.jit(lambda a, b: jnp.einsum("GMK,GKN->GMN", a, b)), (a, b)),
        "xla dot": (
            jax.jit(lambda a, b: jnp.einsum("GMK,GKN->GMN", a, b), compiler_options=CPU_COMPILER_OPTIONS),
            (a, b),
        ),
        "halves": (jax.jit(halves), (a, b)),
        "unrolled": (jax.jit(lambda a, b: jnp.stack([a[g] @ b[g] for g in range(G)])), (a, b)),
        "plain": (jax.jit(lambda a, b: a.reshape(G * M, K) @ b), (a, b[0])),
    }
    try:
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        ta, tb = torch.from_numpy(jax.device_get(a)), torch.from_numpy(jax.device_get(b))
        cases["torch.bmm"] = (torch.bmm, (ta, tb))
    except ImportError:
        pass

    def ready(y):
        return y.block_until_ready() if hasattr(y, "block_until_ready") else y

    for f, args in cases.values():
        ready(f(*args))
    best: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in list(cases)[r % len(cases) :] + list(cases)[: r % len(cases)]:  # rotate the order
            f, args = cases[name]
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                ready(f(*args))
                times.append(time.perf_counter() - start)
            best[name].append(min(times))
    flops = 2 * G * M * K * N
    return {
        "cores": len(os.sched_getaffinity(0)),
        "peak": measure_cpu_matmul_peak(),
        "gflops": {name: flops / statistics.median(t) / 1e9 for name, t in best.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shape", type=int, nargs=4, default=[48, 128, 64, 256], metavar=("G", "M", "K", "N"))
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.child])
        print(json.dumps(child(args.shape, args.rounds, args.reps)))
        return

    import jax

    G, M, K, N = args.shape
    cores = len(os.sched_getaffinity(0))
    print(f"jax {jax.__version__}; batched dot [{G}] {M}x{K} x {K}x{N}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'cores':>5} {'peak GFLOP/s':>13}  " + "  ".join(f"{c:>18}" for c in COLUMNS))
    for n in sorted({1, cores}):
        cmd = [sys.executable, __file__, "--child", str(n), "--rounds", str(args.rounds), "--reps", str(args.reps)]
        out = subprocess.run([*cmd, "--shape", *map(str, args.shape)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.splitlines()[-1])
        cells = []
        for c in COLUMNS:
            g = r["gflops"].get(c)
            cells.append(f"{g:8.1f} ({g * 1e9 / r['peak']:5.1%})" if g else f"{'-':>18}")
        print(f"{r['cores']:>5} {r['peak'] / 1e9:>13.1f}  " + "  ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
