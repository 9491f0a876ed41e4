"""Generation speed and KV-cache size.

    python benchmarks/generate.py [--context 512] [--new 64] [--repeats 3] [key.path=value ...]

For the default model (random weights: speed does not depend on them): prefill tokens/s for a
`--context`-token prompt, cached decode tokens/s, and the time per new token when the full forward
pass is recomputed over the growing sequence instead; then KV-cache bytes at `--context` tokens
for MHA, GQA, MQA and a sliding window, next to the closed form 2*L*K*H*bytes per token.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.accelerator import resolve
from transformer.config_loader import load_config
from transformer.model import Transformer
from transformer.model.summary import kv_cache_bytes_per_token


def median_time(f, repeats):
    jax.block_until_ready(f())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    P, N = args.context, args.new
    cfg = resolve(load_config(None, [f"data.seq_len={P + N}", *args.overrides])).model  # this machine's dtype
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (1, P + N), 0, cfg.vocab_size)
    positions = jnp.arange(P + N, dtype=jnp.int32)[None]

    @functools.partial(jax.jit, static_argnums=0)
    def prefill(graphdef, params, tokens):
        m = nnx.merge(graphdef, params)
        return m.decode(tokens[:, :P], positions[:, :P], m.init_cache(1, P + N), 0)

    @functools.partial(jax.jit, static_argnums=0)
    def decode(graphdef, params, cache, tokens):
        m = nnx.merge(graphdef, params)

        def step(cache, t):
            logits, cache = m.decode(
                jax.lax.dynamic_slice_in_dim(tokens, t, 1, 1),
                jax.lax.dynamic_slice_in_dim(positions, t, 1, 1),
                cache,
                t,
            )
            return cache, logits[:, -1]

        return jax.lax.scan(step, cache, jnp.arange(P, P + N))[1]

    @functools.partial(jax.jit, static_argnums=0)
    def recompute(graphdef, params, tokens):  # one new token the uncached way: a full forward at length P
        return nnx.merge(graphdef, params)(tokens[:, :P])[:, -1]

    _, cache = prefill(graphdef, params, tokens)
    t_prefill = median_time(lambda: prefill(graphdef, params, tokens), args.repeats)
    t_decode = median_time(lambda: decode(graphdef, params, cache, tokens), args.repeats) / N
    t_full = median_time(lambda: recompute(graphdef, params, tokens), args.repeats)
    print(f"default model, float32, batch 1, {P}-token prompt, {N} new tokens:")
    print(
        f"  prefill {P / t_prefill:,.0f} tokens/s; cached decode {1 / t_decode:,.0f} tokens/s "
        f"({1e3 * t_decode:.2f} ms/token); recomputing the forward pass {1e3 * t_full:.2f} ms/token: "
        f"cache is {t_full / t_decode:.1f}x faster"
    )
    print(f"KV cache at {P} tokens:")
    for name, extra in (
        ("MHA", []),
        ("GQA K=2", ["model.n_kv_heads=2"]),
        ("MQA", ["model.n_kv_heads=1"]),
        ("window 128", ["model.window=128"]),
    ):
        variant = resolve(load_config(None, [f"data.seq_len={P}", *args.overrides, *extra])).model
        caches = jax.eval_shape(lambda v=variant: Transformer(v, rngs=nnx.Rngs(0)).init_cache(1, P))
        # every cached array but the positions: K and V, or MLA's latent and rope key
        measured = sum(a.size * a.dtype.itemsize for layer in caches for name, a in layer.items() if name != "pos")
        closed = kv_cache_bytes_per_token(variant) * P
        bound = "" if variant.window is None else f" (bounded by the window: {variant.window} of {P} entries)"
        print(f"  {name:<11} {measured:>10,} bytes; closed form {closed:>10,}{bound}")


if __name__ == "__main__":
    main()
