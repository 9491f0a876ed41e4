"""The model package. Each module owns one concern and imports only those listed above it:

- `positions.py`: the position encodings and the one dispatcher (`positions_for`) that decides
  what the configured scheme contributes: added to the embeddings, a rotation of q and k, a logit
  bias, or nothing;
- `layers.py`: parameters with logical axes, the initialisation scales (`InitScales`), norms, FFNs;
- `attention.py`: self-attention, causal or bidirectional (MHA/GQA/MQA, windows, documents) and
  the KV cache;
- `cross_attention.py`: an encoder-decoder's cross-attention to the encoder output;
- `moe.py`: the mixture-of-experts FFN (router, capacity or dropless dispatch, routing losses);
- `transformer.py`: the block (norm placement), the layer stacks (scan, remat), the `Transformer`
  of each family (decoder, encoder, encoder-decoder);
- `summary.py`: parameter counts, FLOPs and KV-cache bytes per token, the `--dry-run` summary.
"""

from transformer.model.transformer import Block, Transformer

__all__ = ["Block", "Transformer"]
