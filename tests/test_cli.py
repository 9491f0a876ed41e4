import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from transformer.config import DEFAULT_CONFIG
from transformer.config_loader import load_config

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_LINES = ("parameters by component", "FLOPs per token", "KV cache per token")


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def resolved_config(stdout: str) -> dict:
    return yaml.safe_load(stdout.split("\n\n", 1)[0])


def assert_dry_run(result: subprocess.CompletedProcess, expected: dict) -> None:
    assert result.returncode == 0, result.stderr
    assert resolved_config(result.stdout) == expected
    for line in SUMMARY_LINES:
        assert line in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def assert_usage_error(result: subprocess.CompletedProcess, *names: str) -> None:
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0]
    assert result.returncode == 2


@pytest.mark.slow
def test_dry_run_prints_resolved_config_and_summary():
    assert_dry_run(train("--dry-run"), load_config().to_dict())


@pytest.mark.slow
def test_first_positional_may_be_an_override():
    overrides = ["model.n_layers=2", "optim.lr=3e-4"]
    result = train(*overrides, "--dry-run")
    assert_dry_run(result, load_config(None, overrides).to_dict())
    assert resolved_config(result.stdout)["model"]["n_layers"] == 2


@pytest.mark.slow
def test_config_file_and_overrides(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {DEFAULT_CONFIG}\nmodel:\n  n_layers: 3\n")
    overrides = ["model.n_heads=8", "model.window=null"]
    result = train(str(child), *overrides, "--dry-run")
    assert_dry_run(result, load_config(child, overrides).to_dict())
    assert resolved_config(result.stdout)["model"]["n_layers"] == 3


@pytest.mark.parametrize(
    "args, names",
    [
        (["model.n_head=4"], ["model.n_head", "model.n_heads"]),
        (["model.n_layers=abc"], ["model.n_layers"]),
        (["model.n_kv_heads=3"], ["model.n_kv_heads"]),
        (["does-not-exist.yaml"], ["does-not-exist.yaml"]),
        (["--bogus"], ["--bogus"]),
        (["configs/default.yaml", "model.n_layers"], ["model.n_layers"]),
    ],
    ids=["unknown-key", "wrong-type", "impossible-combination", "missing-file", "unknown-option", "malformed-override"],
)
@pytest.mark.slow
def test_user_mistake_exits_2_with_one_line(args, names):
    assert_usage_error(train(*args, "--dry-run"), *names)


@pytest.mark.slow
def test_invalid_yaml_exits_2_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n\td_model: 3\n")
    assert_usage_error(train(str(bad), "--dry-run"), f"{bad}:2")


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["model.dtype=float16"], ["model.dtype", "float16", "use bfloat16 or float32"]),
        (["model.attention_impl=cudnn", "model.dtype=bfloat16"], ["model.attention_impl", "use xla or einsum"]),
        # XLA's attention forms the scores (the default's blocked and cuDNN's never do)
        (
            ["data.seq_len=100000", "model.position=learned", "model.attention_impl=xla"],
            ["data.seq_len", "TB", "attention scores"],
        ),
    ],
    ids=["float16-on-cpu", "cudnn-without-cudnn", "attention-scores-beyond-memory"],
)
@pytest.mark.slow
def test_what_the_platform_cannot_run_is_refused_before_anything_is_built(overrides, names, tmp_path):
    result = train(*overrides, "--workdir", str(tmp_path / "run"))
    assert_usage_error(result, *names)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_first_override_longer_than_a_file_name_is_an_override():
    """Probing a 300-byte argument as a file path raised `OSError: File name too long`."""
    value = "x" * 300
    assert_usage_error(train(f"model.norm={value}", "--dry-run"), "model.norm", "layernorm, rmsnorm")
    assert_usage_error(train("y" * 300 + ".yaml", "--dry-run"), "File name too long")


@pytest.fixture
def config_only_run(tmp_path) -> Path:
    """A run directory with the default config and no checkpoint: what eval.py checks first."""
    from transformer import rundir

    rundir.write_config(tmp_path, load_config())
    return tmp_path


def eval_usage_error(capsys, *argv: str) -> str:
    from transformer.cli import eval_main

    with pytest.raises(SystemExit) as e:
        eval_main(list(argv))
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("flag", ["--seed", "--max-new-tokens", "--top-k"])
def test_eval_integers_beyond_32_bits_are_refused(capsys, config_only_run, flag):
    line = eval_usage_error(capsys, "--workdir", str(config_only_run), "--generate", "a", flag, str(2**40))
    assert flag in line and "32-bit" in line


def test_eval_top_k_beyond_the_vocabulary_is_refused(capsys, config_only_run):
    line = eval_usage_error(capsys, "--workdir", str(config_only_run), "--generate", "a", "--top-k", "1000")
    assert "--top-k 1000" in line and "vocabulary of 259" in line


def test_eval_kv_cache_beyond_memory_is_refused_with_the_figure(capsys, config_only_run):
    argv = ["--workdir", str(config_only_run), "--generate", "a", "--max-new-tokens", str(2**31 - 1)]
    line = eval_usage_error(capsys, *argv)
    assert "--max-new-tokens" in line and "TB" in line and "KV cache" in line
    # within the vocabulary and memory, sampling goes on to the checkpoint (this run has none)
    assert "no checkpoint" in eval_usage_error(capsys, *argv[:4], "--top-k", "259")


def test_runs_started_in_the_same_second_get_their_own_default_directories(tmp_path, monkeypatch):
    from transformer import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda fmt: "20261201-000000")
    first, second = cli._default_workdir("configs/x.yaml"), cli._default_workdir("configs/x.yaml")
    assert first == Path("runs/x-20261201-000000") and second == Path("runs/x-20261201-000000-2")
    assert first.is_dir() and second.is_dir()


def test_a_sigterm_before_training_starts_exits_as_preempted(tmp_path):
    """A scheduler's SIGTERM in the first seconds (imports, data, compile) exits 75, which SLURM
    requeues, not 143; nothing was trained, so the same command starts the run again."""
    import signal
    import time

    cmd = [
        sys.executable,
        "train.py",
        "model.n_layers=2",
        "model.d_model=64",
        "train.steps=3",
        "--workdir",
        str(tmp_path / "w"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stderr=subprocess.PIPE, text=True
    )
    time.sleep(1.0)  # in its imports: before the training loop's own handler
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    assert "run the same command" in proc.stderr.read()
