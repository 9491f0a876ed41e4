"""Causal attention alone, forward + backward: this framework's `blocked` and `xla` implementations
(`blocked` as the model calls it, `flash.attend_blocked`: on a CPU the fused kernel of
model/flash_cpu.cc where it is built; `xla blocks` the blocks it falls back to,
`flash.attend_in_chains`), and PyTorch's fused `scaled_dot_product_attention` where torch is
installed (the `benchmark` extra).

    python benchmarks/attention.py [--shapes B,T,N,H ...] [--rounds 6] [--calls 4]

Each round times `--calls` calls of every implementation in turn (the order alternating between
rounds); the figure is the median over rounds of each round's median. Inputs are float32 random
normals; the loss is the sum of the output times a fixed random cotangent, so the backward pass
computes all three gradients.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.model.flash import Mask, attend_blocked, attend_in_chains


def timed(f, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def implementations(B: int, T: int, N: int, H: int) -> dict:
    """name -> a function running one forward + backward pass and waiting for it."""
    rng = np.random.default_rng(0)
    q, c = (rng.standard_normal((B, T, N, 1, H), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, N, H), np.float32) for _ in range(2))
    scale = H**-0.5

    def blocked(q, k, v):
        return jnp.sum(attend_blocked(q, k, v, scale, Mask(causal=True, window=None)) * c)

    def xla_blocks(q, k, v):
        return jnp.sum(attend_in_chains(q, k, v, scale, Mask(causal=True, window=None)) * c)

    def xla(q, k, v):
        out = jax.nn.dot_product_attention(q[:, :, :, 0], k, v, scale=scale, is_causal=True, implementation="xla")
        return jnp.sum(out * c[:, :, :, 0])

    runs = {}
    for name, loss in (("blocked", blocked), ("xla blocks", xla_blocks), ("xla", xla)):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        runs[name] = lambda grad=grad: jax.block_until_ready(grad(q, k, v))
    try:
        import torch
        from torch.nn import functional as F
    except ImportError:
        return runs
    tq, tk, tv = (torch.tensor(a).reshape(B, T, N, H).transpose(1, 2).requires_grad_() for a in (q, k, v))
    tc = torch.tensor(c).reshape(B, T, N, H).transpose(1, 2)

    def sdpa():
        (F.scaled_dot_product_attention(tq, tk, tv, is_causal=True) * tc).sum().backward()

    runs["torch sdpa"] = sdpa
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8,256,6,64", "2,2048,4,64"], help="B,T,N,H")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args()
    print(f"jax {jax.__version__} ({jax.default_backend()}); causal attention, forward + backward, float32")
    for shape in args.shapes:
        B, T, N, H = (int(x) for x in shape.split(","))
        runs = implementations(B, T, N, H)
        for run in runs.values():  # compile / warm up
            run()
        rounds: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                rounds[name].append(timed(runs[name], args.calls))
        figures = ", ".join(f"{name} {1e3 * statistics.median(t):.1f} ms" for name, t in rounds.items())
        print(f"B{B} T{T} N{N} H{H}: {figures}")


if __name__ == "__main__":
    main()
