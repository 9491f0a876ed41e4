"""How hyperparameters transfer across width and depth: the standard parametrization, µP, and
depth-µP or CompleteP on top of µP, in one table.

**Width.** µP (Yang et al. 2021, "Tensor Programs V", arXiv 2203.03466; the form of EleutherAI and
Cerebras's "Practitioner's Guide to the Maximal Update Parameterization", 2024) for Adam-family
optimisers. Each parameter is of one kind, and each kind's initial standard deviation and learning
rate scale as a power of its width multiplier m: its fan-in over that of the same parameter at the
base shape (`ModelConfig.width_multipliers`; every m is 1 at the base shape, where µP is the
standard model):

| kind   | parameters                              | fan-in                  | init std | Adam lr |
|--------|-----------------------------------------|-------------------------|----------|---------|
| input  | token and learned position tables       | the vocabulary (fixed)  | x 1      | x 1     |
| hidden | q/k/v, attention output, FFN in and out, | d_model, N*H, d_ff,     | x m^-1/2 | x m^-1  |
|        | each expert's FFN in and out, MLA's      | moe_d_ff, kv_lora_rank  |          |         |
|        | projections to and from its latent      |                         |          |         |
| output | an untied head, the MoE router          | d_model                 | x 1      | x 1     |
| vector | norm gains, biases                      | (none)                  | x 1      | x 1     |

and three forward multipliers: the output logits and the router logits times 1/m_d_model
(`Transformer.logits`, `MoE.route`: a readout of d_model correlated coordinates into a fixed
number of outputs grows as d_model, not its square root), and the attention logits scaled by
1/d_head rather than 1/sqrt(d_head) (`ModelConfig.scale`). Hidden matrices' Adam steps shrink as 1/m
because an update aligned with its input moves the output by fan-in times a coordinate's step; their
init shrinks as m^-1/2 so the product stays O(1). Adam's epsilon is times m_d_model^-1 for every
parameter: behind the 1/m readout every gradient shrinks as 1/m, and an epsilon that did not would
come to dominate them (as µP's and CompleteP's reference code scale it). Tied embeddings keep the input rule: the table and
the head share it, and the 1/m logit multiplier makes the shared table's readout right. The router
is the head's case exactly (d_model in, a fixed n_experts out), so it gets the head's rule; the
experts are hidden matrices with their own width, shared experts included. Weight decay rides on
the learning rate (AdamW's decoupled decay is multiplied by it), as the per-group learning rates of
µP's own code (`mup.MuAdamW`) do; decay independent of the learning rate (`optim.independent_decay`)
takes none of it, so every width decays alike.

**Depth** (`model.depth_scaling`), on top of µP, with m_L = n_layers / mup_base_n_layers and
alpha 1/2 (depth-µP: Yang et al. 2023, "Tensor Programs VI", arXiv 2310.02244, and Bordelon et al.
2023) or 1 (CompleteP: Dey et al. 2025, arXiv 2505.01618), as CompleteP's reference code
(EleutherAI/nanoGPT-mup, branch completep) writes both:
- every sublayer's output is multiplied by m_L^-alpha before it joins the residual stream
  (`Block.branch`, after a sandwich block's output norm), which is why only pre-LN and sandwich
  blocks take it: post-LN and DeepNorm renormalise the stream itself, which undoes any multiplier;
- GPT-2's depth-scaled init of the residual writes uses the base depth, so the init does not also
  shrink with depth (the multiplier does that);
- every parameter inside a block (matrices, norm gains, biases) has its learning rate times
  m_L^(alpha-1) (1 under CompleteP, m_L^-1/2 under depth-µP); the embeddings, head and final norm
  keep theirs;
- Adam's epsilon is times m_L^-alpha inside the blocks (their gradients pass through the branch
  multiplier), not outside them, as the paper's equation 40 has it and the reference code does since
  a fix (found by arXiv 2512.22382; it had put m_L^-alpha on every parameter's);
- weight decay no longer rides on the width factor of the learning rate: a hidden matrix decays by
  lr * weight_decay * m_L^(alpha-1) whatever its width (the reference's weight_decay / width_lr).

**What transfers is the base model's every hyperparameter**, not only its learning rate: init_std
(the kinds' init std at the base), and the two forward multipliers a µP user tunes there beside it
(the Practitioner's Guide's alpha_input and alpha_output: `model.mup_input_alpha` on the embedding
output, `model.mup_output_alpha` on the logits, 1.0 by default, so that at the base shape µP is the
standard model). A base tuned badly transfers badly: GPT-2's init_std of 0.02 was chosen for width
768; at a base of width 32 it left every µP width at the base's slow start (benchmarks/README.md).

MLA's sizes must be the ones derived from head_dim (`config.mla_sizes`), so that its latent and
head widths scale with the model: a written size, or a low-rank query latent, would stay fixed as
the model widens (a finite width, which is not a hidden matrix's rule), and is refused in one line.
**Muon** (train/muon.py) takes the hidden matrices, the table's `matrix` column saying how each is
read as matrices; under µP it must use the spectral scale, which makes their update the same size in
the spectral norm at every width, so their learning rate is not scaled; the rest keep Adam's rules.
Other optimisers outside config.ADAM_FAMILY have other rules and are refused under µP.
"""

from __future__ import annotations

import dataclasses

import jax

from transformer.config import ModelConfig

# depth_scaling -> alpha: the power of the depth multiplier each residual branch is divided by
DEPTH_ALPHA = {"none": 0.0, "depth_mup": 0.5, "complete_p": 1.0}


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Powers of a parameter's width multiplier m in its init std and its learning rate, the width
    its fan-in is (a key of `ModelConfig.width_multipliers`; None: it has no width fan-in), and, for
    a hidden matrix, how Muon reads it as matrices (`matrix`: see `matrix_axes`)."""

    init: float
    lr: float
    fan_in: str | None
    matrix: str | None = None


INPUT, OUTPUT, VECTOR = Scaling(0.0, 0.0, None), Scaling(0.0, 0.0, None), Scaling(0.0, 0.0, None)


def hidden(fan_in: str, matrix: str) -> Scaling:
    return Scaling(-0.5, -1.0, fan_in, matrix)


# Every parameter by its leaf name in the model's parameter tree: the one table of µP's rules. A hidden
# matrix also says its axes within one layer (the axis legend of model/layers.py), fan-in before the
# comma, fan-out after, for Muon (`matrix_axes`).
RULES: dict[str, Scaling] = {
    "embed": INPUT,
    "pos_embed": INPUT,
    "encoder_pos_embed": INPUT,
    "type_embed": INPUT,
    # t5_relative's bias tables [buckets, heads]: a one-hot readout of the bucket, no width in it
    "rel_bias": VECTOR,
    "encoder_rel_bias": VECTOR,
    "qkv": hidden("d_model", "D,KCH"),
    "out": hidden("attention", "NH,D"),
    # MLA: queries (full-rank, or down to and up from a latent of q_lora_rank), the kv latent and the
    # shared rope key from d_model, keys and values up from the latent
    "wq": hidden("d_model", "D,NH"),
    "wq_down": hidden("d_model", "D,Q"),
    "wq_up": hidden("q_lora_rank", "Q,NH"),
    "wkv_down": hidden("d_model", "D,R"),
    "wk_rope": hidden("d_model", "D,H"),
    "wk_up": hidden("kv_lora_rank", "R,NH"),
    "wv_up": hidden("kv_lora_rank", "R,NH"),
    "w_in": hidden("d_model", "D,CF"),
    "w_out": hidden("d_ff", "F,D"),
    "head": OUTPUT,
    "router": OUTPUT,
    "shared_gate": OUTPUT,  # the shared experts' gate (Qwen2-MoE): d_model in, one number out
    "router_bias": VECTOR,  # chooses experts, never gates them: no gradient reaches it
    "dense": hidden("d_model", "D,E"),  # BERT's prediction head (model.mlm_head; refused under µP)
    **{
        name: VECTOR for name in ("scale", "bias", "b_in", "b_out", "qkv_bias", "out_bias", "dense_bias", "output_bias")
    },
}
# ...and where a mixture of experts' FFN differs: its matrices' inner width is the experts'.
EXPERT_RULES: dict[str, Scaling] = {**RULES, "w_out": hidden("moe_d_ff", "F,D")}

# The parameter tree's block stacks (model/transformer.py); everything else is outside the blocks.
BLOCK_STACKS = ("blocks", "moe_blocks", "encoder_blocks")


def rule(name: str, experts: bool = False) -> Scaling:
    """The rule of parameter `name` (`experts`: of a mixture of experts' FFN)."""
    rules = EXPERT_RULES if experts else RULES
    if name not in rules:
        raise ValueError(f"model/parametrization.py has no µP rule for parameter {name!r}")
    return rules[name]


def matrix_axes(cfg: ModelConfig, name: str) -> str | None:
    """How Muon reads parameter `name` as matrices: its axes within one layer, fan-in before the
    comma, fan-out after (leading axes beyond them, L and E, index separate matrices; a fused axis C
    is cut into the projections it fuses). None: not a hidden matrix (AdamW's, under Muon)."""
    axes = rule(name).matrix
    if axes is not None and name == "w_in" and not cfg.gated_ffn:
        return axes.replace("C", "")  # one projection in: nothing fused
    return axes


def _power(cfg: ModelConfig, scaling: Scaling, exponent: float) -> float:
    """m of `scaling`'s fan-in width to `exponent` (1.0 without a width fan-in, and at the base shape)."""
    return 1.0 if scaling.fan_in is None else cfg.width_multipliers[scaling.fan_in] ** exponent


def init_factor(cfg: ModelConfig, name: str, experts: bool = False) -> float:
    """What parameter `name`'s initial standard deviation is multiplied by (1.0 at the base shape)."""
    scaling = rule(name, experts)
    return _power(cfg, scaling, scaling.init)


def output_multiplier(cfg: ModelConfig) -> float:
    """What the router logits are multiplied by (and the output logits, times mup_output_alpha):
    1/m of d_model under µP, 1.0 at the base shape."""
    return 1.0 / cfg.width_multipliers["d_model"]


def logit_multiplier(cfg: ModelConfig) -> float:
    """What the output logits are multiplied by: the base's tuned alpha_output times the readout's 1/m."""
    return cfg.mup_output_alpha * output_multiplier(cfg)


def branch_multiplier(cfg: ModelConfig) -> float:
    """What each sublayer's output is multiplied by before the residual add: m_L^-alpha (1.0 without
    depth scaling, and at the base depth)."""
    return cfg.depth_multiplier ** -DEPTH_ALPHA[cfg.depth_scaling]


@dataclasses.dataclass(frozen=True)
class OptimizerScaling:
    """What µP (and depth scaling) change in the optimiser, per parameter (trees like the
    parameters): multipliers of the learning rate, of the weight decay's lr * weight_decay, and of
    Adam's epsilon."""

    lr: dict
    decay: dict
    eps: dict


def optimizer_scaling(cfg: ModelConfig, params: dict, muon: bool = False) -> OptimizerScaling | None:
    """For a pure-dict parameter tree: the multipliers of `cfg`'s parametrization (None under the
    standard one; all 1.0 at the base shape). Under Muon (`muon`, with the spectral scale) a hidden
    matrix's learning rate is not scaled: its orthogonalised update times sqrt(fan_out / fan_in)
    already has the spectral norm µP asks of every width (Yang, Simon & Bernstein 2023)."""
    if cfg.parametrization != "mup":
        return None
    alpha = DEPTH_ALPHA[cfg.depth_scaling]
    depth_lr = cfg.depth_multiplier ** (alpha - 1.0)
    width_eps = 1.0 / cfg.width_multipliers["d_model"]

    def multipliers(path) -> tuple[float, float, float]:
        """(learning-rate, decay, epsilon) multiplier of the parameter at `path`."""
        keys = [str(getattr(k, "key", k)) for k in path]
        scaling = rule(keys[-1], experts=keys[0] == "moe_blocks" and "ffn" in keys)
        width = 1.0 if muon and scaling.matrix is not None else _power(cfg, scaling, scaling.lr)
        if cfg.depth_scaling == "none":
            return width, width, width_eps
        if keys[0] not in BLOCK_STACKS:
            return width, 1.0, width_eps
        return width * depth_lr, depth_lr, width_eps * cfg.depth_multiplier**-alpha

    table = jax.tree_util.tree_map_with_path(lambda path, _: multipliers(path), params)
    lr, decay, eps = (
        jax.tree.map(lambda t, i=i: t[i], table, is_leaf=lambda t: isinstance(t, tuple)) for i in range(3)
    )
    return OptimizerScaling(lr, decay, eps)
