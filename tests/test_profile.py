"""`logging.profile` / `--profile START:STOP`: a jax.profiler trace of those steps in the run directory."""

import gzip
import json

import pytest
from conftest import tiny_run_overrides, write_corpus

from transformer import cli
from transformer.config import ConfigError, LoggingConfig


def test_profile_writes_a_trace_of_the_window(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0, n=40)
    overrides = tiny_run_overrides(corpus, tmp_path / "cache", "model.n_layers=1", "train.steps=3")
    run = tmp_path / "run"
    assert cli.train_main([*overrides, "--workdir", str(run), "--profile", "1:2"]) == 0
    assert "profile of steps 1..1 written to" in capsys.readouterr().out
    (perfetto,) = run.glob("tb/plugins/profile/*/perfetto_trace.json.gz")
    assert list(perfetto.parent.glob("*.xplane.pb"))  # what TensorBoard's Profile tab reads
    events = json.loads(gzip.decompress(perfetto.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any("train_step" in str(e.get("name", "")) for e in events)  # the step ran inside the trace


@pytest.mark.parametrize("window", ["3:1", "2:2", "5", "a:b", "-1:3"])
def test_a_malformed_window_is_refused(window):
    with pytest.raises(ConfigError, match="profile"):
        LoggingConfig(profile=window)
    assert LoggingConfig(profile=" 2 : 5").profile_steps == (2, 5)
