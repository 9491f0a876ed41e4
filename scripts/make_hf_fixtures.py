"""Make the tiny Hugging Face fixtures tests/test_hf.py compares against, and check the export path
against transformers. Needs torch and transformers (`pip install -e ".[hf-fixtures]"`); the test suite
does not.

    python scripts/make_hf_fixtures.py            # write tests/fixtures/hf/<family>/, then verify
    python scripts/make_hf_fixtures.py --verify   # only verify the committed fixtures
    python scripts/make_hf_fixtures.py --exact    # only add the float64 logits to the committed ones

For each family: a random model (every weight, norm gain and bias drawn, so that a swapped or
untransposed tensor shows in the logits), saved with `save_pretrained` (config.json,
model.safetensors), and reference.safetensors holding input ids, transformers' float32 logits and
its float64 logits rounded to float32 (`logits_f64`: the exact function, which the tests compare
against, with transformers' own float32 error as the measure of the rounding a float32 model makes).
The llama and gpt2 fixtures also carry a small byte-level BPE tokenizer in the HF layout.

Verification: each fixture imported with transformer.io.hf, exported again, loaded back with
AutoModelForCausalLM.from_pretrained: its logits must equal the reference; and a model of this
framework (random init) of each exportable kind is exported and its logits compared with
transformers'.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "tests" / "fixtures" / "hf"
VOCAB = 320
IDS_SHAPE = (2, 24)  # longer than mistral's window

COMMON = dict(vocab_size=VOCAB, tie_word_embeddings=False)
# a fixture's seed is its place in this table: new fixtures go last, so that the others stay as made
FIXTURES = {
    "gpt2": transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function="gelu", vocab_size=VOCAB
    ),
    # rope frequencies with wavelengths 6.3 (kept), 20 (blended) and >= 63 tokens (stretched) under llama3
    "llama": transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        **COMMON,
    ),
    "mistral": transformers.MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=5,
        **COMMON,
    ),
    "qwen2": transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    "qwen3": transformers.Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    # the MoE families: top-2 of 4 experts, renormalised (Mixtral, Qwen3-MoE here) or not (Qwen2-MoE,
    # whose first layer is dense and whose shared expert is two experts wide, gated)
    "mixtral": transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        **COMMON,
    ),
    "qwen2_moe": transformers.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        decoder_sparse_step=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        **COMMON,
    ),
    "qwen3_moe": transformers.Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        **COMMON,
    ),
    # Gemma 2 (soft-capped, local then global) and Gemma 3 (qk-norm, 2 local : 1 global, a theta each)
    "gemma2": transformers.Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=12,
        sliding_window=5,
        vocab_size=VOCAB,
    ),
    "gemma3_text": transformers.Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        sliding_window_pattern=3,
        rope_parameters={
            "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 1e2, "rope_type": "default"},
        },
        vocab_size=VOCAB,
    ),
    # encoders: BERT, and RoBERTa (positions from 2)
    "bert": transformers.BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        vocab_size=VOCAB,
    ),
    "roberta": transformers.RobertaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=66,
        type_vocab_size=1,
        vocab_size=VOCAB,
    ),
    # an encoder-decoder: BART, with scaled embeddings (mBART's and some BARTs' choice)
    "bart": transformers.BartConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        scale_embedding=True,
        vocab_size=VOCAB,
    ),
    # T5 v1.1 (Flan-T5's kind): relative position buckets past the rows' length (24 > 20), gated GELU
    "t5": transformers.T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        vocab_size=VOCAB,
    ),
    # ModernBERT: a global layer every third (the first included), local ones seeing 3 tokens either
    # way, a theta each; LayerNorms without biases, the first layer without an attention norm
    "modernbert": transformers.ModernBertConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        global_attn_every_n_layers=3,
        local_attention=6,
        global_rope_theta=160000.0,
        local_rope_theta=10.0,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        vocab_size=VOCAB,
    ),
    # the original T5: a plain ReLU FFN, the head tied and its input scaled by d_model^-0.5
    "t5_v1_0": transformers.T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        vocab_size=VOCAB,
    ),
    # MLA: DeepSeek-V2-Lite's shape (full-rank queries) with group-limited softmax routing, scaled
    # gates, two shared experts and the first layer dense; DeepSeek-V3's (low-rank queries) with
    # sigmoid routing, its choice bias drawn too, groups of four scored by their two best; both
    # under YaRN stretching a context of 16 by 4, V3 with a rotary temperature of its own
    "deepseek_v2": transformers.DeepseekV2Config(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        n_shared_experts=2,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        **COMMON,
    ),
    "deepseek_v3": transformers.DeepseekV3Config(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=24,
        q_lora_rank=20,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=12,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=0.9,
        ),
        **COMMON,
    ),
    # Gemma 3 as its 4B and larger models are: the global layers' RoPE stretched linearly, the local not
    "gemma3_scaled": transformers.Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        sliding_window_pattern=3,
        rope_parameters={
            "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_theta": 1e2, "rope_type": "default"},
        },
        vocab_size=VOCAB,
    ),
}
MASKED = ("bert", "roberta", "modernbert")  # encoders with a prediction head: AutoModelForMaskedLM
SEQ2SEQ = ("bart", "t5", "t5_v1_0")  # encoder-decoders: AutoModelForSeq2SeqLM
# T5's unscaled attention logits make its random fixture sensitive to float32 rounding: transformers'
# own float32 logits differ from its float64 ones by 1.3e-4 there, and this framework's by as much
IMPORT_TOLERANCE = {"t5": 5e-4, "t5_v1_0": 5e-4}
WITH_TOKENIZER = ("llama", "gpt2")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter: matrices ~ N(0, 1/fan_in), gains ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(noise / max(p.shape) ** 0.5 * 2)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(1.0 + 0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's choice bias: a saved buffer
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def auto_class(kind: str):
    if kind in SEQ2SEQ:
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForMaskedLM if kind in MASKED else transformers.AutoModelForCausalLM


def decoder_ids(ids: np.ndarray) -> np.ndarray:
    """An encoder-decoder's decoder input beside `ids` (its encoder input): the rows reversed."""
    return np.ascontiguousarray(ids[:, ::-1])


def hf_logits(
    path: Path, ids: np.ndarray, token_types: np.ndarray | None = None, dtype: torch.dtype = torch.float32
) -> np.ndarray:
    """transformers' logits of `ids` (an encoder-decoder's: of decoder_ids(ids), reading ids; BERT's
    of `token_types` where given)."""
    kind = json.loads((path / "config.json").read_text())["model_type"]
    # the eager experts: the default grouped_mm takes no float64
    model = auto_class(kind).from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    extra = {"decoder_input_ids": torch.from_numpy(decoder_ids(ids))} if kind in SEQ2SEQ else {}
    if token_types is not None:
        extra["token_type_ids"] = torch.from_numpy(token_types)
    with torch.no_grad():
        return model(torch.from_numpy(ids), **extra).logits.numpy()


def our_logits(model, ids: np.ndarray) -> np.ndarray:
    """This framework's logits as hf_logits computes transformers'."""
    if model.cfg.arch == "encoder_decoder":
        return np.asarray(model(decoder_ids(ids), encoder_tokens_BxS=ids))[..., :VOCAB]
    return np.asarray(model(ids))[..., :VOCAB]


def tokenizer_files(out: Path) -> None:
    """A byte-level BPE of VOCAB ids in the HF layout: <|endoftext|> as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.read_text() for p in sorted((ROOT / "transformer").glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    special = "<|endoftext|>"
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=special, eos_token=special)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make(name: str, seed: int) -> None:
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = FIXTURES[name]
    model = auto_class(name).from_config(config, attn_implementation="eager")
    randomize(model, seed)
    model.save_pretrained(out)
    if name in WITH_TOKENIZER:
        tokenizer_files(out)
    ids = np.random.default_rng(seed).integers(0, VOCAB, IDS_SHAPE).astype(np.int64)
    if name == "roberta":  # it counts positions past its padding id (1): a single-segment row has none
        ids[ids == 1] = 3
    logits = hf_logits(out, ids)
    reference = {"input_ids": ids, "logits": logits.astype(np.float32), "logits_f64": exact_logits(out, ids)}
    if getattr(config, "type_vocab_size", 1) > 1:  # BERT's segments: the second half of each row type 1
        types = (np.arange(ids.shape[1]) >= ids.shape[1] // 2).astype(np.int64)[None].repeat(len(ids), 0)
        reference |= {"token_type_ids": types, "type_logits": hf_logits(out, ids, types).astype(np.float32)}
    save_file(reference, str(out / "reference.safetensors"))
    print(f"{name}: {sum(f.stat().st_size for f in out.iterdir()) / 1e3:.0f} kB")


def exact_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """transformers' logits computed in float64, rounded to float32 (half an ulp, ~1e-7 here, far
    below the float32 models' own error)."""
    return hf_logits(path, ids, dtype=torch.float64).astype(np.float32)


def add_exact(name: str) -> None:
    """Add `logits_f64` to a committed fixture's reference, leaving its weights and other tensors."""
    path = OUT / name / "reference.safetensors"
    reference = load_file(str(path))
    reference["logits_f64"] = exact_logits(OUT / name, reference["input_ids"])
    save_file(reference, str(path))
    error = np.abs(reference["logits"] - reference["logits_f64"]).max()
    print(f"{name}: transformers' float32 logits off its float64 ones by {error:.2e}")


def perturbed(model, seed: int):
    """This framework's model with every parameter moved off its initial value (norm gains of 1 and
    biases of 0 would hide a misplaced tensor)."""
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, noisy))
    return model


MODERNBERT_KIND = dict(
    arch="encoder", n_kv_heads=4, norm="layernorm", embedding_norm=True, first_attn_norm=False, mlm_head=True
)
OURS = {  # exportable kinds of this framework's model -> the family they export as
    "llama": dict(),
    "llama-geglu-mha-untied": dict(ffn="geglu", n_kv_heads=4, tie_embeddings=False),
    "llama-erf-geglu": dict(ffn="geglu_exact"),
    "llama-biases": dict(use_bias=True),
    "llama-linear-rope": dict(rope_scaling="linear", rope_factor=4.0),
    "llama-yarn-rope": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, rope_attention_factor=1.2),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=16),
    "mistral": dict(window=5, n_kv_heads=1),
    "gpt2": dict(position="learned", norm="layernorm", ffn="gelu", use_bias=True, n_kv_heads=4),
    "gpt2-exact-gelu": dict(position="learned", norm="layernorm", ffn="gelu_exact", use_bias=True, n_kv_heads=4),
    "gemma2": dict(
        norm_position="sandwich",
        norm_offset=True,
        embed_scale=True,
        ffn="geglu",
        window=5,
        attention_pattern=("local", "global"),
        attn_softcap=50.0,
        logit_softcap=30.0,
    ),
    "gemma3_text": dict(
        norm_position="sandwich",
        norm_offset=True,
        embed_scale=True,
        ffn="geglu",
        qk_norm=True,
        window=5,
        attention_pattern=("local", "local", "global"),
        n_layers=3,
        rope_theta=1e6,
        rope_local_theta=1e3,
    ),
    "gemma3-global-scaling": dict(
        norm_position="sandwich",
        norm_offset=True,
        embed_scale=True,
        ffn="geglu",
        qk_norm=True,
        window=5,
        attention_pattern=("local", "local", "global"),
        n_layers=3,
        rope_theta=1e6,
        rope_local_theta=1e3,
        rope_scaling="linear",
        rope_factor=8.0,
        rope_local_scaling=False,
    ),
    "bert": dict(
        arch="encoder",
        position="learned",
        norm="layernorm",
        norm_position="post",
        embedding_norm=True,
        ffn="gelu_exact",
        use_bias=True,
        n_kv_heads=4,
        mlm_head=True,
        output_bias=True,
        norm_eps=1e-12,
        token_types=2,
    ),
    "modernbert": MODERNBERT_KIND
    | dict(
        norm_bias=False,
        norm_eps=1e-5,
        ffn="geglu_exact",
        mlm_head_bias=False,
        output_bias=True,
        n_layers=3,
        window=4,
        attention_pattern=("global", "local", "local"),
        rope_theta=160000.0,
        rope_local_theta=10.0,
    ),
    "modernbert-biases-untied": MODERNBERT_KIND | dict(ffn="geglu", tie_embeddings=False),
    "bart": dict(
        arch="encoder_decoder",
        n_encoder_layers=3,
        position="learned",
        encoder_positions=True,
        norm="layernorm",
        norm_eps=1e-5,
        norm_position="post",
        embedding_norm=True,
        ffn="gelu_exact",
        use_bias=True,
        n_kv_heads=4,
        output_bias=True,
    ),
    "t5": dict(
        arch="encoder_decoder",
        n_encoder_layers=3,
        position="t5_relative",
        rel_buckets=8,
        rel_max_distance=20,
        ffn="geglu",
        attn_scale=1.0,
        n_kv_heads=4,
    ),
    "t5-v1.0": dict(
        arch="encoder_decoder", position="t5_relative", ffn="relu", attn_scale=1.0, scale_head_input=True, n_kv_heads=4
    ),
    "t5-untied": dict(
        arch="encoder_decoder", position="t5_relative", ffn="geglu", attn_scale=1.0, tie_embeddings=False, n_kv_heads=4
    ),
    # mixtures of experts, dropless (as inference computes them)
    "mixtral": dict(n_experts=4, top_k=2, d_ff=48, capacity_factor=None),
    "qwen2_moe": dict(
        n_experts=4,
        top_k=2,
        moe_d_ff=24,
        moe_every=2,
        renormalize_gates=False,
        n_shared_experts=2,
        shared_expert_gate=True,
        qkv_bias=True,
        capacity_factor=None,
    ),
    "qwen3_moe": dict(n_experts=4, top_k=2, moe_d_ff=24, qk_norm=True, head_dim=16, capacity_factor=None),
    "deepseek_v2-dense-mla": dict(attention="mla", n_kv_heads=4),
    "deepseek_v2": dict(
        attention="mla",
        n_kv_heads=4,
        n_layers=3,
        n_experts=8,
        top_k=2,
        moe_d_ff=16,
        n_shared_experts=1,
        moe_first_dense=1,
        router_groups=4,
        router_topk_groups=2,
        renormalize_gates=False,
        routed_scale=2.0,
        capacity_factor=None,
    ),
    "deepseek_v3": dict(
        attention="mla",
        q_lora_rank=16,
        n_kv_heads=4,
        n_experts=8,
        top_k=2,
        moe_d_ff=16,
        n_shared_experts=1,
        router="sigmoid",
        router_bias=True,
        router_groups=2,
        router_topk_groups=1,
        router_group_score="top2",
        routed_scale=2.5,
        rope_scaling="yarn",
        rope_factor=4.0,
        rope_original_max_len=16,
        capacity_factor=None,
    ),
}


def verify() -> bool:
    import jax
    from flax import nnx

    from transformer.config import ModelConfig
    from transformer.io import hf
    from transformer.model import Transformer

    jax.config.update("jax_default_matmul_precision", "highest")
    ok = True
    for name in FIXTURES:
        ref = load_file(str(OUT / name / "reference.safetensors"))
        m, model = hf.load_model(OUT / name)
        ours = our_logits(model, ref["input_ids"])
        with tempfile.TemporaryDirectory() as tmp:
            hf.save(m, nnx.to_pure_dict(nnx.state(model, nnx.Param)), Path(tmp))
            again = hf_logits(Path(tmp), ref["input_ids"])
        d_import, d_export = np.abs(ours - ref["logits"]).max(), np.abs(again - ref["logits"]).max()
        ok &= d_import < IMPORT_TOLERANCE.get(name, 1e-4) and d_export < 1e-4
        print(f"fixture {name}: |ours - HF| {d_import:.2e}; exported again, loaded by transformers: {d_export:.2e}")
    ids = np.random.default_rng(0).integers(0, VOCAB, IDS_SHAPE)
    for i, (name, kw) in enumerate(OURS.items()):
        base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64)
        m = ModelConfig(**(base | kw))
        model = perturbed(Transformer(m, rngs=nnx.Rngs(i)), i)
        ours = our_logits(model, ids)
        with tempfile.TemporaryDirectory() as tmp:
            family = hf.save(m, nnx.to_pure_dict(nnx.state(model, nnx.Param)), Path(tmp))
            theirs = hf_logits(Path(tmp), ids)
        diff = np.abs(ours - theirs).max()
        ok &= diff < 1e-4
        print(f"ours {name} exported as {family.name}: |ours - transformers| {diff:.2e}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verify", action="store_true", help="only verify the committed fixtures")
    p.add_argument("--exact", action="store_true", help="only add float64 logits to the committed fixtures")
    args = p.parse_args()
    if args.exact:
        for name in FIXTURES:
            add_exact(name)
        return 0
    if not args.verify:
        for seed, name in enumerate(FIXTURES):
            make(name, seed)
    ok = verify()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}: {'all equal' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
