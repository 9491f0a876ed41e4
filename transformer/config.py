"""Typed run configuration: the schema, its defaults, its validation and its derived values.

A run is described by one frozen `Config` with one section per concern. Every field is typed;
`transformer.config_loader` reads YAML files and overrides into it, checking each value against its
annotation, and each section's `__post_init__` checks ranges and combinations, so a user mistake
becomes one `ConfigError` naming the key instead of a traceback from deep inside JAX.

Derived values (head_dim when unset, the padded vocab, per-layer windows, DeepNet constants, the
parsed data source, ...) are resolved once here and exposed as fields or properties; nothing
downstream recomputes them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from transformer.synthetic import RecallTask, Seq2seqTask

ROOT = Path(__file__).resolve().parent.parent  # the repository: configs/, train.py
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"

# Sliding-window size given to "global" layers of a per-layer pattern inside the layer scan, where
# the window is a traced value. Larger than any context this framework will see.
GLOBAL_WINDOW = 2**30

Norm = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post", "sandwich", "deepnorm"]
Ffn = Literal["relu", "gelu", "gelu_exact", "swiglu", "geglu", "geglu_exact", "reglu"]
GATED_FFNS = ("swiglu", "geglu", "geglu_exact", "reglu")
Position = Literal["learned", "sinusoidal", "rope", "alibi", "t5_relative", "none"]
RopeScaling = Literal["none", "linear", "llama3", "yarn"]
AttentionImpl = Literal["xla", "einsum", "cudnn", "blocked", "auto"]  # auto: accelerator.choose_attention decides
AttentionKernel = Literal["xla", "einsum", "cudnn", "blocked"]  # what a built model runs
AttentionKind = Literal["mha", "mla"]  # mha covers GQA and MQA through n_kv_heads
MLA_SIZES = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
LayerKind = Literal["local", "global"]
Remat = Literal["none", "full", "dots", "dots_no_batch"]
DType = Literal["float32", "bfloat16", "float16"]
ComputeDType = Literal["auto", "float32", "bfloat16", "float16"]  # auto: accelerator.choose_dtype decides
Router = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2"]  # a group of experts scored by its best, or its two best summed
Parametrization = Literal["standard", "mup"]  # mup: model/parametrization.py
DepthScaling = Literal["none", "depth_mup", "complete_p"]  # on top of mup: model/parametrization.py
# µP's base shape: the sizes a µP model's hyperparameters were tuned at (ModelConfig._resolve_mup_base)
MUP_BASE = (
    "mup_base_d_model",
    "mup_base_n_heads",
    "mup_base_head_dim",
    "mup_base_d_ff",
    "mup_base_moe_d_ff",
    "mup_base_n_layers",
)
MUP_ALPHAS = ("mup_input_alpha", "mup_output_alpha")  # µP's tunable forward multipliers
ADAM_FAMILY = ("adamw", "adam", "lion")  # the optimisers µP's Adam rules hold for (per-coordinate normalised steps)
# The three Transformer families: decoder-only (causal LM), encoder-only (bidirectional, masked LM),
# encoder-decoder (bidirectional encoder; causal decoder with cross-attention to it).
Arch = Literal["decoder", "encoder", "encoder_decoder"]
# What a batch trains: causal (next token of text), prefix (decoder-only on input/target pairs: the
# target predicted after the input in one sequence), mlm (masked tokens of text), span (T5 span
# corruption of text), seq2seq (encoder-decoder on input/target pairs).
Objective = Literal["causal", "prefix", "mlm", "span", "seq2seq"]
# Each family's objectives: the first on text, the second on input/target pairs.
OBJECTIVES: dict[str, tuple[Objective, ...]] = {
    "decoder": ("causal", "prefix"),
    "encoder": ("mlm",),
    "encoder_decoder": ("span", "seq2seq"),
}
# builtin:stdlib, the Python sources; builtin:recall[:opts] and builtin:seq2seq[:opts], see synthetic.py
BUILTINS = ("stdlib", "recall", "seq2seq")
# the builtins that take options: the task each parses them into
BUILTIN_TASKS: dict[str, type[RecallTask] | type[Seq2seqTask]] = {"recall": RecallTask, "seq2seq": Seq2seqTask}


class ConfigError(ValueError):
    """A user mistake in the configuration: `key` is the dotted path of the offending value."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message

    def under(self, section: str) -> ConfigError:
        return ConfigError(f"{section}.{self.key}" if self.key else section, self.message)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


# Integers reach JAX as int32 (steps, seeds, sizes, positions): larger ones cannot be held there.
INT_LIMIT = 2**31


def _check_ints(section: Any) -> None:
    """Every integer field of a section fits a signed 32-bit integer."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if isinstance(value, int) and not isinstance(value, bool):
            _check(
                -INT_LIMIT <= value < INT_LIMIT,
                field.metadata.get("key", field.name),  # yaml_key, defined below
                f"must fit a 32-bit integer (less than 2**31 = {INT_LIMIT:,} in size), got {value:,}",
            )


def mla_sizes(head_dim: int, n_heads: int) -> dict[str, int]:
    """MLA's sizes derived from the head dim as in DeepSeek-V2: d_h for the rest of each query/key
    head and for values, d_h/2 (even) for the rope part, a latent of 4*d_h (at most what it is
    projected up to)."""
    h = head_dim
    return {
        "qk_nope_head_dim": h,
        "qk_rope_head_dim": max(2, h // 4 * 2),
        "v_head_dim": h,
        "kv_lora_rank": min(4 * h, 2 * n_heads * h),
    }


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# A size the user may leave out (null) and __post_init__ then derives. The loader reads the schema's
# `int | None`; the type checker is told `int`, the only type a constructed ModelConfig ever holds.
if TYPE_CHECKING:
    DerivedInt = int
else:
    DerivedInt = int | None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: Arch = "decoder"
    d_model: int = 128
    n_layers: int = 4  # the decoder's depth; an encoder-only model's encoder depth
    n_encoder_layers: DerivedInt = None  # type: ignore[assignment]  # encoder_decoder only; None: n_layers
    n_heads: int = 4
    n_kv_heads: DerivedInt = None  # type: ignore[assignment]  # None: = n_heads (MHA); 1: MQA; otherwise GQA
    head_dim: DerivedInt = None  # type: ignore[assignment]  # None: d_model // n_heads
    # d_ff None: 4*D for MLPs, 8*D/3 for gated FFNs, rounded up to ffn_multiple
    d_ff: DerivedInt = None  # type: ignore[assignment]
    ffn_multiple: int = 64
    vocab_size: int = 259  # the tokenizer's vocabulary (byte tokenizer: 256 bytes + BOS, EOS, PAD)
    vocab_multiple: int = 64  # the embedding table is padded up to a multiple of this
    max_seq_len: int | None = None  # None: data.seq_len when loaded as part of a run config
    window: int | None = None  # sliding-window size in tokens (a query sees itself and window-1 back)
    attention_pattern: tuple[LayerKind, ...] | None = None  # cycled over layers, e.g. local,local,global
    # auto: the fast implementation for the backend and the mask (accelerator.choose_attention): the
    # blocked one on a CPU, cuDNN on a GPU where it applies, XLA's elsewhere
    attention_impl: AttentionImpl = "auto"
    # Multi-head latent attention (DeepSeek-V2): model.attention=mla and its sizes (null: derived from
    # head_dim as in DeepSeek-V2, d_c = 4*d_h, d_h^R = d_h/2 made even; q_lora_rank null = full-rank queries).
    attention: AttentionKind = "mha"
    kv_lora_rank: DerivedInt = None  # type: ignore[assignment]
    q_lora_rank: int | None = None
    qk_rope_head_dim: DerivedInt = None  # type: ignore[assignment]
    qk_nope_head_dim: DerivedInt = None  # type: ignore[assignment]
    v_head_dim: DerivedInt = None  # type: ignore[assignment]
    attn_scale: float | None = None  # None: 1/sqrt(qk_head_dim), the width of a query/key head
    position: Position = "rope"
    rope_theta: float = 10000.0
    encoder_positions: bool = False  # an encoder-decoder's encoder has a learned position table of its own (BART)
    rel_buckets: int = 32  # t5_relative: buckets of the distance, half each way when bidirectional
    rel_max_distance: int = 128  # t5_relative: the distance the last (logarithmic) bucket starts at
    rope_local_theta: float | None = None  # theta of the layers with a window (Gemma 3, ModernBERT); null: rope_theta
    rope_local_scaling: bool = True  # false: rope_scaling stretches the global layers alone, not the windowed (Gemma 3)
    # RoPE frequencies stretched for longer contexts: linear divides all by rope_factor; llama3
    # (Llama 3.1) divides the low ones, keeps the high ones, and blends between (see positions.py)
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_len: int = 8192  # llama3, yarn: the context the model was pretrained with
    # yarn (Peng et al. 2023): frequencies below beta_slow rotations over the original context
    # interpolated by rope_factor, above beta_fast kept, a ramp between; rotated parts times
    # rope_attention_factor (null: YaRN's 0.1 ln(rope_factor) + 1)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    norm: Norm = "rmsnorm"
    norm_position: NormPosition = "pre"
    norm_eps: float = 1e-6
    norm_bias: bool = True  # LayerNorm's bias; false: its gain alone (ModernBERT)
    # false: the first layer's attention reads the stream as it is, the embedding norm serving as its
    # norm (ModernBERT); its attn_norm's parameters are then never read
    first_attn_norm: bool = True
    token_types: int = 0  # a learned embedding per token type added to the tokens' (BERT's segments A/B); 0: none
    embedding_norm: bool = False  # a norm on the embeddings, positions added (BERT, BART); each stack its own
    norm_offset: bool = False  # norm gains kept as their offset w from 1, applied as 1 + w (Gemma): 0 at init
    embed_scale: bool = False  # token embeddings times sqrt(d_model), before positions (Vaswani et al., Gemma)
    ffn: Ffn = "swiglu"
    use_bias: bool = False  # biases on every projection (GPT-2)
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2); implied by use_bias
    tie_embeddings: bool = True
    mlm_head: bool = False  # BERT's prediction head before the output projection: dense + the FFN's activation + norm
    mlm_head_bias: bool = True  # the prediction head's dense layer has a bias (BERT's; ModernBERT's has none)
    scale_head_input: bool = False  # the final hidden states times d_model^-0.5 before the output projection (T5 v1.0)
    output_bias: bool = False  # a learned bias per vocabulary entry on the logits (BERT's, BART's final_logits_bias)
    dropout: float = 0.0  # on the embedding output and on each sublayer's output before the residual add
    attn_dropout: float = 0.0  # on attention probabilities (einsum implementation only)
    qk_norm: bool = False
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # QK-clip (Kimi K2's MuonClip): after each update, a head whose largest attention logit in the
    # step passed this threshold has its query and key projections scaled down to bring it back to
    # the threshold (model/qk_clip.py); null: off
    qk_clip: float | None = None
    init_std: float = 0.02
    init_depth_scaled: bool = True  # residual output projections get init_std / sqrt(2 * n_layers)
    param_dtype: DType = "float32"
    # compute dtype; softmax, norms and logits are always float32. auto: float32 on a CPU, bfloat16
    # on a GPU or TPU (with param_dtype's float32 master weights), decided by accelerator.resolve
    dtype: ComputeDType = "auto"
    scan_layers: bool = True
    # layers run by each iteration of the layer scan (lax.scan's unroll); null: the whole stack on a
    # CPU (where the stacked activations' copies cost ~10% of the step, benchmarks/README.md), one
    # layer elsewhere, so compile time stays flat in depth (accelerator.resolve decides)
    scan_unroll: int | None = None
    remat: Remat = "none"
    # a Hugging Face model directory: the architecture keys come from its config.json, the first
    # parameters from its weights (transformer/io/hf.py)
    init_from: str | None = None
    # --- mixture of experts (model/moe.py); n_experts 0: a dense FFN in every layer ---
    n_experts: int = 0
    top_k: int = 1  # experts each token is routed to
    n_shared_experts: int = 0  # experts every token goes through, beside the routed ones (DeepSeek)
    moe_d_ff: DerivedInt = None  # type: ignore[assignment]  # each expert's width; None: d_ff
    moe_every: int = 1  # layers k-1, 2k-1, ... are MoE, the others dense (n_layers a multiple of k)
    router: Router = "softmax"  # softmax then top-k, or sigmoid scores (DeepSeek-V3)
    renormalize_gates: bool = True  # top_k > 1: the chosen gates over their sum; false: the scores as they are
    routed_scale: float = 1.0  # the routed experts' gates times this (DeepSeek's routed_scaling_factor)
    # a per-expert bias added to the scores for choosing experts only, never to the gates (DeepSeek-V3's
    # e_score_correction_bias); no gradient reaches it, nor does the optimiser
    router_bias: bool = False
    # aux-loss-free load balancing (Wang et al. 2024, DeepSeek-V3): after each update the choice bias
    # of an expert below the layer's mean load rises by this, of one above it falls (0: it stays)
    router_bias_rate: float = 0.0
    # group-limited routing (DeepSeek): the experts in router_groups equal groups, each scored by
    # router_group_score, and a token's experts chosen from its router_topk_groups best groups
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: GroupScore = "max"
    moe_first_dense: int = 0  # the first k layers dense, the rest MoE (DeepSeek's first_k_dense_replace)
    shared_expert_gate: bool = False  # the shared experts' output times sigmoid(x . w), per token (Qwen2-MoE)
    capacity_factor: float | None = 1.25  # expert slots per row = factor * T * top_k / n_experts; null: dropless
    moe_aux_loss: float = 0.01  # weight of the Switch load-balancing loss (0: off)
    moe_z_loss: float = 0.001  # weight of the router z-loss (ST-MoE; 0: off)
    # --- hyperparameters that transfer across width (model/parametrization.py) ---
    parametrization: Parametrization = "standard"
    # mup only: the base shape whose hyperparameters this model's mean the same as (null: derived
    # as this model derives its own from mup_base_d_model; mup_base_d_model null: d_model itself)
    mup_base_d_model: DerivedInt = None  # type: ignore[assignment]
    mup_base_n_heads: DerivedInt = None  # type: ignore[assignment]
    mup_base_head_dim: DerivedInt = None  # type: ignore[assignment]
    mup_base_d_ff: DerivedInt = None  # type: ignore[assignment]
    mup_base_moe_d_ff: DerivedInt = None  # type: ignore[assignment]  # with n_experts only
    # mup only: the base's tunable forward multipliers (the Practitioner's Guide's alpha_input and
    # alpha_output), tuned at the base like its learning rate and init_std, and transferred unchanged:
    # the embedding output (tokens and positions) times mup_input_alpha, the logits times
    # mup_output_alpha / m_d_model
    mup_input_alpha: float = 1.0
    mup_output_alpha: float = 1.0
    # how hyperparameters transfer across depth, on top of µP's width rules: none, depth_mup (branch
    # multiplier m_L^-1/2) or complete_p (m_L^-1), with m_L = n_layers / mup_base_n_layers
    depth_scaling: DepthScaling = "none"
    mup_base_n_layers: DerivedInt = None  # type: ignore[assignment]  # with depth_scaling only; null: n_layers

    def __post_init__(self):
        _check_ints(self)
        # in this order, so that of several mistakes the most basic is reported
        self._resolve_mup_base()  # before _resolve_sizes, which fills in the head_dim and d_ff it reads
        self._resolve_sizes()
        self._check_positions()
        self._check_windows()
        self._check_scalars()
        self._check_attention_impl()
        self._check_qk_clip()
        self._check_mla()
        self._check_moe()
        self._check_norms()
        self._check_arch()
        _check(  # a learned table needs a last row: see max_positions
            self.position != "learned" or self.max_seq_len is not None,
            "max_seq_len",
            "learned positions need a maximum length (model.max_seq_len or data.seq_len)",
        )

    def _ffn_width(self, d_model: int) -> int:
        """d_ff's default: 4*D for MLPs, 8*D/3 for gated FFNs, rounded up to ffn_multiple."""
        width = 8 * d_model / 3 if self.ffn in GATED_FFNS else 4 * d_model
        return _round_up(math.ceil(width), self.ffn_multiple)

    def _resolve_mup_base(self) -> None:
        """µP's base shape, filled in as the base model would derive its own sizes: a head_dim or
        d_ff written in the config is the base's too (it does not scale), a derived one is derived
        from mup_base_d_model. Resolved once, so the saved config holds the numbers."""
        if self.parametrization != "mup":
            _check(
                self.depth_scaling == "none",
                "depth_scaling",
                "scales µP's rules across depth: only with model.parametrization=mup (at its base width µP is the standard model)",
            )
            for name in MUP_BASE:
                _check(getattr(self, name) is None, name, "sets µP's base shape: only with model.parametrization=mup")
            self._check_mup_alphas()
            return
        self._check_mup_alphas()
        _check(
            self.attention != "mla" or self.q_lora_rank is None,
            "q_lora_rank",
            "under µP a written query latent stays fixed as the model widens, which µP has no rule for here: leave it null (full-rank queries)",
        )
        _check(not self.mlm_head, "mlm_head", "µP has no rule written here for BERT's prediction head: leave it false")
        if self.mup_base_d_model is None:
            object.__setattr__(self, "mup_base_d_model", self.d_model)
        if self.mup_base_n_heads is None:
            object.__setattr__(self, "mup_base_n_heads", self.n_heads)
        for name in ("mup_base_d_model", "mup_base_n_heads"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        if self.mup_base_head_dim is None:
            d, n = self.mup_base_d_model, self.mup_base_n_heads
            _check(
                self.head_dim is not None or d % n == 0,
                "mup_base_head_dim",
                f"the base d_model ({d}) is not divisible by its {n} heads: set it",
            )
            object.__setattr__(self, "mup_base_head_dim", self.head_dim if self.head_dim is not None else d // n)
        if self.mup_base_d_ff is None:
            object.__setattr__(
                self, "mup_base_d_ff", self.d_ff if self.d_ff is not None else self._ffn_width(self.mup_base_d_model)
            )
        if not self.n_experts:
            _check(
                self.mup_base_moe_d_ff is None, "mup_base_moe_d_ff", "is the experts' base width: only with n_experts"
            )
        elif self.mup_base_moe_d_ff is None:  # an expert's width is d_ff's unless written
            base = self.moe_d_ff if self.moe_d_ff is not None else self.mup_base_d_ff
            object.__setattr__(self, "mup_base_moe_d_ff", base)
        self._resolve_depth_base()
        for name in MUP_BASE:
            value = getattr(self, name)
            _check(value is None or value >= 1, name, f"must be >= 1, got {value}")

    def _check_mup_alphas(self) -> None:
        """µP's tunable multipliers: finite and positive, and 1.0 (none) without µP."""
        for name in MUP_ALPHAS:
            value = getattr(self, name)
            if self.parametrization != "mup":
                _check(value == 1.0, name, "is a µP multiplier: only with model.parametrization=mup")
            _check(math.isfinite(value) and value > 0, name, f"must be a finite number > 0, got {value}")

    def _resolve_depth_base(self) -> None:
        """The base depth of depth_mup and complete_p, and the blocks their branch multiplier fits."""
        if self.depth_scaling == "none":
            _check(
                self.mup_base_n_layers is None, "mup_base_n_layers", "is the base depth: only with model.depth_scaling"
            )
            return
        _check(
            self.norm_position in ("pre", "sandwich"),
            "depth_scaling",
            f"scales residual branches, which {self.norm_position} blocks renormalise away: use norm_position pre or sandwich",
        )
        _check(
            self.arch != "encoder_decoder",
            "depth_scaling",
            "has one base depth, and an encoder-decoder's two stacks would need two: not yet",
        )
        if self.mup_base_n_layers is None:
            object.__setattr__(self, "mup_base_n_layers", self.n_layers)

    def _resolve_sizes(self) -> None:
        """Check the sizes and fill in the derived ones (kv heads, head dim, FFN width)."""
        for name in ("d_model", "n_layers", "n_heads", "ffn_multiple", "vocab_size", "vocab_multiple"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(
            self.scan_unroll is None or self.scan_unroll >= 1,
            "scan_unroll",
            f"must be >= 1 (or null: decided by the platform), got {self.scan_unroll}",
        )
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _check(
            1 <= self.n_kv_heads <= self.n_heads,
            "n_kv_heads",
            f"must be between 1 and n_heads ({self.n_heads}), got {self.n_kv_heads}",
        )
        _check(
            self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            f"n_heads ({self.n_heads}) is not a multiple of n_kv_heads ({self.n_kv_heads})",
        )
        if self.head_dim is None:
            _check(
                self.d_model % self.n_heads == 0,
                "n_heads",
                f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads}); set model.head_dim",
            )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _check(self.head_dim >= 1, "head_dim", f"must be >= 1, got {self.head_dim}")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", self._ffn_width(self.d_model))
        _check(self.d_ff >= 1, "d_ff", f"must be >= 1, got {self.d_ff}")
        if self.max_seq_len is not None:
            _check(self.max_seq_len >= 1, "max_seq_len", f"must be >= 1, got {self.max_seq_len}")

    def _check_positions(self) -> None:
        _check(
            self.position != "rope" or self.head_dim % 2 == 0,
            "head_dim",
            f"RoPE needs an even head_dim, got {self.head_dim}",
        )
        _check(
            self.position != "sinusoidal" or self.d_model % 2 == 0,
            "d_model",
            f"sinusoidal positions need an even d_model, got {self.d_model}",
        )

    def _check_windows(self) -> None:
        if self.window is not None:
            _check(self.window >= 1, "window", f"must be >= 1 (or null for full attention), got {self.window}")
        if self.attention_pattern is not None:
            _check(len(self.attention_pattern) >= 1, "attention_pattern", "must name at least one layer kind")
            _check(
                self.window is not None,
                "attention_pattern",
                "a per-layer pattern needs model.window for its local layers",
            )
        _check(self.rel_buckets >= 2, "rel_buckets", f"must be >= 2, got {self.rel_buckets}")
        _check(self.rel_max_distance >= 1, "rel_max_distance", f"must be >= 1, got {self.rel_max_distance}")
        if self.rope_local_theta is not None:
            _check(self.position == "rope", "rope_local_theta", "is RoPE's: set model.position=rope")
            _check(self.rope_local_theta > 0, "rope_local_theta", f"must be > 0, got {self.rope_local_theta}")
            _check(self.window is not None, "rope_local_theta", "is the windowed layers' theta: set model.window")
            _check(self.rope_scaling != "yarn", "rope_local_theta", "has no yarn scaling here (one theta per model)")
        if not self.rope_local_scaling:
            _check(
                self.rope_scaling != "none",
                "rope_local_scaling",
                "false keeps the windowed layers unscaled: set model.rope_scaling",
            )
            _check(self.window is not None, "rope_local_scaling", "is the windowed layers' scaling: set model.window")
        yarn = ("rope_beta_fast", 32.0), ("rope_beta_slow", 1.0), ("rope_attention_factor", None)
        for name, default in yarn if self.rope_scaling != "yarn" else ():
            _check(getattr(self, name) == default, name, "is yarn's: set model.rope_scaling=yarn, or leave it out")

    def _check_scalars(self) -> None:
        for name in ("rope_theta", "rope_factor", "rope_low_freq_factor", "norm_eps", "init_std"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            "rope_high_freq_factor",
            f"must exceed rope_low_freq_factor ({self.rope_low_freq_factor}), got {self.rope_high_freq_factor}",
        )
        _check(
            self.rope_original_max_len >= 1, "rope_original_max_len", f"must be >= 1, got {self.rope_original_max_len}"
        )
        _check(
            self.rope_beta_fast > self.rope_beta_slow > 0,
            "rope_beta_fast",
            f"must exceed rope_beta_slow ({self.rope_beta_slow}), which must be > 0; got {self.rope_beta_fast}",
        )
        for name in ("attn_scale", "attn_softcap", "logit_softcap", "qk_clip", "rope_attention_factor"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, f"must be > 0 or null, got {value}")
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, name, f"must be in [0, 1), got {value}")

    def _check_attention_impl(self) -> None:
        # jax.nn.dot_product_attention has no hook for soft-capping or dropping attention weights.
        if self.attention_impl not in ("einsum", "auto"):
            for name in ("attn_softcap", "attn_dropout"):
                _check(
                    not getattr(self, name),
                    name,
                    f"needs model.attention_impl=einsum (the {self.attention_impl} implementation has no hook for it)",
                )
        _check(
            self.attention_impl != "cudnn" or self.dtype != "float32",
            "attention_impl",
            "cudnn attention runs in bfloat16 or float16; set model.dtype accordingly",
        )

    def _check_qk_clip(self) -> None:
        if self.qk_clip is None:
            return
        _check(
            not self.qk_norm,
            "qk_clip",
            "rescales the query and key projections, which qk_norm normalises away again: use one of the two",
        )
        _check(
            self.arch != "encoder_decoder",
            "qk_clip",
            "clips self-attention in decoders and encoders; an encoder-decoder's encoder and cross-attention are not clipped yet",
        )

    def _check_mla(self) -> None:
        """MLA's sizes (derived where null) fit, and what it cannot combine with is refused."""
        if self.attention != "mla":
            for name in MLA_SIZES:
                _check(getattr(self, name) is None, name, "is an MLA size: set model.attention=mla, or leave it out")
            return
        derived = mla_sizes(self.head_dim, self.n_heads)
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, derived[name])
        for name in (*MLA_SIZES[2:], *MLA_SIZES[:2]):  # the head sizes first: the rank's default needs them
            if name == "kv_lora_rank" and self.kv_lora_rank is None:
                object.__setattr__(self, name, min(4 * self.head_dim, self.mla_kv_width))
            value = getattr(self, name)
            _check(value is None or value >= 1, name, f"must be >= 1, got {value}")
        for name, size in derived.items():  # µP's base derives its sizes so: a written one would not scale
            _check(
                self.parametrization != "mup" or getattr(self, name) == size,
                name,
                f"under µP MLA's sizes scale with head_dim as derived ({size} here): leave it null, a written size stays fixed as the model widens",
            )
        _check(
            self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"RoPE needs an even size, got {self.qk_rope_head_dim}"
        )
        for name, width, what in (
            ("kv_lora_rank", self.mla_kv_width, "n_heads*(qk_nope_head_dim+v_head_dim)"),
            ("q_lora_rank", self.n_heads * self.qk_head_dim, "n_heads*(qk_nope_head_dim+qk_rope_head_dim)"),
        ):
            value = getattr(self, name)
            _check(
                value is None or value <= width,
                name,
                f"must be at most {what} = {width}, the width it is projected up to (a wider latent compresses nothing), got {value}",
            )
        for name, ok, why in (
            ("position", self.position == "rope", "MLA needs position=rope (its RoPE is on a decoupled key)"),
            (
                "n_kv_heads",
                self.n_kv_heads == self.n_heads,
                f"MLA has no kv heads (one latent serves every head): set it to n_heads ({self.n_heads}) or null",
            ),
            ("qk_norm", not self.qk_norm, "MLA normalises its latents already; qk_norm is for attention=mha"),
            ("use_bias", not self.use_bias, "MLA has no bias terms (DeepSeek-V2); set use_bias=false"),
            ("attention_impl", self.attention_impl != "cudnn", "MLA runs with xla or einsum, not cudnn"),
        ):
            _check(ok, name, why)

    def _check_moe(self) -> None:
        _check(self.moe_every >= 1, "moe_every", f"must be >= 1, got {self.moe_every}")
        _check(self.n_experts >= 0, "n_experts", f"must be >= 0 (0: dense), got {self.n_experts}")
        _check(
            not self.shared_expert_gate or self.n_shared_experts > 0,
            "shared_expert_gate",
            "gates the shared experts' output: set model.n_shared_experts > 0",
        )
        if not self.n_experts:  # a dense model keeps moe_d_ff null, as exported HF configs do
            routing: dict[str, object] = dict(renormalize_gates=True, routed_scale=1.0, router_bias=False)
            routing |= dict(router_bias_rate=0.0)
            routing |= dict(router_groups=1, router_topk_groups=1, router_group_score="max", moe_first_dense=0)
            for name, default in routing.items():
                _check(getattr(self, name) == default, name, "is the routed experts' rule: only with n_experts")
            _check(self.moe_d_ff is None, "moe_d_ff", "is an expert's width: set model.n_experts, or leave it out")
            _check(
                self.n_shared_experts == 0,
                "n_shared_experts",
                f"{self.n_shared_experts} shared experts go beside routed ones: set model.n_experts > 0, or leave it out",
            )
            return
        if self.moe_d_ff is None:
            object.__setattr__(self, "moe_d_ff", self.d_ff)
        _check(
            1 <= self.top_k <= self.n_experts,
            "top_k",
            f"must be between 1 and n_experts ({self.n_experts}), got {self.top_k}",
        )
        _check(
            self.n_layers % self.moe_every == 0,
            "moe_every",
            f"n_layers ({self.n_layers}) is not a multiple of moe_every ({self.moe_every})",
        )
        _check(self.moe_d_ff >= 1, "moe_d_ff", f"must be >= 1, got {self.moe_d_ff}")
        self._check_routing()
        _check(self.n_shared_experts >= 0, "n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        cf = self.capacity_factor
        _check(cf is None or cf > 0, "capacity_factor", f"must be > 0 or null (dropless), got {cf}")
        for name in ("moe_aux_loss", "moe_z_loss"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check(not self.use_bias, "use_bias", "experts have no biases: set model.use_bias=false with n_experts")

    def _check_norms(self) -> None:
        _check(self.token_types >= 0, "token_types", f"must be >= 0 (0: none), got {self.token_types}")
        _check(self.mlm_head or self.mlm_head_bias, "mlm_head_bias", "is the prediction head's: set model.mlm_head")
        _check(self.norm_bias or self.norm == "layernorm", "norm_bias", "is LayerNorm's: set model.norm=layernorm")
        if self.first_attn_norm:
            return
        for ok, why in (
            (self.norm_position == "pre", "false is for pre-norm blocks (set model.norm_position=pre)"),
            (not self.n_experts, "false is for dense models (one stack of blocks), not with model.n_experts"),
            (self.arch != "encoder_decoder", "false is for a decoder or an encoder, not an encoder_decoder"),
        ):
            _check(ok, "first_attn_norm", why)

    def _check_routing(self) -> None:
        E, G, top = self.n_experts, self.router_groups, self.router_topk_groups
        _check(self.routed_scale > 0, "routed_scale", f"must be > 0, got {self.routed_scale}")
        rate = self.router_bias_rate
        _check(rate >= 0, "router_bias_rate", f"must be >= 0, got {rate}")
        _check(rate == 0 or self.router_bias, "router_bias_rate", "moves the choice bias: set model.router_bias=true")
        _check(
            0 <= self.moe_first_dense < self.n_layers,
            "moe_first_dense",
            f"must be in [0, n_layers) ({self.n_layers}), got {self.moe_first_dense}",
        )
        _check(
            not self.moe_first_dense or self.moe_every == 1,
            "moe_first_dense",
            "leads the layers that are all MoE: not with moe_every > 1",
        )
        _check(G >= 1 and E % G == 0, "router_groups", f"must divide n_experts ({E}), got {G}")
        _check(1 <= top <= G, "router_topk_groups", f"must be between 1 and router_groups ({G}), got {top}")
        _check(
            self.top_k <= top * E // G,
            "top_k",
            f"{self.top_k} experts from {top} groups of {E // G}: at most {top * E // G}",
        )
        _check(
            self.router_group_score != "top2" or E // G >= 2,
            "router_group_score",
            f"top2 needs groups of 2 or more experts, got {E // G}",
        )

    def _check_arch(self) -> None:
        _check(
            self.arch == "decoder" or self.window is None or self.attention_impl != "cudnn",
            "attention_impl",
            f"cudnn has no two-sided sliding window for a {self.arch}'s bidirectional attention: use xla or einsum",
        )
        _check(
            not self.encoder_positions or (self.arch == "encoder_decoder" and self.position == "learned"),
            "encoder_positions",
            "is an encoder-decoder's second learned position table: set model.arch=encoder_decoder, model.position=learned",
        )
        if self.arch != "encoder_decoder":
            _check(
                self.n_encoder_layers is None,
                "n_encoder_layers",
                f"is the encoder's depth of an encoder-decoder: set model.arch=encoder_decoder, or leave it out ({self.arch} uses n_layers)",
            )
            return
        if self.n_encoder_layers is None:
            object.__setattr__(self, "n_encoder_layers", self.n_layers)
        _check(self.n_encoder_layers >= 1, "n_encoder_layers", f"must be >= 1, got {self.n_encoder_layers}")
        _check(
            not self.n_experts,
            "n_experts",
            "mixtures of experts are for decoder and encoder models; an encoder_decoder's blocks are dense",
        )

    # --- derived values -------------------------------------------------------------------------
    @property
    def causal(self) -> bool:
        """Whether the main stack (`blocks`) attends causally: the decoder's does, an encoder's not."""
        return self.arch != "encoder"

    @property
    def deepest_stack(self) -> int:
        """Layers of the deepest stack: an encoder-decoder's encoder may be deeper than its decoder."""
        return max(self.n_layers, self.n_encoder_layers or 0)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's FFN is a mixture of experts (every moe_every-th, ending a group; none of
        the first moe_first_dense)."""
        return tuple(
            bool(self.n_experts) and i >= self.moe_first_dense and (i + 1) % self.moe_every == 0
            for i in range(self.n_layers)
        )

    @property
    def at_inference(self) -> ModelConfig:
        """The model evaluation and generation compute: a capacity-trained mixture of experts without
        drops. A drop depends on the other tokens of the row (with top_k > 1 on later ones too) and
        the capacity on its length, so no cached decoding could compute the training function; every
        inference path (validation, eval.py, the harness, generation) computes this one instead, which
        cached decoding equals. Training keeps its capacity. `self` where nothing differs."""
        if not self.n_experts or self.capacity_factor is None:
            return self
        return dataclasses.replace(self, capacity_factor=None)

    @property
    def compute_dtype(self) -> DType:
        """The dtype activations are computed in. A run's model is built from a config that
        `accelerator.resolve` has settled (auto: float32 on a CPU, bfloat16 on a GPU or TPU); one built
        straight from an unresolved config (a test, a notebook, an HF conversion) computes as a CPU does."""
        return "float32" if self.dtype == "auto" else self.dtype

    @property
    def attention_kernel(self) -> AttentionKernel:
        """The attention implementation the model runs. A run's model is built from a config that
        `accelerator.resolve` has settled (auto: blocked on a CPU, cuDNN on a GPU, where the mask allows);
        one built straight from an unresolved config (a test, a notebook, an HF conversion) runs XLA's,
        or the einsum one where soft-capping or attention dropout is asked for, which only it has (as
        `accelerator.choose_attention` decides for auto)."""
        if self.attention_impl != "auto":
            return self.attention_impl
        return "einsum" if self.needs_einsum_attention else "xla"

    @property
    def needs_einsum_attention(self) -> bool:
        """Soft-capping or attention dropout: only the einsum implementation has a hook for them."""
        return bool(self.attn_softcap or self.attn_dropout)

    @property
    def n_kv_groups(self) -> int:
        """G: query heads per kv head (N = K * G)."""
        return self.n_heads // self.n_kv_heads

    @property
    def padded_vocab(self) -> int:
        return _round_up(self.vocab_size, self.vocab_multiple)

    @property
    def has_qkv_bias(self) -> bool:
        return self.use_bias or self.qkv_bias

    @property
    def gated_ffn(self) -> bool:
        return self.ffn in GATED_FFNS

    @property
    def final_norm(self) -> bool:
        # Post-LN and DeepNorm end every block on a norm already; Pre-LN and sandwich need one more.
        return self.norm_position in ("pre", "sandwich")

    @property
    def norms_per_block(self) -> int:
        return 4 if self.norm_position == "sandwich" else 2

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window of each layer of the main stack (None = full attention)."""
        return self.stack_windows(self.n_layers)

    @property
    def encoder_layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window of each layer of an encoder-decoder's encoder stack (the same pattern)."""
        return self.stack_windows(self.n_encoder_layers) if self.arch == "encoder_decoder" else ()

    def stack_windows(self, n_layers: int) -> tuple[int | None, ...]:
        """The window of each of `n_layers` layers: `window`, or the attention pattern cycled."""
        if self.attention_pattern is None:
            return (self.window,) * n_layers
        kinds = [self.attention_pattern[i % len(self.attention_pattern)] for i in range(n_layers)]
        return tuple(self.window if kind == "local" else None for kind in kinds)

    def deepnorm(self, encoder_stack: bool = False) -> tuple[float, float]:
        """DeepNet's (alpha, beta) (Wang et al. 2022, table 1): the residual scale and the init gain of
        the FFN, value and output projections. A decoder- or encoder-only model of L layers:
        (2L)^(1/4), (8L)^(-1/4). An encoder-decoder of N encoder and M decoder layers: its decoder
        (3M)^(1/4), (12M)^(-1/4); its encoder (`encoder_stack`) 0.81 (N^4 M)^(1/16), 0.87 (N^4 M)^(-1/16)."""
        if self.arch != "encoder_decoder":
            return (2 * self.n_layers) ** 0.25, (8 * self.n_layers) ** -0.25
        N, M = self.n_encoder_layers, self.n_layers
        if encoder_stack:
            return 0.81 * (N**4 * M) ** (1 / 16), 0.87 * (N**4 * M) ** (-1 / 16)
        return (3 * M) ** 0.25, (12 * M) ** -0.25

    @property
    def deepnorm_alpha(self) -> float:
        """DeepNet's residual scale of the main stack (see `deepnorm`)."""
        return self.deepnorm()[0]

    @property
    def deepnorm_beta(self) -> float:
        """DeepNet's init gain of the main stack (see `deepnorm`)."""
        return self.deepnorm()[1]

    @property
    def max_positions(self) -> int | None:
        """The most positions the model can encode: the rows of a learned table. None for the
        schemes computed from the position itself, which encode any position."""
        return self.max_seq_len if self.position == "learned" else None

    def fits_positions(self, length: int) -> bool:
        """Whether every position of a `length`-token sequence has an encoding."""
        return self.max_positions is None or length <= self.max_positions

    @property
    def qk_head_dim(self) -> int:
        """Width of a query/key head: MLA's queries and keys carry the rope part beside the rest."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def mla_kv_width(self) -> int:
        """What MLA's latent is projected up to: every head's key (without rope part) and value."""
        return self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def mup_base_mla(self) -> dict[str, int]:
        """MLA's sizes at µP's base shape: derived from its head_dim, as µP's own are (`_check_mla`)."""
        return mla_sizes(self.mup_base_head_dim, self.mup_base_n_heads)

    @property
    def scale(self) -> float:
        """The attention logits' scale: 1/sqrt(qk_head_dim), or attn_scale. Under µP 1/d instead of
        1/sqrt(d) (keys and queries become correlated in training, so their dot product grows as d),
        written as the base's scale times base/d so that at the base shape it is the same float."""
        if self.parametrization != "mup":
            return self.attn_scale if self.attn_scale is not None else self.qk_head_dim**-0.5
        if self.attention == "mla":
            mla = self.mup_base_mla
            base_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        else:
            base_dim = self.mup_base_head_dim
        base = self.attn_scale if self.attn_scale is not None else base_dim**-0.5
        return base * (base_dim / self.qk_head_dim)

    @property
    def width_multipliers(self) -> dict[str, float]:
        """µP's m of each width a fan-in can have: this model's over the base's (all 1 at the base
        shape and under the standard parametrization), keyed as model/parametrization.py's table."""
        if self.parametrization != "mup":
            return dict.fromkeys(("d_model", "attention", "d_ff", "moe_d_ff", "kv_lora_rank", "q_lora_rank"), 1.0)
        # the attention output's fan-in: every head's value (MLA's v_head_dim is head_dim under µP)
        return {
            "d_model": self.d_model / self.mup_base_d_model,
            "attention": (self.n_heads * self.head_dim) / (self.mup_base_n_heads * self.mup_base_head_dim),
            "d_ff": self.d_ff / self.mup_base_d_ff,
            "moe_d_ff": self.moe_d_ff / self.mup_base_moe_d_ff if self.n_experts else 1.0,
            "kv_lora_rank": self.kv_lora_rank / self.mup_base_mla["kv_lora_rank"] if self.attention == "mla" else 1.0,
            "q_lora_rank": 1.0,  # µP refuses a query latent (it would not widen with the model)
        }

    @property
    def depth_multiplier(self) -> float:
        """m_L of depth scaling: n_layers over the base's (1.0 without depth scaling)."""
        return 1.0 if self.depth_scaling == "none" else self.n_layers / self.mup_base_n_layers


SourceKind = Literal["builtin", "hf", "files"]


@dataclasses.dataclass(frozen=True)
class DataSource:
    """`data.source` parsed once: builtin:stdlib | builtin:recall[:opts] | builtin:seq2seq[:opts] |
    hf:NAME[:CONFIG] | files:GLOB."""

    text: str  # as written, for messages
    kind: SourceKind
    name: str = ""  # builtin: the corpus (stdlib, recall); hf: the dataset
    config: str | None = None  # hf: the dataset's configuration, if named
    glob: str = ""  # files: a path, a directory or a glob (~ expanded when read)
    recall: RecallTask | None = None  # builtin:recall: the task its options describe
    seq2seq: Seq2seqTask | None = None  # builtin:seq2seq: the task its options describe

    @classmethod
    def parse(cls, text: str, key: str = "source") -> DataSource:
        """Parse and check a source string; a mistake is a ConfigError on `key` (source, val_source)."""
        kind, _, arg = text.partition(":")
        if kind == "hf":
            name, _, config = arg.partition(":")
            _check(bool(name), key, f"names no dataset: {text!r} (hf:NAME[:CONFIG])")
            return cls(text, "hf", name=name, config=config or None)
        if kind == "files":
            _check(bool(arg), key, f"names no path: {text!r} (files:PATH or files:GLOB)")
            return cls(text, "files", glob=arg)
        _check(kind == "builtin", key, f"must start with builtin:, hf: or files:, got {text!r}")
        return cls._parse_builtin(text, arg, key)

    @classmethod
    def _parse_builtin(cls, text: str, arg: str, key: str) -> DataSource:
        corpus, _, options = arg.partition(":")
        _check(corpus in BUILTINS, key, f"unknown builtin corpus {arg!r} (builtin:{', builtin:'.join(BUILTINS)})")
        if corpus not in BUILTIN_TASKS:
            _check(not options, key, f"builtin:{corpus} takes no options, got {options!r}")
            return cls(text, "builtin", name=corpus)
        try:
            task = BUILTIN_TASKS[corpus].parse(options)
        except ValueError as e:
            raise ConfigError(key, f"{text}: {e}") from None
        parsed: dict[str, Any] = {corpus: task}  # the field named after the task holds it
        return cls(text, "builtin", name=corpus, **parsed)


# a source's name in a mixture becomes part of metric keys (val/<name>/loss) and report columns
MIXTURE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclasses.dataclass(frozen=True)
class MixtureEntry:
    """One source of `data.mixture`; the fields left unset take the data section's."""

    source: str = ""  # any data.source spec
    weight: float = 1.0  # its share of the training rows (weights are normalised over the mixture)
    name: str | None = None  # in metric keys (val/<name>/loss); default source<i>
    text_field: str | None = None
    train_split: str | None = None
    val_split: str | None = None

    def __post_init__(self) -> None:
        _check(bool(self.source), "source", "is required (any data.source spec)")
        DataSource.parse(self.source)
        _check(math.isfinite(self.weight), "weight", f"must be finite, got {self.weight}")
        _check(self.weight >= 0, "weight", f"must be >= 0, got {self.weight}")
        _check(
            self.name is None or MIXTURE_NAME.fullmatch(self.name) is not None,
            "name",
            f"must be 1-64 letters, digits, '_', '.' or '-' (it names metrics), got {self.name!r}",
        )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "builtin:stdlib"  # builtin:stdlib | builtin:recall[:opts] | hf:NAME[:CONFIG] | files:GLOB
    tokenizer: str = "byte"  # byte | bpe | pretrained:PATH
    vocab_size: int = 4096  # for tokenizer=bpe
    seq_len: int = 256
    text_field: str = "text"
    train_split: str = "train"
    val_split: str = "validation"
    val_fraction: float = 0.01  # when the source has no validation split of its own
    val_windows: int = 128  # the fixed validation windows every evaluation uses
    document_mask: bool = False
    cache_dir: str | None = None
    # splits each document's text (a whole .txt file, a row's text field) into documents, e.g. "\n\n"
    document_separator: str | None = None
    val_source: str | None = None  # validate on this source (any data.source spec) instead of a split
    # the next steps' batches made on a background thread and put on the devices while a step runs
    # (transformer/train/feed.py); 0: each made when its step needs it. Changes no result
    prefetch: int = 1
    # weighted sources instead of data.source (which must then be left at its default)
    mixture: tuple[MixtureEntry, ...] = ()
    # --- what a batch trains (null: the model family's default, filled in when the run config is
    # built; a key of an objective the run does not train is refused) ---
    objective: Objective | None = None  # causal, mlm or span on text; prefix or seq2seq on input/target pairs
    mask_rate: float | None = None  # mlm: the fraction of tokens chosen for prediction (0.15)
    mask_token_fraction: float | None = None  # mlm: of those, the fraction replaced by the mask token (0.8)
    random_token_fraction: float | None = None  # mlm: ... by a random token (0.1); the rest are kept as they are
    noise_density: float | None = None  # span: the fraction of tokens in corrupted spans (0.15)
    mean_span_length: float | None = None  # span: the mean length of a corrupted span (3.0)
    input_field: str | None = None  # pairs from hf:/files: sources: the input's field (with target_field)
    target_field: str | None = None
    target_len: int | None = None  # prefix and seq2seq: target tokens per row (null: seq_len)

    def __post_init__(self) -> None:
        _check_ints(self)
        self._check_mixture()
        _check(self.seq_len >= 1, "seq_len", f"must be >= 1, got {self.seq_len}")
        _check(self.val_windows >= 1, "val_windows", f"must be >= 1, got {self.val_windows}")
        _check(self.prefetch >= 0, "prefetch", f"must be >= 0, got {self.prefetch}")
        _check(self.vocab_size >= 1, "vocab_size", f"must be >= 1, got {self.vocab_size}")
        _check(0.0 <= self.val_fraction < 1.0, "val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        DataSource.parse(self.source)
        if self.val_source is not None:
            DataSource.parse(self.val_source, "val_source")
        _check(
            self.document_separator is None or self.document_separator != "",
            "document_separator",
            "must not be empty (null: each .txt file or row is one document)",
        )
        self._check_kinds()
        _check(
            self.tokenizer in ("byte", "bpe") or self.tokenizer.startswith("pretrained:"),
            "tokenizer",
            f"must be byte, bpe or pretrained:PATH, got {self.tokenizer!r}",
        )
        self._check_objective_values()

    def _check_objective_values(self) -> None:
        """Ranges of the objectives' keys (which objective may set them: `Config._resolve_objective`)."""
        _check(
            self.mask_rate is None or 0.0 < self.mask_rate < 1.0,
            "mask_rate",
            f"must be in (0, 1), got {self.mask_rate}",
        )
        for name in ("mask_token_fraction", "random_token_fraction"):
            value = getattr(self, name)
            _check(value is None or 0.0 <= value <= 1.0, name, f"must be in [0, 1], got {value}")
        replaced = (self.mask_token_fraction or 0.0) + (self.random_token_fraction or 0.0)
        _check(
            replaced <= 1.0,
            "random_token_fraction",
            f"mask_token_fraction + random_token_fraction must be at most 1, got {replaced:g}",
        )
        density = self.noise_density
        _check(density is None or 0.0 < density < 1.0, "noise_density", f"must be in (0, 1), got {density}")
        span = self.mean_span_length
        _check(span is None or span >= 1.0, "mean_span_length", f"must be >= 1, got {span}")
        _check(self.target_len is None or self.target_len >= 1, "target_len", f"must be >= 1, got {self.target_len}")
        _check(
            (self.input_field is None) == (self.target_field is None),
            "input_field" if self.input_field is None else "target_field",
            "input_field and target_field go together: name both fields of the pairs, or neither",
        )
        _check(
            self.input_field is None or self.source_spec.kind in ("hf", "files"),
            "input_field",
            f"names fields of hf: or files: sources, not of {self.source}",
        )

    def _check_kinds(self) -> None:
        """A validation source and a document separator are for text: a pair source validates on its
        own split, and a text source cannot validate on pairs (what the run's loader refuses too)."""
        if self.pairs:
            for key in ("val_source", "document_separator"):
                _check(
                    getattr(self, key) is None,
                    key,
                    f"applies to text sources, and {self.source} gives input/target pairs "
                    "(they validate on the source's own validation split, or a hash split of it)",
                )
            return
        if self.val_source is not None:
            _check(
                DataSource.parse(self.val_source).name != "seq2seq",
                "val_source",
                f"{self.val_source} gives input/target pairs, and data.source {self.source} gives text: "
                "validate on a text source",
            )

    @property
    def pairs(self) -> bool:
        """Whether the source gives input/target pairs (builtin:seq2seq, or named fields) rather than text."""
        return self.input_field is not None or self.source_spec.name == "seq2seq"

    def _check_mixture(self) -> None:
        if not self.mixture:
            return
        default = DataConfig.__dataclass_fields__["source"].default
        _check(
            self.source == default,
            "mixture",
            f"is set together with data.source ({self.source}): give every source in data.mixture and leave data.source out",
        )
        _check(
            self.val_source is None,
            "mixture",
            "cannot be used with data.val_source: each source validates on its own split",
        )
        _check(
            any(e.weight > 0 for e in self.mixture), "mixture", "the weights are all zero: give a source a weight > 0"
        )
        total = sum(e.weight for e in self.mixture)
        _check(
            math.isfinite(total),
            "mixture",
            f"the weights sum to {total} (too large to normalise): scale them down, only their ratios count",
        )
        _check(
            self.input_field is None,
            "input_field",
            "names the fields of input/target pairs, and data.mixture mixes text sources only",
        )
        for i, e in enumerate(self.mixture):
            _check(
                DataSource.parse(e.source).name != "seq2seq",
                f"mixture[{i}].source",
                f"{e.source} gives input/target pairs, and data.mixture mixes text sources only (the causal objective)",
            )
        names = self.mixture_names
        duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
        _check(duplicate is None, "mixture", f"two sources are named {duplicate!r}: give each a distinct name")

    @property
    def mixture_names(self) -> list[str]:
        """Each mixture source's name: its `name`, or source<i>."""
        return [e.name if e.name is not None else f"source{i}" for i, e in enumerate(self.mixture)]

    def mixture_source(self, i: int) -> DataConfig:
        """The single-source data config of mixture entry `i`: its fields over this section's."""
        e = self.mixture[i]
        return dataclasses.replace(
            self,
            source=e.source,
            text_field=e.text_field if e.text_field is not None else self.text_field,
            train_split=e.train_split if e.train_split is not None else self.train_split,
            val_split=e.val_split if e.val_split is not None else self.val_split,
            mixture=(),
        )

    @property
    def source_spec(self) -> DataSource:
        """`source` parsed (it was checked when this config was built, so this does not raise)."""
        return DataSource.parse(self.source)


MuonNewtonSchulz = Literal["jordan", "polar_express"]
MuonScale = Literal["moonlight", "jordan", "spectral"]


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Muon (`optim.name: muon`, transformer/train/muon.py): each hidden matrix's momentum,
    orthogonalised by a Newton-Schulz iteration and scaled by its shape, times optim.lr; the
    embeddings, the head, the router, norm gains and biases take AdamW at `adam_lr`.

    `scale` is what the orthogonal update is multiplied by: Moonlight's 0.2 * sqrt(max(fan_in,
    fan_out)) (Liu et al. 2025; the default, because it gives the update AdamW's RMS, so one lr and
    one weight decay serve both groups and an AdamW run's carry over), Jordan's sqrt(max(1,
    fan_out / fan_in)) (modded-nanogpt; its lr is ~10x AdamW's), or the spectral condition's
    sqrt(fan_out / fan_in) (Yang, Simon & Bernstein 2023; µP's, as it keeps every width's update
    the same size in the spectral norm)."""

    ns: MuonNewtonSchulz = "jordan"  # Keller Jordan's quintic, or Polar Express's per-step coefficients
    ns_steps: int = 5
    momentum: float = 0.95
    nesterov: bool = True
    scale: MuonScale = "moonlight"
    adam_lr: float | None = None  # the AdamW group's peak lr (same schedule); null: optim.lr

    def __post_init__(self):
        _check_ints(self)
        most = 5 if self.ns == "polar_express" else 100  # Polar Express's coefficients are for five steps
        _check(1 <= self.ns_steps <= most, "ns_steps", f"must be in [1, {most}] for ns: {self.ns}, got {self.ns_steps}")
        _check(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")
        _check(self.adam_lr is None or self.adam_lr > 0, "adam_lr", f"must be > 0 or null, got {self.adam_lr}")


@dataclasses.dataclass(frozen=True)
class AdEMAMixConfig:
    """AdEMAMix (`optim.name: ademamix`; Pagliardini et al. 2024, arXiv 2409.03137): AdamW whose step
    adds `alpha` times a slow EMA of the gradients (decay `b3`, not bias-corrected) to the fast one.
    As the paper's code, alpha warms up linearly from 0 and b3 from optim.b1 linearly in half-life
    over `warmup` steps (null: the whole run, the paper's T_alpha = T_b3 = T), so the slow EMA's
    early, stale mean does not steer the first steps. Decay and its mask are AdamW's."""

    b3: float = 0.9999
    alpha: float = 5.0
    warmup: int | None = None

    def __post_init__(self):
        _check_ints(self)
        _check(0.0 < self.b3 < 1.0, "b3", f"must be in (0, 1), got {self.b3}")
        _check(self.alpha >= 0, "alpha", f"must be >= 0, got {self.alpha}")
        _check(self.warmup is None or self.warmup >= 1, "warmup", f"must be >= 1 or null, got {self.warmup}")


@dataclasses.dataclass(frozen=True)
class SoapConfig:
    """SOAP (`optim.name: soap`, transformer/train/soap.py; Vyas et al. 2024, arXiv 2409.11321): Adam in
    the eigenbasis of Shampoo's factors for the hidden matrices, AdamW for the rest, both at optim.lr
    with optim.b1 and b2 (the paper's 0.95 and 0.95; its factors decay at b2 too)."""

    precondition_every: int = 10  # steps between refreshes of the eigenbases (the paper's f)
    max_precond_dim: int = 10000  # a side longer than this is not rotated (one-sided SOAP)

    def __post_init__(self):
        _check_ints(self)
        for name in ("precondition_every", "max_precond_dim"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "adam", "lion", "adafactor", "sgd", "muon", "ademamix", "schedule_free_adamw", "soap"] = (
        "adamw"
    )
    lr: float = 3e-3
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the share of steps spent decaying at the end
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # true: weight_decay is not multiplied by the learning rate (Loshchilov & Hutter's original form,
    # Wortsman et al. 2023's "independent" decay): each step takes theta -= s_t * weight_decay * theta,
    # s_t the schedule's shape (lr(t) / optim.lr), so the decay is the same at every optim.lr
    independent_decay: bool = False
    decay_embeddings: bool = False
    clip_norm: float | None = 1.0
    muon: MuonConfig = MuonConfig()
    ademamix: AdEMAMixConfig = AdEMAMixConfig()
    soap: SoapConfig = SoapConfig()

    def __post_init__(self):
        _check_ints(self)
        for section, default in (("muon", MuonConfig()), ("ademamix", AdEMAMixConfig()), ("soap", SoapConfig())):
            _check(
                self.name == section or getattr(self, section) == default,
                section,
                f"is {section}'s (optim.name: {section}); {self.name} does not read it",
            )
        _check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(0.0 < self.decay_fraction <= 1.0, "decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        for name in ("b1", "b2"):
            _check(0.0 <= getattr(self, name) < 1.0, name, f"must be in [0, 1), got {getattr(self, name)}")
        _check(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.clip_norm is None or self.clip_norm > 0, "clip_norm", f"must be > 0 or null, got {self.clip_norm}")
        if self.name == "schedule_free_adamw":
            _check(
                self.schedule == "constant",
                "schedule",
                f"schedule_free_adamw replaces the decay schedule by its average: set optim.schedule=constant (the warm-up stays), not {self.schedule}",
            )
            _check(self.b1 > 0, "b1", "is schedule_free_adamw's interpolation toward the average: must be in (0, 1)")
            _check(
                not self.independent_decay,
                "independent_decay",
                "schedule_free_adamw decays its own iterate inside its step; its decay is lr-coupled only",
            )


# A vocabulary this large (GPT-2's, Llama's) makes the float32 logits of a batch (4 bytes x vocabulary
# per token), and their gradient, among a step's largest buffers: the loss then forms them in chunks
# of the largest power-of-two number of tokens whose logits fit LOSS_CHUNK_BYTES (GPT-2: 4,096 tokens;
# Llama 3: 2,048), over the whole micro-batch, so a device holds its share of that.
LARGE_VOCAB = 16384
LOSS_CHUNK_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 16  # global batch, in sequences
    grad_accum: int = 1
    seed: int = 0
    eval_every: int = 200
    # lm-eval tasks evaluated at each eval_every (the evals extra), logged as eval/<task>/<metric>;
    # at most eval_tasks_limit items of each (null: all)
    eval_tasks: tuple[str, ...] = ()
    eval_tasks_limit: int | None = 200
    z_loss: float = 0.0
    # tokens of a micro-batch whose logits the loss forms at once (transformer/train/loss.py): 0 all of
    # them; null (auto) chunks of LOSS_CHUNK_BYTES of logits when the padded vocabulary is LARGE_VOCAB or more
    loss_chunk: int | None = None

    def __post_init__(self):
        _check_ints(self)
        _check(
            self.loss_chunk is None or self.loss_chunk >= 0,
            "loss_chunk",
            f"must be >= 0 or null, got {self.loss_chunk}",
        )
        for name in ("steps", "batch_size", "grad_accum", "eval_every"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(
            self.batch_size % self.grad_accum == 0,
            "grad_accum",
            f"batch_size ({self.batch_size}) is not divisible by grad_accum ({self.grad_accum})",
        )
        _check(self.z_loss >= 0, "z_loss", f"must be >= 0, got {self.z_loss}")
        _check(
            all(name.strip() and "," not in name for name in self.eval_tasks),
            "eval_tasks",
            f"names lm-eval tasks, one per list entry (e.g. [stdlib_next_line]), got {list(self.eval_tasks)}",
        )
        _check(
            self.eval_tasks_limit is None or self.eval_tasks_limit >= 1,
            "eval_tasks_limit",
            f"must be >= 1 or null, got {self.eval_tasks_limit}",
        )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: all devices left over by the other axes
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1  # shards model.n_experts (expert parallelism)

    def __post_init__(self):
        _check_ints(self)
        sizes = dataclasses.asdict(self)
        for name, size in sizes.items():
            _check(size == -1 or size >= 1, name, f"must be >= 1 or -1 (fill), got {size}")
        filled = [f"mesh.{name}" for name, size in sizes.items() if size == -1]
        # data is -1 by default: the axis named is the other one, the one the user set
        if len(filled) > 1:
            others = " and ".join(filled[:-1])
            raise ConfigError(
                filled[-1][5:],
                f"at most one mesh axis may be -1, but {others} {'is' if len(filled) == 2 else 'are'} -1 too; give {others} a size",
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    keep: int = 2
    keep_best: int = 1
    async_: bool = dataclasses.field(default=True, metadata={"key": "async"})

    def __post_init__(self):
        _check_ints(self)
        _check(self.every >= 1, "every", f"must be >= 1, got {self.every}")
        _check(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")
        _check(self.keep_best >= 0, "keep_best", f"must be >= 0, got {self.keep_best}")


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    window: int = 128
    threshold: float = 6.0
    on_spike: Literal["log", "skip", "rollback"] = "log"
    divergence_steps: int = 200
    skip_batches: int = 200
    lr_factor: float = 1.0
    cooldown: int = 0
    max_rollbacks: int = 3
    max_nonfinite: int = 5
    stats_every: int = 0  # 0: per-layer stability statistics off

    def __post_init__(self):
        _check_ints(self)
        for name in ("window", "divergence_steps", "max_nonfinite"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("skip_batches", "cooldown", "max_rollbacks", "stats_every"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.threshold > 0, "threshold", f"must be > 0, got {self.threshold}")
        _check(self.lr_factor > 0, "lr_factor", f"must be > 0, got {self.lr_factor}")


@dataclasses.dataclass(frozen=True)
class FaultsConfig:
    """Injected faults, for tests and demonstrations of recovery; each fires once per run."""

    lr_step: int | None = None  # the update at this step uses lr * lr_multiplier
    lr_multiplier: float = 100.0
    corrupt_step: int | None = None  # this step's batch is replaced by random or repeated tokens
    corrupt_kind: Literal["random", "repeated"] = "random"
    nan_step: int | None = None  # this step's gradients are NaN

    def __post_init__(self):
        _check_ints(self)
        for name in ("lr_step", "corrupt_step", "nan_step"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, f"must be >= 0 or null, got {value}")
        _check(self.lr_multiplier > 0, "lr_multiplier", f"must be > 0, got {self.lr_multiplier}")


WandbMode = Literal["disabled", "online", "offline"]


def _wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (the optional `wandb` extra), off unless `mode` is online or offline (offline
    needs no network: `wandb sync` uploads later). A sweep's members are runs of one group, named
    after the sweep's directory unless `group` is given."""

    mode: WandbMode = "disabled"
    project: str | None = None
    entity: str | None = None
    group: str | None = None

    def __post_init__(self):
        _check(
            self.mode == "disabled" or _wandb_installed(),
            "mode",
            "needs wandb: pip install 'transformer-ablations[wandb]'",
        )


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    every: int = 10
    tensorboard: bool = True
    progress: bool = True
    profile: str | None = (
        None  # "START:STOP": a jax.profiler trace of steps START..STOP-1 (transformer/train/profile.py)
    )
    wandb: WandbConfig = WandbConfig()

    def __post_init__(self):
        _check_ints(self)
        _check(self.every >= 1, "every", f"must be >= 1, got {self.every}")
        _ = self.profile_steps  # refuses a malformed window now, not at step START

    @property
    def profile_steps(self) -> tuple[int, int] | None:
        """(START, STOP) of `profile`, or None."""
        if self.profile is None:
            return None
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(self.profile))
        _check(
            match is not None and int(match[1]) < int(match[2]),
            "profile",
            f"must be START:STOP with START < STOP (quoted in YAML: '5:10'), got {self.profile!r}",
        )
        assert match is not None
        return int(match[1]), int(match[2])


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    monitor: MonitorConfig = MonitorConfig()
    faults: FaultsConfig = FaultsConfig()
    logging: LoggingConfig = LoggingConfig()

    def __post_init__(self):
        object.__setattr__(self, "data", _resolve_objective(self.model.arch, self.data))
        m, context = self.model, context_length(self.model.arch, self.data)
        if m.max_seq_len is None:
            object.__setattr__(self, "model", dataclasses.replace(m, max_seq_len=context))
            m = self.model
        _check(
            context <= m.max_seq_len,
            "data.seq_len",
            f"rows of {context} tokens ({self.data.objective}) exceed model.max_seq_len ({m.max_seq_len})",
        )
        if m.parametrization == "mup":
            self._check_mup_optimizer()
            _check(  # under width-only µP the decay is every width's (not the 1/m its lr takes)
                not self.optim.independent_decay or m.depth_scaling == "none",
                "optim.independent_decay",
                "depth scaling's decay multipliers are written for lr-coupled decay (model.depth_scaling)",
            )
        _check(  # the cooldown scales the step the parameters take, which schedule-free's is not
            self.optim.name != "schedule_free_adamw" or self.monitor.lr_factor == 1.0,
            "monitor.lr_factor",
            "a rollback's cooldown scales the update of the parameters, which under schedule_free_adamw is a step of the average, not the optimiser's: leave it 1.0",
        )
        if self.mesh.tensor > 1:
            check_tensor_split(m, self.mesh.tensor)
        if self.mesh.expert != 1:
            check_expert_split(m, self.mesh.expert)

    def _check_mup_optimizer(self) -> None:
        """µP's rules (model/parametrization.py) are written for the Adam family and for Muon with the
        spectral scale (whose hidden updates are already the same size at every width)."""
        name, muon = self.optim.name, self.optim.muon
        _check(
            name in (*ADAM_FAMILY, "muon"),
            "optim.name",
            f"µP's rules here are for {', '.join(ADAM_FAMILY)} and muon; {name} needs others (model.parametrization)",
        )
        if name != "muon":
            return
        _check(
            muon.scale == "spectral",
            "optim.muon.scale",
            f"µP with Muon needs the spectral scale sqrt(fan_out/fan_in), not {muon.scale} (model.parametrization)",
        )
        _check(
            self.model.depth_scaling == "none",
            "model.depth_scaling",
            "depth scaling's rules here are Adam's; Muon under µP transfers across width only",
        )

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the cross-entropy, 0 for none (`train.loss_chunk`, auto resolved)."""
        if self.train.loss_chunk is not None:
            return self.train.loss_chunk
        V = self.model.padded_vocab
        return 2 ** int(math.log2(LOSS_CHUNK_BYTES // (4 * V))) if V >= LARGE_VOCAB else 0

    def with_vocab(self, vocab_size: int) -> Config:
        """This config with the model's vocabulary taken from the tokenizer; a pretrained model keeps
        its own, which the tokenizer's ids must fit in."""
        if self.model.init_from is not None:
            _check(
                vocab_size <= self.model.vocab_size,
                "data.tokenizer",
                f"gives {vocab_size} ids, more than the pretrained model's {self.model.vocab_size} (model.init_from)",
            )
            return self
        return dataclasses.replace(self, model=dataclasses.replace(self.model, vocab_size=vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# Each objective's keys and their defaults; set under another objective they are refused.
OBJECTIVE_KEYS: dict[str, dict[str, Any]] = {
    "mlm": {"mask_rate": 0.15, "mask_token_fraction": 0.8, "random_token_fraction": 0.1},
    "span": {"noise_density": 0.15, "mean_span_length": 3.0},
    "prefix": {"target_len": None},
    "seq2seq": {"target_len": None},
}


def _objective(arch: str, data: DataConfig) -> Objective:
    """The objective `data` trains a model.arch=`arch` model with: its own, or the family's default."""
    own = OBJECTIVES[arch]
    return data.objective or own[1 if data.pairs and len(own) > 1 else 0]


def context_length(arch: str, data: DataConfig) -> int:
    """The longest row any stack of a model.arch=`arch` model sees, the default model.max_seq_len:
    data.seq_len, or for pairs the input's (seq_len) and the target's (target_len; null: seq_len)
    lengths, side by side in one decoder row (prefix) or the longer of the two (seq2seq)."""
    objective, target = _objective(arch, data), data.target_len or data.seq_len
    if objective == "prefix":
        return data.seq_len + target
    return max(data.seq_len, target) if objective == "seq2seq" else data.seq_len


def _resolve_objective(arch: str, data: DataConfig) -> DataConfig:
    """`data` with its objective (null: the family's for the source's kind) and that objective's
    keys filled in; an objective the family cannot train, or a key of another, is refused."""
    own, objective = OBJECTIVES[arch], _objective(arch, data)
    _check(
        objective in own,
        "data.objective",
        f"{objective} does not train a model.arch={arch} model (it trains {' or '.join(own)})",
    )
    is_pairs = objective in ("prefix", "seq2seq")
    _check(
        is_pairs == data.pairs,
        "data.source",
        f"{data.source} gives {'input/target pairs' if data.pairs else 'text'}, which data.objective={objective} does not train"
        + ("" if data.pairs else " (pairs: builtin:seq2seq, or data.input_field and data.target_field)"),
    )
    _check(
        objective == "causal" or not data.mixture,
        "data.mixture",
        f"trains the causal objective only, not {objective}",
    )
    for other, keys in OBJECTIVE_KEYS.items():
        for name in keys:
            _check(
                other == objective or name in OBJECTIVE_KEYS.get(objective, {}) or getattr(data, name) is None,
                f"data.{name}",
                f"is a key of data.objective={other}, and this run trains {objective}: leave it out",
            )
    defaults = {k: v for k, v in OBJECTIVE_KEYS.get(objective, {}).items() if getattr(data, k) is None}
    if "target_len" in defaults:
        defaults["target_len"] = data.seq_len
    try:  # the defaults may not fit with what was set (mask_token_fraction + random_token_fraction)
        return dataclasses.replace(data, objective=objective, **defaults)
    except ConfigError as e:
        raise e.under("data") from None


def check_tensor_split(m: ModelConfig, tensor: int) -> None:
    """Tensor parallelism splits heads, kv heads, the FFN width and the vocab: each must divide."""
    for what, size in (
        ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", m.n_kv_heads),
        ("model.d_ff", m.d_ff),
        ("the padded vocab (model.vocab_multiple)", m.padded_vocab),
    ):
        _check(size % tensor == 0, "mesh.tensor", f"{tensor} does not divide {what} = {size}")


def check_expert_split(m: ModelConfig, expert: int) -> None:
    """Expert parallelism splits the experts: there must be some, and the axis must divide them."""
    _check(m.n_experts > 0, "mesh.expert", f"{expert} needs model.n_experts > 0 (experts to split)")
    _check(m.n_experts % expert == 0, "mesh.expert", f"{expert} does not divide model.n_experts = {m.n_experts}")


# --- schema walking ------------------------------------------------------------------------------


def yaml_key(field: dataclasses.Field) -> str:
    """The key a field is spelled with in YAML (`async` for the field `async_`, a Python keyword)."""
    return field.metadata.get("key", field.name)


def _to_dict(obj: Any) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            value = _to_dict(value)
        elif isinstance(value, tuple):  # data.mixture holds dataclasses
            value = [_to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[yaml_key(field)] = value
    return out


# --- comparing configs ----------------------------------------------------------------------------

# Keys that may change when a run is resumed: they change how long it runs, what it logs and where
# it runs, never the trajectory of the updates it has made so far. The execution keys change speed and
# memory (which a comparison of runs may be about; the attention implementation also the rounding of
# the steps after the resume), the others only bookkeeping.
RUN_BOOKKEEPING = (
    "train.steps",
    "train.eval_every",
    "train.eval_tasks",  # downstream scores are read from the parameters, never fed back
    "logging.",
    "checkpoint.",
    "mesh.",
    "data.cache_dir",
)
EXECUTION = ("model.remat", "model.scan_layers", "model.scan_unroll", "model.attention_impl", "data.prefetch")
SAFE_ON_RESUME = RUN_BOOKKEEPING + EXECUTION


def flatten(d: dict, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{'model': {'d_model': 64}} -> {'model.d_model': 64}"""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(unsafe, safe) differences as 'key: old -> new' lines."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    unsafe: list[str] = []
    safe: list[str] = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            (safe if key.startswith(SAFE_ON_RESUME) else unsafe).append(line)
    return unsafe, safe
