"""The gradient profile (`--grad-profile`, train/gradprofile.py): each layer's gradient norm is the
loss's own derivative (a finite-difference check), layers come out in layer order across dense and
MoE stacks, the sweep summary's ratio and slope are the closed forms of what it was given, and the
command and the Xiong study's quick form run end to end."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import sharding
from transformer.config_loader import load_config
from transformer.model import layer_slots
from transformer.report.gradients import summarize_gradients
from transformer.train import Trainer
from transformer.train.gradprofile import GradProfile, profile_of

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _trainer(*overrides: str) -> Trainer:
    run = ["model.d_model=32", "model.n_layers=3", "model.n_heads=4", "model.ffn_multiple=16"]
    run += ["model.vocab_multiple=16", "data.seq_len=16", "train.batch_size=4", *overrides]
    cfg = load_config(None, run).with_vocab(61)
    return Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))


def _batch(trainer: Trainer) -> dict:
    tokens = np.random.default_rng(0).integers(0, 61, (4, 17)).astype(np.int32)
    return trainer.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, 4)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_each_layers_norm_is_the_losss_derivative_along_that_layers_gradient(placement):
    """The derivative of the loss along layer l's own gradient direction, by finite differences, is
    the norm the profile gives layer l: so the profile slices layers right and is the loss's."""
    trainer = _trainer(f"model.norm_position={placement}")
    state, batch = trainer.initial_state(), _batch(trainer)
    profile = profile_of(trainer, state, batch)

    def mean_loss(params):
        objective, (_, count, _, _, _) = trainer._loss(params, batch, None)
        return objective / count

    grads = jax.grad(mean_loss)(state.params)
    w_out = state.params["blocks"]["ffn"]["w_out"]
    for layer in range(3):
        direction = jnp.zeros_like(w_out).at[layer].set(grads["blocks"]["ffn"]["w_out"][layer])
        direction = direction / jnp.linalg.norm(direction)
        eps = 0.1  # large: the loss is float32, and a smaller step would measure its rounding

        def at(t, d=direction):
            ffn = {**state.params["blocks"]["ffn"], "w_out": w_out + t * d}
            return mean_loss({**state.params, "blocks": {**state.params["blocks"], "ffn": ffn}})

        # the five-point stencil, whose O(eps^4) error keeps so large a step exact enough
        slope = float((8 * (at(eps) - at(-eps)) - (at(2 * eps) - at(-2 * eps))) / (12 * eps))
        assert profile.norms["ffn/w_out"][layer] == pytest.approx(slope, rel=1e-2)
    assert profile.loss == pytest.approx(float(mean_loss(state.params)), rel=1e-6)


def test_dense_and_moe_layers_come_out_in_layer_order():
    trainer = _trainer("model.n_experts=2", "model.moe_every=2", "model.n_layers=4")
    state, batch = trainer.initial_state(), _batch(trainer)
    profile = profile_of(trainer, state, batch)
    grads = jax.device_get(trainer.gradients(state, batch)[0])
    slots = layer_slots(trainer.cfg.model)
    assert [stack for stack, _ in slots] == ["blocks", "moe_blocks", "blocks", "moe_blocks"]
    for i, (stack, j) in enumerate(slots):  # each layer's norm is its own stack's slice
        for name in ("w_in", "w_out"):
            want = np.linalg.norm(np.asarray(grads[stack]["ffn"][name][j], np.float64))
            assert profile.norms[f"ffn/{name}"][i] == pytest.approx(want, rel=1e-5)
    # the router is the MoE layers' only: absent from the dense ones
    assert [v is None for v in profile.norms["ffn/router"]] == [True, False, True, False]
    assert len(profile.group("FFN")) == 4 and min(profile.group("FFN")) > 0


def _profile(ffn_last: float, layers: int) -> GradProfile:
    return GradProfile({"ffn/w_in": [1.0] * (layers - 1) + [ffn_last]}, {}, {}, 1.0)


def test_the_summary_ratio_and_slope_are_the_closed_forms():
    """Post's last-layer norm c * sqrt(L) times Pre-LN's, per seed: the ratio is c sqrt(L) and the
    slope 1/2 exactly, whatever the seeds' levels."""
    profiles = []
    for seed, level in ((0, 1.0), (1, 3.0)):
        for layers in (2, 8, 32):
            for placement, last in (("pre", level), ("post", level * 0.1 * np.sqrt(layers))):
                cfg = load_config(
                    None, [f"model.norm_position={placement}", f"model.n_layers={layers}", f"train.seed={seed}"]
                )
                profiles.append((cfg, _profile(last, layers)))
    summary = summarize_gradients(profiles)
    assert summary is not None
    for layers in (2, 8, 32):
        np.testing.assert_allclose(summary.ratios["post"][layers], [0.1 * np.sqrt(layers)] * 2, rtol=1e-12)
    slope, low, high = summary.slope("post")
    assert slope == pytest.approx(0.5) and low == pytest.approx(0.5) and high == pytest.approx(0.5)
    assert any("post / pre" in line and "L^0.50" in line for line in summary.lines())
    # without a Pre-LN member there is nothing to compare with
    assert summarize_gradients([p for p in profiles if p[0].model.norm_position != "pre"]) is None


@pytest.mark.slow
def test_grad_profile_on_the_xiong_study_runs_and_names_its_finding(tmp_path):
    """The study's quick form: two placements, two depths, one seed, through train.py."""
    quick = [
        "sweep.grid={model.norm_position: [pre, post], model.n_layers: [2, 4]}",
        "sweep.seeds=[0]",
        "model.d_model=32",
        "data.seq_len=32",
        "train.batch_size=4",
    ]
    cmd = [sys.executable, "train.py", "configs/ablations/xiong.yaml", "--grad-profile", "--workdir", str(tmp_path)]
    out = subprocess.run([*cmd, *quick], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "post / pre, last layer's FFN gradient norm at init: L=2" in out.stdout
    assert (tmp_path / "grad_profile_summary.png").is_file() and (
        tmp_path / "post-L4-s0" / "grad_profile.json"
    ).is_file()
    single = subprocess.run(
        [sys.executable, "train.py", "--grad-profile", "--coord-check"], cwd=ROOT, capture_output=True, text=True
    )
    assert single.returncode == 2 and single.stderr.count("\n") == 1 and "one check at a time" in single.stderr
