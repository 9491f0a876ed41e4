"""The run directory: its journals, its one writer (the lock), and runs that end at any moment —
killed before the first checkpoint, during the first save, beside a second trainer, inside a sweep —
and are run again with the same command."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY_SWEEP, assert_bitwise_equal, final_params, tiny_run_overrides, within, write_corpus

from transformer import rundir
from transformer.config import ConfigError
from transformer.config_loader import load_config
from transformer.train.job import resume_changes, run

# --- journals --------------------------------------------------------------------------------------


def test_readers_skip_a_torn_line_and_truncate_drops_later_steps(tmp_path):
    (tmp_path / rundir.METRICS).write_text('{"step": 1, "loss": 2}\n{"step": 2, "loss": 1}\n{"step": 3, "lo')
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [1, 2]
    assert rundir.truncate_metrics(tmp_path, 1) == 2  # step 2 and the torn line
    assert (tmp_path / rundir.METRICS).read_text() == '{"step": 1, "loss": 2}\n'
    assert rundir.truncate_metrics(tmp_path, 0) == 1 and (tmp_path / rundir.METRICS).read_text() == ""


def test_truncate_keeps_the_rows_of_trajectories_rollbacks_abandoned(tmp_path):
    """Steps 1-3, a rollback to step 1 (the file was `history` bytes then), steps 2-3 again, a torn
    line: a resume from step 2 keeps the abandoned rows 2 and 3 and drops only what comes after."""
    before = '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    (tmp_path / rundir.METRICS).write_text(before + '{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    assert rundir.truncate_metrics(tmp_path, 2, history=len(before)) == 2
    assert (tmp_path / rundir.METRICS).read_text() == before + '{"step": 2}\n'


def test_status_follows_the_events():
    assert rundir.run_status([]) == "pending"
    assert rundir.run_status([{"event": "start"}]) == "interrupted"
    assert rundir.run_status([{"event": "start"}, {"event": "end", "step": 10}], steps=10) == "finished"
    assert rundir.run_status([{"event": "start"}, {"event": "end", "step": 10}], steps=20) == "interrupted"


# --- the lock --------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    with rundir.RunLock(tmp_path / "run"):
        holder = rundir.lock_holder(tmp_path / "run")
        assert holder is not None and f"pid {os.getpid()}" in holder and socket.gethostname() in holder
        with pytest.raises(rundir.Busy, match=f"pid {os.getpid()} on host {socket.gethostname()}") as e:
            rundir.RunLock(tmp_path / "run").acquire()
        assert "\n" not in str(e.value)
    assert rundir.lock_holder(tmp_path / "run") is None  # released
    with rundir.RunLock(tmp_path / "run"):  # and can be taken again
        pass


def test_a_directory_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("a file where the run directory should be")
    with pytest.raises(rundir.Busy, match=r"cannot write to .*file"):
        rundir.RunLock(tmp_path / "file").acquire()


def test_probing_an_unlocked_directory_creates_nothing(tmp_path):
    assert rundir.lock_holder(tmp_path / "nothing") is None
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize("name", [rundir.LOCK, rundir.METRICS, rundir.EVENTS])
def test_a_symlink_in_the_run_directory_is_refused_not_written_through(tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(victim)
    with pytest.raises(rundir.Busy, match="symbolic link") as e:
        with rundir.RunLock(tmp_path / "run"):
            rundir.RunWriter(tmp_path / "run", True, tensorboard=False).event("start", 0)
    assert str(tmp_path / "run" / name) in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "DATA\n"
    assert rundir.lock_holder(tmp_path / "run") is None  # nor is it probed through


@pytest.mark.parametrize("name", [rundir.LOCK, rundir.METRICS])
def test_a_fifo_or_directory_in_the_run_directory_is_refused_in_one_line(tmp_path, name):
    for kind, make in (("fifo", os.mkfifo), ("dir", os.mkdir)):
        run = tmp_path / kind
        run.mkdir()
        make(run / name)
        error = within(10, lambda run=run: write_through(run))  # a FIFO with no reader would block for good
        assert isinstance(error, rundir.Busy) and "not a regular file" in str(error), error
        assert str(run / name) in str(error) and "\n" not in str(error)


def write_through(run: Path) -> None:
    with rundir.RunLock(run):
        rundir.RunWriter(run, True, tensorboard=False).close()


def test_config_and_truncated_metrics_replace_a_symlink_never_write_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text('{"step": 5}\n')
    (tmp_path / "run").mkdir()
    for name in (rundir.CONFIG, rundir.METRICS):
        (tmp_path / "run" / name).symlink_to(victim)
    rundir.write_config(tmp_path / "run", load_config(None, ["train.steps=3"]))
    rundir.truncate_metrics(tmp_path / "run", 0)
    assert victim.read_text() == '{"step": 5}\n'
    assert not any((tmp_path / "run" / n).is_symlink() for n in (rundir.CONFIG, rundir.METRICS))


HOLD = "import sys, time; from pathlib import Path; from transformer import rundir; " + (
    "rundir.RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"
)


def test_a_lock_whose_holder_was_killed_does_not_block(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert f"pid {holder.pid}" in rundir.lock_holder(tmp_path)
    with pytest.raises(rundir.Busy):
        rundir.RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    assert f'"pid": {holder.pid}' in (tmp_path / rundir.LOCK).read_text()  # its record is left behind...
    with rundir.RunLock(tmp_path):  # ...and means nothing: the kernel dropped the lock with its holder
        assert f'"pid": {os.getpid()}' in (tmp_path / rundir.LOCK).read_text()


# --- start over or refuse: the directory of a run that never checkpointed ------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("rundir-corpus") / "docs.jsonl", seed=1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rundir-cache")


STEPS = 60


def args(corpus, cache, *extra):
    return tiny_run_overrides(
        corpus,
        cache,
        f"train.steps={STEPS}",
        "train.eval_every=20",
        "checkpoint.every=50",
        "optim.warmup_steps=5",
        *extra,
    )


def test_a_run_without_checkpoints_is_started_over_unless_of_another_config(corpus, cache, tmp_path):
    cfg = load_config(None, args(corpus, cache))
    (tmp_path / rundir.METRICS).write_text('{"step": 1, "loss": 5.0}\n')  # killed before its first checkpoint
    assert resume_changes(cfg, tmp_path) is None  # a fresh start, not a refusal
    rundir.write_config(tmp_path, load_config(None, args(corpus, cache, "train.steps=20")))
    assert resume_changes(cfg, tmp_path) is None  # a safe change: still ours to start over
    rundir.write_config(tmp_path, load_config(None, args(corpus, cache, "data.prefetch=0")))
    assert resume_changes(cfg, tmp_path) is None  # prefetching changes no batch
    rundir.write_config(tmp_path, load_config(None, args(corpus, cache, "model.d_model=64")))
    with pytest.raises(ConfigError, match=r"another config.*d_model"):
        resume_changes(cfg, tmp_path)


def test_a_saved_float32_run_is_the_same_config_as_auto_on_a_cpu(corpus, cache, tmp_path):
    """Runs saved before `model.dtype: auto` say float32: on a CPU, auto computes that, so they
    still resume; a dtype that changes what is computed here is refused, naming the key."""
    cfg = load_config(None, args(corpus, cache))
    assert cfg.model.dtype == "auto"
    (tmp_path / rundir.METRICS).write_text('{"step": 1, "loss": 5.0}\n')
    rundir.write_config(tmp_path, load_config(None, args(corpus, cache, "model.dtype=float32")))
    assert resume_changes(cfg, tmp_path) is None
    rundir.write_config(tmp_path, load_config(None, args(corpus, cache, "model.dtype=bfloat16")))
    with pytest.raises(ConfigError, match=r"model\.dtype: 'bfloat16' -> 'float32'"):
        resume_changes(cfg, tmp_path)


# --- end to end ------------------------------------------------------------------------------------

TIMING = {"step_time", "tokens_per_s", "tflops_per_device", "mfu"}  # wall-clock figures differ run to run


def trajectory(workdir: Path) -> list[dict]:
    """The metrics file, record by record, without its wall-clock figures."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rundir.read_metrics(workdir)]


def assert_same_run(workdir: Path, reference: Path):
    """Bitwise the same final parameters, and the same metrics file (apart from timings)."""
    assert trajectory(workdir) == trajectory(reference)
    assert [r["step"] for r in rundir.read_metrics(workdir) if "loss" in r] == list(range(1, STEPS + 1))
    assert_bitwise_equal(final_params(workdir), final_params(reference))


@pytest.fixture(scope="module")
def straight(corpus, cache, tmp_path_factory):
    """The uninterrupted reference."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    run(load_config(None, args(corpus, cache)), workdir, log=lambda _: None)
    return workdir


def env():
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def start(argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *argv],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def cli(*argv):
    return subprocess.run(
        [sys.executable, "train.py", *argv], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )


def wait_until(condition, proc: subprocess.Popen | None = None, timeout=300, what="the condition"):
    deadline = time.time() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {what}: {proc.stderr.read()[-3000:]}")
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.01)


def checkpoints(workdir: Path) -> list[str]:
    directory = workdir / rundir.CHECKPOINTS
    return sorted(p.name for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def kinds(workdir: Path) -> list[str]:
    return [e["event"] for e in rundir.read_events(workdir)]


@pytest.mark.slow
def test_sigkill_before_the_first_checkpoint_then_the_same_command_finishes_as_if_uninterrupted(
    corpus, cache, straight, tmp_path
):
    workdir = tmp_path / "run"
    proc = start([*args(corpus, cache), "--workdir", str(workdir)])
    wait_until(lambda: len(rundir.read_metrics(workdir)) >= 2, proc, what="two metrics lines")
    proc.kill()
    proc.wait()
    assert not checkpoints(workdir), "the first checkpoint was written before the kill: the test missed its moment"
    assert f'"pid": {proc.pid}' in (workdir / rundir.LOCK).read_text()  # the dead holder's record stays
    out = cli(*args(corpus, cache), "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert kinds(workdir) == ["start", "restart", "start", "end"]
    restart = rundir.read_events(workdir, "restart")[0]
    assert restart["dropped_metrics"] >= 2 and "no checkpoint" in restart["reason"]
    assert_same_run(workdir, straight)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_sigkill_during_the_first_save_then_the_same_command_finishes(corpus, cache, straight, tmp_path, delay):
    """Asynchronous saves every 2 steps: a kill shortly after the run starts lands in or around the
    first save (the delays vary where)."""
    workdir = tmp_path / "run"
    proc = start([*args(corpus, cache, "checkpoint.every=2", "checkpoint.async=true"), "--workdir", str(workdir)])
    wait_until(lambda: "start" in kinds(workdir), proc, what="the start event")
    time.sleep(delay)
    proc.kill()
    proc.wait()
    out = cli(*args(corpus, cache, "checkpoint.every=2", "checkpoint.async=true"), "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert kinds(workdir)[-2:] == ["start", "end"]
    assert_same_run(workdir, straight)


@pytest.mark.slow
def test_killed_after_the_final_checkpoint_the_same_command_journals_the_end(corpus, cache, straight, tmp_path):
    """A kill between the final save and the `end` event (found by benchmarks/reliability.py): the
    rerun was refused as "already trained" (exit 2, which stops a sweep); it ends the run instead, and
    the same command once more has nothing to do (exit 0)."""
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    lines = (workdir / rundir.EVENTS).read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "end"
    (workdir / rundir.EVENTS).write_text("".join(line + "\n" for line in lines[:-1]))
    assert rundir.status(workdir, STEPS) == "interrupted"
    out = cli(*args(corpus, cache), "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert kinds(workdir) == ["start", "resume", "end"]
    ended, reference = rundir.read_events(workdir, "end")[0], rundir.read_events(straight, "end")[0]
    assert {k: v for k, v in ended.items() if k != "time"} == {k: v for k, v in reference.items() if k != "time"}
    assert_same_run(workdir, straight)
    again = cli(*args(corpus, cache), "--workdir", str(workdir))  # now it is finished: said so, as before
    assert again.returncode == 0 and "already trained to step 60; nothing to do" in again.stdout, again.stderr


@pytest.mark.slow
def test_a_second_trainer_on_one_workdir_is_refused_in_one_line_naming_the_first(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "run"
    first = start([*args(corpus, cache), "--workdir", str(workdir)])
    wait_until(lambda: f"pid {first.pid}" in (rundir.lock_holder(workdir) or ""), first, what="the lock")
    first.send_signal(signal.SIGSTOP)  # hold it there, lock and all, while the second one tries
    try:
        second = cli(*args(corpus, cache), "--workdir", str(workdir))
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert f"pid {first.pid} on host {socket.gethostname()}" in lines[0] and str(workdir) in lines[0]
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert kinds(workdir) == ["start", "end"]
    assert_same_run(workdir, straight)  # the first run lost nothing to the second


def test_train_refuses_a_symlinked_lock_in_one_line_and_leaves_its_target(corpus, cache, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / rundir.LOCK).symlink_to(victim)
    out = cli(*args(corpus, cache, "train.steps=2"), "--workdir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0] and rundir.LOCK in lines[0], out.stderr
    assert victim.read_text() == "DATA\n"


def member_dir(workdir: Path) -> Path:
    return workdir / "norm_position-pre"


@pytest.mark.slow
def test_a_sweep_killed_at_once_takes_its_member_down_and_a_rerun_completes_it(tmp_path):
    spec = {
        **TINY_SWEEP,
        "train": {**TINY_SWEEP["train"], "steps": 400, "eval_every": 200},
        "checkpoint": {"every": 100, "async": False},
        "sweep": {"grid": {"model.norm_position": ["pre"]}},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    argv = [str(tmp_path / "sweep.yaml"), "--workdir", str(tmp_path)]
    sweep = start(argv, start_new_session=True)  # its own group: killed as a scheduler kills a job
    member = member_dir(tmp_path)
    wait_until(lambda: "start" in kinds(member), sweep, what="the member's start")
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    # the member was told (SIGTERM on its parent's death): it checkpoints, journals it, and exits
    wait_until(lambda: rundir.lock_holder(member) is None, timeout=120, what="the member's exit")
    assert "preempted" in kinds(member) and "end" not in kinds(member)
    out = cli(*argv)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert rundir.status(member, 400) == "finished"
    assert kinds(member)[-3:] == ["resume", "start", "end"]


@pytest.mark.slow
def test_a_sweep_rerun_waits_for_a_member_still_held_then_runs_it(tmp_path):
    spec = {**TINY_SWEEP, "sweep": {"grid": {"model.norm_position": ["pre"]}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.replace("600", "8"), str(member_dir(tmp_path))], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"  # an orphan of an earlier sweep, as far as the rerun knows
    out = cli(str(tmp_path / "sweep.yaml"), "--workdir", str(tmp_path))
    holder.wait()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"waiting for pid {holder.pid}" in out.stdout
    assert kinds(member_dir(tmp_path)) == ["start", "end"]


@pytest.mark.slow
def test_a_second_sweep_on_one_directory_is_refused(tmp_path):
    spec = {**TINY_SWEEP, "sweep": {"grid": {"model.norm_position": ["pre"]}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    with rundir.RunLock(tmp_path):  # a sweep running there
        out = cli(str(tmp_path / "sweep.yaml"), "--workdir", str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"pid {os.getpid()}" in out.stderr
    assert not member_dir(tmp_path).exists()


@pytest.mark.slow
def test_kills_at_random_moments_resume(tmp_path):
    """The suite's small version of benchmarks/reliability.py (which runs more trials), with its two
    hostile cases: a dead runner's claim and takeover marker, and another run's checkpoints."""
    out = subprocess.run(
        [sys.executable, "benchmarks/reliability.py", "--trials", "2", "--sweeps", "1", "--workdir", str(tmp_path)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "trials": 2,
        "held": 2,
        "sweep_trials": 1,
        "sweep_held": 1,
        "claim_held": True,
        "swap_refused": True,
    }
