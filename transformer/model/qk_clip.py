"""QK-clip (Kimi K2, arXiv 2507.20534, section 2.1: the clip of MuonClip), `model.qk_clip`.

After each update, every attention head h whose largest logit in the step, S_h (the scaled score
q·k before soft-capping and position biases, `attention.head_logit_max`, from the step's own
forward pass), passed the threshold tau has its query and key projections scaled so that its
logits shrink by gamma_h = tau / S_h; heads below tau are left as they are. Kimi K2 splits the
factor evenly, gamma^alpha on the query and gamma^(1-alpha) on the key with alpha = 1/2:

- MHA: exactly that, per head, on the fused weight's query and key slices (and their biases, so
  that the projections themselves scale, not only their weight part).
- GQA/MQA: a kv head's key serves G query heads, so it can take only one factor: the smallest of
  its group's, eta_k = min_g gamma_kg, to the power 1 - alpha; each query head then takes
  gamma_kg / eta_k^(1-alpha). Every head's logits scale by exactly its own gamma (a group-wide
  factor, as Megatron-LM applies, would also shrink the group's heads that stayed below tau);
  with G = 1 it is the MHA rule.
- MLA: the head's own parts, as the paper does: the non-rotary query (q^C) by gamma^alpha, its
  key's up-projection (k^C) by gamma^(1-alpha), the rotary query (q^R) by gamma; the rotary key
  k^R is shared by every head and left alone. With low-rank queries it is the up-projection that
  scales (the down-projection is shared).
RoPE rotates queries and keys after the projection: a rotation commutes with the scaling, so the
rotated logits scale by gamma too (tested). qk-norm would normalise the scaling away again
(refused with it), and an encoder-decoder's encoder and cross-attention are not clipped yet
(refused).

Nothing here touches the optimiser's state: Muon's and Adam's moments go on as they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer.config import ModelConfig
from transformer.model.transformer import layer_slots

ALPHA = 0.5  # the query's share of a head's clip factor (Kimi K2's alpha)


def clip_factors(head_max: jax.Array, threshold: float) -> jax.Array:
    """gamma per head: threshold / S where S passed the threshold, else 1. A non-finite S (a step
    that will not be applied) clips nothing, rather than zeroing the head."""
    passed = jnp.isfinite(head_max) & (head_max > threshold)
    return jnp.where(passed, threshold / jnp.where(passed, head_max, 1.0), 1.0)


def clip_qk(cfg: ModelConfig, params: dict, head_max_LxN: jax.Array) -> tuple[dict, jax.Array]:
    """(the parameters with every clipped head's query and key projections rescaled, the number
    of heads clipped). `head_max_LxN`: each layer's heads' largest logit in the step (layer order)."""
    assert cfg.qk_clip is not None, "clip_qk runs under model.qk_clip only"
    gamma_LxN = clip_factors(head_max_LxN, cfg.qk_clip)
    out = dict(params)
    slots = layer_slots(cfg)
    for stack in ("blocks", "moe_blocks"):
        layers = [i for i, (name, _) in enumerate(slots) if name == stack]
        if not layers:
            continue
        gamma = gamma_LxN[jnp.asarray(layers)]
        attn = params[stack]["attn"]
        out[stack] = {
            **params[stack],
            "attn": _clip_mla(cfg, attn, gamma) if "wk_up" in attn else _clip_fused(cfg, attn, gamma),
        }
    return out, jnp.sum(gamma_LxN < 1.0)


def _scaled(w: jax.Array, factor: jax.Array) -> jax.Array:
    return (w * factor).astype(w.dtype)


def _clip_fused(cfg: ModelConfig, attn: dict, gamma_LxN: jax.Array) -> dict:
    """The fused D x K x (G+2) x H weight (attention.py): query slices by gamma / eta^(1-alpha),
    each kv head's key by eta^(1-alpha), values untouched."""
    L, K, G = gamma_LxN.shape[0], cfg.n_kv_heads, cfg.n_kv_groups
    gamma_LxKxG = gamma_LxN.reshape(L, K, G)
    key_LxK = jnp.min(gamma_LxKxG, axis=-1) ** (1.0 - ALPHA)
    query_LxKxG = gamma_LxKxG / key_LxK[..., None]
    scale_LxKxC = jnp.concatenate([query_LxKxG, key_LxK[..., None], jnp.ones((L, K, 1))], axis=-1)
    out = {**attn, "qkv": _scaled(attn["qkv"], scale_LxKxC[:, None, :, :, None])}
    if "qkv_bias" in attn:
        out["qkv_bias"] = _scaled(attn["qkv_bias"], scale_LxKxC[..., None])
    return out


def _clip_mla(cfg: ModelConfig, attn: dict, gamma_LxN: jax.Array) -> dict:
    """MLA: each head's query, its first A (non-rotary) columns by gamma^alpha and its last E
    (rotary) by gamma, and its key up-projection by gamma^(1-alpha)."""
    A, E = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    L, N = gamma_LxN.shape
    assert A is not None and E is not None
    query_LxNxH = jnp.concatenate(
        [jnp.broadcast_to((gamma_LxN**ALPHA)[..., None], (L, N, A)), jnp.broadcast_to(gamma_LxN[..., None], (L, N, E))],
        axis=-1,
    )
    name = "wq" if "wq" in attn else "wq_up"  # [L, D or Q, N, H]
    return {
        **attn,
        name: _scaled(attn[name], query_LxNxH[:, None]),
        "wk_up": _scaled(attn["wk_up"], (gamma_LxN ** (1.0 - ALPHA))[:, None, :, None]),  # [L, R, N, A]
    }
