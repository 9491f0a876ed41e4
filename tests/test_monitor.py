"""Loss-spike monitoring and recovery: detection, skip, rollback, non-finite steps, fault records."""

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, final_params, logged, read_events, tiny_run_overrides, write_corpus

from transformer import rundir, sharding
from transformer.config import MonitorConfig
from transformer.config_loader import load_config
from transformer.data import prepare
from transformer.train.job import run
from transformer.train.monitor import Monitor, MonitorStop, Recovery
from transformer.train.trainer import Trainer, default_controls


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("monitor-corpus") / "docs.jsonl", seed=3, n=400)


def args(corpus, cache, *extra):
    return tiny_run_overrides(
        corpus,
        cache,
        "train.eval_every=1000",
        "checkpoint.every=10",
        "checkpoint.keep=3",
        "optim.warmup_steps=5",
        "optim.schedule=constant",
        "monitor.window=64",
        "monitor.threshold=8",
        "optim.lr=1e-3",
        *extra,
    )


def train_run(corpus, cache, workdir, *extra):
    run(load_config(None, args(corpus, cache, *extra)), workdir, log=lambda _: None)
    return workdir


events = read_events


def final_losses(workdir: Path) -> dict[int, float]:
    return logged(workdir, "loss")


# --- the monitor on its own ----------------------------------------------------------------------


def test_spike_detection_and_window_hygiene():
    monitor = Monitor(MonitorConfig(window=32, threshold=6.0))
    rng = np.random.default_rng(0)
    for step in range(1, 41):
        assert monitor.observe(step, 3.0 + 0.01 * rng.standard_normal(), 1.0 + 0.01 * rng.standard_normal()) is None
    spike = monitor.observe(41, 3.5, 1.0)
    assert spike.kind == "spike" and spike.loss_z > 6
    assert all(e[0] != 41 for e in monitor.window)  # anomalies never widen the band
    assert monitor.observe(42, 3.0, 1.5).kind == "spike"  # the gradient norm alone is enough
    assert monitor.observe(43, math.nan, 1.0).kind == "nonfinite"
    assert monitor.nonfinite_run == 1
    assert monitor.observe(44, 3.0, 1.0) is None and monitor.nonfinite_run == 0


def test_not_warm_no_spike_and_divergence_reported_once():
    monitor = Monitor(MonitorConfig(window=128, divergence_steps=3))
    assert monitor.observe(1, 2.0, 1.0) is None
    for step in range(2, 10):  # 100x the loss, but too few steps to judge: no spike
        found = monitor.observe(step, 200.0, 1.0)
        assert found is None or found.kind == "divergence"
    kinds = [monitor.observe(s, 5.0, 1.0) for s in range(10, 20)]
    assert [k for k in kinds if k is not None] == []  # divergence was reported once, at step 4
    fresh = Monitor(MonitorConfig(window=128, divergence_steps=3))
    got = [fresh.observe(s, loss, 1.0) for s, loss in enumerate([2.0, 3.0, 3.0, 3.0, 3.0], start=1)]
    assert [a.step for a in got if a is not None and a.kind == "divergence"] == [4]


def test_skip_limits_count_only_steps_up_to_the_asked_one():
    monitor = Monitor(MonitorConfig(window=16, threshold=2.0, on_spike="skip"))
    for step in range(1, 17):
        monitor.observe(step, float(step % 2), 1.0)
    assert monitor.limits(up_to=16) == pytest.approx((0.5 + 2 * 0.5, 1.0))
    assert monitor.limits(up_to=3) == (math.inf, math.inf)  # 3 steps: not warm
    assert Monitor(MonitorConfig(window=16, on_spike="log"), monitor.state()).limits(16) == (math.inf, math.inf)


def test_recovery_replay_skips_cooldowns_and_faults(tmp_path):
    journal = tmp_path / rundir.EVENTS
    lines = [
        {"event": "fault", "step": 50, "fault": "lr"},
        {"event": "rollback", "step": 40, "to_step": 40, "skip_batches": 20, "cooldown": 10, "lr_factor": 0.5},
        {"event": "rollback", "step": 30, "to_step": 30, "skip_batches": 5, "cooldown": 0, "lr_factor": 1.0},
    ]
    journal.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"event": "roll')  # a torn last line
    recovery = Recovery.replay(rundir.read_events(tmp_path))
    assert recovery.rollbacks == 2 and recovery.fired == {"lr"}
    # the second rollback (to 30) abandoned what the first recorded at 40
    assert recovery.skips == [(30, 5)] and recovery.cooldowns == []
    assert recovery.targets == [30]  # a checkpoint a rollback returned to is not judged sound again
    assert [recovery.batch_index(s) for s in (29, 30, 31)] == [29, 35, 36]
    assert recovery.skipped_batches() == [30, 31, 32, 33, 34]
    two = Recovery()
    two.rollback(40, 20, 10, 0.5)
    assert [two.lr_scale(s) for s in (39, 40, 49, 50)] == [1.0, 0.5, 0.5, 1.0]


def test_a_level_shift_restarts_the_window_instead_of_flagging_forever():
    monitor = Monitor(MonitorConfig(window=32, threshold=6.0))
    rng = np.random.default_rng(1)
    for step in range(1, 33):
        monitor.observe(step, 3.0 + 0.01 * rng.standard_normal(), 1.0 + 0.01 * rng.standard_normal())
    kinds = [monitor.observe(s, 5.0 + 0.01 * rng.standard_normal(), 1.0) for s in range(33, 60)]
    names = [k.kind if k else None for k in kinds]
    assert names[: monitor.warm_count - 1] == ["spike"] * (monitor.warm_count - 1)
    assert names[monitor.warm_count - 1] == "level_shift"
    assert set(names[monitor.warm_count :]) == {None}  # the new level is the new normal


def test_divergence_is_reported_even_when_every_step_is_a_spike():
    monitor = Monitor(MonitorConfig(window=32, divergence_steps=5))
    for step in range(1, 20):
        monitor.observe(step, 3.0 - 0.01 * step, 1.0)
    kinds = [monitor.observe(s, 50.0, 1.0) for s in range(20, 30)]
    assert [k.kind for k in kinds if k is not None].count("divergence") == 1


def test_a_step_the_jit_did_not_apply_is_a_spike():
    monitor = Monitor(MonitorConfig(window=32))
    assert monitor.observe(1, 3.0, 1.0, applied=False).kind == "spike"
    assert not monitor.window


def test_fault_replay_after_a_kill(tmp_path):
    journal = tmp_path / rundir.EVENTS
    journal.write_text(json.dumps({"event": "fault", "step": 40, "fault": "lr"}) + "\n")
    assert Recovery.replay(rundir.read_events(tmp_path), resume_step=41).fired == {"lr"}  # in the checkpoint's past
    assert (
        Recovery.replay(rundir.read_events(tmp_path), resume_step=40).fired == set()
    )  # killed before it was dealt with: again
    with open(journal, "a") as f:
        f.write(
            json.dumps(
                {"event": "rollback", "step": 40, "to_step": 40, "skip_batches": 3, "cooldown": 0, "lr_factor": 1.0}
            )
            + "\n"
        )
    assert Recovery.replay(rundir.read_events(tmp_path), resume_step=40).fired == {"lr"}  # recovered from: never again


# --- in the jitted step --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stepper(corpus, tmp_path_factory):
    cfg = load_config(None, args(corpus, tmp_path_factory.mktemp("cache")))
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
    cfg = cfg.with_vocab(data.vocab_size)
    trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    return trainer, data


def snapshot(state):
    return [np.asarray(x).copy() for x in jax.tree.leaves((state.params, state.opt_state))]


@pytest.mark.parametrize(
    "controls",
    [default_controls(loss_limit=0.0), default_controls(grad_limit=0.0), default_controls(nan_grads=True)],
    ids=["loss-above-limit", "grad-above-limit", "nan-gradients"],
)
def test_a_dropped_step_leaves_parameters_and_moments_bitwise_unchanged(stepper, controls):
    trainer, data = stepper
    state = trainer.init(jax.random.key(0))
    state, _ = trainer.train_step(state, trainer.put_batch(data.train_batch(0), 8), default_controls())
    before = snapshot(state)
    state, metrics = trainer.train_step(state, trainer.put_batch(data.train_batch(1), 8), controls)
    assert float(metrics["applied"]) == 0.0
    for a, b in zip(before, snapshot(state)):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 2  # the batch was consumed all the same
    state, metrics = trainer.train_step(state, trainer.put_batch(data.train_batch(2), 8), default_controls())
    assert float(metrics["applied"]) == 1.0
    assert any(not np.array_equal(a, b) for a, b in zip(before, snapshot(state)))


# --- whole runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("monitor-cache")


@pytest.fixture(scope="module")
def reference(corpus, cache, tmp_path_factory):
    return train_run(corpus, cache, tmp_path_factory.mktemp("reference") / "run", "train.steps=100")


@pytest.mark.slow
def test_injected_spike_rollback_recovers(corpus, cache, reference, tmp_path):
    workdir = train_run(
        corpus,
        cache,
        tmp_path / "run",
        "train.steps=100",
        "faults.lr_step=50",
        "faults.lr_multiplier=3000",
        "monitor.on_spike=rollback",
        "monitor.skip_batches=20",
        "monitor.cooldown=10",
        "monitor.lr_factor=0.5",
    )
    assert [e["step"] for e in events(workdir, "fault")] == [50]
    spikes = events(workdir, "spike")
    assert spikes and 51 <= spikes[0]["step"] <= 54, "detected within a few steps of the fault"
    assert spikes[0]["action"] == "rollback" and spikes[0]["batch"] >= 50 and len(spikes[0]["windows"]) == 8
    rollback = events(workdir, "rollback")[0]
    assert rollback["to_step"] == 50 and rollback["skip_batches"] == 20
    got, want = final_losses(workdir), final_losses(reference)
    # back on track: within 5% of the uninjected run, averaged over the last 20 steps
    tail = range(81, 101)
    assert abs(np.mean([got[s] for s in tail]) / np.mean([want[s] for s in tail]) - 1) < 0.05
    assert max(got[s] for s in range(60, 101)) < 1.5 * max(want[s] for s in range(60, 101))


@pytest.mark.slow
def test_skip_mode_drops_the_spike_step(corpus, cache, tmp_path):
    workdir = train_run(
        corpus,
        cache,
        tmp_path / "run",
        "train.steps=80",
        "faults.corrupt_step=70",
        "faults.corrupt_kind=repeated",
        "monitor.on_spike=skip",
    )
    records = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "applied" in r:
            records[r["step"]] = r
    assert records[71]["applied"] == 0.0, "the corrupt batch's update was applied"
    assert sum(r["applied"] == 0.0 for r in records.values()) <= 3
    assert any(e["action"] == "skipped" and e["step"] == 71 for e in events(workdir, "spike"))


@pytest.mark.slow
def test_nan_gradients_never_reach_parameters_or_checkpoints(corpus, cache, reference, tmp_path):
    from transformer.io.checkpoint import load

    workdir = train_run(corpus, cache, tmp_path / "run", "train.steps=40", "faults.nan_step=25")
    nonfinite = events(workdir, "nonfinite")
    assert [e["step"] for e in nonfinite] == [26] and nonfinite[0]["action"] == "not applied"
    _, model = load(workdir)
    from flax import nnx

    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.slow
def test_consecutive_nonfinite_steps_stop_the_run(corpus, cache, tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(MonitorStop, match=r"3 non-finite steps in a row \(monitor.max_nonfinite = 3\)") as stop:
        train_run(
            corpus,
            cache,
            workdir,
            "train.steps=40",
            "optim.lr=1e30",
            "optim.name=sgd",
            "optim.clip_norm=null",
            "optim.warmup_steps=0",
            "monitor.max_nonfinite=3",
        )
    assert [e["action"] for e in events(workdir, "nonfinite")] == ["not applied"] * 3
    # lr 1e30: applied updates made the parameters non-finite; the message must not deny it
    message = str(stop.value)
    assert "no bad update was applied" not in message
    assert "none of them was applied" in message and "applied before step" in message, message
    assert not [p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]  # nothing bad was saved


@pytest.mark.slow
def test_recovery_records_survive_a_kill(corpus, cache, tmp_path):
    """Killed after a rollback: the resumed run does not fire the fault again, keeps the skipped
    batches, ends where an unkilled run with the same rollback ends, and its metrics are the
    unkilled run's, row for row: the abandoned trajectory's rows (its anomalous step's) included."""
    extra = (
        "train.steps=70",
        "faults.lr_step=40",
        "faults.lr_multiplier=3000",
        "monitor.on_spike=rollback",
        "monitor.skip_batches=20",
        "checkpoint.async=false",
    )
    straight = train_run(corpus, cache, tmp_path / "straight", *extra)
    workdir = tmp_path / "killed"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args(corpus, cache, *extra), "--workdir", str(workdir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while (
        not (workdir / "events.jsonl").exists() or '"event": "rollback"' not in (workdir / "events.jsonl").read_text()
    ):
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    train_run(corpus, cache, workdir, *extra)
    assert [e["step"] for e in events(workdir, "fault")] == [40]  # fired once, not again after the resume
    assert len(events(workdir, "rollback")) == len(events(straight, "rollback")) == 1
    got, want = final_losses(workdir), final_losses(straight)
    assert {s: got[s] for s in range(41, 71)} == {s: want[s] for s in range(41, 71)}
    rows = [[(r["step"], r["loss"]) for r in rundir.read_metrics(w) if "loss" in r] for w in (workdir, straight)]
    assert rows[0] == rows[1]
    steps = [s for s, _ in rows[1]]
    assert any(b < a for a, b in itertools.pairwise(steps))  # the abandoned rows are there, before the rollback


# --- false spikes on clean data (issue 18, "Monitor") ---------------------------------------------

# The monitor's defaults (window 128, threshold 6) on the module's corpus (an epoch is ~230 batches).
# Measured: a clean 500-step run with on_spike=rollback rolls back at step 265 (grad_z 8.0, loss_z
# -1.6); after an injected lr x1000 spike at step 100, the run rolls back again at 203, 235 and 236
# (grad_z 6.2-6.9, loss_z < 0) and stops with its rollbacks spent. The window's content after a
# rollback is not the cause: started afresh at the rollback, the second rollback still comes (at 297).
# Gradient norms in the later epochs are heavy-tailed, and mean + 6 std of a 128-step window flags
# ordinary batches whose loss is at or below the mean; a rollback's 200 skipped batches reach those
# epochs 200 steps sooner. Judged in log space (monitor._log), the largest z of the clean run is ~4.5.
FALSE_SPIKES = ("train.steps=280", "monitor.window=128", "monitor.threshold=6", "monitor.on_spike=rollback")


@pytest.mark.slow
def test_clean_data_never_rolls_back(corpus, cache, tmp_path):
    workdir = train_run(corpus, cache, tmp_path / "run", *FALSE_SPIKES)
    assert events(workdir, "rollback") == [], events(workdir, "spike")


@pytest.mark.slow
def test_one_injected_spike_rolls_back_exactly_once(corpus, cache, tmp_path):
    workdir = train_run(
        corpus, cache, tmp_path / "run", *FALSE_SPIKES, "faults.lr_step=100", "faults.lr_multiplier=1000"
    )
    assert [r["to_step"] for r in events(workdir, "rollback")] == [100], events(workdir, "spike")


# --- the rollback target (issue 18, "Monitor") ----------------------------------------------------

# The loss logged at step d comes from the parameters after d - 1 updates on data batch d - 1: a spike
# there is either a bad batch (checkpoint d - 1 is sound) or a bad update d - 1 (checkpoint d - 1
# holds it). When checkpoint d - 1 exists, its parameters are judged on the batch of the last normal step.
ROLLBACK = ("train.steps=50", "monitor.on_spike=rollback", "monitor.skip_batches=5", "checkpoint.async=false")


def rollback_events(workdir: Path) -> list[dict]:
    return [{k: e[k] for k in ("step", "to_step", "checkpoint_sound")} for e in events(workdir, "rollback")]


@pytest.mark.slow
def test_a_corrupt_batch_right_after_a_checkpoint_rolls_back_to_that_checkpoint(corpus, cache, tmp_path):
    workdir = train_run(
        corpus, cache, tmp_path / "run", *ROLLBACK, "faults.corrupt_step=40", "faults.corrupt_kind=repeated"
    )
    assert [e["step"] for e in events(workdir, "spike")][:1] == [41]
    # checkpoint 40 holds clean parameters (batch 40 was trained after it): not 30
    assert rollback_events(workdir) == [{"step": 40, "to_step": 40, "checkpoint_sound": True}]


@pytest.mark.slow
def test_a_bad_update_saved_in_the_checkpoint_rolls_back_past_it(corpus, cache, tmp_path):
    workdir = train_run(corpus, cache, tmp_path / "run", *ROLLBACK, "faults.lr_step=39", "faults.lr_multiplier=3000")
    assert [e["step"] for e in events(workdir, "spike")][:1] == [41]
    # the update of step 39 (lr x3000) is in checkpoint 40: back to 30
    assert rollback_events(workdir) == [{"step": 30, "to_step": 30, "checkpoint_sound": False}]


@pytest.mark.slow
def test_batches_made_ahead_train_the_same_run_through_a_rollback_and_skips(corpus, cache, tmp_path):
    """The feed guesses the next steps' batches; a rollback that skips batches proves guesses wrong
    (they are dropped) and a corrupting fault replaces one: bit for bit the run made on demand."""
    fault = (*ROLLBACK, "faults.corrupt_step=40", "faults.corrupt_kind=repeated")
    runs = {
        depth: train_run(corpus, cache, tmp_path / f"p{depth}", *fault, f"data.prefetch={depth}") for depth in (0, 3)
    }
    assert (
        rollback_events(runs[0]) == rollback_events(runs[3]) == [{"step": 40, "to_step": 40, "checkpoint_sound": True}]
    )
    assert final_losses(runs[0]) == final_losses(runs[3])
    for a, b in zip(final_params(runs[0]), final_params(runs[3]), strict=True):
        np.testing.assert_array_equal(a, b)


# Measured (lr x1000 at step 50 of 100, the mean loss of steps 81-100): clean 2.636, rollback 2.634
# (ratio 0.999), skip 3.352 (1.27: the update is applied one step before the spike shows, then 16
# steps are dropped until the window restarts at the new level), log 2.738 (1.04).
@pytest.mark.slow
def test_rollback_undoes_an_applied_bad_update_and_skip_cannot(corpus, cache, reference, tmp_path):
    fault = ("train.steps=100", "faults.lr_step=50", "faults.lr_multiplier=1000")
    want = final_losses(reference)
    tail = range(81, 101)

    def ratio(workdir: Path) -> float:
        got = final_losses(workdir)
        return float(np.mean([got[s] for s in tail]) / np.mean([want[s] for s in tail]))

    rolled = train_run(
        corpus, cache, tmp_path / "rollback", *fault, "monitor.on_spike=rollback", "monitor.skip_batches=20"
    )
    skipped = train_run(corpus, cache, tmp_path / "skip", *fault, "monitor.on_spike=skip")
    assert [r["to_step"] for r in events(rolled, "rollback")] == [50]
    assert abs(ratio(rolled) - 1) < 0.03, ratio(rolled)
    assert ratio(skipped) > 1.1, ratio(skipped)  # the bad update stays in the parameters
