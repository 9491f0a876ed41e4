"""The model package. Each module owns one concern and imports only those listed above it:

- `positions.py`: the position encodings and the one dispatcher (`positions_for`) that decides
  what the configured scheme contributes: added to the embeddings, a rotation of q and k, a logit
  bias, or nothing;
- `parametrization.py`: the standard parametrization, µP, and depth-µP or CompleteP on top of it,
  in one table (init, learning-rate and forward multipliers of each kind of parameter, by its width
  over the base shape's; the residual branches' and the optimiser's by the depth over the base's;
  and how Muon reads each hidden matrix, `matrix_axes`);
- `layers.py`: parameters with logical axes, the initialisation scales (`InitScales`), norms, FFNs;
- `flash_cpu.py`: the fused CPU attention, forward and backward each one C++ kernel
  (`flash_cpu.cc`) through XLA's FFI, compiled on first use and cached;
- `flash.py`: blocked attention (`attention_impl=blocked`), causal or bidirectional, static
  window, a custom VJP that recomputes the probabilities; on a CPU the fused kernel where it applies;
- `attention.py`: self-attention, causal or bidirectional (MHA/GQA/MQA, windows, documents) and
  the KV cache;
- `mla.py`: multi-head latent attention (an `Attention` that caches one latent and one RoPE key);
- `cross_attention.py`: an encoder-decoder's cross-attention to the encoder output;
- `moe.py`: the mixture-of-experts FFN (router, capacity or dropless dispatch, routing losses);
- `transformer.py`: the block (norm placement), the layer stacks (scan, remat), the `Transformer`
  of each family (decoder, encoder, encoder-decoder);
- `qk_clip.py`: QK-clip (`model.qk_clip`), each clipped head's query and key projections rescaled
  after the update;
- `summary.py`: parameter counts, FLOPs and KV-cache bytes per token, the `--dry-run` summary.

The model places nothing on devices: it names logical axes, which `transformer/sharding.py` maps.
"""

from transformer.model.flash_cpu import describe_cpu_attention
from transformer.model.layers import Placer, placing
from transformer.model.moe import STEP_METRICS, balance_router_bias
from transformer.model.parametrization import OptimizerScaling, matrix_axes, optimizer_scaling
from transformer.model.qk_clip import clip_qk
from transformer.model.summary import (
    abstract_model,
    count_params,
    cross_cache_bytes_per_source_token,
    flops_per_token,
    kv_cache_bytes_per_token,
    non_embedding_params,
    summary_text,
)
from transformer.model.transformer import Block, Transformer, for_inference, layer_slots

__all__ = [
    "STEP_METRICS",
    "Block",
    "OptimizerScaling",
    "Placer",
    "Transformer",
    "abstract_model",
    "balance_router_bias",
    "clip_qk",
    "count_params",
    "cross_cache_bytes_per_source_token",
    "describe_cpu_attention",
    "flops_per_token",
    "for_inference",
    "kv_cache_bytes_per_token",
    "layer_slots",
    "matrix_axes",
    "non_embedding_params",
    "optimizer_scaling",
    "placing",
    "summary_text",
]
