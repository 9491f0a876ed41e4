"""Model summary: parameters by component, FLOPs per token and KV-cache bytes per token.

`count_params` is the closed form; tests hold it against the real parameter tree over a grid of
configurations, so the numbers printed by `--dry-run` and used for MFU can be trusted.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.positions import positions_for

if TYPE_CHECKING:
    from transformer.model.transformer import Transformer


def count_params(cfg: ModelConfig) -> int:
    """Closed-form parameter count.

    MHA with d_ff = 4D, no biases and tied embeddings gives the textbook 12*L*D^2 + V*D, plus the
    norm and position parameters; every other variant changes one term below. An encoder-decoder
    adds its encoder stack (the same blocks) with its final norm, and a cross-attention (always
    MHA/GQA, as `mha_params`) with its norms in each decoder block.
    """
    D, L, V, F = cfg.d_model, cfg.n_layers, cfg.padded_vocab, cfg.d_ff
    norm = D * (2 if cfg.norm == "layernorm" and cfg.norm_bias else 1)
    attention = mha_params(cfg)
    if cfg.attention == "mla":  # (the config refuses biases and qk-norm with MLA)
        attention = mla_matmul_params(cfg) + mla_norm_params(cfg)
    ffn_in = (2 if cfg.gated_ffn else 1) * F
    ffn = D * ffn_in + F * D + ((ffn_in + D) if cfg.use_bias else 0)
    per_layer = attention + ffn + cfg.norms_per_block * norm
    total = V * D + L * per_layer
    if cfg.arch == "encoder_decoder":
        cross = mha_params(cfg) + (2 if cfg.norm_position == "sandwich" else 1) * norm
        total += L * cross + cfg.n_encoder_layers * per_layer + (norm if cfg.final_norm else 0)
    # a MoE layer's FFN: the router (and its choice bias) and E routed plus the shared experts (and
    # their gate), instead of the dense FFN
    n_moe = sum(cfg.moe_layers)
    experts = (cfg.n_experts + cfg.n_shared_experts) * expert_params(cfg) + D * cfg.shared_expert_gate
    total += n_moe * ((D + cfg.router_bias) * cfg.n_experts + experts - ffn)
    table = positions_for(cfg).table_shape
    total += math.prod(table) * (1 + cfg.encoder_positions) if table is not None else 0
    total += cfg.token_types * D
    total += norm if cfg.final_norm else 0
    total += norm * (1 + (cfg.arch == "encoder_decoder")) if cfg.embedding_norm else 0
    total += D * D + D * cfg.mlm_head_bias + norm if cfg.mlm_head else 0
    total += V if cfg.output_bias else 0
    bias_table = positions_for(cfg).bias_table_shape
    total += math.prod(bias_table) * (1 + (cfg.arch == "encoder_decoder")) if bias_table is not None else 0
    total += 0 if cfg.tie_embeddings else D * V
    return total


def non_embedding_params(cfg: ModelConfig) -> int:
    """`count_params` less the token (and token type) embeddings, an untied output head and a
    learned position table: the size scaling laws count (Kaplan et al. 2020), which at this
    framework's CPU sizes differs from the total by the embedding table's V*D, often the larger part."""
    table = positions_for(cfg).table_shape
    tables = (cfg.padded_vocab * (1 if cfg.tie_embeddings else 2) + cfg.token_types) * cfg.d_model
    return count_params(cfg) - tables - (math.prod(table) * (1 + cfg.encoder_positions) if table is not None else 0)


def mha_params(cfg: ModelConfig) -> int:
    """One MHA/GQA/MQA attention's parameters: the fused q/k/v and output weights, biases, qk-norm."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attention = D * (N + 2 * K) * H + N * H * D
    attention += ((N + 2 * K) * H if cfg.has_qkv_bias else 0) + (D if cfg.use_bias else 0)
    return attention + (2 * H if cfg.qk_norm else 0)


def expert_params(cfg: ModelConfig) -> int:
    """One expert's weights (no biases): D x moe_d_ff in (twice when gated) and moe_d_ff x D out."""
    return (3 if cfg.gated_ffn else 2) * cfg.d_model * cfg.moe_d_ff if cfg.n_experts else 0


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: all but the n_experts - top_k routed experts it skips per MoE layer."""
    return count_params(cfg) - sum(cfg.moe_layers) * (cfg.n_experts - cfg.top_k) * expert_params(cfg)


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with shapes only (nothing allocated): cheap even for billions of parameters."""
    from transformer.model.transformer import Transformer

    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _component(path: tuple) -> str:
    names = [str(p) for p in path]
    if names[0] in ("embed", "type_embed"):
        return "embedding"
    if names[0] in ("pos_embed", "encoder_pos_embed", "rel_bias", "encoder_rel_bias"):
        return "positions"
    if names[0] in ("head", "mlm_head", "output_bias"):
        return "output head"
    if "norm" in names[-2] or "norm" in names[0]:
        return "norms"
    if names[0] in ("blocks", "encoder_blocks"):
        return {"attn": "attention", "ffn": "ffn", "cross_attn": "cross-attn"}[names[1]]
    if names[0] == "moe_blocks":
        moe = {
            "router": "router",
            "router_bias": "router",
            "w_in": "experts",
            "w_out": "experts",
            "shared": "shared ffn",
            "shared_gate": "shared ffn",
        }
        return "attention" if names[1] == "attn" else moe[names[2]]
    raise ValueError(f"unclassified parameter {'/'.join(names)}")


def params_by_component(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the real (abstract) parameter tree, grouped by component."""
    counts: dict[str, int] = {}
    for path, leaf in nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)):
        name = _component(path)
        counts[name] = counts.get(name, 0) + math.prod(leaf.get_value().shape)
    return counts


def mean_attended_keys(
    cfg: ModelConfig, seq_len: int, windows: tuple[int | None, ...] | None = None, causal: bool | None = None
) -> float:
    """Keys a query attends to, averaged over positions and the layers of `windows` (default: the
    main stack's): causal about T/2, bidirectional T (an encoder's attention is not halved)."""
    windows = cfg.layer_windows if windows is None else windows
    causal = cfg.causal if causal is None else causal
    total = 0
    for window in windows:
        w = seq_len if window is None else min(window, seq_len)
        if causal:  # position t sees min(t + 1, w) keys
            total += w * (w + 1) // 2 + (seq_len - w) * w
        else:  # min(t, w - 1) before it, min(T - 1 - t, w - 1) after it, and itself
            total += 2 * ((w - 1) * w // 2 + (seq_len - w) * (w - 1)) + seq_len
    return total / (len(windows) * seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), matmuls only.

    Each weight used in a matmul costs 2 FLOPs per token forward (the input embedding is a lookup
    and costs none; the output head does, tied or not). Attention scores and the weighted sum cost
    2 * 2 * N * H per attended key, counting only the unmasked keys: about half of them causally,
    all of them in an encoder (MLA: 2 * N * (A + E + Y) per key). MLA is counted as trained, keys
    and values projected up from the latent for every token. An encoder-decoder's figure is per
    target token (`target_len`, default seq_len) of a pair whose input has seq_len tokens: the
    encoder's and the cross-attention's work are spread over the target tokens.
    """
    D, L, V, F = cfg.d_model, cfg.n_layers, cfg.padded_vocab, cfg.d_ff
    T = seq_len if target_len is None else target_len
    matmul_params = L * self_block_matmul_params(cfg) + D * V + (D * D if cfg.mlm_head else 0)
    # a MoE layer: the router and the experts a token is routed to (active parameters; a dropped
    # assignment's or an empty capacity slot's work is not useful work)
    moe_ffn = D * (cfg.n_experts + cfg.shared_expert_gate) + (cfg.top_k + cfg.n_shared_experts) * expert_params(cfg)
    matmul_params += sum(cfg.moe_layers) * (moe_ffn - (3 if cfg.gated_ffn else 2) * D * F)
    forward = 2 * matmul_params + L * per_key_flops(cfg) * mean_attended_keys(cfg, T)
    if cfg.arch == "encoder_decoder":
        forward += encoder_and_cross_flops(cfg, seq_len, T)
    return 3 * forward


def self_block_matmul_params(cfg: ModelConfig) -> int:
    """The weights one token multiplies in a dense block: self-attention and the FFN."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attention = mla_matmul_params(cfg) if cfg.attention == "mla" else D * (N + 2 * K) * H + N * H * D
    return attention + (3 if cfg.gated_ffn else 2) * D * cfg.d_ff


def per_key_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs of one query head set on one attended key: scores, then the weighted values."""
    value_width = cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    return 2 * cfg.n_heads * (cfg.qk_head_dim + value_width)


def encoder_and_cross_flops(cfg: ModelConfig, source_len: int, target_len: int) -> float:
    """Forward FLOPs per target token that an encoder-decoder adds to its decoder stack: per target
    token and decoder layer, cross-attention's queries and output (2 * 2 * D * N * H) and every one
    of the S source keys (4 * N * H each); per source token, each decoder layer's cross keys and
    values (2 * 2 * D * K * H) and the bidirectional encoder stack. Source work is spread over T."""
    D, L, N, K, H = cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    S, E = source_len, cfg.n_encoder_layers
    cross_per_target = L * (2 * 2 * D * N * H + 4 * N * H * S)
    encoder_keys = mean_attended_keys(cfg, S, cfg.encoder_layer_windows, causal=False)
    per_source = L * 2 * 2 * D * K * H + E * (2 * self_block_matmul_params(cfg) + per_key_flops(cfg) * encoder_keys)
    return cross_per_target + per_source * S / target_len


def kv_cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Self-attention cache per decoded token: 2 (K and V) * L * K * H * bytes per element, in the
    compute dtype; MLA: L * (R + E) * bytes, its latent and shared rope key. An encoder decodes
    nothing: 0 (an encoder-decoder adds `cross_cache_bytes_per_source_token`)."""
    if cfg.arch == "encoder":
        return 0
    if cfg.attention == "mla":
        return cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * jnp.dtype(cfg.compute_dtype).itemsize
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def cross_cache_bytes_per_source_token(cfg: ModelConfig) -> int:
    """An encoder-decoder's cross-attention keys and values, kept once per input token while
    decoding: 2 * L * K * H * bytes (0 for the other families)."""
    if cfg.arch != "encoder_decoder":
        return 0
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


# --- multi-head latent attention (model/mla.py), per layer -----------------------------------------


def mla_matmul_params(cfg: ModelConfig) -> int:
    """MLA's weights: queries (full-rank D*N*H, or D*Q + Q*N*H through the query latent), the
    latent D*R and rope key D*E, their up-projections R*N*(A + Y), and the output N*Y*D."""
    D, N, H, Q = cfg.d_model, cfg.n_heads, cfg.qk_head_dim, cfg.q_lora_rank
    queries = D * N * H if Q is None else D * Q + Q * N * H
    keys_values = D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.mla_kv_width * cfg.kv_lora_rank
    return queries + keys_values + N * cfg.v_head_dim * D


def mla_norm_params(cfg: ModelConfig) -> int:
    """The RMSNorm gains on MLA's latents."""
    return cfg.kv_lora_rank + (cfg.q_lora_rank or 0)


def summary_text(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> str:
    """What `--dry-run` prints about the model: its shape, parameters by component, FLOPs (of rows
    of seq_len tokens; an encoder-decoder's of seq_len input and target_len target tokens), KV cache."""
    by_component = params_by_component(cfg)
    total = sum(by_component.values())
    windows = cfg.layer_windows
    attention = "MHA" if cfg.n_kv_heads == cfg.n_heads else "MQA" if cfg.n_kv_heads == 1 else "GQA"
    if cfg.attention == "mla":
        queries = "full-rank" if cfg.q_lora_rank is None else f"latent {cfg.q_lora_rank}"
        attention = (
            f"MLA: kv latent {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim} + nope {cfg.qk_nope_head_dim}, "
            f"v {cfg.v_head_dim}, queries {queries}"
        )
    if any(w is not None for w in windows):
        attention += f", sliding window {cfg.window}"
        if cfg.attention_pattern:
            attention += f" in pattern {','.join(cfg.attention_pattern)}"
    layers = f"{cfg.n_layers} layers"
    if cfg.arch == "encoder_decoder":
        layers = f"{cfg.n_encoder_layers} encoder + {cfg.n_layers} decoder layers (cross-attention)"
    lines = [
        f"model: {cfg.arch}, {layers}, d_model {cfg.d_model}, {cfg.n_heads} heads / {cfg.n_kv_heads} kv heads "
        f"of {cfg.head_dim} ({attention}), ffn {cfg.ffn} d_ff {cfg.d_ff}, positions {cfg.position}, "
        f"{cfg.norm} {cfg.norm_position}, vocab {cfg.vocab_size} (padded {cfg.padded_vocab})",
        "parameters by component:",
    ]
    for name, count in sorted(by_component.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<12} {count:>15,}  {100 * count / total:5.1f}%")
    lines.append(f"  {'total':<12} {total:>15,}")
    if cfg.n_experts:
        active = active_params(cfg)
        lines.append(f"  {'active':<12} {active:>15,}  per token ({cfg.top_k} of {cfg.n_experts} experts)")
        dispatch = "dropless" if cfg.capacity_factor is None else f"capacity factor {cfg.capacity_factor}"
        lines.append(
            f"mixture of experts: {sum(cfg.moe_layers)} of {cfg.n_layers} layers, {cfg.n_experts} experts "
            f"of d_ff {cfg.moe_d_ff} (+{cfg.n_shared_experts} shared), top-{cfg.top_k} {cfg.router} router, "
            f"{dispatch}; FLOPs and MFU count active parameters"
        )
    flops = flops_per_token(cfg, seq_len, target_len)
    if cfg.arch == "encoder_decoder":
        rows = f"input {seq_len}, target {seq_len if target_len is None else target_len} tokens"
        lines.append(f"FLOPs per target token (forward+backward, {rows}): {flops:,.0f}")
    else:
        lines.append(f"FLOPs per token (forward+backward, seq_len {seq_len}): {flops:,.0f}")
    return "\n".join(lines + _cache_lines(cfg))


def _cache_lines(cfg: ModelConfig) -> list[str]:
    """The summary's lines on what decoding keeps per token: none for an encoder."""
    if cfg.arch == "encoder":
        return ["KV cache: none (an encoder does not decode)"]
    form = "L*(kv_lora_rank+qk_rope_head_dim)*bytes" if cfg.attention == "mla" else "2*L*K*H*bytes"
    lines = [f"KV cache per token: {kv_cache_bytes_per_token(cfg):,} bytes ({cfg.compute_dtype}; {form})"]
    if cfg.arch == "encoder_decoder":
        cross = cross_cache_bytes_per_source_token(cfg)
        lines.append(f"cross-attention cache per input token: {cross:,} bytes (2*L*K*H*bytes, made once)")
    return lines
