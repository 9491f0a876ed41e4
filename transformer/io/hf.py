"""Hugging Face checkpoints in and out: a directory in the HF layout (`config.json`, `model.safetensors`
or a sharded `model.safetensors.index.json`, tokenizer files) read into this framework's parameters,
and a run's parameters written back as one.

Table-driven: `FAMILIES` holds one entry per HF `model_type`, each a reader of its `config.json`
(the architecture as `model.*` keys; an option this model cannot reproduce is one line naming the
field), a writer of it, and the `Layout` of its tensors: one `Rule` per parameter of ours, naming the
HF tensors it is made of and the two exact conversions between them. A new family (MoE, MLA) is one
more entry, with a new layout where its tensor names differ.

Weights are read with `safetensors`' numpy API one tensor at a time (a large one in blocks of rows),
each file opened only while it is read (its mapped pages are let go with it), and converted into one
host array per parameter, a layer-stacked one filled layer by layer, from which the sharded device
array is made. On a CPU that host array becomes the device buffer itself (no copy); elsewhere it is
copied to the devices and let go. Either way the host holds the model at most once, plus one
parameter. No torch.

The commands that use a whole checkpoint (`eval.py --hf`, `--export-hf`) are `pretrained.py`'s: they
run the trainer and the evaluation, which read weights through this module, so they sit above both.

Axis legend as in model/layers.py; HF linear weights are [out, in], GPT-2's Conv1D ones [in, out].
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from transformer.config import INT_LIMIT, Config, ConfigError, ModelConfig, flatten
from transformer.errors import first_line

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # its special tokens
READ_BLOCK_BYTES = 64 * 2**20  # a larger tensor is read in blocks of rows (see Checkpoint.get)
ALIGNMENT = 64  # bytes: see host_array


class HFError(ConfigError):
    """A checkpoint this converter cannot take (or a run it cannot write): a user mistake, exit 2."""


def _refuse(field: str, message: str) -> HFError:
    return HFError(f"{CONFIG_JSON}: {field}", message)


# --- config.json -> model.* keys --------------------------------------------------------------------

# The model keys a checkpoint leaves to the run: how it executes, trains and is initialised. Every
# other key describes the function it computes: a family's config.json sets some, and the rest must
# be at their defaults (so a key added to ModelConfig later is refused by every family until one
# sets it).
# A mixture of experts' capacity is training's too (inference computes it without drops, as the MoE
# families' code does: ModelConfig.at_inference), and so are its routing losses and the choice bias's
# balancing rule.
FREE = (
    "max_seq_len ffn_multiple vocab_multiple attention_impl dropout attn_dropout init_std init_depth_scaled "
    "param_dtype dtype scan_layers scan_unroll remat init_from capacity_factor moe_aux_loss moe_z_loss "
    "router_bias_rate"
).split()
ARCHITECTURE = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in FREE]


def pinned(keys: dict) -> dict:
    """A family's model keys, with every architecture key it does not set at its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in ARCHITECTURE}
    return defaults | keys


def _field(hf: dict, name: str, default: Any = None, where: str = "") -> Any:
    """config.json's `name` (in the object `where`, "" for the top level), or `default` if it is absent or null."""
    value = hf.get(name, default)
    if value is None and default is None:
        raise _refuse(where + name, "is missing")
    return value if value is not None else default


def _positive(hf: dict, name: str, default: int | None = None, where: str = "") -> int:
    value = _field(hf, name, default, where)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < INT_LIMIT:
        raise _refuse(where + name, f"must be a positive integer below 2^31, got {value!r}")
    return value


def _optional_positive(hf: dict, name: str) -> int | None:
    """A positive integer where null (or no value) means "none" or "derived"."""
    return None if hf.get(name) is None else _positive(hf, name)


def _number(hf: dict, name: str, default: float | None = None, where: str = "") -> float:
    value = _field(hf, name, default, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise _refuse(where + name, f"must be a positive number, got {value!r}")
    return float(value)


def _flag(hf: dict, name: str, default: bool) -> bool:
    value = _field(hf, name, default)
    if not isinstance(value, bool):
        raise _refuse(name, f"must be true or false, got {value!r}")
    return value


def _object(hf: dict, name: str) -> dict:
    """A nested object (null or absent: empty)."""
    value = hf.get(name)
    if value is not None and not isinstance(value, dict):
        raise _refuse(name, f"must be an object, got {value!r}")
    return value or {}


def _rope_params(hf: dict) -> tuple[str, dict, str]:
    """(where RoPE's parameters are, them, the rope type): `rope_parameters` (transformers 5) or `rope_scaling`."""
    where = "rope_parameters" if hf.get("rope_parameters") not in (None, {}) else "rope_scaling"
    params = _object(hf, where)
    return where, params, params.get("rope_type", params.get("type", "default"))


def _rope_keys(hf: dict) -> dict:
    """RoPE theta and scaling, from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    where, params, kind = _rope_params(hf)
    theta = _number(params, "rope_theta", None, f"{where}.") if params.get("rope_theta") is not None else None
    keys = dict(rope_theta=theta or _number(hf, "rope_theta", 10000.0))
    if kind == "default":
        return keys
    if kind == "linear":
        return keys | dict(rope_scaling="linear", rope_factor=_number(params, "factor", where=f"{where}."))
    if kind == "llama3":
        return keys | dict(
            rope_scaling="llama3",
            rope_factor=_number(params, "factor", where=f"{where}."),
            rope_low_freq_factor=_number(params, "low_freq_factor", where=f"{where}."),
            rope_high_freq_factor=_number(params, "high_freq_factor", where=f"{where}."),
            rope_original_max_len=_positive(params, "original_max_position_embeddings", where=f"{where}."),
        )
    if kind == "yarn":
        return keys | _yarn_keys(params, where)
    raise _refuse(f"{where}.rope_type", f"{kind!r} is not supported (default, linear, llama3, yarn)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature 0.1 * mscale * ln(factor) + 1 (1 where nothing is stretched), as transformers."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_keys(params: dict, where: str) -> dict:
    """YaRN, as transformers computes it: the rotated parts times `attention_factor`, or where it is
    absent the ratio of `mscale`'s temperature to `mscale_all_dim`'s where both are set, else YaRN's."""
    if params.get("truncate", True) is not True:
        raise _refuse(f"{where}.truncate", "false: here the correction range is rounded to whole dimensions")
    factor = _number(params, "factor", where=f"{where}.")
    factor_of = params.get("attention_factor")
    if factor_of is not None:
        factor_of = _number(params, "attention_factor", where=f"{where}.")
    elif params.get("mscale") and params.get("mscale_all_dim"):
        mscale, all_dim = (_number(params, n, where=f"{where}.") for n in ("mscale", "mscale_all_dim"))
        factor_of = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return dict(
        rope_scaling="yarn",
        rope_factor=factor,
        rope_original_max_len=_positive(params, "original_max_position_embeddings", where=f"{where}."),
        rope_beta_fast=_number(params, "beta_fast", 32.0, f"{where}."),
        rope_beta_slow=_number(params, "beta_slow", 1.0, f"{where}."),
        rope_attention_factor=factor_of,
    )


GATED_ACTIVATIONS = {
    "silu": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "gelu": "geglu_exact",
    "relu": "reglu",
}
MLP_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}


# the HF names each of ours is written as (gelu_new, an alias of the tanh GELU, is read only)
GATED_NAMES = {ours: name for name, ours in GATED_ACTIVATIONS.items() if name != "gelu_new"}
MLP_NAMES = {ours: name for name, ours in MLP_ACTIVATIONS.items() if name != "gelu_new"}


def _mha_heads(hf: dict, width: str, heads: str) -> tuple[int, int]:
    """(model width, heads) of a family whose heads split the width evenly (head_dim = width / heads)."""
    D, N = _positive(hf, width), _positive(hf, heads)
    if D % N:
        raise _refuse(width, f"{D} is not a multiple of {heads} ({N})")
    return D, N


def _choice(hf: dict, name: str, table: dict[str, str]) -> str:
    value = _field(hf, name)
    if not isinstance(value, str) or value not in table:
        raise _refuse(name, f"{value!r} is not supported ({', '.join(table)})")
    return table[value]


def _full_attention_only(hf: dict) -> None:
    """Qwen's per-layer sliding windows are not reproduced: every layer must attend fully."""
    if _flag(hf, "use_sliding_window", False):
        raise _refuse("use_sliding_window", "true is not supported (per-layer sliding windows)")
    kinds = hf.get("layer_types") or ["full_attention"]
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise _refuse("layer_types", f"must be a list of layer kinds, got {kinds!r}")
    if set(kinds) != {"full_attention"}:
        raise _refuse("layer_types", f"only full_attention layers are supported, got {sorted(set(kinds))}")


def _llama_keys(hf: dict) -> dict:
    """The decoder shared by Llama, Mistral and Qwen: RoPE, RMSNorm, a gated FFN, GQA."""
    D, N = _positive(hf, "hidden_size"), _positive(hf, "num_attention_heads")
    attention_bias, mlp_bias = _flag(hf, "attention_bias", False), _flag(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise _refuse("attention_bias", f"{attention_bias} with mlp_bias {mlp_bias}: biases go on all or none")
    return dict(
        d_model=D,
        n_layers=_positive(hf, "num_hidden_layers"),
        n_heads=N,
        n_kv_heads=_optional_positive(hf, "num_key_value_heads") or N,
        head_dim=_optional_positive(hf, "head_dim") or D // N,
        d_ff=_positive(hf, "intermediate_size"),
        vocab_size=_positive(hf, "vocab_size"),
        position="rope",
        norm="rmsnorm",
        norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        ffn=_choice(hf, "hidden_act", GATED_ACTIVATIONS),
        use_bias=attention_bias,
        tie_embeddings=_flag(hf, "tie_word_embeddings", False),
        **_rope_keys(hf),
    )


def _mistral_keys(hf: dict) -> dict:
    return _llama_keys(hf) | dict(window=_optional_positive(hf, "sliding_window"))


def _qwen2_keys(hf: dict) -> dict:
    _full_attention_only(hf)
    return _llama_keys(hf) | dict(qkv_bias=True)


def _qwen3_keys(hf: dict) -> dict:
    _full_attention_only(hf)
    return _llama_keys(hf) | dict(qk_norm=True)


def _mixtral_keys(hf: dict) -> dict:
    """Mistral's decoder with every FFN a softmax top-k mixture of `intermediate_size` experts."""
    top_k = _positive(hf, "num_experts_per_tok", 2)
    if top_k == 1:
        raise _refuse("num_experts_per_tok", "1: Mixtral renormalises a lone gate to 1; this model's is the router's")
    keys = _mistral_keys(hf)
    return keys | dict(n_experts=_positive(hf, "num_local_experts", 8), top_k=top_k, moe_d_ff=keys["d_ff"])


def _qwen_moe_keys(hf: dict) -> dict:
    """The routed experts of Qwen2-MoE and Qwen3-MoE: softmax top-k, renormalised or not, of
    `moe_intermediate_size`, in every `decoder_sparse_step`-th layer (the others dense, of
    `intermediate_size`)."""
    if _field(hf, "mlp_only_layers", []) != []:
        raise _refuse("mlp_only_layers", "dense layers at chosen indices: here every decoder_sparse_step-th is MoE")
    top_k, norm = _positive(hf, "num_experts_per_tok"), _flag(hf, "norm_topk_prob", False)
    if top_k == 1 and norm:
        raise _refuse("norm_topk_prob", "true with one expert per token makes its gate 1; this model's is the router's")
    return dict(
        n_experts=_positive(hf, "num_experts" if "num_experts" in hf else "num_local_experts"),
        top_k=top_k,
        moe_d_ff=_positive(hf, "moe_intermediate_size"),
        moe_every=_positive(hf, "decoder_sparse_step", 1),
        renormalize_gates=norm or top_k == 1,
    )


def _qwen2_moe_keys(hf: dict) -> dict:
    """Qwen2's decoder with Qwen MoE layers, and beside the routed experts a gated shared one."""
    keys = _qwen2_keys(hf) | _qwen_moe_keys(hf) | dict(qkv_bias=_flag(hf, "qkv_bias", True))
    shared, width = _positive(hf, "shared_expert_intermediate_size"), keys["moe_d_ff"]
    if shared % width:
        raise _refuse(
            "shared_expert_intermediate_size", f"{shared} is not a multiple of moe_intermediate_size ({width})"
        )
    return keys | dict(n_shared_experts=shared // width, shared_expert_gate=True)


def _qwen3_moe_keys(hf: dict) -> dict:
    return _qwen3_keys(hf) | _qwen_moe_keys(hf)


def _count(hf: dict, name: str, default: int) -> int:
    value = _field(hf, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < INT_LIMIT:
        raise _refuse(name, f"must be a whole number >= 0, got {value!r}")
    return value


def _deepseek_attention(hf: dict) -> dict:
    """DeepSeek's MLA, and YaRN's temperature on all of its logits (`mscale_all_dim`: the softmax scale
    times its temperature squared, as transformers' yarn_apply_mscale)."""
    N = _positive(hf, "num_attention_heads")
    if _field(hf, "num_key_value_heads", N) != N:
        raise _refuse("num_key_value_heads", f"must equal num_attention_heads ({N}): MLA's latent serves every head")
    if _number(hf, "rms_norm_eps", 1e-6) != 1e-6:
        raise _refuse("rms_norm_eps", "is not 1e-6: DeepSeek's latent norms take 1e-6 whatever it says, here one eps")
    nope, rope = _positive(hf, "qk_nope_head_dim"), _positive(hf, "qk_rope_head_dim")
    keys = dict(
        attention="mla",
        n_heads=N,
        n_kv_heads=N,
        head_dim=_positive(hf, "hidden_size") // N,  # what MLA's sizes would derive from (all are given)
        kv_lora_rank=_positive(hf, "kv_lora_rank"),
        q_lora_rank=_optional_positive(hf, "q_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_positive(hf, "v_head_dim"),
        **_rope_keys(hf),
    )
    where, params, kind = _rope_params(hf)
    if kind == "yarn" and params.get("mscale_all_dim"):
        temperature = yarn_mscale(keys["rope_factor"], _number(params, "mscale_all_dim", where=f"{where}."))
        keys["attn_scale"] = (nope + rope) ** -0.5 * temperature * temperature
    return keys


def _deepseek_keys(hf: dict, defaults: dict) -> dict:
    """The decoder of DeepSeek-V2 and V3: MLA, RMSNorm, gated FFNs; after the first
    `first_k_dense_replace` layers, mixtures of routed experts of `moe_intermediate_size` with
    `n_shared_experts` beside them (`defaults`: the family's own for fields config.json leaves out)."""
    for name in ("attention_bias", "mlp_bias"):
        if _flag(hf, name, False):
            raise _refuse(name, "true: MLA and DeepSeek's experts have no biases here")
    if _field(hf, "moe_layer_freq", 1) != 1:
        raise _refuse("moe_layer_freq", "is not 1: here every layer after first_k_dense_replace is MoE")
    keys = dict(
        d_model=_positive(hf, "hidden_size"),
        n_layers=_positive(hf, "num_hidden_layers"),
        d_ff=_positive(hf, "intermediate_size"),
        vocab_size=_positive(hf, "vocab_size"),
        position="rope",
        norm="rmsnorm",
        ffn=_choice(hf, "hidden_act", GATED_ACTIVATIONS),
        tie_embeddings=_flag(hf, "tie_word_embeddings", False),
        **_deepseek_attention(hf),
    )
    first_dense = _count(hf, "first_k_dense_replace", defaults["first_k_dense_replace"])
    if first_dense >= keys["n_layers"]:  # no layer is MoE: a dense MLA model
        return keys
    return keys | dict(
        n_experts=_positive(hf, "n_routed_experts", defaults.get("n_routed_experts")),
        top_k=_positive(hf, "num_experts_per_tok", defaults.get("num_experts_per_tok")),
        moe_d_ff=_positive(hf, "moe_intermediate_size", defaults.get("moe_intermediate_size")),
        n_shared_experts=_count(hf, "n_shared_experts", defaults["n_shared_experts"]),
        moe_first_dense=first_dense,
        routed_scale=_number(hf, "routed_scaling_factor", defaults["routed_scaling_factor"]),
    )


def _deepseek_v2_keys(hf: dict) -> dict:
    """DeepSeek-V2: a softmax router, its top-k not renormalised (transformers' DeepSeek-V2 never
    does), `group_limited_greedy` choosing within the `topk_group` groups of best experts."""
    defaults = dict(first_k_dense_replace=0, n_routed_experts=64, n_shared_experts=2, routed_scaling_factor=1.0)
    keys = _deepseek_keys(hf, defaults | dict(moe_intermediate_size=1407))
    if "n_experts" not in keys:
        return keys
    if _flag(hf, "norm_topk_prob", False) and keys["top_k"] > 1:
        raise _refuse("norm_topk_prob", "true: transformers' DeepSeek-V2 ignores it, its reference code renormalises")
    method = _field(hf, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise _refuse("topk_method", f"{method!r} is not supported (greedy, group_limited_greedy)")
    keys["renormalize_gates"] = keys["top_k"] == 1  # a lone gate is the router's score either way
    if method == "greedy":
        return keys
    return keys | dict(router_groups=_positive(hf, "n_group"), router_topk_groups=_positive(hf, "topk_group"))


def _deepseek_v3_keys(hf: dict) -> dict:
    """DeepSeek-V3: sigmoid scores, experts chosen by the scores plus `e_score_correction_bias` from
    the `topk_group` groups whose two best biased scores sum highest, gated by the unbiased scores
    (renormalised with `norm_topk_prob`)."""
    if not _flag(hf, "rope_interleave", True):
        raise _refuse("rope_interleave", "false: here DeepSeek-V3's rotary rows are read as interleaved pairs")
    defaults = dict(first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, routed_scaling_factor=2.5)
    keys = _deepseek_keys(hf, defaults | dict(num_experts_per_tok=8, moe_intermediate_size=2048))
    if "n_experts" not in keys:
        return keys
    norm = _flag(hf, "norm_topk_prob", True)
    if keys["top_k"] == 1 and norm:
        raise _refuse("norm_topk_prob", "true with one expert per token makes its gate 1; this model's is the router's")
    groups = _positive(hf, "n_group", 8)
    return keys | dict(
        router="sigmoid",
        router_bias=True,
        renormalize_gates=norm or keys["top_k"] == 1,
        router_groups=groups,
        router_topk_groups=_positive(hf, "topk_group", 4),
        router_group_score="top2" if groups > 1 else "max",
    )


def _gemma_layers(hf: dict, n_layers: int) -> dict:
    """Which layers slide (`layer_types`, else every `sliding_window_pattern`-th is global: Gemma 2
    alternates, local first) as model.window and model.attention_pattern."""
    types = hf.get("layer_types")
    if types is None:
        period = _positive(hf, "sliding_window_pattern", 2)
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    if not isinstance(types, list) or len(types) != n_layers or any(t not in kinds for t in types):
        raise _refuse("layer_types", f"must list {n_layers} of sliding_attention, full_attention, got {types!r}")
    pattern = tuple(kinds[t] for t in types)
    if "local" not in pattern:
        return dict(window=None)
    window = _positive(hf, "sliding_window")
    return dict(window=window) if "global" not in pattern else dict(window=window, attention_pattern=pattern)


def _gemma_rope(hf: dict) -> dict:
    """The global layers' theta and scaling and the local ones' (Gemma 3: `rope_parameters` by layer
    type, or `rope_theta`, `rope_scaling` for the global layers alone and `rope_local_base_freq`;
    Gemma 2: one for all); the local layers scaled as the global ones, or not at all."""
    by_type = _object(hf, "rope_parameters")
    if "full_attention" in by_type:
        full = _rope_keys({"rope_parameters": _object(by_type, "full_attention")})
        local = _rope_keys({"rope_parameters": _object(by_type, "sliding_attention")})
    elif "rope_local_base_freq" in hf:  # transformers 4's Gemma 3: rope_scaling is the global layers'
        full = _rope_keys(hf)
        local = dict(rope_theta=_number(hf, "rope_local_base_freq"))
    else:
        full = local = _rope_keys(hf)
    scaling, local_scaling = ({k: v for k, v in d.items() if k != "rope_theta"} for d in (full, local))
    if local_scaling and local_scaling != scaling:
        raise _refuse("rope_parameters", "the local layers' RoPE scaling is not the global layers': not supported")
    return full | dict(rope_local_theta=local["rope_theta"], rope_local_scaling=bool(local_scaling) or not scaling)


def _gemma_keys(hf: dict) -> dict:
    """Gemma 2: sandwich RMSNorms with gains kept as offsets from 1, embeddings times sqrt(D), tanh
    GeGLU, local and global layers, soft-capped attention and output logits, tied embeddings."""
    for name in ("attention_bias", "use_bidirectional_attention"):
        if _flag(hf, name, False):
            raise _refuse(name, "true is not supported")
    D, N, L, H = (_positive(hf, n) for n in ("hidden_size", "num_attention_heads", "num_hidden_layers", "head_dim"))
    scalar = _positive(hf, "query_pre_attn_scalar", H)
    layers, rope = _gemma_layers(hf, L), _gemma_rope(hf)
    if layers["window"] is None or rope["rope_local_theta"] == rope["rope_theta"]:
        rope["rope_local_theta"] = None
    if layers["window"] is None:  # no local layer to keep unscaled
        rope["rope_local_scaling"] = True
    caps = {
        ours: None if hf.get(name) is None else _number(hf, name)
        for ours, name in (("attn_softcap", "attn_logit_softcapping"), ("logit_softcap", "final_logit_softcapping"))
    }
    return dict(
        d_model=D,
        n_layers=L,
        n_heads=N,
        n_kv_heads=_optional_positive(hf, "num_key_value_heads") or N,
        head_dim=H,
        d_ff=_positive(hf, "intermediate_size"),
        vocab_size=_positive(hf, "vocab_size"),
        position="rope",
        norm="rmsnorm",
        norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        norm_position="sandwich",
        norm_offset=True,
        embed_scale=True,
        ffn=_choice(hf, "hidden_activation", GATED_ACTIVATIONS),
        tie_embeddings=_flag(hf, "tie_word_embeddings", True),
        attn_scale=None if scalar == H else scalar**-0.5,
        **caps,
        **layers,
        **rope,
    )


def _gemma3_keys(hf: dict) -> dict:
    """Gemma 3's text model: Gemma 2's, with qk-norm (gains offset from 1 too) and a theta per layer kind."""
    return _gemma_keys(hf) | dict(qk_norm=True)


def _bert_keys(hf: dict) -> dict:
    """BERT: a Post-LN encoder with learned positions and token types (model.token_types; a single
    type's row joins the positions), a LayerNorm on the embeddings, biases everywhere, a GELU MLP and
    the prediction head, its decoder the word embeddings."""
    for name in ("is_decoder", "add_cross_attention"):
        if _flag(hf, name, False):
            raise _refuse(name, "true is not supported (an encoder is read here)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise _refuse("position_embedding_type", f"{hf['position_embedding_type']!r} is not supported (absolute)")
    if not _flag(hf, "tie_word_embeddings", True):
        raise _refuse("tie_word_embeddings", "false is not supported (the prediction head decodes with the embeddings)")
    D, N = _mha_heads(hf, "hidden_size", "num_attention_heads")
    return dict(
        arch="encoder",
        d_model=D,
        n_layers=_positive(hf, "num_hidden_layers"),
        n_heads=N,
        n_kv_heads=N,
        head_dim=D // N,
        d_ff=_positive(hf, "intermediate_size"),
        vocab_size=_positive(hf, "vocab_size"),
        max_seq_len=_positive(hf, "max_position_embeddings"),
        position="learned",
        norm="layernorm",
        norm_eps=_number(hf, "layer_norm_eps", 1e-12),
        norm_position="post",
        embedding_norm=True,
        ffn=_choice(hf, "hidden_act", MLP_ACTIVATIONS),
        use_bias=True,
        tie_embeddings=True,
        mlm_head=True,
        output_bias=True,
        token_types=0 if (types := _positive(hf, "type_vocab_size", 2)) == 1 else types,
    )


def _modernbert_layers(hf: dict, n_layers: int) -> dict:
    """ModernBERT's global and local layers (`layer_types`, else every `global_attn_every_n_layers`-th
    global, the first one included) and their thetas; a local layer sees `local_attention` / 2
    tokens either way (transformers' |q - k| <= local_attention // 2)."""
    if hf.get("layer_types") is None:
        every = _positive(hf, "global_attn_every_n_layers", 3)
        types = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(n_layers)]
        hf = hf | {"layer_types": types}
    hf = hf | {"sliding_window": _positive(hf, "local_attention", 128) // 2 + 1}
    keys = _gemma_layers(hf, n_layers)
    by_type = _object(hf, "rope_parameters")
    if "full_attention" in by_type:
        keys |= _gemma_rope(hf)
    else:  # transformers 4's fields
        keys |= dict(rope_theta=_number(hf, "global_rope_theta", 160000.0))
        keys |= dict(rope_local_theta=_number(hf, "local_rope_theta", 10000.0))
    if keys["window"] is None:  # no local layer: no local theta
        keys["rope_local_theta"] = None
    return keys


def _modernbert_keys(hf: dict) -> dict:
    """ModernBERT: a Pre-LN encoder with RoPE (a theta for the global layers and one for the local),
    LayerNorms with or without biases, a LayerNorm on the embeddings serving as the first layer's
    attention norm, an erf-GeGLU FFN, no projection biases, and the prediction head (its dense layer
    with or without a bias, the FFN's activation, a norm) decoding with the embeddings and a bias."""
    for name in ("attention_bias", "mlp_bias"):
        if _flag(hf, name, False):
            raise _refuse(name, "true is not supported (ModernBERT's projections have no biases here)")
    ffn = _choice(hf, "hidden_activation", GATED_ACTIVATIONS)
    if _choice(hf, "classifier_activation", GATED_ACTIVATIONS) != ffn:
        raise _refuse("classifier_activation", "differs from hidden_activation: here the head takes the FFN's")
    D, N = _mha_heads(hf, "hidden_size", "num_attention_heads")
    n_layers = _positive(hf, "num_hidden_layers")
    return dict(
        arch="encoder",
        d_model=D,
        n_layers=n_layers,
        n_heads=N,
        n_kv_heads=N,
        head_dim=D // N,
        d_ff=_positive(hf, "intermediate_size"),
        vocab_size=_positive(hf, "vocab_size"),
        position="rope",
        norm="layernorm",
        norm_bias=_flag(hf, "norm_bias", False),
        norm_eps=_number(hf, "norm_eps", 1e-5),
        embedding_norm=True,
        first_attn_norm=False,
        ffn=ffn,
        tie_embeddings=_flag(hf, "tie_word_embeddings", True),
        mlm_head=True,
        mlm_head_bias=_flag(hf, "classifier_bias", False),
        output_bias=_flag(hf, "decoder_bias", True),
        **_modernbert_layers(hf, n_layers),
    )


def _roberta_keys(hf: dict) -> dict:
    """RoBERTa: BERT's, with positions counted from padding_idx + 1 = 2 (the table's first rows unused)."""
    if _field(hf, "pad_token_id", 1) != 1:
        raise _refuse("pad_token_id", f"{hf['pad_token_id']!r}: positions are read as counted from padding id 1")
    keys = _bert_keys(hf)
    if keys["max_seq_len"] <= ROBERTA_OFFSET:
        raise _refuse("max_position_embeddings", f"must exceed {ROBERTA_OFFSET} (RoBERTa's first position is 2)")
    return keys | dict(max_seq_len=keys["max_seq_len"] - ROBERTA_OFFSET)


def _bart_keys(hf: dict) -> dict:
    """BART: a Post-LN encoder-decoder with biases everywhere, a GELU MLP, a learned position table
    per stack (counted from 2) and a LayerNorm on each stack's embeddings, tied embeddings and a bias
    on the logits."""
    for ours, (enc, dec) in {
        "n_heads": ("encoder_attention_heads", "decoder_attention_heads"),
        "d_ff": ("encoder_ffn_dim", "decoder_ffn_dim"),
    }.items():
        if _positive(hf, enc) != _positive(hf, dec):
            raise _refuse(enc, f"differs from {dec}: this model's stacks share model.{ours}")
    if not _flag(hf, "tie_word_embeddings", True):
        raise _refuse("tie_word_embeddings", "false is not supported (BART's head is its shared embeddings)")
    D, N = _mha_heads(hf, "d_model", "decoder_attention_heads")
    return dict(
        arch="encoder_decoder",
        d_model=D,
        n_layers=_positive(hf, "decoder_layers"),
        n_encoder_layers=_positive(hf, "encoder_layers"),
        n_heads=N,
        n_kv_heads=N,
        head_dim=D // N,
        d_ff=_positive(hf, "decoder_ffn_dim"),
        vocab_size=_positive(hf, "vocab_size"),
        max_seq_len=_positive(hf, "max_position_embeddings"),
        position="learned",
        encoder_positions=True,
        norm="layernorm",
        norm_eps=1e-5,  # BART's LayerNorms keep torch's default
        norm_position="post",
        embedding_norm=True,
        embed_scale=_flag(hf, "scale_embedding", False),
        ffn=_choice(hf, "activation_function", MLP_ACTIVATIONS),
        use_bias=True,
        tie_embeddings=True,
        output_bias=True,
    )


# gated-gelu is transformers' tanh GELU (gelu_new), plain gelu its erf one
T5_FFNS = {
    "gated-gelu": "geglu",
    "gated-silu": "swiglu",
    "gated-relu": "reglu",
    "relu": "relu",
    "gelu": "gelu_exact",
    "gelu_new": "gelu",
}


def _t5_keys(hf: dict) -> dict:
    """T5 (v1.0: a plain ReLU FFN, the tied head's input scaled by d_model^-0.5), T5 v1.1 and Flan-T5
    (a gated FFN, the head tied or its own, unscaled): a Pre-LN encoder-decoder with RMSNorms, a
    relative position bias per stack (t5_relative), unscaled attention logits, no biases.
    (transformers 4 wrote `tie_word_embeddings` and scaled a tied head; 5 writes
    `scale_decoder_outputs`.)"""
    tied = _flag(hf, "tie_word_embeddings", True)
    D, N = _positive(hf, "d_model"), _positive(hf, "num_heads")
    return dict(
        arch="encoder_decoder",
        d_model=D,
        n_layers=_optional_positive(hf, "num_decoder_layers") or _positive(hf, "num_layers"),
        n_encoder_layers=_positive(hf, "num_layers"),
        n_heads=N,
        n_kv_heads=N,
        head_dim=_positive(hf, "d_kv"),
        d_ff=_positive(hf, "d_ff"),
        vocab_size=_positive(hf, "vocab_size"),
        position="t5_relative",
        rel_buckets=_positive(hf, "relative_attention_num_buckets", 32),
        rel_max_distance=_positive(hf, "relative_attention_max_distance", 128),
        norm="rmsnorm",
        norm_eps=_number(hf, "layer_norm_epsilon", 1e-6),
        ffn=_choice(hf, "feed_forward_proj", T5_FFNS),
        attn_scale=1.0,
        tie_embeddings=tied,
        scale_head_input=_flag(hf, "scale_decoder_outputs", tied),
    )


def _gpt2_keys(hf: dict) -> dict:
    for name in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if _flag(hf, name, False):
            raise _refuse(name, "true is not supported")
    D, N = _mha_heads(hf, "n_embd", "n_head")
    return dict(
        d_model=D,
        n_layers=_positive(hf, "n_layer"),
        n_heads=N,
        n_kv_heads=N,
        head_dim=D // N,
        d_ff=_optional_positive(hf, "n_inner") or 4 * D,
        vocab_size=_positive(hf, "vocab_size"),
        max_seq_len=_positive(hf, "n_positions"),
        position="learned",
        norm="layernorm",
        norm_eps=_number(hf, "layer_norm_epsilon", 1e-5),
        ffn=_choice(hf, "activation_function", MLP_ACTIVATIONS),
        attn_scale=None if _flag(hf, "scale_attn_weights", True) else 1.0,
        use_bias=True,
        tie_embeddings=_flag(hf, "tie_word_embeddings", True),
    )


# --- model.* keys -> config.json --------------------------------------------------------------------


def _rope_json(m: ModelConfig) -> dict:
    params: dict[str, Any] = {"rope_theta": m.rope_theta, "rope_type": "default"}
    if m.rope_scaling == "linear":
        params |= {"rope_type": "linear", "factor": m.rope_factor}
    elif m.rope_scaling == "yarn":
        params |= {
            "rope_type": "yarn",
            "factor": m.rope_factor,
            "original_max_position_embeddings": m.rope_original_max_len,
            "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow,
        }
        if m.rope_attention_factor is not None:
            params["attention_factor"] = m.rope_attention_factor
    elif m.rope_scaling == "llama3":
        params |= {
            "rope_type": "llama3",
            "factor": m.rope_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_len,
        }
    # both spellings: transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling
    scaling = None if m.rope_scaling == "none" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params, "rope_theta": m.rope_theta, "rope_scaling": scaling}


def _max_positions(m: ModelConfig) -> int:
    """config.json's max_position_embeddings: past the original context (llama3), YaRN's stretched one."""
    stretched = round(m.rope_original_max_len * m.rope_factor) if m.rope_scaling == "yarn" else 0
    return max(m.max_seq_len or 0, m.rope_original_max_len + 1, stretched)


def _llama_json(m: ModelConfig) -> dict:
    return {
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": GATED_NAMES[m.ffn],
        "max_position_embeddings": _max_positions(m),
        "rms_norm_eps": m.norm_eps,
        "attention_bias": m.use_bias,
        "mlp_bias": m.use_bias,
        "tie_word_embeddings": m.tie_embeddings,
        "vocab_size": m.vocab_size,
        **_rope_json(m),
    }


def _mistral_json(m: ModelConfig) -> dict:
    return {k: v for k, v in _llama_json(m).items() if k not in ("attention_bias", "mlp_bias")} | {
        "sliding_window": m.window
    }


def _qwen_json(m: ModelConfig) -> dict:
    return {k: v for k, v in _llama_json(m).items() if k not in ("attention_bias", "mlp_bias")} | {
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * m.n_layers,
    }


def _mixtral_json(m: ModelConfig) -> dict:
    return _mistral_json(m) | {"num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k}


def _qwen_moe_json(m: ModelConfig) -> dict:
    return _qwen_json(m) | {
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.moe_d_ff,
        "decoder_sparse_step": m.moe_every,
        "mlp_only_layers": [],
        "norm_topk_prob": m.renormalize_gates and m.top_k > 1,
    }


def _qwen2_moe_json(m: ModelConfig) -> dict:
    return _qwen_moe_json(m) | {"shared_expert_intermediate_size": m.n_shared_experts * m.moe_d_ff}


def _mscale_all_dim(m: ModelConfig) -> float | None:
    """The `mscale_all_dim` _deepseek_attention reads back as `m.attn_scale` (None: no such value)."""
    if m.attn_scale is None or m.rope_scaling != "yarn" or m.rope_factor <= 1:
        return None
    base, ln = m.qk_head_dim**-0.5, math.log(m.rope_factor)
    guess = (math.sqrt(m.attn_scale / base) - 1) / (0.1 * ln)
    for candidate in (guess, *(guess + guess * k * 2**-52 for k in range(-64, 65))):  # rounding's neighbours
        temperature = yarn_mscale(m.rope_factor, candidate)
        if base * temperature * temperature == m.attn_scale:
            return candidate
    return None


def _deepseek_json(m: ModelConfig) -> dict:
    rope = _rope_json(m)
    mscale_all_dim = _mscale_all_dim(m)
    if mscale_all_dim is not None:
        rope["rope_parameters"]["mscale_all_dim"] = rope["rope_scaling"]["mscale_all_dim"] = mscale_all_dim
    config = {
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "hidden_act": GATED_NAMES[m.ffn],
        "max_position_embeddings": _max_positions(m),
        "rms_norm_eps": m.norm_eps,
        "attention_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "vocab_size": m.vocab_size,
        "first_k_dense_replace": m.moe_first_dense if m.n_experts else m.n_layers,
        **rope,
    }
    if not m.n_experts:
        return config
    return config | {
        "n_routed_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.moe_d_ff,
        "n_shared_experts": m.n_shared_experts,
        "routed_scaling_factor": m.routed_scale,
        "n_group": m.router_groups,
        "topk_group": m.router_topk_groups,
    }


def _deepseek_v2_json(m: ModelConfig) -> dict:
    method = "group_limited_greedy" if m.router_groups > 1 else "greedy"
    return _deepseek_json(m) | ({"topk_method": method, "norm_topk_prob": False} if m.n_experts else {})


def _deepseek_v3_json(m: ModelConfig) -> dict:
    extra = {"norm_topk_prob": m.renormalize_gates and m.top_k > 1} if m.n_experts else {}
    return _deepseek_json(m) | {"rope_interleave": True} | extra


def _gemma_json(m: ModelConfig) -> dict:
    rope = {}
    if m.qk_norm:  # Gemma 3: a theta per kind of layer, and the global layers' scaling, the local's too or none
        full = _rope_json(m)["rope_parameters"]
        local = full if m.rope_local_scaling else {"rope_type": "default"}
        local = local | {"rope_theta": m.rope_theta if m.rope_local_theta is None else m.rope_local_theta}
        rope = {"rope_parameters": {"full_attention": full, "sliding_attention": local}, "rope_scaling": None}
    return {k: v for k, v in _llama_json(m).items() if k not in ("hidden_act", "mlp_bias")} | {
        "hidden_activation": GATED_NAMES[m.ffn],
        "query_pre_attn_scalar": m.head_dim if m.attn_scale is None else round(m.attn_scale**-2),
        "attn_logit_softcapping": m.attn_softcap,
        "final_logit_softcapping": m.logit_softcap,
        "sliding_window": m.window,
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in m.layer_windows],
        **rope,
    }


def _bert_json(m: ModelConfig) -> dict:
    return {
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "intermediate_size": m.d_ff,
        "hidden_act": MLP_NAMES[m.ffn],
        "max_position_embeddings": m.max_seq_len,
        "type_vocab_size": max(1, m.token_types),  # none: one, all zero
        "layer_norm_eps": m.norm_eps,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": True,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }


def _modernbert_json(m: ModelConfig) -> dict:
    kinds = ["sliding_attention" if w is not None else "full_attention" for w in m.layer_windows]
    local = m.rope_theta if m.rope_local_theta is None else m.rope_local_theta
    thetas = {"full_attention": m.rope_theta, "sliding_attention": local}
    act = GATED_NAMES[m.ffn]
    return {
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "vocab_size": m.vocab_size,
        "norm_eps": m.norm_eps,
        "norm_bias": m.norm_bias,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_activation": act,
        "classifier_activation": act,
        "classifier_bias": m.mlm_head_bias,
        "decoder_bias": m.output_bias,
        "tie_word_embeddings": m.tie_embeddings,
        "layer_types": kinds,
        "local_attention": 2 * ((m.window or 129) - 1),
        "rope_parameters": {kind: {"rope_type": "default", "rope_theta": theta} for kind, theta in thetas.items()},
        "max_position_embeddings": max(m.max_seq_len or 0, 8192),
        # not the answerdotai tokenizer's ids (past a small vocabulary): the run's, where it gives them
        **dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")),
    }


def _bart_json(m: ModelConfig) -> dict:
    stacks = {"encoder": m.n_encoder_layers, "decoder": m.n_layers}
    return {
        "d_model": m.d_model,
        **{f"{s}_layers": n for s, n in stacks.items()},
        **{f"{s}_attention_heads": m.n_heads for s in stacks},
        **{f"{s}_ffn_dim": m.d_ff for s in stacks},
        "activation_function": MLP_NAMES[m.ffn],
        "max_position_embeddings": m.max_seq_len,
        "scale_embedding": m.embed_scale,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        **dict.fromkeys(("dropout", "attention_dropout", "activation_dropout"), 0.0),
    }


def _t5_json(m: ModelConfig) -> dict:
    ffns = {ours: name for name, ours in T5_FFNS.items()}
    if m.ffn not in ffns:
        raise HFError("--export-hf", f"model.ffn={m.ffn}: T5's FFNs are {', '.join(ffns)}")
    return {
        "d_model": m.d_model,
        "d_kv": m.head_dim,
        "d_ff": m.d_ff,
        "num_layers": m.n_encoder_layers,
        "num_decoder_layers": m.n_layers,
        "num_heads": m.n_heads,
        "relative_attention_num_buckets": m.rel_buckets,
        "relative_attention_max_distance": m.rel_max_distance,
        "layer_norm_epsilon": m.norm_eps,
        "feed_forward_proj": ffns[m.ffn],
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "scale_decoder_outputs": m.scale_head_input,
        "is_encoder_decoder": True,
        "dropout_rate": 0.0,
    }


def _gpt2_json(m: ModelConfig) -> dict:
    return {
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": m.d_ff,
        "n_positions": m.max_seq_len,
        "vocab_size": m.vocab_size,
        "activation_function": {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}[m.ffn],
        "layer_norm_epsilon": m.norm_eps,
        "scale_attn_weights": m.attn_scale is None,
        "tie_word_embeddings": m.tie_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


# --- tensors: one rule per parameter of ours ---------------------------------------------------------

Arrays = list[np.ndarray]


def _same(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return xs[0]


def _as_list(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [x]


@dataclasses.dataclass(frozen=True)
class TensorPart:
    """A parameter that is part of one 2-D HF tensor (DeepSeek's fused latent projections): the
    tensor viewed as `shape(m)` and cut along `axis` at `at(m)`; `index` 0 is the piece before the cut."""

    shape: Callable[[ModelConfig], tuple[int, ...]]
    axis: int
    at: Callable[[ModelConfig], int]
    index: int

    def cut(self, m: ModelConfig, x: np.ndarray) -> np.ndarray:
        return np.split(x.reshape(self.shape(m)), [self.at(m)], axis=self.axis)[self.index]

    def join(self, pieces: dict[int, np.ndarray]) -> np.ndarray:
        """The HF tensor from its two pieces."""
        whole = np.concatenate([pieces[0], pieces[1]], axis=self.axis)
        return whole.reshape(-1, whole.shape[-1])


@dataclasses.dataclass(frozen=True)
class Rule:
    """A parameter of ours (its path in the parameter dict, "/"-joined) made of the HF tensors `names`
    ("{l}" in them: one set per layer of a layer-stacked parameter; "{e}": one set per expert, in
    expert order), and the exact conversions."""

    path: str
    names: tuple[str, ...]
    to_ours: Callable[[ModelConfig, Arrays], np.ndarray] = _same
    to_hf: Callable[[ModelConfig, np.ndarray], Arrays] = _as_list
    adds: bool = False  # to_ours adds values (BERT's token type into its positions), not only moves them
    part: TensorPart | None = None  # the parameter is part of its one HF tensor
    when: Callable[[ModelConfig], bool] | None = None  # the rule of its path only for such models
    # layer 0 has no such tensor (ModernBERT's attention norm, model.first_attn_norm=false): that
    # layer's parameter, never read by the model, is made filled with this value (as initialised)
    # and not written
    layer_0_fill: float | None = None

    @property
    def per_layer(self) -> bool:
        return "{l}" in self.names[0]

    def hf_names(self, layer: int | None, experts: int = 0) -> list[str]:
        if "{e}" not in self.names[0]:
            return [n.format(l=layer) for n in self.names]
        return [n.format(l=layer, e=e) for e in range(experts) for n in self.names]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The tensors of one family's checkpoints."""

    rules: tuple[Rule, ...]
    ignored: str = r"^$"  # tensors that are buffers, not weights (GPT-2's causal mask)
    strip: str = ""  # a prefix some checkpoints of the family leave out (GPT-2: "transformer.")

    def rule(self, path: str, m: ModelConfig) -> Rule:
        """The rule of `path` in model `m`; a MoE layer's attention and norms are those of any layer."""
        for name in (path, re.sub(r"^moe_blocks/", "blocks/", path)):
            for rule in self.rules:
                if rule.path == name and (rule.when is None or rule.when(m)):
                    return rule
        raise AssertionError(f"no {path} in the layout: a parameter the family cannot hold was built")


def stack_layers(m: ModelConfig, stack: str) -> list[int]:
    """The model's layer indices a layer stack holds, in order: the MoE layers in `moe_blocks`, the
    others in `blocks` (all of them in a dense model)."""
    if stack == "encoder_blocks":
        return list(range(m.n_encoder_layers or 0))
    return [i for i, moe in enumerate(m.moe_layers) if moe == (stack == "moe_blocks")]


def tensor_names(m: ModelConfig, rule: Rule, path: str, index: int | None) -> list[str]:
    """The HF tensors of parameter `path` (of its stack's layer `index`, where it is per layer)."""
    layer = None if index is None else stack_layers(m, path.split("/")[0])[index]
    return rule.hf_names(layer, m.n_experts)


def _pad_vocab(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """The embedding rows [V, D] padded with zeros to the padded vocab (rows no logit ever uses)."""
    (x,) = xs
    if x.shape[0] != m.vocab_size:
        raise ValueError(f"{x.shape[0]} rows for a vocabulary of {m.vocab_size}")
    if m.padded_vocab == m.vocab_size:  # no copy of the largest tensor without need
        return x
    return np.concatenate([x, np.zeros((m.padded_vocab - m.vocab_size,) + x.shape[1:], x.dtype)])


def _vocab_rows(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [x[: m.vocab_size]]


def _head_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return _pad_vocab(m, xs).T


def _head_out(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [x[:, : m.vocab_size].T]


def _qkv_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """q [N*H, D], k and v [K*H, D] -> D x K x (G + 2) x H: each kv head's query heads, key, value."""
    q, k, v = xs
    D, K, G, H = m.d_model, m.n_kv_heads, m.n_kv_groups, m.head_dim
    return np.concatenate([q.T.reshape(D, K, G, H), k.T.reshape(D, K, 1, H), v.T.reshape(D, K, 1, H)], axis=2)


def _qkv_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    D, G = m.d_model, m.n_kv_groups
    return [w[:, :, :G].reshape(D, -1).T, w[:, :, G].reshape(D, -1).T, w[:, :, G + 1].reshape(D, -1).T]


def _qkv_bias_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    q, k, v = xs
    K, G, H = m.n_kv_heads, m.n_kv_groups, m.head_dim
    return np.concatenate([q.reshape(K, G, H), k.reshape(K, 1, H), v.reshape(K, 1, H)], axis=1)


def _qkv_bias_out(m: ModelConfig, b: np.ndarray) -> Arrays:
    G = m.n_kv_groups
    return [b[:, :G].reshape(-1), b[:, G].reshape(-1), b[:, G + 1].reshape(-1)]


def _out_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """o_proj [D, N*H] -> N x H x D."""
    return xs[0].T.reshape(m.n_heads, m.head_dim, m.d_model)


def _out_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w.reshape(-1, m.d_model).T]


def _transposed(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return xs[0].T


def _transpose_back(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [x.T]


def _gate_up_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """gate and up [F, D] -> D x 2 x F (gate first)."""
    return np.stack([xs[0].T, xs[1].T], axis=1)


def _gate_up_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w[:, 0].T, w[:, 1].T]


def _stack(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return np.stack(xs)


def _unstack(m: ModelConfig, x: np.ndarray) -> Arrays:
    return list(x)


_L = "model.layers.{l}."
LLAMA = Layout(
    (
        Rule("embed", ("model.embed_tokens.weight",), _pad_vocab, _vocab_rows),
        Rule("head", ("lm_head.weight",), _head_in, _head_out),
        Rule("final_norm/scale", ("model.norm.weight",)),
        Rule("blocks/attn_norm/scale", (_L + "input_layernorm.weight",)),
        Rule("blocks/ffn_norm/scale", (_L + "post_attention_layernorm.weight",)),
        Rule("blocks/attn/qkv", tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"), _qkv_in, _qkv_out),
        Rule(
            "blocks/attn/qkv_bias", tuple(_L + f"self_attn.{p}_proj.bias" for p in "qkv"), _qkv_bias_in, _qkv_bias_out
        ),
        Rule("blocks/attn/out", (_L + "self_attn.o_proj.weight",), _out_in, _out_out),
        Rule("blocks/attn/out_bias", (_L + "self_attn.o_proj.bias",)),
        Rule("blocks/attn/q_norm/scale", (_L + "self_attn.q_norm.weight",)),
        Rule("blocks/attn/k_norm/scale", (_L + "self_attn.k_norm.weight",)),
        Rule("blocks/ffn/w_in", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), _gate_up_in, _gate_up_out),
        Rule("blocks/ffn/b_in", (_L + "mlp.gate_proj.bias", _L + "mlp.up_proj.bias"), _stack, _unstack),
        Rule("blocks/ffn/w_out", (_L + "mlp.down_proj.weight",), _transposed, _transpose_back),
        Rule("blocks/ffn/b_out", (_L + "mlp.down_proj.bias",)),
    ),
    ignored=r"\.rotary_emb\.inv_freq$",
)


def _experts_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """Each expert's gate and up [F, D] -> E x D x 2 x F."""
    return np.stack([_gate_up_in(m, xs[i : i + 2]) for i in range(0, len(xs), 2)])


def _experts_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [x for expert in w for x in _gate_up_out(m, expert)]


def _experts_down_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """Each expert's down projection [D, F] -> E x F x D."""
    return np.stack([x.T for x in xs])


def _experts_down_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [expert.T for expert in w]


def _row(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """A one-output linear [1, D] -> D."""
    return xs[0].reshape(-1)


def _row_out(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [x[None]]


ROBERTA_OFFSET = 2  # RoBERTa counts positions from padding_idx + 1


def _bert_positions_in(offset: int) -> Callable[[ModelConfig, Arrays], np.ndarray]:
    """Position rows from `offset` on (RoBERTa's first two are never read), plus the one token type's
    row where there is only one (type_vocab_size 1, RoBERTa's: model.token_types 0, as every input has it)."""

    def to_ours(m: ModelConfig, xs: Arrays) -> np.ndarray:
        return xs[0][offset:] if m.token_types else xs[0][offset:] + xs[1][0]

    return to_ours


def _bert_positions_out(offset: int) -> Callable[[ModelConfig, np.ndarray], Arrays]:
    def to_hf(m: ModelConfig, x: np.ndarray) -> Arrays:
        positions = np.concatenate([np.zeros((offset, x.shape[1]), x.dtype), x])
        return [positions] if m.token_types else [positions, np.zeros((1, x.shape[1]), x.dtype)]

    return to_hf


def _bert_layout(prefix: str, head: str, head_norm: str, offset: int) -> Layout:
    """BERT's tensors (`prefix` the encoder's, `head` the prediction head's, whose norm is
    `head_norm`; positions from row `offset`). RoBERTa's differ in their names and offset only."""
    e, b = prefix + "embeddings.", prefix + "encoder.layer.{l}."
    qkv = ("query", "key", "value")
    return Layout(
        (
            Rule("embed", (e + "word_embeddings.weight",), _pad_vocab, _vocab_rows),
            Rule(
                "pos_embed",
                (e + "position_embeddings.weight",),
                _bert_positions_in(offset),
                _bert_positions_out(offset),
                when=lambda m: m.token_types > 0,
            ),
            Rule(  # one token type: its row joins the positions
                "pos_embed",
                (e + "position_embeddings.weight", e + "token_type_embeddings.weight"),
                _bert_positions_in(offset),
                _bert_positions_out(offset),
                adds=True,
            ),
            Rule("type_embed", (e + "token_type_embeddings.weight",)),
            Rule("embed_norm/scale", (e + "LayerNorm.weight",)),
            Rule("embed_norm/bias", (e + "LayerNorm.bias",)),
            Rule("blocks/attn/qkv", tuple(b + f"attention.self.{p}.weight" for p in qkv), _qkv_in, _qkv_out),
            Rule(
                "blocks/attn/qkv_bias", tuple(b + f"attention.self.{p}.bias" for p in qkv), _qkv_bias_in, _qkv_bias_out
            ),
            Rule("blocks/attn/out", (b + "attention.output.dense.weight",), _out_in, _out_out),
            Rule("blocks/attn/out_bias", (b + "attention.output.dense.bias",)),
            Rule("blocks/attn_norm/scale", (b + "attention.output.LayerNorm.weight",)),
            Rule("blocks/attn_norm/bias", (b + "attention.output.LayerNorm.bias",)),
            Rule("blocks/ffn/w_in", (b + "intermediate.dense.weight",), _transposed, _transpose_back),
            Rule("blocks/ffn/b_in", (b + "intermediate.dense.bias",)),
            Rule("blocks/ffn/w_out", (b + "output.dense.weight",), _transposed, _transpose_back),
            Rule("blocks/ffn/b_out", (b + "output.dense.bias",)),
            Rule("blocks/ffn_norm/scale", (b + "output.LayerNorm.weight",)),
            Rule("blocks/ffn_norm/bias", (b + "output.LayerNorm.bias",)),
            Rule("mlm_head/dense", (head + "dense.weight",), _transposed, _transpose_back),
            Rule("mlm_head/dense_bias", (head + "dense.bias",)),
            Rule("mlm_head/norm/scale", (head_norm + ".weight",)),
            Rule("mlm_head/norm/bias", (head_norm + ".bias",)),
            Rule("output_bias", (head.removesuffix("transform.") + "bias",), _pad_vocab, _vocab_rows),
        ),
        # the decoder is the word embeddings (tied) and its bias the head's; the pooler and the
        # next-sentence head are not the masked-LM model's
        ignored=rf"(^{prefix}pooler\.|^cls\.seq_relationship\.|\.position_ids$|decoder\.(weight|bias)$)",
    )


def _wqkv_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """ModernBERT's fused Wqkv [3*N*H, D] (q, k, v) -> D x N x 3 x H (K = N, G = 1)."""
    return _c_attn_in(m, [xs[0].T])


def _wqkv_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [_c_attn_out(m, w)[0].T]


def _wi_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """ModernBERT's fused Wi [2F, D] (the activated half, then the gate) -> D x 2 x F."""
    return xs[0].T.reshape(m.d_model, 2, -1)


def _wi_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w.reshape(m.d_model, -1).T]


def _layernorm(ours: str, theirs: str, layer_0_absent: bool = False) -> tuple[Rule, ...]:
    """A LayerNorm's gain and (where the model has one) bias; `layer_0_absent`: not in layer 0 (a
    gain of 1 and a bias of 0 there, as initialised)."""
    fills = dict(scale=1.0, bias=0.0) if layer_0_absent else {}
    return tuple(Rule(f"{ours}/{o}", (f"{theirs}.{t}",), layer_0_fill=fills.get(o)) for o, t in NORM_TENSORS)


BERT = _bert_layout("bert.", "cls.predictions.transform.", "cls.predictions.transform.LayerNorm", 0)


def _bart_positions_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return xs[0][ROBERTA_OFFSET:]


def _bart_positions_out(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [np.concatenate([np.zeros((ROBERTA_OFFSET, x.shape[1]), x.dtype), x])]


def _bias_row_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """final_logits_bias [1, V] -> the padded vocabulary's [V']."""
    return _pad_vocab(m, [xs[0].reshape(-1)])


def _bias_row_out(m: ModelConfig, x: np.ndarray) -> Arrays:
    return [x[None, : m.vocab_size]]


def _bart_attention(ours: str, theirs: str) -> tuple[Rule, ...]:
    """An attention's q, k, v and output projections with their biases (BART's names)."""
    qkv = tuple(f"{theirs}.{p}_proj" for p in "qkv")
    return (
        Rule(f"{ours}/qkv", tuple(n + ".weight" for n in qkv), _qkv_in, _qkv_out),
        Rule(f"{ours}/qkv_bias", tuple(n + ".bias" for n in qkv), _qkv_bias_in, _qkv_bias_out),
        Rule(f"{ours}/out", (f"{theirs}.out_proj.weight",), _out_in, _out_out),
        Rule(f"{ours}/out_bias", (f"{theirs}.out_proj.bias",)),
    )


def _bart_stack(ours: str, theirs: str, cross: bool) -> tuple[Rule, ...]:
    """One stack's layers: self-attention, cross-attention (the decoder's), the MLP, each with its norm."""
    layer = f"model.{theirs}.layers.{{l}}."
    parts = [("attn", "self_attn", "self_attn_layer_norm")]
    if cross:
        parts.append(("cross_attn", "encoder_attn", "encoder_attn_layer_norm"))
    rules: list[Rule] = []
    for name, attention, norm in parts:
        rules += _bart_attention(f"{ours}/{name}", layer + attention)
        rules += [Rule(f"{ours}/{name}_norm/{p}", (f"{layer}{norm}.{q}",)) for p, q in NORM_TENSORS]
    rules += [
        Rule(f"{ours}/ffn/w_in", (layer + "fc1.weight",), _transposed, _transpose_back),
        Rule(f"{ours}/ffn/b_in", (layer + "fc1.bias",)),
        Rule(f"{ours}/ffn/w_out", (layer + "fc2.weight",), _transposed, _transpose_back),
        Rule(f"{ours}/ffn/b_out", (layer + "fc2.bias",)),
        *(Rule(f"{ours}/ffn_norm/{p}", (f"{layer}final_layer_norm.{q}",)) for p, q in NORM_TENSORS),
    ]
    return tuple(rules)


def _t5_stack(ours: str, theirs: str, cross: bool) -> tuple[Rule, ...]:
    """One T5 stack's layers: its sublayers numbered in order (self-attention, the decoder's
    cross-attention, the FFN: gated, or T5 v1.0's plain one), each with its RMSNorm; no biases."""
    layer = f"{theirs}.block.{{l}}.layer."
    parts = [("attn", "SelfAttention")] + ([("cross_attn", "EncDecAttention")] if cross else [])
    rules: list[Rule] = []
    for i, (name, attention) in enumerate(parts):
        rules += [
            Rule(f"{ours}/{name}/qkv", tuple(f"{layer}{i}.{attention}.{p}.weight" for p in "qkv"), _qkv_in, _qkv_out),
            Rule(f"{ours}/{name}/out", (f"{layer}{i}.{attention}.o.weight",), _out_in, _out_out),
            Rule(f"{ours}/{name}_norm/scale", (f"{layer}{i}.layer_norm.weight",)),
        ]
    ffn = f"{layer}{len(parts)}."
    return (
        *rules,
        Rule(
            f"{ours}/ffn/w_in",
            (ffn + "DenseReluDense.wi_0.weight", ffn + "DenseReluDense.wi_1.weight"),
            _gate_up_in,
            _gate_up_out,
            when=lambda m: m.gated_ffn,
        ),
        Rule(f"{ours}/ffn/w_in", (ffn + "DenseReluDense.wi.weight",), _transposed, _transpose_back),  # T5 v1.0's
        Rule(f"{ours}/ffn/w_out", (ffn + "DenseReluDense.wo.weight",), _transposed, _transpose_back),
        Rule(f"{ours}/ffn_norm/scale", (ffn + "layer_norm.weight",)),
    )


T5 = Layout(
    (
        Rule("embed", ("shared.weight",), _pad_vocab, _vocab_rows),
        Rule("head", ("lm_head.weight",), _head_in, _head_out),
        Rule("rel_bias", ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
        Rule("encoder_rel_bias", ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
        Rule("final_norm/scale", ("decoder.final_layer_norm.weight",)),
        Rule("encoder_norm/scale", ("encoder.final_layer_norm.weight",)),
        *_t5_stack("encoder_blocks", "encoder", cross=False),
        *_t5_stack("blocks", "decoder", cross=True),
    ),
    ignored=r"^(encoder|decoder)\.embed_tokens\.weight$",  # the stacks' copies of the shared embeddings
)
NORM_TENSORS = (("scale", "weight"), ("bias", "bias"))
BART = Layout(
    (
        Rule("embed", ("model.shared.weight",), _pad_vocab, _vocab_rows),
        Rule("output_bias", ("final_logits_bias",), _bias_row_in, _bias_row_out),
        Rule("pos_embed", ("model.decoder.embed_positions.weight",), _bart_positions_in, _bart_positions_out),
        Rule("encoder_pos_embed", ("model.encoder.embed_positions.weight",), _bart_positions_in, _bart_positions_out),
        *(Rule(f"embed_norm/{p}", (f"model.decoder.layernorm_embedding.{q}",)) for p, q in NORM_TENSORS),
        *(Rule(f"encoder_embed_norm/{p}", (f"model.encoder.layernorm_embedding.{q}",)) for p, q in NORM_TENSORS),
        *_bart_stack("encoder_blocks", "encoder", cross=False),
        *_bart_stack("blocks", "decoder", cross=True),
    ),
    # the stacks' and the head's copies of the shared embeddings
    ignored=r"^(model\.(encoder|decoder)\.embed_tokens\.weight|lm_head\.weight)$",
)
_MB = "model.layers.{l}."
MODERNBERT = Layout(
    (
        Rule("embed", ("model.embeddings.tok_embeddings.weight",), _pad_vocab, _vocab_rows),
        *_layernorm("embed_norm", "model.embeddings.norm"),
        *_layernorm("blocks/attn_norm", _MB + "attn_norm", layer_0_absent=True),
        Rule("blocks/attn/qkv", (_MB + "attn.Wqkv.weight",), _wqkv_in, _wqkv_out),
        Rule("blocks/attn/out", (_MB + "attn.Wo.weight",), _out_in, _out_out),
        *_layernorm("blocks/ffn_norm", _MB + "mlp_norm"),
        Rule("blocks/ffn/w_in", (_MB + "mlp.Wi.weight",), _wi_in, _wi_out),
        Rule("blocks/ffn/w_out", (_MB + "mlp.Wo.weight",), _transposed, _transpose_back),
        *_layernorm("final_norm", "model.final_norm"),
        Rule("mlm_head/dense", ("head.dense.weight",), _transposed, _transpose_back),
        Rule("mlm_head/dense_bias", ("head.dense.bias",)),
        *_layernorm("mlm_head/norm", "head.norm"),
        Rule("head", ("decoder.weight",), _head_in, _head_out),
        Rule("output_bias", ("decoder.bias",), _pad_vocab, _vocab_rows),
    ),
    ignored=r"^decoder\.weight$",  # the embeddings again, where tied
)


ROBERTA = _bert_layout("roberta.", "lm_head.", "lm_head.layer_norm", ROBERTA_OFFSET)
# Gemma's sandwich: a norm before and after each sublayer
GEMMA = Layout(
    (
        *(r for r in LLAMA.rules if r.path != "blocks/ffn_norm/scale"),
        Rule("blocks/attn_out_norm/scale", (_L + "post_attention_layernorm.weight",)),
        Rule("blocks/ffn_norm/scale", (_L + "pre_feedforward_layernorm.weight",)),
        Rule("blocks/ffn_out_norm/scale", (_L + "post_feedforward_layernorm.weight",)),
    ),
    ignored=LLAMA.ignored,
)
_X = _L + "block_sparse_moe."
MIXTRAL = Layout(
    (
        *LLAMA.rules,
        Rule("moe_blocks/ffn/router", (_X + "gate.weight",), _transposed, _transpose_back),
        Rule(
            "moe_blocks/ffn/w_in",
            (_X + "experts.{e}.w1.weight", _X + "experts.{e}.w3.weight"),
            _experts_in,
            _experts_out,
        ),
        Rule("moe_blocks/ffn/w_out", (_X + "experts.{e}.w2.weight",), _experts_down_in, _experts_down_out),
    ),
    ignored=LLAMA.ignored,
)
_M = _L + "mlp."
QWEN_MOE = Layout(
    (
        *LLAMA.rules,
        Rule("moe_blocks/ffn/router", (_M + "gate.weight",), _transposed, _transpose_back),
        Rule(
            "moe_blocks/ffn/w_in",
            (_M + "experts.{e}.gate_proj.weight", _M + "experts.{e}.up_proj.weight"),
            _experts_in,
            _experts_out,
        ),
        Rule("moe_blocks/ffn/w_out", (_M + "experts.{e}.down_proj.weight",), _experts_down_in, _experts_down_out),
        Rule(
            "moe_blocks/ffn/shared/w_in",
            (_M + "shared_expert.gate_proj.weight", _M + "shared_expert.up_proj.weight"),
            _gate_up_in,
            _gate_up_out,
        ),
        Rule("moe_blocks/ffn/shared/w_out", (_M + "shared_expert.down_proj.weight",), _transposed, _transpose_back),
        Rule("moe_blocks/ffn/shared_gate", (_M + "shared_expert_gate.weight",), _row, _row_out),
    ),
    ignored=LLAMA.ignored,
)


def _rope_halves(m: ModelConfig) -> np.ndarray:
    """DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; this model the halves: the rows in
    that order rotate alike, and a dot product of two vectors permuted alike is unchanged."""
    E = m.qk_rope_head_dim
    return np.concatenate([np.arange(0, E, 2), np.arange(1, E, 2)])


def _mla_heads_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """q_proj or q_b_proj [N*(A+E), fan-in] -> fan-in x N x (A+E), each head's rotary rows as halves."""
    (x,) = xs
    A = m.qk_nope_head_dim
    w = x.T.reshape(x.shape[1], m.n_heads, m.qk_head_dim)
    return np.concatenate([w[..., :A], w[..., A:][..., _rope_halves(m)]], axis=-1)


def _mla_heads_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    A = m.qk_nope_head_dim
    w = np.concatenate([w[..., :A], w[..., A:][..., np.argsort(_rope_halves(m))]], axis=-1)
    return [w.reshape(w.shape[0], -1).T]


def _rope_key_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """kv_a_proj_with_mqa's rotary rows [E, D] -> D x E, as halves."""
    return xs[0].T[:, _rope_halves(m)]


def _rope_key_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w[:, np.argsort(_rope_halves(m))].T]


def _latent_up_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """kv_b_proj's key or value rows of each head [N, A or Y, R] -> R x N x (A or Y)."""
    return xs[0].transpose(2, 0, 1)


def _latent_up_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w.transpose(1, 2, 0)]


def _mla_out_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """o_proj [D, N*Y] -> N x Y x D."""
    return xs[0].T.reshape(m.n_heads, m.v_head_dim, m.d_model)


_A = _L + "self_attn."
KV_DOWN = TensorPart(lambda m: (m.kv_lora_rank + m.qk_rope_head_dim, m.d_model), 0, lambda m: m.kv_lora_rank, 0)
KV_UP = TensorPart(
    lambda m: (m.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank), 1, lambda m: m.qk_nope_head_dim, 0
)
DEEPSEEK = Layout(
    (
        *(r for r in LLAMA.rules if "/attn/" not in r.path),
        Rule("blocks/attn/wq", (_A + "q_proj.weight",), _mla_heads_in, _mla_heads_out),
        Rule("blocks/attn/wq_down", (_A + "q_a_proj.weight",), _transposed, _transpose_back),
        Rule("blocks/attn/q_latent_norm/scale", (_A + "q_a_layernorm.weight",)),
        Rule("blocks/attn/wq_up", (_A + "q_b_proj.weight",), _mla_heads_in, _mla_heads_out),
        Rule("blocks/attn/wkv_down", (_A + "kv_a_proj_with_mqa.weight",), _transposed, _transpose_back, part=KV_DOWN),
        Rule(
            "blocks/attn/wk_rope",
            (_A + "kv_a_proj_with_mqa.weight",),
            _rope_key_in,
            _rope_key_out,
            part=dataclasses.replace(KV_DOWN, index=1),
        ),
        Rule("blocks/attn/kv_latent_norm/scale", (_A + "kv_a_layernorm.weight",)),
        Rule("blocks/attn/wk_up", (_A + "kv_b_proj.weight",), _latent_up_in, _latent_up_out, part=KV_UP),
        Rule(
            "blocks/attn/wv_up",
            (_A + "kv_b_proj.weight",),
            _latent_up_in,
            _latent_up_out,
            part=dataclasses.replace(KV_UP, index=1),
        ),
        Rule("blocks/attn/out", (_A + "o_proj.weight",), _mla_out_in, _out_out),
        *(r for r in QWEN_MOE.rules if r.path.startswith("moe_blocks/ffn/") and "shared" not in r.path),
        Rule("moe_blocks/ffn/router_bias", (_M + "gate.e_score_correction_bias",)),
        Rule(
            "moe_blocks/ffn/shared/w_in",
            (_M + "shared_experts.gate_proj.weight", _M + "shared_experts.up_proj.weight"),
            _gate_up_in,
            _gate_up_out,
        ),
        Rule("moe_blocks/ffn/shared/w_out", (_M + "shared_experts.down_proj.weight",), _transposed, _transpose_back),
    ),
    ignored=LLAMA.ignored,
)


def _c_attn_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    """GPT-2's fused Conv1D [D, 3*N*H] (q, k, v) -> D x N x 3 x H (K = N, G = 1)."""
    D, N, H = m.d_model, m.n_heads, m.head_dim
    return xs[0].reshape(D, 3, N, H).transpose(0, 2, 1, 3)


def _c_attn_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w.transpose(0, 2, 1, 3).reshape(m.d_model, -1)]


def _c_attn_bias_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return xs[0].reshape(3, m.n_heads, m.head_dim).transpose(1, 0, 2)


def _c_attn_bias_out(m: ModelConfig, b: np.ndarray) -> Arrays:
    return [b.transpose(1, 0, 2).reshape(-1)]


def _c_proj_in(m: ModelConfig, xs: Arrays) -> np.ndarray:
    return xs[0].reshape(m.n_heads, m.head_dim, m.d_model)


def _c_proj_out(m: ModelConfig, w: np.ndarray) -> Arrays:
    return [w.reshape(-1, m.d_model)]


_H = "transformer.h.{l}."
GPT2 = Layout(
    (
        Rule("embed", ("transformer.wte.weight",), _pad_vocab, _vocab_rows),
        Rule("pos_embed", ("transformer.wpe.weight",)),
        Rule("head", ("lm_head.weight",), _head_in, _head_out),
        Rule("final_norm/scale", ("transformer.ln_f.weight",)),
        Rule("final_norm/bias", ("transformer.ln_f.bias",)),
        Rule("blocks/attn_norm/scale", (_H + "ln_1.weight",)),
        Rule("blocks/attn_norm/bias", (_H + "ln_1.bias",)),
        Rule("blocks/ffn_norm/scale", (_H + "ln_2.weight",)),
        Rule("blocks/ffn_norm/bias", (_H + "ln_2.bias",)),
        Rule("blocks/attn/qkv", (_H + "attn.c_attn.weight",), _c_attn_in, _c_attn_out),
        Rule("blocks/attn/qkv_bias", (_H + "attn.c_attn.bias",), _c_attn_bias_in, _c_attn_bias_out),
        Rule("blocks/attn/out", (_H + "attn.c_proj.weight",), _c_proj_in, _c_proj_out),
        Rule("blocks/attn/out_bias", (_H + "attn.c_proj.bias",)),
        Rule("blocks/ffn/w_in", (_H + "mlp.c_fc.weight",)),
        Rule("blocks/ffn/b_in", (_H + "mlp.c_fc.bias",)),
        Rule("blocks/ffn/w_out", (_H + "mlp.c_proj.weight",)),
        Rule("blocks/ffn/b_out", (_H + "mlp.c_proj.bias",)),
    ),
    ignored=r"\.attn\.(masked_)?bias$",
    strip="transformer.",
)


# --- the families -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF `model_type`: its config.json read as model.* keys and written back, and its tensors."""

    name: str
    architecture: str  # the class transformers builds for it
    keys: Callable[[dict], dict]
    to_json: Callable[[ModelConfig], dict]
    layout: Layout


FAMILIES = {
    f.name: f
    for f in (
        Family("gpt2", "GPT2LMHeadModel", _gpt2_keys, _gpt2_json, GPT2),
        Family("llama", "LlamaForCausalLM", _llama_keys, _llama_json, LLAMA),
        Family("mistral", "MistralForCausalLM", _mistral_keys, _mistral_json, LLAMA),
        Family("qwen2", "Qwen2ForCausalLM", _qwen2_keys, _qwen_json, LLAMA),
        Family("qwen3", "Qwen3ForCausalLM", _qwen3_keys, _qwen_json, LLAMA),
        Family("bert", "BertForMaskedLM", _bert_keys, _bert_json, BERT),
        # exported as BERT (export_family never picks it): its positions' offset hangs on the pad id
        Family("roberta", "RobertaForMaskedLM", _roberta_keys, _bert_json, ROBERTA),
        Family("modernbert", "ModernBertForMaskedLM", _modernbert_keys, _modernbert_json, MODERNBERT),
        Family("bart", "BartForConditionalGeneration", _bart_keys, _bart_json, BART),
        Family("t5", "T5ForConditionalGeneration", _t5_keys, _t5_json, T5),
        Family("gemma2", "Gemma2ForCausalLM", _gemma_keys, _gemma_json, GEMMA),
        Family("gemma3_text", "Gemma3ForCausalLM", _gemma3_keys, _gemma_json, GEMMA),
        Family("mixtral", "MixtralForCausalLM", _mixtral_keys, _mixtral_json, MIXTRAL),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe_keys, _qwen2_moe_json, QWEN_MOE),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_keys, _qwen_moe_json, QWEN_MOE),
        Family("deepseek_v2", "DeepseekV2ForCausalLM", _deepseek_v2_keys, _deepseek_v2_json, DEEPSEEK),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", _deepseek_v3_keys, _deepseek_v3_json, DEEPSEEK),
    )
}


def read_config_json(path: Path) -> dict:
    """The checkpoint's config.json; a missing or broken one is an HFError naming it."""
    file = path / CONFIG_JSON
    if not file.is_file():
        raise HFError("model.init_from", f"{path} holds no {CONFIG_JSON} (a Hugging Face model directory)")
    try:
        hf = json.loads(file.read_text())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HFError("model.init_from", f"{file} is not JSON: {first_line(e)}") from None
    except OSError as e:
        raise HFError("model.init_from", f"cannot read {file}: {e.strerror or first_line(e)}") from None
    if not isinstance(hf, dict):
        raise HFError("model.init_from", f"{file} is not a JSON object")
    return hf


def family_of(hf: dict) -> Family:
    kind = hf.get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise _refuse("model_type", f"{kind!r} is not supported ({', '.join(FAMILIES)})")
    return FAMILIES[kind]


def architecture(path: Path) -> dict:
    """The model.* keys of the checkpoint at `path` (every field it uses checked here, each refusal
    naming the field and what it takes)."""
    hf = read_config_json(path)
    try:
        return pinned(family_of(hf).keys(hf))
    except (ArithmeticError, AttributeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        # a field the readers above do not check yet: still one line naming the file
        raise HFError("model.init_from", f"{path / CONFIG_JSON} is malformed ({type(e).__name__}: {e})") from None


# --- reading the weights ----------------------------------------------------------------------------


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what a weight may be stored as (safetensors' names)


@contextlib.contextmanager
def _reading(file: Path) -> Iterator[None]:
    """safetensors' errors about `file` (a malformed header, sizes past its end, ...) and the
    system's as one HFError naming it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise HFError("model.init_from", f"{file} is not a safetensors file: {first_line(e)}") from None
    except OSError as e:
        raise HFError("model.init_from", f"cannot read {file}: {e.strerror or first_line(e)}") from None


def _tensor_dtypes(file: Path) -> dict[str, str]:
    """The tensors a safetensors file holds and their dtypes, from its header (checked whole)."""
    from safetensors import safe_open

    with _reading(file), safe_open(file, framework="numpy") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def _inside(file: Path, directory: Path) -> bool:
    """Whether `file`, links resolved, lies in `directory`, or in the blobs of the Hugging Face hub's
    cache where `directory` is one of its snapshots (whose files are links into ../../blobs)."""
    target, home = file.resolve(), directory.resolve()
    roots = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])
    return any(target.is_relative_to(root) for root in roots)


def _shard(path: Path, name: str, file: Any) -> Path:
    """The file the index names for tensor `name`: a file in the model directory, or refused."""
    index = path / WEIGHTS_INDEX
    if not isinstance(file, str) or not file:
        raise HFError("model.init_from", f"{index}: weight_map gives {name} the file {file!r}, not a file name")
    shard = path / file
    if not shard.is_file():
        raise HFError("model.init_from", f"{index}: {name} is in {file!r}, which is not a file in {path}")
    if not _inside(shard, path):
        raise HFError("model.init_from", f"{index}: {name} is in {file!r}, outside {path} (links resolved): refused")
    return shard


def _index_files(path: Path) -> dict[str, Path]:
    """The file of each tensor, as a sharded checkpoint's index maps them."""
    index = path / WEIGHTS_INDEX
    try:
        data = json.loads(index.read_bytes())
    except OSError as e:
        raise HFError("model.init_from", f"cannot read {index}: {e.strerror or first_line(e)}") from None
    except (ValueError, RecursionError) as e:  # not JSON (or nested past Python's stack), or not text
        raise HFError("model.init_from", f"{index} is not JSON: {first_line(e)}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise HFError("model.init_from", f"{index} has no weight_map object (tensor name -> file name)")
    files, checked = {}, {}  # each file checked once
    for name, file in weight_map.items():
        if not (isinstance(file, str) and file in checked):
            checked[file] = _shard(path, name, file)
        files[name] = checked[file]
    return files


class Checkpoint:
    """The tensors of a checkpoint directory by name (one file, or the shards of an index), each read
    on its own with the file open only meanwhile. Every header is read and checked on opening: the
    index's files are the directory's own, hold the tensors it names, and every weight is floating
    point."""

    def __init__(self, path: Path, layout: Layout):
        self.layout = layout
        if (path / WEIGHTS_INDEX).is_file():
            self.files = _index_files(path)
        elif (path / WEIGHTS).is_file():
            self.files = dict.fromkeys(_tensor_dtypes(path / WEIGHTS), path / WEIGHTS)
        else:
            raise HFError("model.init_from", f"{path} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}")
        self.read: set[str] = set()
        for file in sorted(set(self.files.values())):
            self._check_header(path, file)

    def _check_header(self, path: Path, file: Path) -> None:
        dtypes = _tensor_dtypes(file)
        for name in (n for n, f in self.files.items() if f == file):
            if name not in dtypes:
                raise HFError(
                    "model.init_from", f"{path / WEIGHTS_INDEX}: {name} is in {file.name}, which does not hold it"
                )
            if dtypes[name] not in FLOAT_DTYPES and not re.search(self.layout.ignored, name):
                raise HFError(
                    "model.init_from",
                    f"{file}: tensor {name} is {dtypes[name]}; weights are floating point ({', '.join(FLOAT_DTYPES)})",
                )

    def name(self, name: str) -> str:
        """The name as this checkpoint spells it (some GPT-2 files leave out "transformer.")."""
        short = name.removeprefix(self.layout.strip) if self.layout.strip else name
        if name not in self.files and short in self.files:
            return short
        if name not in self.files:
            raise HFError("model.init_from", f"the checkpoint has no tensor {name} (config.json describes one)")
        return name

    def get(self, name: str) -> np.ndarray:
        """The tensor; a large one is read in blocks of rows, the file reopened for each, so that
        its mapped pages never add up to a second copy of it."""
        from safetensors import safe_open

        name = self.name(name)
        self.read.add(name)
        file = self.files[name]
        with _reading(file):
            with safe_open(file, framework="numpy") as f:
                part = f.get_slice(name)
                shape = part.get_shape()
                first = part[:1] if shape else None
                if first is None or first.nbytes * shape[0] <= READ_BLOCK_BYTES:
                    return f.get_tensor(name)
            rows = max(1, READ_BLOCK_BYTES // first.nbytes)
            out = host_array(tuple(shape), first.dtype)
            for start in range(0, shape[0], rows):
                with safe_open(file, framework="numpy") as f:
                    stop = min(start + rows, shape[0])
                    out[start:stop] = f.get_slice(name)[start:stop]
        return out

    def check_all_read(self) -> None:
        """A tensor nothing read is a part of the model config.json did not announce: refuse it."""
        left = sorted(n for n in self.files if n not in self.read and not re.search(self.layout.ignored, n))
        if left:
            raise HFError("model.init_from", f"the checkpoint has tensors config.json does not explain: {left[0]}, ...")


def _flatten(tree: dict) -> dict[str, Any]:
    """Parameter paths as 'blocks/attn/qkv' (the layout's rule names)."""
    return flatten(tree, sep="/")


def _unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _converted(ckpt: Checkpoint, rule: Rule, m: ModelConfig, names: list[str], like: jax.ShapeDtypeStruct):
    """The value of `rule`'s parameter (one layer's slice of it) from the tensors `names`, as `like`."""
    xs = [ckpt.get(n) for n in names]
    # Conversions only move values (zero padding is +0.0's bits): on unsigned integers of the same
    # width they are exact, and fast for the dtypes numpy only knows through ml_dtypes (bfloat16).
    as_bits = all(x.dtype == like.dtype for x in xs) and not rule.adds
    try:
        ys = [x.view(f"u{x.dtype.itemsize}") for x in xs] if as_bits else xs
        value = rule.to_ours(m, [rule.part.cut(m, y) for y in ys] if rule.part else ys)
        fits = value.shape == like.shape
    except ValueError:  # a reshape the sizes do not allow
        fits = False
    if not fits:
        got = ", ".join(f"{n} {list(x.shape)}" for n, x in zip(names, xs))
        raise HFError("model.init_from", f"{got} do not fit the model config.json describes")
    return value.view(like.dtype) if as_bits else value.astype(like.dtype, copy=False)


def host_array(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised host array on a 64-byte boundary, where XLA's CPU client adopts a host
    buffer as the device's instead of copying it: on a CPU, a parameter is then in memory once."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + size].view(dtype).reshape(shape)


def _load_one(ckpt: Checkpoint, path: str, m: ModelConfig, like: jax.ShapeDtypeStruct) -> jax.Array:
    """Parameter `path`, placed as `like.sharding` says. A layer-stacked one is assembled a layer at a
    time in the host array the device array is made from (the device's own memory, on a CPU)."""
    rule = ckpt.layout.rule(path, m)
    if rule.per_layer:
        names = [tensor_names(m, rule, path, j) for j in range(like.shape[0])]
        read = range(0 if rule.layer_0_fill is None else 1, like.shape[0])
        for n in (n for j in read for n in names[j]):  # all there, before the stack's memory is taken
            ckpt.name(n)
        layer_like = jax.ShapeDtypeStruct(like.shape[1:], like.dtype)
        first = _converted(ckpt, rule, m, names[read[0]], layer_like)  # and of the size config.json says
        host = host_array(like.shape, like.dtype)
        host[read[0]] = first
        if rule.layer_0_fill is not None:
            host[0] = np.full(like.shape[1:], rule.layer_0_fill, like.dtype)
        for j in read[1:]:
            host[j] = _converted(ckpt, rule, m, names[j], layer_like)
    else:
        host = _converted(ckpt, rule, m, tensor_names(m, rule, path, None), like)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda index: host[index])


def load_params(path: Path, m: ModelConfig, abstract: dict) -> dict:
    """The checkpoint at `path` as this model's parameters: `abstract` is the parameter dict of
    ShapeDtypeStructs (with shardings) to fill, for `m` resolved from the same checkpoint."""
    ckpt = Checkpoint(path, family_of(read_config_json(path)).layout)
    flat = {key: _load_one(ckpt, key, m, like) for key, like in _flatten(abstract).items()}
    ckpt.check_all_read()
    return _unflatten(flat)


# --- writing a checkpoint -----------------------------------------------------------------------------

NO_EQUIVALENT = (
    "none of the Hugging Face families here (gpt2, llama, mistral, qwen2, qwen3, their MoE kin, gemma, deepseek)"
)


def _family_candidate(m: ModelConfig) -> Family:
    """The one family that could compute what `m` does, or an HFError saying why none can."""
    # the one family of each kind of model, or of its marks; anything else the family lacks, the
    # config.json round trip of export_family names
    marked = None
    if m.arch == "encoder_decoder":
        marked = "t5" if m.position == "t5_relative" else "bart"
    elif m.mlm_head:
        marked = "bert" if m.position == "learned" else "modernbert"
    elif m.norm_offset or m.embed_scale:
        marked = "gemma3_text" if m.qk_norm else "gemma2"
    if marked is not None:  # each family's FFN kind is checked here: its writer names only its own
        plain = marked in ("bart", "bert")
        if m.gated_ffn == plain and marked != "t5":  # T5 has both (v1.0 plain, v1.1 gated)
            kind = "a plain MLP (gelu, gelu_exact, relu)" if plain else f"a gated FFN ({', '.join(GATED_NAMES)})"
            raise HFError("--export-hf", f"model.ffn={m.ffn}: {marked.upper()} has {kind}")
        return FAMILIES[marked]
    reasons = [
        (m.position not in ("learned", "rope"), f"model.position={m.position}: {NO_EQUIVALENT} encodes positions so"),
        (m.norm_position != "pre", f"model.norm_position={m.norm_position}: {NO_EQUIVALENT} places norms so"),
        (m.attn_softcap is not None or m.logit_softcap is not None, f"soft-capping: {NO_EQUIVALENT} has it"),
        (m.attention_pattern is not None, f"model.attention_pattern: {NO_EQUIVALENT} has per-layer windows"),
        (
            m.position == "learned" and m.gated_ffn,
            f"model.ffn={m.ffn}: GPT-2 (learned positions) has a plain MLP (gelu, gelu_exact, relu)",
        ),
        (
            m.n_experts > 0 and m.top_k == 1 and not (m.qk_norm or m.n_shared_experts or m.attention == "mla"),
            "model.top_k=1: HF mixtral renormalises a lone gate to 1, where this model's is the router's probability",
        ),
        (
            m.position == "rope" and not m.gated_ffn,
            f"model.ffn={m.ffn}: the RoPE families (llama, mistral, qwen2, qwen3) have a gated FFN",
        ),
    ]
    for refused, why in reasons:
        if refused:
            raise HFError("--export-hf", why)
    if m.position == "learned":
        return FAMILIES["gpt2"]
    if m.attention == "mla":
        return FAMILIES["deepseek_v3" if m.router == "sigmoid" else "deepseek_v2"]
    if m.n_experts:  # what each family cannot hold (a sigmoid router, ...) its config.json round trip names
        return FAMILIES["qwen3_moe" if m.qk_norm else "qwen2_moe" if m.n_shared_experts else "mixtral"]
    if m.qk_norm:
        return FAMILIES["qwen3"]
    if m.qkv_bias and not m.use_bias:
        return FAMILIES["qwen2"]
    return FAMILIES["mistral" if m.window is not None else "llama"]


def export_family(m: ModelConfig) -> Family:
    """The family that computes exactly what `m` does: its config.json, read back, gives all of `m`'s
    architecture keys; else an HFError naming the first key it cannot hold."""
    family = _family_candidate(m)
    back = pinned(family.keys(family.to_json(m)))
    for key, value in back.items():
        ours = getattr(m, key)
        if ours != value:
            raise HFError(
                "--export-hf", f"model.{key}={ours}: HF {family.name} has no such option (it would be {value})"
            )
    return family


def hf_config(m: ModelConfig, family: Family, token_ids: dict[str, Any]) -> dict:
    return {
        "architectures": [family.architecture],
        "model_type": family.name,
        **family.to_json(m),
        "torch_dtype": m.param_dtype,
        **token_ids,
    }


def hf_tensors(m: ModelConfig, family: Family, params: dict) -> dict[str, np.ndarray]:
    """The parameters as the family's tensors (host arrays, one at a time from the devices)."""
    tensors: dict[str, np.ndarray] = {}
    pieces: dict[str, tuple[TensorPart, dict[int, np.ndarray]]] = {}
    for key, leaf in _flatten(params).items():
        rule = family.layout.rule(key, m)
        host = np.asarray(jax.device_get(leaf))
        for j in range(host.shape[0]) if rule.per_layer else [None]:
            if j == 0 and rule.layer_0_fill is not None:
                continue
            values = rule.to_hf(m, host if j is None else host[j])
            names = tensor_names(m, rule, key, j)
            if rule.part is None:
                tensors.update({n: np.ascontiguousarray(v) for n, v in zip(names, values)})
                continue
            for n, v in zip(names, values):
                pieces.setdefault(n, (rule.part, {}))[1][rule.part.index] = v
    tensors |= {n: np.ascontiguousarray(part.join(cut)) for n, (part, cut) in pieces.items()}
    return tensors


def check_export_dir(out: Path) -> None:
    """Refuse an OUT that `--export-hf` could not write, before anything is read: a file, a link to
    nowhere, a directory with files in it, or a place where no directory can be made or written. A
    directory made to find that out is removed again."""
    made: list[Path] = []
    try:
        made = [p for p in (out, *out.parents) if not p.exists() and not p.is_symlink()]
        if out.is_symlink() and not out.exists():
            raise HFError("--export-hf", f"{out} is a link to nothing ({os.readlink(out)}): give a new directory")
        if out.exists() and not out.is_dir():
            raise HFError("--export-hf", f"{out} exists and is not a directory: give a new directory")
        if out.is_dir() and any(out.iterdir()):
            raise HFError("--export-hf", f"{out} exists and is not empty: give a new directory")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise HFError("--export-hf", f"{out}: cannot write there: {e.strerror or first_line(e)}") from None
    finally:
        for p in made:  # the deepest first
            with contextlib.suppress(OSError):
                p.rmdir()


def save(m: ModelConfig, params: dict, out: Path, token_ids: dict[str, Any] | None = None) -> Family:
    """Write config.json and model.safetensors for `params` (a model of `m`) into `out`."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    family = export_family(m)
    config = hf_config(m, family, token_ids or {})
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(hf_tensors(m, family, params), str(out / WEIGHTS), metadata={"format": "pt"})
        (out / CONFIG_JSON).write_text(json.dumps(config, indent=2) + "\n")
    except (OSError, SafetensorError) as e:
        raise HFError(
            "--export-hf", f"{out}: cannot write there: {getattr(e, 'strerror', None) or first_line(e)}"
        ) from None
    return family


# --- whole models ---------------------------------------------------------------------------------------


def model_config(path: Path, **options: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint at `path`; `options` set the keys config.json leaves free
    (dtype, scan_layers, attention_impl, vocab_multiple, ...)."""
    return _built(path, None, options | architecture(path))


def abstract_params(m: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> dict:
    """The parameter dict of `m` as ShapeDtypeStructs placed as the sharding table says (on one
    device without a mesh)."""
    from flax import nnx

    from transformer import sharding
    from transformer.model import Transformer

    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0))), nnx.Param)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        placed = jax.tree.map(lambda _: device, nnx.to_pure_dict(abstract))
    else:
        placed = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(abstract), placed
    )


def load_model(path: str | Path, **options: Any):
    """(ModelConfig, Transformer) of the checkpoint at `path`, on one device. For notebooks and tests:
    `m, model = load_model("Qwen3-0.6B")`; `model(tokens)` gives logits, computed in float32 unless
    `dtype="bfloat16"` is given (a bare ModelConfig's `auto` computes as a CPU does); a mixture of
    experts without drops, as inference computes it (`ModelConfig.at_inference`)."""
    from flax import nnx

    from transformer.model import Transformer

    path = Path(path).expanduser()
    m = model_config(path, **options)
    params = load_params(path, m, abstract_params(m))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(m.at_inference, rngs=nnx.Rngs(0))))
    return m, nnx.merge(graphdef, params)


# --- a config that starts from a checkpoint: train.py model.init_from=PATH --------------------------------


def _written_keys(config_path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The flattened keys the user's config (file chain and overrides) sets to values of its own: those
    that differ from the embedded default config's, which stands in for what nobody wrote."""
    from transformer.config_loader import load_raw

    written, default = flatten(load_raw(config_path, overrides)), flatten(load_raw(None))
    missing = object()
    return {k: v for k, v in written.items() if default.get(k, missing) != v}


def _check_tokenizer_config(tokenizer: Path) -> None:
    """The tokenizer_config.json beside a pretrained tokenizer, if any: BOS, EOS and PAD as tokens."""
    file = (tokenizer if tokenizer.is_dir() else tokenizer.parent) / TOKENIZER_CONFIG
    if not file.is_file():
        return
    try:
        named = json.loads(file.read_bytes())
    except OSError as e:
        raise HFError("data.tokenizer", f"cannot read {file}: {e.strerror or first_line(e)}") from None
    except (ValueError, RecursionError) as e:
        raise HFError("data.tokenizer", f"{file} is not JSON: {first_line(e)}") from None
    if not isinstance(named, dict):
        raise HFError("data.tokenizer", f"{file} is not a JSON object")
    for key in ("bos_token", "eos_token", "pad_token"):
        value = named.get(key)
        token = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(token, str):
            raise HFError(
                "data.tokenizer",
                f"{file}: {key} must be a token (text, or an object whose content is text), got {value!r}",
            )


def _check_tokenizer(path: Path, tokenizer: str, vocab_size: int) -> None:
    """The tokenizer a run from the checkpoint at `path` takes: the byte tokenizer's ids must fit the
    model's vocabulary, and a pretrained one's tokenizer_config.json must be sound."""
    from transformer.data import ByteTokenizer

    if tokenizer == "byte" and ByteTokenizer.vocab_size > vocab_size:
        none = "" if (path / TOKENIZER_JSON).is_file() else f"{path} holds no {TOKENIZER_JSON}, and "
        raise HFError(
            "data.tokenizer",
            f"{none}the byte tokenizer's {ByteTokenizer.vocab_size} ids do not fit the model's vocabulary of "
            f"{vocab_size}: give data.tokenizer=pretrained:DIR (the model's own tokenizer)",
        )
    if tokenizer.startswith("pretrained:"):
        _check_tokenizer_config(Path(tokenizer.partition(":")[2]).expanduser())


def _built(path: Path, base: ModelConfig | None, keys: dict) -> ModelConfig:
    """The ModelConfig of `keys` (over `base`'s); one that cannot be built is refused naming config.json."""
    try:
        return ModelConfig(**keys) if base is None else dataclasses.replace(base, **keys)
    except ConfigError as e:
        raise HFError(
            "model.init_from", f"{path / CONFIG_JSON} describes a model that cannot be built: model.{e}"
        ) from None


def tokenizer_note(cfg: Config) -> str | None:
    """A line for the user when the model.init_from checkpoint brings no tokenizer of its own: which
    one the run takes instead."""
    if cfg.model.init_from is None or cfg.data.tokenizer.startswith("pretrained:"):
        return None
    path = Path(cfg.model.init_from).expanduser()
    if (path / TOKENIZER_JSON).is_file():
        return None
    return (
        f"{path} holds no {TOKENIZER_JSON}: using data.tokenizer={cfg.data.tokenizer} (set data.tokenizer for another)"
    )


def load_run_config(config_path: str | None, overrides: Sequence[str] = ()) -> Config:
    """`load_config`, and for a config naming model.init_from, `with_pretrained` of it: the
    checkpoint's architecture fills the model keys the config leaves to it before the whole config is
    checked, so that what depends on the model (an encoder's data.objective, say) is checked against
    the model the run will have."""
    from transformer.config_loader import from_dict, load_raw

    raw = load_raw(config_path, overrides)
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("init_from"), str):  # none, or a mistake from_dict names
        return from_dict(raw)
    written = _written_keys(config_path, list(overrides))
    arch = architecture(Path(model["init_from"]).expanduser())
    left = {k: list(v) if isinstance(v, tuple) else v for k, v in arch.items() if f"model.{k}" not in written}
    return with_pretrained(from_dict({**raw, "model": {**model, **left}}), config_path, overrides)


def with_pretrained(cfg: Config, config_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """`cfg` with the architecture of its model.init_from checkpoint, and its tokenizer when the
    config names none. A model key the config sets to a value config.json contradicts is refused
    with a diff, and the weights' index and headers and the tokenizer are checked, before anything
    is built."""
    assert cfg.model.init_from is not None
    path = Path(cfg.model.init_from).expanduser()
    arch = architecture(path)
    written = _written_keys(config_path, list(overrides))
    clashes = [
        f"model.{key}: {getattr(cfg.model, key)!r} (config) vs {value!r} (config.json)"
        for key, value in arch.items()
        if f"model.{key}" in written and getattr(cfg.model, key) != value
    ]
    if clashes:
        raise ConfigError(
            "model.init_from",
            f"{path}/{CONFIG_JSON} sets the architecture, and the config contradicts it: {'; '.join(clashes)}; "
            "leave those keys out",
        )
    model = _built(path, cfg.model, arch)
    Checkpoint(path, family_of(read_config_json(path)).layout)
    data = cfg.data
    if "data.tokenizer" not in written and (path / TOKENIZER_JSON).is_file():
        data = dataclasses.replace(data, tokenizer=f"pretrained:{path}")
    _check_tokenizer(path, data.tokenizer, model.vocab_size)
    return dataclasses.replace(cfg, model=model, data=data)
