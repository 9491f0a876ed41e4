"""Sweep files: expansion (grid, zip, seeds, names), validation of every member before any runs,
the command line, and re-running a half-finished sweep."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, TINY_SWEEP, read_events

from transformer import rundir
from transformer.config import ConfigError
from transformer.config_loader import load_config, load_raw
from transformer.rundir import FINAL, status
from transformer.sweep import SweepError, expand
from transformer.train.preflight import work_per_step

BASE = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4}, "train": {"steps": 10}}


def sweep(spec: dict, base: dict = BASE, overrides=()):
    return expand({**base, "sweep": spec}, "test.yaml", tuple(overrides))


def test_grid_zip_and_seeds_expand_to_every_combination_with_unique_names():
    s = sweep(
        {
            "grid": {"model.norm_position": ["pre", "post"], "optim.lr": [1e-3, 3e-3, 1e-2]},
            "zip": [{"attention": ["mha", "mqa"], "model.n_kv_heads": [4, 1]}],
            "seeds": [0, 1],
        }
    )
    assert len(s.members) == 2 * 3 * 2 * 2
    assert len({m.name for m in s.members}) == len(s.members)
    assert s.keys == ("model.norm_position", "optim.lr", "attention", "model.n_kv_heads")
    assert s.compare == "model.norm_position"  # the first varied key that is not the learning rate
    seen = set()
    for m in s.members:
        cfg = m.config
        assert cfg.model.norm_position == m.values["model.norm_position"]
        assert cfg.optim.lr == m.values["optim.lr"]
        assert cfg.model.n_kv_heads == {"mha": 4, "mqa": 1}[m.labels["attention"]]  # zipped, not crossed
        assert cfg.train.seed == m.seed and m.name == f"{m.variant}-s{m.seed}"
        assert cfg.model.d_model == 32 and cfg.train.steps == 10  # the base is shared
        seen.add((cfg.model.norm_position, cfg.optim.lr, m.labels["attention"], m.seed))
    assert len(seen) == 24
    # members of a variant differ only in the seed
    variants = {}
    for m in s.members:
        variants.setdefault(m.variant, set()).add(m.seed)
    assert len(variants) == 12 and all(seeds == {0, 1} for seeds in variants.values())


def test_name_template_nested_grid_and_any_config_key():
    s = sweep({"grid": {"optim": {"lr": [1e-3, 1e-2]}}, "name": "lr{optim.lr:.0e}-d{model.d_model}"})
    assert [m.name for m in s.members] == ["lr1e-03-d32", "lr1e-02-d32"]
    assert s.keys == ("optim.lr",) and s.compare == "optim.lr"


def test_names_are_safe_directory_names_without_equals_signs():
    s = sweep(
        {
            "grid": {
                "model.attention_pattern": [["local", "global"]],
                "model.window": [8],
                "data.source": ["builtin:recall"],
            }
        }
    )
    (name,) = [m.name for m in s.members]
    assert "/" not in name and "=" not in name and ":" not in name, name


def test_no_sweep_values_is_one_member():
    s = sweep({"seeds": [3]})
    assert [(m.name, m.seed) for m in s.members] == [("run-s3", 3)]


@pytest.mark.parametrize(
    "spec, key, words",
    [
        ({"gird": {}}, "sweep.gird", "did you mean sweep.grid"),
        (
            {"grid": {"model.norm_postion": ["pre"]}},
            "sweep.grid.model.norm_postion",
            "did you mean model.norm_position",
        ),
        ({"grid": {"optim.lr": []}}, "sweep.grid.optim.lr", "non-empty list"),
        ({"grid": {"optim.lr": 1e-3}}, "sweep.grid.optim.lr", "non-empty list"),
        ({"grid": {"train.seed": [0, 1]}}, "sweep.grid.train.seed", "sweep.seeds"),
        ({"zip": [{"model.n_kv_heads": [4, 1], "model.window": [None]}]}, "sweep.zip[0]", "different lengths"),
        ({"grid": {"optim.lr": [1e-3]}, "zip": [{"optim.lr": [1e-2]}]}, "sweep", "swept twice"),
        ({"seeds": [0, 0]}, "sweep.seeds", "distinct integers"),
        ({"grid": {"optim.lr": [1e-3, 1e-2]}, "name": "fixed"}, "sweep.name", "both named 'fixed'"),
        ({"grid": {"optim.lr": [1e-3]}, "name": "{optim.lr}-{seed}"}, "sweep.name", "leave {seed} out"),
        ({"grid": {"optim.lr": [1e-3]}, "name": "{optim.rate}"}, "sweep.name", "neither a config key"),
        ({"grid": {"optim.lr": [1e-3]}, "name": "{optim.lr:.0q}"}, "sweep.name", "cannot format"),
        ({"grid": {"optim.lr": [1e-3]}, "compare": "model.ffn"}, "sweep.compare", "not a swept key"),
        ({"zip": [{"which": ["members"]}]}, "sweep.name", "reserved"),
    ],
)
def test_sweep_mistakes_name_the_key(spec, key, words):
    with pytest.raises(SweepError) as e:
        sweep(spec)
    assert e.value.key == key and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "name", ["report.html", "report.md", "sweep.json", "members", "logs", "plots", "-lr", "--help"]
)
def test_a_member_named_like_a_sweep_file_or_an_option_is_refused_before_anything_runs(name):
    """Such a member's directory would overwrite (or be overwritten by) the sweep's own files, or its
    path would read as an option on train.py's command line: refused at expansion, naming both."""
    with pytest.raises(SweepError) as e:
        sweep({"grid": {"optim.lr": [1e-3]}, "name": name})
    message = str(e.value)
    assert e.value.key == "sweep.name" and repr(name) in message and "\n" not in message, message


def test_an_invalid_member_is_refused_naming_the_member_and_the_key():
    with pytest.raises(ConfigError) as e:
        sweep({"grid": {"model.n_kv_heads": [4, 2, 3]}})  # 4 heads are not a multiple of 3 kv heads
    assert e.value.key == "model.n_kv_heads"
    assert "n_kv_heads-3" in str(e.value) and "sweep member" in str(e.value)


def test_overriding_a_swept_key_is_refused_other_overrides_apply_to_every_member(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE, "sweep": {"grid": {"optim.lr": [1e-3, 1e-2]}}}))
    with pytest.raises(SweepError, match="is swept"):
        expand(load_raw(path, ["optim.lr=0.1"]), str(path), ("optim.lr=0.1",))
    s = expand(load_raw(path, ["train.steps=7", "sweep.seeds=[1, 2]"]), str(path))
    assert len(s.members) == 4 and {m.config.train.steps for m in s.members} == {7}
    assert {m.seed for m in s.members} == {1, 2}


def test_builtin_studies_expand_and_validate():
    """Every shipped study is a valid sweep (all members validated), small enough to run on a CPU."""
    studies = sorted((ROOT / "configs" / "ablations").glob("*.yaml"))
    assert {p.stem for p in studies} >= {"norm_placement", "attention", "ffn", "positions"}
    for path in studies:
        s = expand(load_raw(path), str(path))
        assert len(s.members) >= 2, path
        for m in s.members:  # ~3.5 minutes at the ~30 GFLOP/s these small models reach on a 2-core CPU
            _, flops_per_step = work_per_step(m.config)  # of the objective's rows, an encoder's included
            assert m.config.train.steps * flops_per_step <= 6e12, m.name


def test_norm_placement_study_covers_the_issue_grid():
    s = expand(load_raw(ROOT / "configs/ablations/norm_placement.yaml"))
    values = {k: {repr(m.values[k]) for m in s.members} for k in s.keys}
    assert values["model.norm_position"] == {"'pre'", "'post'", "'sandwich'", "'deepnorm'"}
    assert len(values["optim.lr"]) >= 3 and len(values["model.n_layers"]) == 2
    assert any("0" == v for v in values["optim.warmup_steps"]) and len(values["optim.warmup_steps"]) == 2
    assert s.compare == "model.norm_position"


def test_attention_study_window_cannot_reach_the_recall_answers():
    """The sliding-window member's receptive field, L·(window-1), is shorter than the recall distance."""
    from transformer.synthetic import RecallTask

    s = expand(load_raw(ROOT / "configs/ablations/attention.yaml"))
    windowed = [m for m in s.members if m.config.model.window and m.config.data.source.startswith("builtin:recall")]
    assert windowed
    for m in windowed:
        task = RecallTask.parse(m.config.data.source.partition("recall")[2].lstrip(":"))
        assert m.config.model.n_layers * (m.config.model.window - 1) < task.distance
        assert task.doc_tokens + 1 <= m.config.data.seq_len


# --- the command line and running ------------------------------------------------------------------


def _train(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


TINY = {k: v for k, v in TINY_SWEEP.items() if k != "sweep"}


@pytest.mark.slow
def test_cli_refuses_an_invalid_member_before_running_any(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "sweep": {"grid": {"model.n_kv_heads": [2, 3]}}}))
    out = _train(path, "--workdir", tmp_path / "runs")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_kv_heads" in lines[0] and "n_kv_heads-3" in lines[0], out.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started or written


@pytest.mark.slow
def test_cli_print_commands_and_dry_run(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**TINY, "sweep": {"grid": {"optim.lr": [1e-3, 1e-2]}, "seeds": [0, 1]}}))
    dry = _train(path, "--dry-run")
    assert dry.returncode == 0 and dry.stdout.strip().endswith("4 members"), dry.stderr
    out = _train(path, "--workdir", tmp_path / "runs", "--print-commands")
    assert out.returncode == 0, out.stderr
    commands = [line.split() for line in out.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 4
    for cmd in commands:  # self-contained: a resolved member config and its own run directory
        assert cmd[0] == "python" and cmd[1] == "train.py" and cmd[3] == "--workdir"
        cfg = load_config(cmd[2])
        assert cfg.optim.lr in (1e-3, 1e-2) and cfg.train.seed in (0, 1)
    assert not any((tmp_path / "runs").glob("*/config.yaml"))  # nothing ran
    assert _train(path, "--parallel", "0").returncode == 2
    assert _train(TINY["base"], "--parallel", "2").returncode == 2  # not a sweep file


def test_member_status_reads_the_events(tmp_path):
    assert status(tmp_path / "none") == "pending"
    events = tmp_path / "events.jsonl"
    events.write_text('{"event": "start", "step": 0}\n')
    assert status(tmp_path) == "interrupted"
    events.write_text('{"event": "start", "step": 0}\n{"event": "end", "step": 9}\n{"event": "start", "st')
    assert status(tmp_path) == "finished"  # a torn last line is ignored
    assert status(tmp_path, steps=9) == "finished"
    assert status(tmp_path, steps=20) == "interrupted"  # train.steps raised: it continues
    events.write_text('{"event": "start", "step": 0}\n{"event": "stopped", "step": 4}\n')
    assert status(tmp_path) == "stopped" and "stopped" in FINAL


@pytest.mark.slow
@pytest.mark.xdist_group("sweep")
def test_rerunning_a_half_finished_sweep_runs_only_the_unfinished_members(tiny_sweep, tmp_path):
    """One member finished, one interrupted after its first checkpoint, one never started: the rerun
    leaves the first alone, resumes the second from its checkpoint, and runs the third."""
    workdir = tmp_path / "sweep"
    shutil.copytree(tiny_sweep, workdir)
    names = json.loads((workdir / "sweep.json").read_text())["members"]
    finished, interrupted, fresh = (workdir / m["name"] for m in names[:3])
    untouched = (finished / "events.jsonl").read_text()
    # interrupted: as if killed after the step-6 checkpoint
    shutil.rmtree(interrupted / "checkpoints" / "12")
    lines = (interrupted / "events.jsonl").read_text().splitlines()
    (interrupted / "events.jsonl").write_text("\n".join(line for line in lines if '"end"' not in line) + "\n")
    shutil.rmtree(fresh)
    shutil.rmtree(workdir / "plots")
    (workdir / "report.md").unlink()

    out = _train(workdir / "sweep.yaml", "--workdir", workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 already done, 2 to run" in out.stdout, out.stdout
    assert (finished / "events.jsonl").read_text() == untouched
    assert [e["step"] for e in read_events(interrupted, "resume")] == [6]
    assert read_events(interrupted, "end") and read_events(fresh, "end")
    assert len(read_events(fresh, "start")) == 1
    assert (workdir / "report.md").is_file() and (workdir / "plots" / "loss.png").is_file()

    again = _train(workdir / "sweep.yaml", "--workdir", workdir)  # all done: nothing runs, report rewritten
    assert again.returncode == 0 and "4 already done, 0 to run" in again.stdout, again.stdout


@pytest.mark.slow
def test_a_member_with_another_config_in_its_directory_is_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**TINY, "sweep": {"grid": {"optim.lr": [1e-3]}}}))
    member = tmp_path / "runs" / "lr-0.001"
    member.mkdir(parents=True)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**TINY, "model": {**TINY["model"], "d_model": 64}}))
    (member / "config.yaml").write_text(load_config(other).to_yaml())
    out = _train(path, "--workdir", tmp_path / "runs")
    assert out.returncode == 2 and "lr-0.001" in out.stderr and "model.d_model" in out.stderr, out.stderr
    assert not (member / "events.jsonl").exists()  # refused before anything ran


def test_a_member_whose_run_config_cannot_be_read_is_one_line_naming_it(tmp_path):
    """Another version's config (a key this one does not know) or a damaged one: refused before
    anything runs, the run directory as it was."""
    from transformer.sweep import prepare_sweep as prepare

    s = sweep({"grid": {"optim.lr": [1e-3]}})
    (member,) = s.members
    (tmp_path / member.name).mkdir()
    rundir.write_config(tmp_path / member.name, member.config)
    path = tmp_path / member.name / rundir.CONFIG
    written = path.read_text().replace("model:\n", "model:\n  from_a_later_version: 1\n", 1)
    path.write_text(written)
    with pytest.raises(SweepError, match=r"sweep member lr-0\.001: .*from_a_later_version.*new --workdir") as e:
        prepare(s, tmp_path)
    assert "\n" not in str(e.value) and path.read_text() == written


def test_a_member_leaving_the_dtype_to_auto_is_not_refused_for_the_dtype_its_run_recorded(tmp_path):
    """A run directory records the dtype auto chose where it ran; re-preparing the sweep leaves that
    to the member's own train.py (which knows its machine) and still refuses a change of shape."""
    from transformer.sweep import prepare_sweep as prepare

    s = sweep({"grid": {"optim.lr": [1e-3]}})
    (member,) = s.members
    assert member.config.model.dtype == "auto"
    (tmp_path / member.name).mkdir()
    for dtype in ("float32", "bfloat16"):
        rundir.write_config(tmp_path / member.name, _with_model(member.config, dtype=dtype))
        assert prepare(s, tmp_path) == {member.name: "pending"}
    rundir.write_config(tmp_path / member.name, _with_model(member.config, d_model=64))
    with pytest.raises(SweepError, match=r"lr-0\.001.*model\.d_model"):
        prepare(s, tmp_path)


def _with_model(cfg, **changes):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def test_ffn_study_compares_at_equal_parameter_count():
    from transformer.model.summary import count_params

    s = expand(load_raw(ROOT / "configs/ablations/ffn.yaml"))
    assert {m.config.model.ffn for m in s.members} == {"gelu", "swiglu", "geglu"}
    assert len({count_params(m.config.model) for m in s.members}) == 1


@pytest.mark.slow
def test_a_signal_stops_the_sweep_with_the_running_member_checkpointed(tmp_path):
    """SIGTERM to the sweep (a scheduler's preemption, or Ctrl-C) is passed to the running member,
    which checkpoints and exits 75; the sweep starts nothing more and exits 75 too."""
    import signal
    import time

    path = tmp_path / "s.yaml"
    spec = {
        **TINY,
        "train": {**TINY["train"], "steps": 20000, "eval_every": 10000},
        "checkpoint": {"every": 10000},
        "sweep": {"grid": {"optim.lr": [1e-3, 1e-2]}},
    }
    path.write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), str(path), "--workdir", str(runs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = runs / "lr-0.001"
    deadline = time.monotonic() + 240
    while (
        time.monotonic() < deadline
        and len((first / "metrics.jsonl").read_text().splitlines() if (first / "metrics.jsonl").exists() else []) < 20
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    (preempted,) = read_events(first, "preempted")
    assert preempted["checkpoint"] == preempted["step"] > 0  # the newest state is on disk
    assert status(first) == "interrupted"
    assert not (runs / "lr-0.01").exists()  # nothing more was started
    assert "run the same command to resume" in out
