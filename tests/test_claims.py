"""Claims on a shared sweep directory: a member is claimed atomically, a live claim is respected, a
stale one is taken over by exactly one taker, and several runners on one directory run every member
exactly once, even when one of them is killed mid-member. (Two train.py on one --workdir are refused
by the run-directory lock: tests/test_rundir.py::test_a_second_trainer_on_one_workdir_is_refused_...)"""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, TINY_SWEEP, within

from transformer import rundir
from transformer.sweep.claims import Claim, claim_path, read_claim, run_claimed


def write_claim(member, host="elsewhere", pid=1, token="old", age=0.0, **more):
    path = claim_path(member)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "token": token, **more}))
    os.utime(path, (time.time() - age, time.time() - age))


def test_a_claim_is_exclusive_until_released(tmp_path):
    first, second = Claim(tmp_path / "m"), Claim(tmp_path / "m")
    assert first.try_acquire() is None
    holder = second.try_acquire()
    assert holder is not None and f"pid {os.getpid()} on host {socket.gethostname()}" in holder
    record, _ = read_claim(claim_path(tmp_path / "m"))
    assert record["token"] == first.token and record["host"] == socket.gethostname()
    first.release()
    assert not claim_path(tmp_path / "m").exists()
    assert second.try_acquire() is None
    second.release()


def test_a_live_claim_elsewhere_is_respected_a_silent_one_taken_over(tmp_path):
    write_claim(tmp_path / "m", age=5.0)
    claim = Claim(tmp_path / "m", stale_after=60)
    assert "host elsewhere" in claim.try_acquire()  # its heartbeat is recent: someone works on it
    write_claim(tmp_path / "m", age=120.0)
    assert claim.try_acquire() is None  # no heartbeat for two minutes: its holder is gone
    assert read_claim(claim_path(tmp_path / "m"))[0]["token"] == claim.token
    claim.release()
    write_claim(tmp_path / "m", host=socket.gethostname(), pid=dead_pid())  # a dead process here: at once
    assert Claim(tmp_path / "m", stale_after=60).try_acquire() is None


def test_a_requeued_slurm_task_takes_its_own_claim_back_at_once(tmp_path, monkeypatch):
    """A requeued array task runs on any node, while its earlier attempt's claim still looks alive."""
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    write_claim(tmp_path / "m", host="node3", pid=99, slurm_task="7_2")
    assert "host node3" in Claim(tmp_path / "m", stale_after=600).try_acquire()  # another task's member
    write_claim(tmp_path / "m", host="node3", pid=99, slurm_task="7_1")
    claim = Claim(tmp_path / "m", stale_after=600)
    assert claim.try_acquire() is None
    assert read_claim(claim_path(tmp_path / "m"))[0]["slurm_task"] == "7_1"
    claim.release()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_empty_claim_file_left_by_a_crash_goes_stale_too(tmp_path):
    claim_path(tmp_path / "m").parent.mkdir(parents=True)
    claim_path(tmp_path / "m").write_text("")
    assert Claim(tmp_path / "m", stale_after=60).try_acquire() is not None  # being written, as far as we know
    os.utime(claim_path(tmp_path / "m"), (time.time() - 120, time.time() - 120))
    assert Claim(tmp_path / "m", stale_after=60).try_acquire() is None


def _take(member, start, results, done):
    claim = Claim(member, stale_after=30)  # the old claim (100 s) is stale, the winner's fresh one not
    start.wait()
    won = claim.try_acquire() is None
    results.put((os.getpid(), won, claim.token))
    done.wait(timeout=60)  # hold it, alive, until every taker has tried (a loaded machine may start one late)


def test_a_stale_claim_is_taken_over_by_exactly_one_of_many(tmp_path):
    write_claim(tmp_path / "m", age=100.0)
    assert_taken_over_by_exactly_one(tmp_path / "m")


def assert_taken_over_by_exactly_one(member):
    ctx = multiprocessing.get_context("fork")
    start, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_take, args=(member, start, results, done)) for _ in range(6)]
    for p in procs:
        p.start()
    start.set()
    outcomes = [results.get(timeout=30) for _ in procs]
    done.set()
    for p in procs:
        p.join()
    winners = [o for o in outcomes if o[1]]
    assert len(winners) == 1, outcomes
    assert read_claim(claim_path(member))[0]["token"] == winners[0][2]


def test_a_holder_whose_claim_was_taken_over_is_told(tmp_path):
    lost = []
    claim = Claim(tmp_path / "m", heartbeat=0.05, on_lost=lambda: lost.append(True))
    assert claim.try_acquire() is None
    write_claim(tmp_path / "m", token="someone else")  # as a taker replaces it
    assert claim.lost.wait(5) and lost == [True]
    claim.release()
    assert read_claim(claim_path(tmp_path / "m"))[0]["token"] == "someone else"  # not ours to delete


def test_run_claimed_waits_for_the_holder_and_never_reruns_a_finished_member(tmp_path):
    member, runs = tmp_path / "m", []
    holder = Claim(member)
    assert holder.try_acquire() is None
    done = []
    finisher = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.3,))
    finisher.start()  # the holder finishes the member while run_claimed waits

    def is_done():
        if not finisher.is_alive() and not done:
            done.append(True)
            holder.release()
        return bool(done)

    lines = []
    assert run_claimed(member, is_done, lambda: runs.append(1) or 0, log=lines.append, poll=0.05) == 0
    assert runs == [] and "waiting" in lines[0] and "finished already" in lines[-1]
    assert run_claimed(tmp_path / "other", lambda: False, lambda: runs.append(1) or 7, poll=0.05) == 7
    assert runs == [1] and not claim_path(tmp_path / "other").exists()


# --- several real runners on one directory ---------------------------------------------------------


def kinds(member) -> list[str]:
    return [e["event"] for e in rundir.read_events(member) if e["event"] in ("start", "preempted", "end")]


def never_overlapping(events: list[str]) -> bool:
    """Each start is closed (preempted or ended) before the next: no two processes ran it at once."""
    open_runs = 0
    for kind in events:
        open_runs += 1 if kind == "start" else -1
        if open_runs not in (0, 1):
            return False
    return open_runs == 0


@pytest.mark.slow
def test_several_runners_run_every_member_once_and_take_over_a_killed_runners_member(tmp_path):
    spec = {
        **TINY_SWEEP,
        "train": {**TINY_SWEEP["train"], "steps": 40, "eval_every": 20},
        "checkpoint": {"every": 10, "async": False},
        "sweep": {"grid": {"model.norm_position": ["pre", "post"]}},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    argv = [sys.executable, str(ROOT / "train.py"), str(tmp_path / "sweep.yaml"), "--workdir", str(tmp_path)]
    runners = [
        subprocess.Popen([*argv, "--shared"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)  # two runners, two members: the property needs no more, and each costs CI a compile
    ]
    members = [tmp_path / f"norm_position-{p}" for p in ("pre", "post")]
    victim = wait_for_a_member_training(members, runners)
    runners[victim[0]].send_signal(signal.SIGKILL)  # mid-member: its member checkpoints on its death and stops
    outputs = [r.communicate(timeout=600)[0] for r in runners]
    survivors = [out for i, out in enumerate(outputs) if i != victim[0]]
    assert all(r.returncode == 0 for i, r in enumerate(runners) if i != victim[0]), survivors
    for member in members:
        events = kinds(member)
        assert events.count("end") == 1 and never_overlapping(events), (member.name, events)
    assert "preempted" in kinds(victim[1])  # the killed runner's member was stopped, then taken over...
    assert rundir.status(victim[1], 40) == "finished"  # ...and finished by another runner
    assert not any(claim_path(m).exists() for m in members)  # every claim let go
    assert (tmp_path / "report.md").is_file()


def wait_for_a_member_training(members, runners, timeout=300):
    """(index of the runner holding a member that has logged steps, that member)."""
    pids = [r.pid for r in runners]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for member in members:
            seen = read_claim(claim_path(member))
            if seen and seen[0].get("pid") in pids and len(rundir.read_metrics(member)) >= 3:
                return pids.index(seen[0]["pid"]), member
        time.sleep(0.05)
    raise AssertionError("no member started: " + " | ".join(r.stdout.read() for r in runners if r.poll() is not None))


# --- damaged claims and abandoned takeovers ------------------------------------------------------


def write_marker(member, token="old", level=1, age=0.0):
    marker = claim_path(member).with_name(f".claim.{token}.takeover" + (f".{level}" if level > 1 else ""))
    marker.write_text("")
    os.utime(marker, (time.time() - age, time.time() - age))
    return marker


def test_an_abandoned_takeover_marker_is_passed_over_a_fresh_one_respected(tmp_path):
    """A taker killed between creating its marker and replacing the claim left the member unclaimable."""
    write_claim(tmp_path / "m", age=100.0)
    marker = write_marker(tmp_path / "m", age=5.0)
    assert "taking over" in Claim(tmp_path / "m", stale_after=30).try_acquire()  # its taker is at work
    os.utime(marker, (time.time() - 100, time.time() - 100))
    second = write_marker(tmp_path / "m", level=2, age=100.0)  # and its successor died too
    claim = Claim(tmp_path / "m", stale_after=30)
    assert claim.try_acquire() is None
    assert read_claim(claim_path(tmp_path / "m"))[0]["token"] == claim.token
    assert not marker.exists() and not second.exists()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [".claim"]
    claim.release()


@pytest.mark.parametrize("levels", [1, 2])
def test_past_abandoned_markers_a_stale_claim_is_still_taken_over_by_exactly_one(tmp_path, levels):
    write_claim(tmp_path / "m", age=100.0)
    for level in range(1, levels + 1):
        write_marker(tmp_path / "m", level=level, age=100.0)
    assert_taken_over_by_exactly_one(tmp_path / "m")


def test_a_taker_whose_marker_was_judged_abandoned_backs_off(tmp_path, monkeypatch):
    """A taker frozen past the timeout between its marker and its replace: another took over meanwhile."""
    write_claim(tmp_path / "m", age=100.0)
    slow, quick = Claim(tmp_path / "m", stale_after=30), Claim(tmp_path / "m", stale_after=30)
    real = read_claim
    calls = []

    def frozen_between(path):  # the slow taker's second read: the quick one acts while it is frozen
        calls.append(path)
        if len(calls) == 2:
            for marker in tmp_path.glob("m/.claim.old.takeover*"):
                os.utime(marker, (time.time() - 100, time.time() - 100))
            monkeypatch.setattr("transformer.sweep.claims.read_claim", real)
            assert quick.try_acquire() is None
            write_claim(tmp_path / "m", token="old", age=100.0)  # as if the slow one read before the replace
        return real(path)

    monkeypatch.setattr("transformer.sweep.claims.read_claim", frozen_between)
    assert slow.try_acquire() is not None and not slow.held
    quick.release()


def test_a_claim_that_is_not_utf8_is_judged_by_its_age(tmp_path):
    claim_path(tmp_path / "m").parent.mkdir(parents=True)
    claim_path(tmp_path / "m").write_bytes(b"\xff\xfe\x80 not a record")
    assert read_claim(claim_path(tmp_path / "m"))[0] == {}
    assert "being written" in Claim(tmp_path / "m", stale_after=60).try_acquire()
    os.utime(claim_path(tmp_path / "m"), (time.time() - 120, time.time() - 120))
    assert Claim(tmp_path / "m", stale_after=60).try_acquire() is None


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_claim_that_is_not_a_file_is_refused_not_waited_on(tmp_path, kind):
    path = claim_path(tmp_path / "m")
    path.parent.mkdir(parents=True)
    {"directory": path.mkdir, "fifo": lambda: os.mkfifo(path), "symlink": lambda: path.symlink_to(tmp_path / "x")}[
        kind
    ]()
    error = within(10, lambda: run_claimed(tmp_path / "m", lambda: False, lambda: 0, poll=0.01))
    assert isinstance(error, rundir.Busy) and "damaged" in str(error), error
    assert str(path) in str(error) and "\n" not in str(error)


def test_train_claim_on_a_claim_directory_is_one_line_and_exit_2(tmp_path):
    claim_path(tmp_path / "w").mkdir(parents=True)
    argv = [sys.executable, str(ROOT / "train.py"), "train.steps=1", "--workdir", str(tmp_path / "w"), "--claim"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:") and ".claim" in lines[0], out.stderr


def test_a_runner_names_another_runners_claim_once_not_at_every_poll(tmp_path):
    """A member held by a live runner elsewhere is deferred at every poll; its holder is said once
    (the log said it hundreds of times a minute while a takeover marker was fresh)."""
    from transformer.sweep import load_sweep
    from transformer.sweep.runner import SweepRunner

    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({**TINY_SWEEP, "sweep": {"seeds": [0]}}))
    sweep = load_sweep(str(spec), [])
    (member,) = sweep.members
    write_claim(tmp_path / member.name, pid=4242, age=0.0)
    lines: list[str] = []
    runner = SweepRunner(sweep, tmp_path, {member.name: "pending"}, log=lines.append)
    for _ in range(5):
        assert runner.take(member) is False
    assert sum("left to it" in line for line in lines) == 1, lines
