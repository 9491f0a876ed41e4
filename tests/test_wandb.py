"""W&B logging (logging.wandb) in offline mode, with no network: the scalars of the W&B run, read back
from its offline run file, equal metrics.jsonl step by step (as TensorBoard's tags); the run carries
the config and is in its sweep's group. An online run without an API key is refused when it starts,
before any work, but its saved config still reads (those tests need no wandb and no network)."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformer import config as config_module
from transformer import rundir
from transformer.config import ConfigError
from transformer.config_loader import load_config
from transformer.train import wandb_sink
from transformer.train.job import run

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32768  # the offline run file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records


def records(path):
    """The protobuf Records of a W&B offline run file, reassembled from their chunks."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, chunks = path.read_bytes(), 7, b""  # 7: the file's header (":W&B", magic, version)
    while pos + 7 <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunks += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


@pytest.mark.slow
def test_offline_wandb_run_holds_the_same_scalars_as_metrics_jsonl_in_the_sweeps_group(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B logging's test needs wandb (pip install '.[wandb]')")
    monkeypatch.setenv("WANDB_SILENT", "true")
    study = tmp_path / "study"
    study.mkdir()
    (study / "sweep.json").write_text("{}")  # a sweep's directory: its members make one group
    cfg = load_config(
        None,
        [
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.n_kv_heads=2",
            "data.source=builtin:recall:train_docs=200,val_docs=20",
            "data.seq_len=32",
            "data.val_windows=2",
            "train.steps=6",
            "train.batch_size=4",
            "train.eval_every=3",
            "checkpoint.every=6",
            "logging.every=1",
            "logging.progress=false",
            "logging.wandb.mode=offline",
            "logging.wandb.project=ablations",
        ],
    )
    run(cfg, study / "member", log=lambda _: None)
    (path,) = (study / "member" / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb-core, a process of its own, may still be writing after finish() returned: wait for the exit record
    deadline = time.monotonic() + 60
    while not any(r.HasField("exit") for r in records(path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    history, runs = {}, []
    for record in records(path):
        if record.HasField("history"):
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif record.HasField("run"):
            runs.append(record.run)
    expected = {}
    for record in rundir.read_metrics(study / "member"):
        step = record.pop("step")
        expected.setdefault(step, {}).update(dict(rundir.scalar_tags(record)))
    assert sorted(history) == sorted(expected) == list(range(1, 7))
    for step, values in expected.items():
        assert history[step] == pytest.approx(values, rel=1e-12), step
    assert any("val_loss" in values for values in history.values())
    (meta,) = runs
    assert meta.run_group == "study" and meta.project == "ablations" and meta.display_name == "member"
    config = {item.key: json.loads(item.value_json) for item in meta.config.update}
    assert config["model"] == cfg.to_dict()["model"] and config["logging"]["wandb"]["mode"] == "offline"


# --- credentials: logging.wandb.mode=online needs an API key, found without wandb or the network ---

WANDB_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "NETRC")


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A home without a netrc, no W&B variables, and wandb taken as installed (whether it is or not)."""
    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # nor a ./wandb/settings
    monkeypatch.setattr(config_module, "_wandb_installed", lambda: True)
    return tmp_path


def online() -> None:
    """An online run's config read (it reads anywhere) and then checked as a run's start checks it."""
    cfg = load_config(None, ["logging.wandb.mode=online"])
    assert cfg.logging.wandb.mode == "online"
    wandb_sink.check_credentials(cfg)


def test_online_without_an_api_key_is_one_line_naming_the_key(no_credentials):
    with pytest.raises(ConfigError) as info:
        online()
    message = str(info.value)
    assert info.value.key == "logging.wandb.mode" and "API key" in message and "WANDB_API_KEY" in message
    assert "\n" not in message
    wandb_sink.check_credentials(load_config(None, ["logging.wandb.mode=offline"]))  # needs no key


def test_an_api_key_from_the_environment_or_netrc_is_enough(no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    online()
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = no_credentials / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    online()
    # the entry must be for the server the run logs to
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    with pytest.raises(ConfigError, match=r"wandb\.example\.com"):
        online()
    elsewhere = no_credentials / "elsewhere"
    elsewhere.write_text(f"machine wandb.example.com login user password {'k' * 40}\n")
    elsewhere.chmod(0o600)
    monkeypatch.setenv("NETRC", str(elsewhere))
    online()


@pytest.mark.slow
def test_online_without_an_api_key_exits_2_before_any_work(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in WANDB_ENV} | {"HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "train.py", "logging.wandb.mode=online", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: config: logging.wandb.mode:"), result.stderr
