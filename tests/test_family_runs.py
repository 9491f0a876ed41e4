"""Each model family through the whole run: it learns its built-in task, resumes bit for bit, and
eval.py generates (encoder-decoder, prefix decoder) or fills masks (encoder) from its checkpoint."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, assert_bitwise_equal, final_params, logged

from transformer.config_loader import load_config
from transformer.train.job import run

RECALL = "builtin:recall:pairs=4,distance=24,train_docs=2000,val_docs=50"
PAIRS = "builtin:seq2seq:task=reverse,max_len=6,train_docs=4000,val_docs=100"
FAMILIES = {
    "encoder-mlm": ["model.arch=encoder", f"data.source={RECALL}", "data.seq_len=64"],
    "encoder_decoder-span": ["model.arch=encoder_decoder", f"data.source={RECALL}", "data.seq_len=64"],
    "encoder_decoder-seq2seq": ["model.arch=encoder_decoder", f"data.source={PAIRS}", "data.seq_len=8"],
    "decoder-prefix": [f"data.source={PAIRS}", "data.seq_len=8"],
}


def overrides(cache: Path, family: str, *extra: str) -> list[str]:
    return [
        *FAMILIES[family],
        f"data.cache_dir={cache}",
        "data.val_windows=16",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.ffn_multiple=16",
        "train.batch_size=16",
        "optim.warmup_steps=10",
        "logging.every=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-cache")


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, cache, tmp_path_factory) -> tuple[str, Path, float]:
    """(family, run directory, unigram baseline) of 300 steps on the family's built-in task (a few
    seconds each: the val losses end at 0.55-0.75 of the baseline)."""
    family, workdir = request.param, tmp_path_factory.mktemp(request.param) / "run"
    lines: list[str] = []
    cfg = load_config(None, overrides(cache, family, "train.steps=300", "train.eval_every=300", "optim.lr=5e-3"))
    run(cfg, workdir, log=lines.append)
    done = next(line for line in lines if line.startswith("done:"))
    baseline = re.search(r"unigram baseline ([0-9.]+)", done)
    assert baseline is not None, done
    return family, workdir, float(baseline[1])


# the tests of a trained run share one worker, so each family trains once (see conftest: loadgroup)
@pytest.mark.xdist_group("family-runs")
def test_each_family_learns_its_task(trained):
    """Well below the best context-free prediction of the targets: the model uses its context
    (bidirectional, through cross-attention, or after the separator)."""
    family, workdir, baseline = trained
    (val,) = logged(workdir, "val_loss").values()
    assert val < 0.8 * baseline, (family, val, baseline)
    (accuracy,) = logged(workdir, "val_accuracy").values()
    assert 0.0 < accuracy <= 1.0
    assert "val_bits_per_byte" not in rundir_metrics(workdir)  # only the causal objective predicts every byte


def rundir_metrics(workdir: Path) -> set[str]:
    from transformer import rundir

    return set(rundir.metric_series(workdir))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_resumes_bitwise(family, cache, tmp_path):
    """8 steps in one go equal 4, a stop and 4 more, bit for bit, with the per-layer statistics on
    (an encoder-decoder's encoder and cross-attention included)."""
    extra = ("checkpoint.every=4", "train.eval_every=8", "monitor.stats_every=4", "optim.schedule=constant")

    def train(workdir: Path, steps: int) -> None:
        run(load_config(None, overrides(cache, family, *extra, f"train.steps={steps}")), workdir, log=lambda _: None)

    train(tmp_path / "straight", 8)
    train(tmp_path / "resumed", 4)
    train(tmp_path / "resumed", 8)
    assert logged(tmp_path / "resumed", "loss") == logged(tmp_path / "straight", "loss")
    assert_bitwise_equal(final_params(tmp_path / "resumed"), final_params(tmp_path / "straight"))
    entropy = "encoder_attn_entropy" if family.startswith("encoder_decoder") else "attn_entropy"
    assert sorted(logged(tmp_path / "straight", entropy)) == [4, 8]
    if family.startswith("encoder_decoder"):
        cross = logged(tmp_path / "straight", "cross_attn_entropy")
        assert all(len(v) == 2 and min(v) > 0 for v in cross.values())
        assert len(logged(tmp_path / "straight", "encoder_grad_norm_attn")[8]) == 2


def eval_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "eval.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.xdist_group("family-runs")
def test_eval_generates_or_fills_masks_as_the_family_does(trained):
    family, workdir, _ = trained
    if family == "encoder-mlm":
        out = eval_cli("--workdir", str(workdir), "--fill-mask", "aQ bR <mask>", "--top-k", "3")
        assert out.returncode == 0, out.stderr
        filled, top = out.stdout.splitlines()[:2]
        assert filled.startswith("aQ bR ") and "<mask>" not in filled and top.startswith("  <mask> 0: ")
        refused = eval_cli("--workdir", str(workdir), "--generate", "abc")
        assert refused.returncode == 2 and "--fill-mask" in refused.stderr and refused.stderr.count("\n") == 1
        return
    out = eval_cli("--workdir", str(workdir), "--generate", "abcd", "--temperature", "0", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("abcd -> ")  # an answer to the input, not a continuation of it
    if family.startswith("encoder_decoder"):
        refused = eval_cli("--workdir", str(workdir), "--fill-mask", "a<mask>")
        assert refused.returncode == 2 and "encoder" in refused.stderr
