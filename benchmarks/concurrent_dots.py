"""XLA:CPU runs independent dots at once, and ones YNNPACK threads then slow each other down: the
minimal reproduction of why the blocked attention chains its long blocks (model/flash.py, issue 36).

    python benchmarks/concurrent_dots.py [--pairs 16] [--keys 256 1024 2048] [--rounds 5] [--reps 10]

`--pairs` query blocks of an attention row against the same keys, each the blocked attention's
two products: scores [K, M, H] x [K, H, S] -> [K, M, S], then [K, M, S] x [K, S, H] -> [K, M, H]
(K=4 heads, M=128 queries, H=64, S keys from `--keys`). Nothing links one pair to another, so
XLA:CPU's thunk executor may run them at once. Computed three ways, the same values bit for bit:
- `independent`: as XLA compiles it (its concurrency-optimised scheduler, the default);
- `chained`: each pair's queries put in memory after the previous pair's output
  (`layers.in_memory_on_cpu(q, after=...)`, what flash.py does where YNNPACK threads the products);
- `memory sched.`: `independent` compiled in a process started with
  `XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false` (a flag, not a compile option:
  given to `jax.jit(compiler_options=...)` it changed nothing here).
Figures: milliseconds a pair (median over rounds of each round's best of `--reps` calls), GFLOP/s
and the fraction of the float32 matmul peak measured in the same process (512 x 512 in JAX).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

K, M, H = 4, 128, 64
SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def child(pairs: int, S: int, rounds: int, reps: int, cases: list[str]) -> dict:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from transformer.model.layers import in_memory_on_cpu
    from transformer.train.metrics import measure_cpu_matmul_peak

    keys = jax.random.split(jax.random.key(0), 3)
    q_PxKxMxH = jax.random.normal(keys[0], (pairs, K, M, H), jnp.float32)
    k_KxHxS = jax.random.normal(keys[1], (K, H, S), jnp.float32)
    v_KxSxH = jax.random.normal(keys[2], (K, S, H), jnp.float32)

    def pair(q_KxMxH, k_KxHxS, v_KxSxH):
        scores_KxMxS = jnp.einsum("KMH,KHS->KMS", q_KxMxH, k_KxHxS)
        return jnp.einsum("KMS,KSH->KMH", scores_KxMxS, v_KxSxH)

    def independent(q, k, v):
        return jnp.stack([pair(q[i], k, v) for i in range(pairs)])

    def chained(q, k, v):
        outs = [pair(q[0], k, v)]
        for i in range(1, pairs):
            outs.append(pair(in_memory_on_cpu(q[i], after=outs[-1]), k, v))
        return jnp.stack(outs)

    functions = {"independent": independent, "chained": chained, "memory sched.": independent}
    compiled = {name: jax.jit(functions[name]) for name in cases}
    results = {name: f(q_PxKxMxH, k_KxHxS, v_KxSxH).block_until_ready() for name, f in compiled.items()}
    best: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in cases[r % len(cases) :] + cases[: r % len(cases)]:  # rotate the order
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                compiled[name](q_PxKxMxH, k_KxHxS, v_KxSxH).block_until_ready()
                times.append(time.perf_counter() - start)
            best[name].append(min(times))
    first = next(iter(results.values()))
    return {
        "peak": measure_cpu_matmul_peak(),
        "seconds": {name: statistics.median(t) / pairs for name, t in best.items()},
        "equal": all(bool((r == first).all()) for r in results.values()),
    }


def run_child(args: argparse.Namespace, S: int, cases: list[str], env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", "--pairs", str(args.pairs), "--keys", str(S)]
    cmd += ["--rounds", str(args.rounds), "--reps", str(args.reps), "--cases", *cases]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--keys", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cases", nargs="+", default=["independent", "chained"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.pairs, args.keys[0], args.rounds, args.reps, args.cases)))
        return

    import jax

    print(f"jax {jax.__version__}; {args.pairs} pairs of [{K}] {M}x{H} x {H}xS and back; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        f"{'S':>5} {'MFLOP/item':>10} {'peak':>6}  "
        + "  ".join(f"{c:>24}" for c in ("independent", "chained", "memory sched."))
    )
    for S in args.keys:
        plain = run_child(args, S, ["independent", "chained"], dict(os.environ))
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {SCHEDULER_FLAG}".strip())
        flagged = run_child(args, S, ["memory sched."], env)
        seconds = {**plain["seconds"], **flagged["seconds"]}
        flops = 2 * 2 * K * M * H * S
        cells = [
            f"{1e3 * t:6.3f} ms {flops / t / 1e9:5.0f} ({flops / t / plain['peak']:4.0%})" for t in seconds.values()
        ]
        note = "" if plain["equal"] else "  (chained differs: a bug)"
        print(
            f"{S:>5} {2 * M * H * S / 1e6:>10.1f} {plain['peak'] / 1e9:>6.0f}  "
            + "  ".join(f"{c:>24}" for c in cells)
            + note
        )


if __name__ == "__main__":
    main()
