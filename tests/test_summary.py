"""The closed-form parameter count, FLOPs and KV-cache bytes, held against the real parameter tree."""

import itertools

import pytest
from conftest import tiny

from transformer.config import ModelConfig
from transformer.model.summary import (
    count_params,
    flops_per_token,
    kv_cache_bytes_per_token,
    mean_attended_keys,
    params_by_component,
    summary_text,
)


@pytest.mark.parametrize("L, D, V", [(1, 32, 64), (3, 64, 128), (12, 768, 50304)])
def test_mha_textbook_count(L, D, V):
    """MHA, d_ff = 4D, no biases, tied embeddings: 12*L*D^2 + V*D plus norms (RMSNorm: D each)."""
    cfg = ModelConfig(d_model=D, n_layers=L, n_heads=4, ffn="gelu", vocab_size=V, vocab_multiple=1, position="rope")
    norms = (2 * L + 1) * D
    assert count_params(cfg) == 12 * L * D**2 + V * D + norms
    assert sum(params_by_component(cfg).values()) == count_params(cfg)


GRID = list(
    itertools.product(
        [dict(n_kv_heads=4), dict(n_kv_heads=2), dict(n_kv_heads=1), dict(n_heads=6, head_dim=8)],
        ["gelu", "swiglu"],
        ["pre", "post", "sandwich", "deepnorm"],
        [
            dict(),
            dict(use_bias=True, norm="layernorm"),
            dict(tie_embeddings=False, position="learned"),
            dict(qk_norm=True, d_ff=40),
        ],
    )
)


@pytest.mark.parametrize("heads, ffn, norm_position, extra", GRID)
def test_closed_form_equals_parameter_tree(heads, ffn, norm_position, extra):
    cfg = tiny(ffn=ffn, norm_position=norm_position, **heads, **extra)
    assert count_params(cfg) == sum(params_by_component(cfg).values())


def test_full_size_llama2_7b_shape_check():
    """Shapes only (jax.eval_shape): Llama-2-7B's published 6,738,415,616 parameters."""
    cfg = ModelConfig(
        d_model=4096, n_layers=32, n_heads=32, d_ff=11008, vocab_size=32000, tie_embeddings=False, max_seq_len=4096
    )
    by_component = params_by_component(cfg)
    assert sum(by_component.values()) == count_params(cfg) == 6_738_415_616
    assert by_component["embedding"] == by_component["output head"] == 32000 * 4096


def test_full_size_gqa_shape_check():
    """A Llama-3-8B-like GQA model (8 kv heads): 8,030,261,248 parameters."""
    cfg = ModelConfig(
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        vocab_size=128256,
        tie_embeddings=False,
        rope_theta=500000.0,
        max_seq_len=8192,
    )
    assert sum(params_by_component(cfg).values()) == count_params(cfg) == 8_030_261_248


def test_mean_attended_keys():
    assert mean_attended_keys(tiny(), 4) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert mean_attended_keys(tiny(window=2), 4) == pytest.approx((1 + 2 + 2 + 2) / 4)
    # local, global alternating: the average of both
    patterned = tiny(window=2, attention_pattern=("local", "global"))
    assert mean_attended_keys(patterned, 4) == pytest.approx((7 / 4 + 10 / 4) / 2)


def test_flops_per_token_by_hand():
    L, D, V, T = 3, 64, 128, 32
    cfg = ModelConfig(d_model=D, n_layers=L, n_heads=4, ffn="gelu", vocab_size=V, vocab_multiple=1)
    matmul_params = 12 * L * D**2 + V * D  # the head is a matmul, the embedding lookup is not
    attention = 3 * L * 4 * D * (T + 1) / 2  # QK^T and AV over the causal half, forward + backward
    assert flops_per_token(cfg, T) == pytest.approx(6 * matmul_params + attention)
    # GQA saves the K/V projection FLOPs
    gqa = ModelConfig(d_model=D, n_layers=L, n_heads=4, n_kv_heads=1, ffn="gelu", vocab_size=V, vocab_multiple=1)
    assert flops_per_token(cfg, T) - flops_per_token(gqa, T) == pytest.approx(6 * L * 2 * D * (D - D // 4))


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_kv_cache_bytes(dtype, itemsize, n_kv_heads):
    cfg = tiny(n_kv_heads=n_kv_heads, dtype=dtype)
    assert kv_cache_bytes_per_token(cfg) == 2 * cfg.n_layers * n_kv_heads * cfg.head_dim * itemsize


def test_summary_text_lists_components():
    text = summary_text(tiny(tie_embeddings=False, position="learned"), 16)
    for word in ("attention", "ffn", "embedding", "positions", "output head", "norms", "total", "FLOPs", "KV cache"):
        assert word in text
    assert f"{count_params(tiny(tie_embeddings=False, position='learned')):,}" in text
