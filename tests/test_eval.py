"""eval.py: losses agree with the training log, other datasets and splits, generation, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, write_corpus

from transformer.cli import eval_main
from transformer.config_loader import load_config
from transformer.train.job import run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    corpus = write_corpus(root / "docs.jsonl", seed=2)
    workdir = root / "run"
    cfg = load_config(
        None,
        [
            f"data.source=files:{corpus}",
            f"data.cache_dir={root / 'cache'}",
            "data.seq_len=32",
            "data.val_windows=12",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.ffn_multiple=16",
            "train.batch_size=8",
            "train.steps=20",
            "train.eval_every=10",
            "checkpoint.every=10",
            "checkpoint.keep=5",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    run(cfg, workdir, log=lambda _: None)
    return workdir, root


def logged_val_loss(workdir: Path, step: int) -> float:
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step and "val_loss" in record:
            return record["val_loss"]
    raise AssertionError(f"no val_loss logged at step {step}")


def eval_json(capsys, *argv) -> dict:
    assert eval_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("step", [None, 10])
def test_eval_loss_equals_the_training_log(trained, capsys, step):
    workdir, _ = trained
    args = ["--workdir", str(workdir)] + (["--step", str(step)] if step else [])
    result = eval_json(capsys, *args)
    assert result["step"] == (step or 20)
    assert result["loss"] == pytest.approx(logged_val_loss(workdir, step or 20), rel=1e-6)
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]), rel=1e-6)
    assert result["tokens"] == 12 * 32
    assert 0 < result["bits_per_byte"] < 10


@pytest.mark.slow
def test_other_split_batches_and_dataset(trained, capsys):
    workdir, root = trained
    train_split = eval_json(capsys, "--workdir", str(workdir), "--split", "train", "--batches", "1")
    assert train_split["split"] == "train" and train_split["tokens"] == 8 * 32
    other = write_corpus(root / "other.jsonl", seed=9, n=200)
    result = eval_json(capsys, "--workdir", str(workdir), f"data.source=files:{other}", "data.val_fraction=0.2")
    assert result["source"] == f"files:{other}"
    assert result["loss"] != pytest.approx(logged_val_loss(workdir, 20), rel=1e-6)


@pytest.mark.slow
def test_generate_prints_a_continuation(trained, capsys):
    workdir, _ = trained
    argv = [
        "--workdir",
        str(workdir),
        "--generate",
        "doc 1: the",
        "--generate",
        "of",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    assert eval_main(argv) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["prompt"] for r in first] == ["doc 1: the", "of"]
    assert all(isinstance(r["completion"], str) and len(r["completion"]) <= 12 for r in first)
    assert eval_main(argv) == 0  # greedy: the same text again
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == first


def expect_usage_error(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        eval_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


@pytest.mark.slow
def test_bad_input(trained, tmp_path, capsys):
    workdir, _ = trained
    expect_usage_error(capsys, ["--workdir", str(tmp_path)], "holds no run")
    empty = tmp_path / "no-checkpoints"
    empty.mkdir()
    (empty / "config.yaml").write_text((workdir / "config.yaml").read_text())
    expect_usage_error(capsys, ["--workdir", str(empty)], "holds no checkpoints")
    expect_usage_error(capsys, ["--workdir", str(workdir), "--step", "7"], "step 7 was not kept")
    expect_usage_error(capsys, ["--workdir", str(workdir), "--generate", "x" * 40], "longer than the context of 32")
    expect_usage_error(capsys, ["--workdir", str(workdir), "--bogus"], "unrecognized arguments: --bogus")
    expect_usage_error(capsys, ["--workdir", str(workdir), "--top-p", "0"], "--top-p")


def eval_cli(workdir: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python eval.py --workdir WORKDIR [FLAGS]` as a user runs it, on the CPU."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "eval.py", "--workdir", str(workdir), *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_eval_cli_end_to_end(trained):
    workdir, _ = trained
    out = eval_cli(workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("step 20 on files:") and "bits per byte" in out.stdout


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_line_and_eval_falls_back(trained, tmp_path):
    """The newest checkpoint's data files gone: one line naming the step and the missing file (not
    tensorstore's JSON spec of the store, nor asyncio's tracebacks of the abandoned reads), and the
    evaluation of the one before it."""
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    shutil.rmtree(workdir / "checkpoints" / "20" / "state" / "d")
    out = eval_cli(workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("step 10 on files:")
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("eval.py: the checkpoint of step 20 is damaged") and "state/d/" in lines[0]
    assert "tensorstore_spec" not in lines[0], lines[0]


# --- a mixture run (issue 16) --------------------------------------------------------------------

MIXTURE_VAL_WINDOWS, MIXTURE_SEQ_LEN, MIXTURE_BATCH = 5, 16, 4


@pytest.fixture(scope="module")
def trained_mixture(tmp_path_factory):
    """A tiny run on a 0.7 / 0.3 mixture of two corpora, validated and saved at steps 3 and 6."""
    root = tmp_path_factory.mktemp("eval-mixture")
    code, prose = write_corpus(root / "code.jsonl", seed=3, n=120), write_corpus(root / "prose.jsonl", seed=4, n=80)
    entries = (
        f"[{{source: 'files:{code}', weight: 0.7, name: code}}, {{source: 'files:{prose}', weight: 0.3, name: prose}}]"
    )
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.ffn_multiple=16"]
    cfg = load_config(
        None,
        [f"data.mixture={entries}", f"data.cache_dir={root / 'cache'}", f"data.seq_len={MIXTURE_SEQ_LEN}", *tiny]
        + [f"data.val_windows={MIXTURE_VAL_WINDOWS}", f"train.batch_size={MIXTURE_BATCH}", "train.steps=6"]
        + ["train.eval_every=3", "checkpoint.every=3", "checkpoint.keep=5", "optim.warmup_steps=1"]
        + ["logging.progress=false", "logging.tensorboard=false"],
    )
    run(cfg, root / "run", log=lambda _: None)
    return root / "run"


@pytest.mark.parametrize("step", [None, 3])
def test_eval_of_a_mixture_gives_each_sources_loss_as_the_training_log(trained_mixture, capsys, step):
    from conftest import logged

    args = ["--workdir", str(trained_mixture)] + (["--step", str(step)] if step else [])
    result = eval_json(capsys, *args)
    at = step or 6
    assert result["step"] == at and set(result["sources"]) == {"code", "prose"}
    for name, own in result["sources"].items():
        assert own["loss"] == pytest.approx(logged(trained_mixture, f"val/{name}/loss")[at], rel=1e-6)
        assert own["bits_per_byte"] == pytest.approx(logged(trained_mixture, f"val/{name}/bits_per_byte")[at], rel=1e-6)
        assert own["tokens"] == MIXTURE_VAL_WINDOWS * MIXTURE_SEQ_LEN
    assert result["loss"] == pytest.approx(logged_val_loss(trained_mixture, at), rel=1e-6)
    assert result["loss"] == pytest.approx(
        0.7 * result["sources"]["code"]["loss"] + 0.3 * result["sources"]["prose"]["loss"]
    )
    assert result["tokens"] == 2 * MIXTURE_VAL_WINDOWS * MIXTURE_SEQ_LEN  # both sources', not the first's


def test_eval_of_a_mixture_on_the_training_split_reads_each_sources_training_windows(trained_mixture, capsys):
    from transformer.data import prepare
    from transformer.eval.evaluate import run_config, split_windows

    val = eval_json(capsys, "--workdir", str(trained_mixture))
    train = eval_json(capsys, "--workdir", str(trained_mixture), "--split", "train")
    assert train["split"] == "train" and train["tokens"] == val["tokens"]
    for name in ("code", "prose"):
        assert train["sources"][name]["loss"] != pytest.approx(val["sources"][name]["loss"], rel=1e-6)
    cfg = run_config(trained_mixture, [])
    data = split_windows(prepare(cfg.data, MIXTURE_BATCH, 0, trained_mixture, log=lambda _: None), "train")
    for part in data.parts:  # evenly spaced over each source's own training windows, first to last
        ids = part.data.val_window_ids
        assert part.data.val is part.data.train and ids[0] == 0 and ids[-1] == part.data.train.count - 1
        assert len(ids) == MIXTURE_VAL_WINDOWS
    one = eval_json(capsys, "--workdir", str(trained_mixture), "--split", "train", "--batches", "1")
    assert [own["tokens"] for own in one["sources"].values()] == [MIXTURE_BATCH * MIXTURE_SEQ_LEN] * 2


def test_eval_text_output_of_a_mixture_has_a_line_per_source(trained_mixture, capsys):
    assert eval_main(["--workdir", str(trained_mixture)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-3:]
    assert lines[0].startswith("step 6 on a mixture of 2 sources (val, 160 tokens): loss ")
    assert lines[1].startswith("  code (files:") and "weight 0.7, 80 tokens): loss " in lines[1]
    assert lines[2].startswith("  prose (files:") and "bits per byte" in lines[2]


@pytest.mark.slow
def test_eval_cli_of_a_mixture_end_to_end(trained_mixture):
    out = eval_cli(trained_mixture, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["sources"]) == {"code", "prose"} and result["tokens"] == 2 * MIXTURE_VAL_WINDOWS * MIXTURE_SEQ_LEN


# --- bad input that needs no trained run (issue 18) ----------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    """A run directory holding only its config.yaml: every refusal below comes before a checkpoint is read."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    cfg = load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "data.seq_len=32"])
    (workdir / "config.yaml").write_text(cfg.with_vocab(259).to_yaml())
    return workdir


DAMAGED_CONFIGS = {
    "not-utf8": b"\xff\xfe\x00 garbage",
    "invalid-yaml": b"model: {d_model: [\n",
    "a-list": b"- 1\n- 2\n",
    "empty": b"",
    "a-bad-value": b"model:\n  d_model: -5\n",
}


@pytest.mark.parametrize("content", DAMAGED_CONFIGS.values(), ids=DAMAGED_CONFIGS.keys())
def test_a_damaged_config_yaml_is_one_line_naming_it(run_dir, capsys, content):
    (run_dir / "config.yaml").write_bytes(content)
    expect_usage_error(capsys, ["--workdir", str(run_dir)], str(run_dir / "config.yaml"))


@pytest.mark.parametrize("content", DAMAGED_CONFIGS.values(), ids=DAMAGED_CONFIGS.keys())
def test_train_on_a_run_with_a_damaged_config_yaml_is_one_line(run_dir, capsys, content):
    from transformer.cli import train_main

    (run_dir / "config.yaml").write_bytes(content)
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        train_main(["--workdir", str(run_dir), "model.d_model=32", "model.n_layers=2", "model.n_heads=4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run_dir / "config.yaml") in err[0], err


@pytest.mark.parametrize("override", ["model.d_model=64", "model.n_layers=3", "model.vocab_size=1024"])
def test_overrides_that_change_parameter_shapes_are_refused_naming_the_key(run_dir, capsys, override):
    key = override.partition("=")[0]
    expect_usage_error(capsys, ["--workdir", str(run_dir), override], key)


@pytest.mark.parametrize(
    "override",
    # model.ffn_multiple=32 keeps the shapes: the saved config holds d_ff itself, resolved at training
    [
        "data.val_fraction=0.2",
        "mesh.data=1",
        "model.remat=full",
        "model.attention_impl=einsum",
        "model.ffn_multiple=32",
    ],
)
def test_overrides_that_keep_parameter_shapes_pass_the_check(run_dir, override):
    from transformer.eval.evaluate import run_config

    assert run_config(run_dir, [override]) is not None


def test_a_prompts_file_that_is_not_utf8_is_one_line(run_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"caf\xe9\n")
    expect_usage_error(capsys, ["--workdir", str(run_dir), "--prompts", str(prompts)], "--prompts")


def test_a_prompt_the_bpe_cannot_take_is_one_line_naming_it():
    from transformer.config import ConfigError
    from transformer.data.objectives import Vocab
    from transformer.data.tokenizer import train_bpe
    from transformer.eval.evaluate import encode_prompts

    tok = Vocab(train_bpe(iter(["hello world, a few words of text"] * 20), 300))
    bad = b"caf\xff".decode("utf-8", errors="surrogateescape")  # what argv holds for undecodable bytes
    with pytest.raises(ConfigError) as info:
        encode_prompts(tok, ["hello", bad])
    assert str(info.value).startswith("--generate:") and repr(bad) in str(info.value)
    assert encode_prompts(tok, ["hello"]) == [list(tok.tokenizer.encode_batch(["hello"])[0])]


@pytest.mark.slow
def test_a_shape_override_on_a_trained_run_is_one_line_not_an_orbax_traceback(trained, capsys):
    workdir, _ = trained
    expect_usage_error(capsys, ["--workdir", str(workdir), "model.d_model=64"], "model.d_model")


def test_a_run_this_backend_cannot_run_is_refused_naming_the_override_that_would(tmp_path):
    from transformer import rundir
    from transformer.config import ConfigError
    from transformer.eval.evaluate import run_config

    # a float16 run from a GPU, evaluated on a CPU, whose XLA has no float16 dot with float32 accumulation
    rundir.write_config(tmp_path, load_config(None, ["model.dtype=float16"]))
    with pytest.raises(ConfigError, match=r"model\.dtype: float16 compute is not supported on cpu"):
        run_config(tmp_path, [])
    assert run_config(tmp_path, ["model.dtype=float32"]).model.dtype == "float32"
