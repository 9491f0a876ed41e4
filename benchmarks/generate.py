"""Generation speed and KV-cache size.

    python benchmarks/generate.py [--context 512] [--new 64] [--repeats 3] [key.path=value ...]
    python benchmarks/generate.py --mla [--context 512] [--new 64] [--repeats 5] [key.path=value ...]

For the default model (random weights: speed does not depend on them): prefill tokens/s for a
`--context`-token prompt, cached decode tokens/s, and the time per new token when the full forward
pass is recomputed over the growing sequence instead; then KV-cache bytes at `--context` tokens
for MHA, GQA, MQA and a sliding window, next to the closed form 2*L*K*H*bytes per token.

`--mla`: the model with `model.attention=mla` (and the overrides), decoding in the absorbed form
(`MultiHeadLatentAttention.absorbs`, what generation runs) against the expanded form (every cached
latent projected up to each head's key and value at every step), alternated round by round: ms per
new token, and the decode step's temporaries (XLA's compiled memory analysis) per cached token.
"""

from __future__ import annotations

import argparse
import contextlib
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
from transformer.model.mla import MultiHeadLatentAttention
from transformer.model.summary import kv_cache_bytes_per_token


def median_time(f, repeats):
    jax.block_until_ready(f())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefilled(model, tokens, positions, P: int, N: int):
    """The cache after the first P tokens of one row, with room for N more."""
    return model.decode(tokens[:, :P], positions[:, :P], model.init_cache(1, P + N), 0)[1]


def decode_steps(model, cache, tokens, positions, P: int, N: int) -> jax.Array:
    """Tokens P..P+N-1 decoded one at a time against the cache (a scan): the last logits of each."""

    def step(cache, t):
        new_BxT = jax.lax.dynamic_slice_in_dim(tokens, t, 1, 1)
        logits, cache = model.decode(new_BxT, jax.lax.dynamic_slice_in_dim(positions, t, 1, 1), cache, t)
        return cache, logits[:, -1]

    return jax.lax.scan(step, cache, jnp.arange(P, P + N))[1]


@contextlib.contextmanager
def expanded_mla():
    """MLA decoding as it ran before absorption: the latents expanded at every step."""
    absorbs = MultiHeadLatentAttention.absorbs
    MultiHeadLatentAttention.absorbs = lambda self, T, cached: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        MultiHeadLatentAttention.absorbs = absorbs  # type: ignore[method-assign]


def mla_decoding(args) -> None:
    """Absorbed against expanded MLA decoding: ms per new token (median of alternated rounds) and
    the decode step's temporaries per cached token."""
    P, N = args.context, args.new
    cfg = resolve(load_config(None, [f"data.seq_len={P + N}", "model.attention=mla", *args.overrides])).model
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (1, P + N), 0, cfg.vocab_size)
    positions = jnp.arange(P + N, dtype=jnp.int32)[None]
    cache = jax.jit(lambda p: prefilled(nnx.merge(graphdef, p), tokens, positions, P, N))(params)

    def compile_decode():
        """The N-token decode loop, traced now (a new function each time: jit caches traces by function)."""

        def decode(params, cache):
            return decode_steps(nnx.merge(graphdef, params), cache, tokens, positions, P, N)

        return jax.jit(decode).lower(params, cache).compile()

    compiled = {"absorbed": compile_decode()}
    with expanded_mla():
        compiled["expanded"] = compile_decode()
    out = {name: f(params, cache) for name, f in compiled.items()}
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for r in range(args.repeats):
        for name in list(compiled)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](params, cache))
            times[name].append((time.perf_counter() - start) / N)
    gap = float(jnp.max(jnp.abs(out["absorbed"] - out["expanded"])))
    print(
        f"MLA decoding, {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, latent {cfg.kv_lora_rank}, "
        f"rope key {cfg.qk_rope_head_dim}, {cfg.compute_dtype}, batch 1, {P}-token prompt, {N} new tokens, "
        f"{args.repeats} alternated rounds; largest logit difference {gap:.1e}"
    )
    for name, f in compiled.items():
        temp = f.memory_analysis().temp_size_in_bytes
        ms = 1e3 * statistics.median(times[name])
        print(f"  {name:<9} {ms:6.2f} ms/token  temporaries {temp:>11,} bytes ({temp / (P + N):,.0f} per cached token)")
    ratio = statistics.median(times["expanded"]) / statistics.median(times["absorbed"])
    print(f"  absorbed decodes {ratio:.2f}x as fast")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mla", action="store_true", help="absorbed against expanded MLA decoding")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.mla:
        mla_decoding(args)
        return
    P, N = args.context, args.new
    cfg = resolve(load_config(None, [f"data.seq_len={P + N}", *args.overrides])).model  # this machine's dtype
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (1, P + N), 0, cfg.vocab_size)
    positions = jnp.arange(P + N, dtype=jnp.int32)[None]

    @functools.partial(jax.jit, static_argnums=0)
    def prefill(graphdef, params, tokens):
        return prefilled(nnx.merge(graphdef, params), tokens, positions, P, N)

    @functools.partial(jax.jit, static_argnums=0)
    def decode(graphdef, params, cache, tokens):
        return decode_steps(nnx.merge(graphdef, params), cache, tokens, positions, P, N)

    @functools.partial(jax.jit, static_argnums=0)
    def recompute(graphdef, params, tokens):  # one new token the uncached way: a full forward at length P
        return nnx.merge(graphdef, params)(tokens[:, :P])[:, -1]

    cache = prefill(graphdef, params, tokens)
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
