"""What this backend can run, checked before anything is built: the attention implementation and
compute dtype (a tiny program compiled once per pair), and whether a run's parameters, optimiser
state and activations (`training_bytes`) or a generation's KV cache can fit in a device's memory.
Each refusal is one ConfigError naming the key and what would work. The mesh these sizes are split
over is `sharding.py`'s.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from transformer.config import Config, ConfigError, ModelConfig
from transformer.errors import first_line
from transformer.model import count_params, cross_cache_bytes_per_source_token, kv_cache_bytes_per_token
from transformer.sharding import mesh_shape

# Optimiser moments kept per parameter (Adafactor's are factored: next to nothing). SGD's momentum
# exists only with b1 > 0; AdEMAMix keeps a slow EMA beside Adam's two; Muon keeps one momentum for
# its matrices and AdamW's two for the rest (so at least one); schedule-free AdamW keeps its z sequence
# and Adam's second moment; SOAP Adam's two (its Shampoo factors and bases are per matrix side, not
# counted). A lower bound, as is everything in `training_bytes`: a run is refused only when it
# certainly cannot fit.
OPTIMIZER_COPIES = {
    "adamw": 2,
    "adam": 2,
    "lion": 1,
    "sgd": 1,
    "adafactor": 0,
    "muon": 1,
    "ademamix": 3,
    "schedule_free_adamw": 2,
    "soap": 2,
}


def check_platform(cfg: Config) -> None:
    """Refuse, before anything is built, a run that the schema allows but this backend cannot run:
    an attention implementation or a compute dtype it does not support, or sizes that cannot fit in
    a device's memory. One ConfigError naming the key and what would work."""
    from transformer.accelerator import resolve

    cfg = resolve(cfg)  # attention_impl: auto -> what this backend runs
    check_attention_support(cfg.model)
    check_training_memory(cfg, mesh_shape(cfg, jax.device_count()))


@functools.cache
def _attention_failure(impl: str, dtype: str) -> str | None:
    """Why the backend cannot compile attention's forward and backward pass with this
    implementation in this dtype (the first line of its error), or None if it can. A tiny program:
    e.g. XLA on CPU refuses float16 dot products with float32 accumulation, which
    jax.nn.dot_product_attention asks for; without cuDNN the cudnn implementation cannot run."""
    x = jax.ShapeDtypeStruct((1, 4, 1, 8), jnp.dtype(dtype))

    def loss(q):
        if impl in ("einsum", "blocked"):  # blocked: the same einsums, a block at a time
            out = jnp.einsum("BTNH,BSNH->BNTS", q, q, preferred_element_type=jnp.float32)
        else:
            out = jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation=impl)
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss)).lower(x).compile()
    except Exception as e:  # whatever the backend raises, it is the answer
        return first_line(e)
    return None


def check_attention_support(m: ModelConfig) -> None:
    """Refuse an attention implementation or compute dtype this backend cannot run, saying what can."""
    if m.dtype == "float32" and m.attention_impl != "cudnn":
        return  # runs everywhere
    platform = jax.default_backend()
    # blocked falls back to XLA's attention where a mask is explicit (KV-cache decoding, documents),
    # so it runs in a dtype only if XLA's does too
    needed = (m.attention_impl, "xla") if m.attention_impl == "blocked" else (m.attention_impl,)
    why = next((failure for impl in needed if (failure := _attention_failure(impl, m.dtype))), None)
    if why is None:
        return
    if m.attention_impl == "cudnn":
        impls = [i for i in ("xla", "einsum") if _attention_failure(i, m.dtype) is None]
        use = " or ".join(impls) if impls else "xla or einsum with model.dtype=float32"
        raise ConfigError("model.attention_impl", f"cudnn cannot run on {platform} ({why}); use {use}")
    works = [d for d in ("bfloat16", "float32") if all(_attention_failure(i, d) is None for i in needed)]
    alternatives = " or ".join(works) or "another dtype"
    if m.attention_impl != "einsum" and _attention_failure("einsum", m.dtype) is None:
        alternatives += ", or model.attention_impl=einsum"
    raise ConfigError(
        "model.dtype",
        f"{m.dtype} compute is not supported on {platform} by model.attention_impl={m.attention_impl} "
        f"({why}); use {alternatives}",
    )


def training_bytes(cfg: Config, sizes: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Lower bounds of what one device holds while training, by part: {part: (the key that sizes
    it, bytes)}. Parameters, gradients and optimiser moments; the largest activations, which XLA
    materialises whole: one layer's attention scores (not with cudnn or blocked, which never form them) and
    the float32 logits."""
    m, train = cfg.model, cfg.train
    # dividing by the expert axis too keeps it a lower bound: only the experts are split over it
    shards = sizes["fsdp"] * sizes["tensor"] * sizes["expert"]
    param_bytes = count_params(m) * jnp.dtype(m.param_dtype).itemsize // shards
    copies = 2 + (OPTIMIZER_COPIES[cfg.optim.name] if cfg.optim.name != "sgd" or cfg.optim.b1 else 0)
    rows = max(1, train.batch_size // train.grad_accum // (sizes["data"] * sizes["fsdp"] * sizes["expert"]))
    T = cfg.data.seq_len
    scores = (
        rows * max(1, m.n_heads // sizes["tensor"]) * T * T * 4 if m.attention_impl not in ("cudnn", "blocked") else 0
    )
    return {
        "parameters, gradients and optimiser state": ("model.d_model", param_bytes * copies),
        f"attention scores ({rows} x {m.n_heads} heads x {T} x {T} x 4 bytes)": ("data.seq_len", scores),
        "logits": ("data.seq_len", rows * logit_positions(cfg) * m.padded_vocab // sizes["tensor"] * 4),
    }


def logit_positions(cfg: Config) -> int:
    """Positions of each row whose float32 logits exist at once: all of them, or a chunk's
    (`train.loss_chunk`, see transformer/train/loss.py)."""
    T, chunk = cfg.data.seq_len, cfg.loss_chunk
    micro_batch = cfg.train.batch_size // cfg.train.grad_accum
    return T if not chunk or chunk >= micro_batch * T else max(1, chunk // micro_batch)


def device_memory() -> tuple[int, str]:
    """(bytes one device can hold, its name): the accelerator's limit where the runtime reports
    one, else the host's physical memory shared by its CPU devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"the {device.device_kind} device"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // jax.local_device_count(), f"host memory per {device.platform} device"


def human_bytes(n: float) -> str:
    """'9.3 TB', '512 MB': decimal units, as memory figures are quoted."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_training_memory(cfg: Config, sizes: dict[str, int]) -> None:
    """Refuse a run whose parameters and largest activations cannot fit in one device's memory,
    naming the largest part, its key and the figures (before anything is allocated)."""
    parts = training_bytes(cfg, sizes)
    need = sum(b for _, b in parts.values())
    have, where = device_memory()
    if need <= have:
        return
    part, (key, largest) = max(parts.items(), key=lambda kv: kv[1][1])
    advice = (
        "use a smaller model or shard it over more devices (mesh.fsdp, mesh.tensor)"
        if key.startswith("model")
        else "lower data.seq_len or train.batch_size, or raise train.grad_accum"
    )
    raise ConfigError(
        key,
        f"training needs at least {human_bytes(need)} per device ({part}: {human_bytes(largest)}), "
        f"more than the {human_bytes(have)} of {where}; {advice}",
    )


def check_generation_memory(m: ModelConfig, rows: int, new_tokens: int) -> None:
    """Refuse sampling whose KV cache (a sliding-window layer's is bounded by its window) and
    generated tokens cannot fit in one device's memory. The key named is `--max-new-tokens`."""
    per_token_layer = kv_cache_bytes_per_token(m) // m.n_layers
    cache = rows * sum(new_tokens if w is None else min(w, new_tokens) for w in m.layer_windows) * per_token_layer
    # an encoder-decoder also keeps every decoder layer's cross-attention keys and values of its input
    cache += rows * (m.max_seq_len or 0) * cross_cache_bytes_per_source_token(m)
    need = cache + rows * new_tokens * 4
    have, where = device_memory()
    if need > have:
        raise ConfigError(
            "--max-new-tokens",
            f"{new_tokens} new tokens for {rows} prompt(s) need at least {human_bytes(need)} (the KV cache), "
            f"more than the {human_bytes(have)} of {where}",
        )
