"""W&B logging (logging.wandb) in offline mode, with no network: the scalars of the W&B run, read back
from its offline run file, equal metrics.jsonl step by step (as TensorBoard's tags); the run carries
the config and is in its sweep's group."""

import json
import struct
import time

import pytest

from transformer import rundir
from transformer.config_loader import load_config
from transformer.train.job import run

wandb = pytest.importorskip("wandb", reason="W&B logging's test needs wandb (pip install '.[wandb]')")
from wandb.proto import wandb_internal_pb2  # noqa: E402

BLOCK = 32768  # the offline run file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records


def records(path):
    """The protobuf Records of a W&B offline run file, reassembled from their chunks."""
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
