"""How hyperparameters transfer across width: the standard parametrization and µP, in one table.

µP (Yang et al. 2021, "Tensor Programs V", arXiv 2203.03466; the form of EleutherAI and Cerebras's
"Practitioner's Guide to the Maximal Update Parameterization", 2024) for Adam-family optimisers.
Each parameter is of one kind, and each kind's initial standard deviation and learning rate scale
as a power of its width multiplier m: its fan-in over that of the same parameter at the base shape
(`ModelConfig.width_multipliers`; every m is 1 at the base shape, where µP is the standard model):

| kind   | parameters                           | fan-in                | init std    | Adam lr    |
|--------|--------------------------------------|-----------------------|-------------|------------|
| input  | token and learned position tables    | the vocabulary (fixed)| x 1         | x 1        |
| hidden | q/k/v, attention output, FFN in, out | d_model, N*H, d_ff    | x m^-1/2    | x m^-1     |
| output | an untied head                       | d_model               | x 1         | x 1        |
| vector | norm gains, biases                   | (none)                | x 1         | x 1        |

and two forward multipliers: the output logits times 1/m_d_model (`Transformer.logits`: a readout
of d_model correlated coordinates grows as d_model, not its square root), and the attention
logits scaled by 1/d_head rather than 1/sqrt(d_head) (`ModelConfig.scale`). Hidden matrices' Adam
steps shrink as 1/m because an update aligned with its input moves the output by fan-in times a
coordinate's step; their init shrinks as m^-1/2 so the product stays O(1). Tied embeddings keep
the input rule: the table and the head share it, and the 1/m logit multiplier makes the shared
table's readout right. Weight decay rides on the learning rate (AdamW's decoupled decay is
multiplied by it), as per-parameter-group learning rates do in the µP papers' own code.
"""

from __future__ import annotations

import dataclasses

import jax

from transformer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Powers of a parameter's width multiplier m in its init std and its learning rate, and the
    width its fan-in is (a key of `ModelConfig.width_multipliers`; None: it has no width fan-in)."""

    init: float
    lr: float
    fan_in: str | None


INPUT, OUTPUT, VECTOR = Scaling(0.0, 0.0, None), Scaling(0.0, 0.0, None), Scaling(0.0, 0.0, None)


def hidden(fan_in: str) -> Scaling:
    return Scaling(-0.5, -1.0, fan_in)


# Every parameter by its leaf name in the model's parameter tree: the one table of µP's rules.
RULES: dict[str, Scaling] = {
    "embed": INPUT,
    "pos_embed": INPUT,
    "qkv": hidden("d_model"),
    "out": hidden("attention"),
    "w_in": hidden("d_model"),
    "w_out": hidden("d_ff"),
    "head": OUTPUT,
    **{name: VECTOR for name in ("scale", "bias", "b_in", "b_out", "qkv_bias", "out_bias")},
}


def _power(cfg: ModelConfig, rule: Scaling, exponent: float) -> float:
    """m of `rule`'s fan-in width to `exponent` (1.0 without a width fan-in, and at the base shape)."""
    return 1.0 if rule.fan_in is None else cfg.width_multipliers[rule.fan_in] ** exponent


def init_factor(cfg: ModelConfig, name: str) -> float:
    """What parameter `name`'s initial standard deviation is multiplied by (1.0 at the base shape)."""
    return _power(cfg, RULES[name], RULES[name].init)


def output_multiplier(cfg: ModelConfig) -> float:
    """What the output logits are multiplied by: 1/m of d_model under µP, 1.0 at the base shape."""
    return 1.0 / cfg.width_multipliers["d_model"]


def lr_multipliers(cfg: ModelConfig, params: dict) -> dict:
    """For a pure-dict parameter tree: each parameter's learning-rate multiplier (1.0 at the base
    shape and under the standard parametrization)."""

    def multiplier(path, _) -> float:
        name = path[-1].key
        if name not in RULES:
            raise ValueError(f"model/parametrization.py has no µP rule for parameter {name!r}")
        return _power(cfg, RULES[name], RULES[name].lr)

    return jax.tree_util.tree_map_with_path(multiplier, params)
