"""µP and depth scaling (model/parametrization.py): at the base shape the standard model bit for bit,
away from it the table's closed forms, a coordinate check that is flat in width where the standard
one grows, and one line for every combination it has no rule for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny
from flax import nnx

from transformer import sharding
from transformer.config import ConfigError, ModelConfig, config_changes
from transformer.config_loader import load_config
from transformer.model import OptimizerScaling, Transformer, optimizer_scaling
from transformer.model.layers import InitScales
from transformer.model.parametrization import RULES, branch_multiplier, output_multiplier
from transformer.train import Trainer
from transformer.train.optim import make_optimizer
from transformer.train.trainer import default_controls

VARIANTS = {
    "default": {},
    "gqa-untied-learned": dict(n_kv_heads=2, tie_embeddings=False, position="learned"),
    "gpt2": dict(norm="layernorm", ffn="gelu", use_bias=True, init_depth_scaled=True),
    "qk-norm-sandwich": dict(qk_norm=True, norm_position="sandwich"),
    "deepnorm-post": dict(norm_position="deepnorm"),
    "encoder": dict(arch="encoder"),
    "encoder-decoder": dict(arch="encoder_decoder", n_encoder_layers=1),
    "head-dim-6": dict(d_model=24),  # sqrt(6)/6 is not the float 6**-0.5: the scale must be the base's
    "moe-shared-every-2": dict(n_experts=4, top_k=2, n_shared_experts=1, moe_every=2),
    "moe-sigmoid-dropless": dict(n_experts=4, router="sigmoid", capacity_factor=None, moe_d_ff=48),
    "mla": dict(attention="mla"),
    "mla-deepnorm-untied": dict(attention="mla", norm_position="deepnorm", tie_embeddings=False),
    # depth scaling at the base depth (the model's own by default)
    "complete-p": dict(depth_scaling="complete_p"),
    "depth-mup-sandwich-moe": dict(depth_scaling="depth_mup", norm_position="sandwich", n_experts=4),
}
MUP_ONLY = ("depth_scaling",)  # keys the standard twin of a variant leaves out


def _params(m: ModelConfig) -> dict:
    return nnx.to_pure_dict(nnx.state(Transformer(m, rngs=nnx.Rngs(0)), nnx.Param))


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("variant", VARIANTS)
def test_at_the_base_shape_mup_is_the_standard_model_bit_for_bit(variant):
    standard = tiny(**{k: v for k, v in VARIANTS[variant].items() if k not in MUP_ONLY})
    mup = tiny(**VARIANTS[variant], parametrization="mup")  # the base shape defaults to the model's own
    assert set(mup.width_multipliers.values()) == {1.0} and mup.scale == standard.scale
    assert mup.depth_multiplier == branch_multiplier(mup) == 1.0
    ps, pm = _params(standard), _params(mup)
    assert _leaves_equal(ps, pm)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 8)), jnp.int32)
    extra = {"encoder_tokens_BxS": tokens} if standard.arch == "encoder_decoder" else {}
    outs = []
    for m, p in ((standard, ps), (mup, pm)):
        model = nnx.merge(nnx.graphdef(Transformer(m, rngs=nnx.Rngs(0))), p)
        x, _ = model.forward(tokens, **extra)
        outs.append(model.logits(x))
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def _trainer(*overrides: str) -> Trainer:
    run = [
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.ffn_multiple=16",
        "model.vocab_multiple=16",
    ]
    run += ["data.seq_len=16", "train.batch_size=8", "optim.warmup_steps=0", "optim.schedule=constant"]
    cfg = load_config(None, [*run, *overrides]).with_vocab(61)
    return Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))


def _batch(trainer: Trainer, seed: int = 0) -> dict:
    tokens = np.random.default_rng(seed).integers(0, 61, (8, 17)).astype(np.int32)
    return trainer.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, 8)


@pytest.mark.parametrize(
    "mup",
    [
        ["model.parametrization=mup"],
        ["model.parametrization=mup", "model.depth_scaling=complete_p", "optim.name=lion"],
        ["model.parametrization=mup", "model.depth_scaling=depth_mup", "model.n_experts=2", "optim.clip_norm=0.5"],
    ],
)
def test_at_the_base_shape_mup_takes_the_standard_update_bit_for_bit(mup):
    states = []
    for extra in ([o for o in mup if o.startswith(("optim.", "model.n_experts"))], mup):
        trainer = _trainer("optim.lr=3e-3", "optim.weight_decay=0.1", *extra)
        state = trainer.init(jax.random.key(0))
        for step in range(2):
            state, metrics = trainer.train_step(state, _batch(trainer, step), default_controls())
        states.append((jax.device_get(state.params), float(metrics["loss"])))
    assert states[0][1] == states[1][1]
    assert _leaves_equal(states[0][0], states[1][0])


def test_init_scales_learning_rates_and_multipliers_are_the_closed_forms():
    m = tiny(d_model=128, n_layers=3, ffn="gelu", parametrization="mup", mup_base_d_model=32)
    # n_heads 4 at both: head_dim 32 against 8; d_ff 4*D against 4*32 (both rounded to 16s: exact)
    assert (m.mup_base_n_heads, m.mup_base_head_dim, m.mup_base_d_ff) == (4, 8, 128)
    widths = {"d_model": 4.0, "attention": 4.0, "d_ff": 4.0, "moe_d_ff": 1.0, "kv_lora_rank": 1.0}  # no experts, no MLA
    widths["q_lora_rank"] = 1.0  # refused under µP
    assert m.width_multipliers == widths
    std, residual = 0.02, 0.02 / np.sqrt(2 * 3)
    scales = InitScales.of(m)
    assert scales.embedding == scales.positions == scales.head == std
    assert scales.qkv == scales.value == pytest.approx(std / 2) and scales.ffn_in == pytest.approx(std / 2)
    assert scales.attn_out == pytest.approx(residual / 2) and scales.ffn_out == pytest.approx(residual / 2)
    assert output_multiplier(m) == 0.25
    assert m.scale == pytest.approx(np.sqrt(8) / 32)  # 1/d_head, equal to the base's 1/sqrt(8) at d_head 8
    lrs = optimizer_scaling(m, _params(m)).lr
    flat = {"/".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(lrs)[0]}
    for path, value in flat.items():
        rule = RULES[path.split("/")[-1]]
        assert value == (1.0 if rule.fan_in is None else widths[rule.fan_in] ** -1.0), path
    assert (
        flat["blocks/attn/qkv"] == flat["blocks/ffn/w_out"] == 0.25
        and flat["embed"] == flat["blocks/attn_norm/scale"] == 1.0
    )
    # Adam's epsilon 1/m_d_model for every parameter: behind the 1/m readout every gradient shrinks so
    assert set(jax.tree.leaves(optimizer_scaling(m, _params(m)).eps)) == {0.25}


def test_the_fan_ins_follow_heads_and_ffn_width_each_on_its_own():
    m = tiny(
        d_model=64, n_heads=8, head_dim=16, d_ff=96, parametrization="mup", mup_base_d_model=32, mup_base_n_heads=2
    )
    # head_dim and d_ff are written, so the base keeps them; only d_model and the heads scale
    assert (m.mup_base_head_dim, m.mup_base_d_ff) == (16, 96)
    fixed = dict.fromkeys(("d_ff", "moe_d_ff", "kv_lora_rank", "q_lora_rank"), 1.0)
    assert m.width_multipliers == {"d_model": 2.0, "attention": 4.0, **fixed}
    assert m.scale == 16**-0.5


def test_mlas_latent_projections_follow_their_fan_ins_and_its_scale_is_one_over_d():
    m = tiny(d_model=64, attention="mla", parametrization="mup", mup_base_d_model=32)
    # 4 heads of 16 against the base's 4 of 8: every derived MLA size doubles with the head dim
    assert (m.kv_lora_rank, m.mup_base_mla["kv_lora_rank"]) == (64, 32) and m.width_multipliers["kv_lora_rank"] == 2.0
    lr = {
        "/".join(str(k.key) for k in path): v
        for path, v in jax.tree_util.tree_flatten_with_path(optimizer_scaling(m, _params(m)).lr)[0]
    }
    for name in ("wq", "wkv_down", "wk_rope", "wk_up", "wv_up", "out"):
        assert lr[f"blocks/attn/{name}"] == 0.5, name
    assert lr["blocks/attn/kv_latent_norm/scale"] == 1.0
    scales = InitScales.of(m)
    assert scales.kv_up == pytest.approx(0.02 / np.sqrt(2)) and scales.v_up == pytest.approx(0.02 / np.sqrt(2))
    # queries and keys of 16 + 8 against the base's 8 + 4: 1/d, equal to the base's 1/sqrt(12) at the base
    assert m.qk_head_dim == 24 and m.scale == pytest.approx(12**-0.5 * 12 / 24)


def test_the_bases_alphas_multiply_the_embedding_output_and_the_logits_and_nothing_else():
    # powers of two, so that every product below is exact and the comparisons bitwise
    shape = dict(d_model=64, parametrization="mup", mup_base_d_model=32, tie_embeddings=False, position="learned")
    plain, tuned = tiny(**shape), tiny(**shape, mup_input_alpha=2.0, mup_output_alpha=0.5)
    params = _params(plain)
    assert _leaves_equal(params, _params(tuned))  # the alphas change no initial value
    doubled = {**params, "embed": params["embed"] * 2, "pos_embed": params["pos_embed"] * 2}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 8)), jnp.int32)
    outs = {}
    for name, m, p in (("plain", plain, doubled), ("tuned", tuned, params)):
        model = nnx.merge(nnx.graphdef(Transformer(m, rngs=nnx.Rngs(0))), p)
        x, _ = model.forward(tokens)
        outs[name] = (np.asarray(x), np.asarray(model.logits(x)))
    # alpha_input 2 is the embedding tables doubled; alpha_output 0.5 halves the logits (m = 2: 1/4 against 1/2)
    np.testing.assert_array_equal(outs["tuned"][0], outs["plain"][0])
    vocab = plain.vocab_size  # the padding rows stay masked
    np.testing.assert_array_equal(outs["tuned"][1][..., :vocab], outs["plain"][1][..., :vocab] * 0.5)
    for name in ("embed", "blocks"):  # nor any learning rate
        lrs = [optimizer_scaling(m, params).lr[name] for m in (plain, tuned)]
        assert jax.tree.leaves(lrs[0]) == jax.tree.leaves(lrs[1])


def test_per_parameter_multipliers_scale_the_step_its_weight_decay_and_adams_epsilon():
    from transformer.config import OptimConfig

    params = {"a": jnp.ones((3, 3)), "b": {"c": jnp.full((2,), 2.0)}}
    grads = {"a": jnp.full((3, 3), 0.5), "b": {"c": jnp.full((2,), -1.0)}}
    cfg = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.1)

    def update(scaling=None, c=cfg):
        opt = make_optimizer(c, 10, params, scaling)
        return jax.tree.map(np.asarray, opt.update(grads, opt.init(params), params)[0])

    ones = {"a": 1.0, "b": {"c": 1.0}}
    plain, no_decay = update(), update(c=OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0))
    # all 1.0 is the plain chain to the last bit
    assert _leaves_equal(update(OptimizerScaling(ones, ones, ones)), plain)
    # µP: the decay rides on the learning rate's multiplier
    rides = update(OptimizerScaling({"a": 0.25, "b": {"c": 1.0}}, {"a": 0.25, "b": {"c": 1.0}}, ones))
    np.testing.assert_allclose(rides["a"], 0.25 * plain["a"], rtol=1e-6)
    np.testing.assert_array_equal(rides["b"]["c"], plain["b"]["c"])  # 1.0: untouched
    # depth scaling: its own decay multiplier, lr * (0.25 * adam + 0.5 * wd * p)
    own = update(OptimizerScaling({"a": 0.25, "b": {"c": 1.0}}, {"a": 0.5, "b": {"c": 1.0}}, ones))
    np.testing.assert_allclose(own["a"], 0.25 * no_decay["a"] - 1e-2 * 0.5 * 0.1 * 1.0, rtol=1e-6)
    # epsilon's factor: each parameter's Adam epsilon times its own
    big_eps = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.1, eps=1e-8 * 1e7)
    one_big = update(OptimizerScaling(ones, ones, {"a": 1e7, "b": {"c": 1.0}}))
    np.testing.assert_allclose(one_big["a"], update(c=big_eps)["a"], rtol=1e-6)
    np.testing.assert_array_equal(one_big["b"]["c"], plain["b"]["c"])
    assert not np.allclose(update(c=big_eps)["a"], plain["a"])  # the factor is large enough to show

    # independent decay (optim.independent_decay): the µP step without decay, then every decayed
    # parameter by 1 - s_t * wd whatever its learning rate's multiplier (s_0 = 1: a constant schedule)
    alone = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.1, independent_decay=True)
    scaling = OptimizerScaling({"a": 0.25, "b": {"c": 1.0}}, {"a": 0.25, "b": {"c": 1.0}}, ones)
    apart = update(scaling, c=alone)
    np.testing.assert_allclose(apart["a"], 0.25 * no_decay["a"] - 0.1 * 1.0, rtol=1e-6)
    np.testing.assert_allclose(apart["b"]["c"], no_decay["b"]["c"] - 0.1 * 2.0, rtol=1e-6)  # alike at 1.0


def test_depth_scaling_multiplies_each_residual_branch_after_its_output_norm():
    from transformer.model import Block

    x = jax.random.normal(jax.random.key(0), (2, 4, 32))
    y = jax.random.normal(jax.random.key(1), (2, 4, 32))
    for position in ("pre", "sandwich"):
        for depth, alpha in (("complete_p", 1.0), ("depth_mup", 0.5)):
            m = tiny(
                n_layers=8, parametrization="mup", depth_scaling=depth, mup_base_n_layers=2, norm_position=position
            )
            assert m.depth_multiplier == 4.0 and branch_multiplier(m) == 4.0**-alpha
            block = Block(m, rngs=nnx.Rngs(0))
            out = block.add_sublayer(x, y, block.attn_norm, block.attn_out_norm, None)
            written = y if position == "pre" else block.attn_out_norm(y)  # type: ignore[misc]
            np.testing.assert_allclose(np.asarray(out - x), 4.0**-alpha * np.asarray(written), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("depth", "alpha"), [("complete_p", 1.0), ("depth_mup", 0.5)])
def test_depth_scalings_learning_rates_decay_epsilon_and_init_are_the_closed_forms(depth, alpha):
    m = tiny(
        d_model=64,
        n_layers=8,
        ffn="gelu",
        parametrization="mup",
        mup_base_d_model=32,
        depth_scaling=depth,
        mup_base_n_layers=2,
    )
    m_n, m_l = 2.0, 4.0
    scaling = optimizer_scaling(m, _params(m))
    lr, decay, eps = (
        {"/".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
        for tree in (scaling.lr, scaling.decay, scaling.eps)
    )
    for name in ("blocks/attn/qkv", "blocks/attn/out", "blocks/ffn/w_in", "blocks/ffn/w_out"):
        assert lr[name] == pytest.approx(m_n**-1 * m_l ** (alpha - 1)) and decay[name] == pytest.approx(
            m_l ** (alpha - 1)
        )
    assert lr["blocks/attn_norm/scale"] == pytest.approx(m_l ** (alpha - 1))
    assert lr["embed"] == lr["final_norm/scale"] == 1.0 and decay["embed"] == 1.0
    # Adam's epsilon: 1/m_N everywhere, and m_L^-alpha inside the blocks only (CompleteP's equation 40)
    assert eps["blocks/attn/qkv"] == eps["blocks/attn_norm/scale"] == pytest.approx(m_n**-1 * m_l**-alpha)
    assert eps["embed"] == eps["final_norm/scale"] == m_n**-1
    # GPT-2's depth-scaled init of the residual writes at the base depth, times µP's width factor
    scales = InitScales.of(m)
    assert scales.attn_out == pytest.approx(0.02 / np.sqrt(2 * 2) * m_n**-0.5)
    assert scales.qkv == pytest.approx(0.02 * m_n**-0.5)


def test_experts_and_the_router_follow_their_own_widths():
    from transformer.model.moe import MoE

    m = tiny(d_model=64, ffn="gelu", n_experts=4, n_shared_experts=1, parametrization="mup", mup_base_d_model=32)
    # moe_d_ff derived from d_ff: the base's from the base d_ff, so it scales with it
    assert m.mup_base_moe_d_ff == m.mup_base_d_ff and m.width_multipliers["moe_d_ff"] == 2.0
    lr = {
        "/".join(str(k.key) for k in path): v
        for path, v in jax.tree_util.tree_flatten_with_path(optimizer_scaling(m, _params(m)).lr)[0]
    }
    assert lr["moe_blocks/ffn/w_out"] == lr["moe_blocks/ffn/shared/w_out"] == lr["moe_blocks/ffn/w_in"] == 0.5
    assert lr["moe_blocks/ffn/router"] == 1.0
    assert InitScales.of(m, experts=True).ffn_out == pytest.approx(0.02 / np.sqrt(2 * 2) / np.sqrt(2))
    # the router is a readout of d_model into n_experts: its logits times 1/m, as the head's
    moe = MoE(m, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 4, 64))
    expected = np.asarray(x) @ np.asarray(moe.router[...]) / 2.0
    np.testing.assert_allclose(np.asarray(moe.route(x).logits_BxTxE), expected, rtol=1e-5, atol=1e-6)
    # an expert width written in the config is the base's too: it does not scale
    fixed = tiny(d_model=64, n_experts=4, moe_d_ff=48, parametrization="mup", mup_base_d_model=32)
    assert fixed.mup_base_moe_d_ff == 48 and fixed.width_multipliers["moe_d_ff"] == 1.0


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.depth_scaling=complete_p"], "model.depth_scaling"),
        (
            ["model.parametrization=mup", "model.depth_scaling=complete_p", "model.norm_position=post"],
            "model.depth_scaling",
        ),
        (
            ["model.parametrization=mup", "model.depth_scaling=depth_mup", "model.norm_position=deepnorm"],
            "model.depth_scaling",
        ),
        (
            ["model.parametrization=mup", "model.depth_scaling=complete_p", "model.arch=encoder_decoder"],
            "model.depth_scaling",
        ),
        (["model.parametrization=mup", "model.mup_base_n_layers=2"], "model.mup_base_n_layers"),
        (["model.parametrization=mup", "model.mup_base_moe_d_ff=32"], "model.mup_base_moe_d_ff"),
        (
            ["model.parametrization=mup", "model.depth_scaling=complete_p", "model.mup_base_n_layers=0"],
            "model.mup_base_n_layers",
        ),
        (["model.parametrization=mup", "model.attention=mla", "model.kv_lora_rank=16"], "model.kv_lora_rank"),
        (["model.parametrization=mup", "model.attention=mla", "model.qk_rope_head_dim=8"], "model.qk_rope_head_dim"),
        (["model.parametrization=mup", "model.attention=mla", "model.q_lora_rank=16"], "model.q_lora_rank"),
        (["model.parametrization=mup", "optim.name=sgd"], "optim.name"),
        (["model.parametrization=mup", "model.mlm_head=true"], "model.mlm_head"),
        (["model.parametrization=mup", "optim.name=adafactor"], "optim.name"),
        (["model.mup_base_d_model=64"], "model.mup_base_d_model"),
        (["model.mup_output_alpha=2"], "model.mup_output_alpha"),
        (["model.parametrization=mup", "model.mup_input_alpha=0"], "model.mup_input_alpha"),
        (["model.parametrization=mup", "model.mup_base_d_model=0"], "model.mup_base_d_model"),
        (["model.parametrization=mup", "model.d_model=96", "model.mup_base_d_model=30"], "model.mup_base_head_dim"),
    ],
)
def test_combinations_without_a_rule_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_a_mup_run_resumes_only_as_mup_and_its_base_shape_is_saved():
    from transformer.config_loader import from_dict

    saved = load_config(None, ["model.parametrization=mup", "model.d_model=256", "model.mup_base_d_model=64"])
    assert from_dict(saved.to_dict()) == saved  # the saved file read back is the same config
    assert saved.to_dict()["model"]["mup_base_head_dim"] == 16
    unsafe, _ = config_changes(saved, load_config(None, ["model.d_model=256"]))
    assert any(line.startswith("model.parametrization") for line in unsafe)
    tuned = load_config(None, ["model.parametrization=mup", "model.mup_output_alpha=2.5"])
    unsafe, _ = config_changes(tuned, load_config(None, ["model.parametrization=mup"]))
    assert any(line.startswith("model.mup_output_alpha") for line in unsafe)  # another function
    deep = [
        "model.parametrization=mup",
        "model.n_layers=8",
        "model.depth_scaling=complete_p",
        "model.mup_base_n_layers=2",
    ]
    saved = load_config(None, deep)
    assert from_dict(saved.to_dict()) == saved and saved.to_dict()["model"]["mup_base_n_layers"] == 2
    unsafe, _ = config_changes(saved, load_config(None, deep[:2]))
    assert any(line.startswith("model.depth_scaling") for line in unsafe)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [[], ["optim.name=muon", "optim.muon.scale=spectral"]], ids=["adamw", "muon"])
def test_the_coordinate_check_is_flat_in_width_under_mup_and_grows_under_standard(tmp_path, optimizer):
    """`train.py --coord-check`'s measurement at widths 32-128 (4 heads, 3 steps at lr 1e-2): µP
    takes away the growth the standard parametrization shows. Theory says 0 under µP; measured
    here the µP slopes are within 0.17 of it (the FFN output's -0.17, -0.27 after a fourth step:
    finite width), so 'no growth' is |slope| < 0.4, against standard slopes of 0.87 (logits) to
    2.6 (FFN output); with µP's hidden learning rates left unscaled the residual stream's was 1.6,
    which this test exists to catch. Attention logits are left out of µP's set: at init µP's 1/d
    scale makes them shrink with width. Under Muon with the spectral scale (no learning rate scaled)
    the µP slopes measured within 0.07 of 0 (attention logits -0.59)."""
    from conftest import write_corpus

    from transformer.config_loader import load_raw
    from transformer.train.coordcheck import run_coord_check

    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0)
    overrides = [f"data.source=files:{corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    overrides += ["model.n_layers=2", "model.n_heads=4", "model.ffn_multiple=16", "train.batch_size=8", "optim.lr=1e-2"]
    overrides += ["optim.weight_decay=0.0", "model.parametrization=mup", "model.mup_base_d_model=32", *optimizer]
    raw = load_raw(None, overrides)
    check = run_coord_check(raw, load_config(None, overrides), [32, 64, 128], steps=3, log=lambda _: None)
    slopes = check.slopes()
    assert all(abs(s) < 0.4 for q, s in slopes["mup"].items() if q != "attn_logits"), slopes["mup"]
    # Muon's orthogonalised steps are already width-free in the standard model's hidden matrices: its
    # residual stream grew by +0.28 here (Adam's: > 1); its sublayer outputs and logits still grow
    growing = ("logits", "ffn_out", "attn_out") + (("residual",) if not optimizer else ())
    assert all(slopes["standard"][q] > 0.5 for q in growing), slopes
    assert len(check.lines()) == 12 and len(check.rms["mup"]["residual"]) == 4


@pytest.mark.slow
def test_the_depth_check_is_flat_in_depth_under_complete_p_where_the_residual_grows_without(tmp_path):
    """`--coord-depths`'s measurement at depths 2-8 (width 32, 3 steps at lr 1e-2), µP at its base
    width: without depth scaling Adam moves every block's output by about the learning rate, so the
    residual stream grows with depth (slope +0.62 at depths 2-16 when this was written); CompleteP's
    1/L branches keep it and the output logits flat (-0.10 and +0.01 at depths 2-16)."""
    from conftest import write_corpus

    from transformer.config_loader import load_raw
    from transformer.train.coordcheck import run_coord_check

    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0)
    overrides = [f"data.source=files:{corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    overrides += ["model.d_model=32", "model.n_heads=4", "model.ffn_multiple=16", "train.batch_size=8"]
    overrides += ["optim.lr=1e-2", "optim.weight_decay=0.0", "model.parametrization=mup"]
    overrides += ["model.depth_scaling=complete_p", "model.n_layers=2"]
    check = run_coord_check(
        load_raw(None, overrides), load_config(None, overrides), [2, 4, 8], steps=3, log=lambda _: None, axis="n_layers"
    )
    slopes = check.slopes()
    assert set(slopes) == {"complete_p", "none"} and check.axis == "n_layers"
    assert all(abs(slopes["complete_p"][q]) < 0.25 for q in ("residual", "logits")), slopes["complete_p"]
    assert slopes["none"]["residual"] > 0.25, slopes["none"]
    assert "against log depth" in check.lines()[0]


def _train(*args: str):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--coord-check", "--coord-widths", "64,x"], "--coord-widths"),
        (["--coord-check", "--coord-widths", "64"], "--coord-widths"),
        (["--coord-check", "--coord-steps", "0"], "--coord-steps"),
        (["--coord-check", "--coord-widths", "60,64", "model.n_heads=8"], "model.n_heads"),
    ],
)
@pytest.mark.slow
def test_coord_check_mistakes_are_one_line_exit_2(args, says):
    result = _train(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1 and says in lines[0], result.stderr


@pytest.mark.slow
def test_coord_check_writes_its_figure_and_a_line_per_quantity(tmp_path):
    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0)
    args = ["--coord-check", "--coord-widths", "32,64", "--coord-steps", "1", "--workdir", str(tmp_path / "cc")]
    args += [f"data.source=files:{corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    args += ["model.n_layers=1", "train.batch_size=4", "model.parametrization=mup", "model.mup_base_d_model=32"]
    result = _train(*args)
    assert result.returncode == 0, result.stderr
    verdicts = [line for line in result.stdout.splitlines() if "of log RMS against log width" in line]
    assert len(verdicts) == 12 and {line.split(":")[0] for line in verdicts} == {"mup", "standard"}
    import json

    saved = json.loads((tmp_path / "cc" / "coord_check.json").read_text())
    assert saved["axis"] == "d_model" and saved["sizes"] == [32, 64] and set(saved["slopes"]) == {"mup", "standard"}
    assert (tmp_path / "cc" / "coord_check.png").stat().st_size > 10_000


@pytest.mark.slow
def test_coord_check_on_a_sweep_checks_each_distinct_model_once(tmp_path):
    """Four members, two models: the learning rate is not the model, so each parametrization is checked once."""
    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0)
    (tmp_path / "sweep.yaml").write_text(
        "sweep:\n  grid:\n    optim.lr: [1.0e-3, 1.0e-2]\n"
        "  zip:\n    - model.parametrization: [standard, mup]\n      model.mup_base_d_model: [null, 32]\n"
        '  name: "{model.parametrization}-lr{optim.lr}"\n'
    )
    args = [str(tmp_path / "sweep.yaml"), "--coord-check", "--coord-widths", "32,64", "--coord-steps", "1"]
    args += ["--workdir", str(tmp_path / "cc"), f"data.source=files:{corpus}", f"data.cache_dir={tmp_path / 'cache'}"]
    args += ["data.seq_len=32", "model.n_layers=1", "train.batch_size=4"]
    result = _train(*args)
    assert result.returncode == 0, result.stderr
    verdicts = [line for line in result.stdout.splitlines() if "of log RMS against log width" in line]
    # the standard member: its own 6 lines; the µP member: 6 for µP, 6 for the standard one beside it
    assert {line.split(":")[0] for line in verdicts} == {"standard-lr0.001", "mup-lr0.001"} and len(verdicts) == 18
    assert sorted(p.name for p in (tmp_path / "cc").iterdir()) == ["mup-lr0.001", "standard-lr0.001"]
    assert (tmp_path / "cc" / "mup-lr0.001" / "coord_check.json").is_file()
