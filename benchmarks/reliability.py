"""Kills at random moments: does running the same command again always end as an uninterrupted run?

    python benchmarks/reliability.py [--trials 8] [--seed 0] [--workdir DIR]

Trains a tiny model twice without interruption (the reference, and a run that times the others and
checks that two uninterrupted runs agree), then, per trial, starts the same
`train.py` command in a fresh directory, SIGKILLs it at a random moment and runs the command again
(as often as it asks: exit 75 means "run it again"). A trial holds when the rerun exits 0 (a run
killed after its `end` event has nothing to do, and says so) with bitwise the reference's final
parameters and the reference's metrics file (timings aside). Even
trials pick the moment over the whole life of the process (start-up, compile, training, saving),
odd ones over its training phase alone (from the `start` event on), where the saves are. Prints one
line per trial (the moment and what the kill left on disk). Then `--sweeps` trials do the same to
a two-member sweep, SIGKILLing its whole process group (its members run in their own sessions: they
must stop with it, or be waited for by the rerun). Then two hostile cases: a member left claimed by
a dead runner with its takeover marker (a runner killed between taking the marker and replacing the
claim), run with `--claim` (it must finish as the reference, not wait forever); and a copy of the
reference whose checkpoints were swapped for another run's (another learning rate, checksums
intact), which must be refused in one line (exit 1), not continued. Last line: {"trials": N,
"held": K, "sweep_trials": M, "sweep_held": L, "claim_held": bool, "swap_refused": bool}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import rundir

ROOT = Path(__file__).resolve().parent.parent
STEPS = 120
CONFIG = [
    "data.source=builtin:recall:train_docs=400,val_docs=40",
    "data.seq_len=32",
    "data.val_windows=4",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_multiple=16",
    "train.batch_size=8",
    f"train.steps={STEPS}",
    "train.eval_every=40",
    "optim.warmup_steps=5",
    "checkpoint.every=20",
    "checkpoint.async=true",
    "logging.every=1",
    "logging.progress=false",
    "logging.tensorboard=false",
]
TIMING = {"step_time", "tokens_per_s", "tflops_per_device", "mfu"}  # wall-clock figures differ run to run


def train(workdir: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    argv = [sys.executable, "train.py", *CONFIG, f"data.cache_dir={cache}", "--workdir", str(workdir)]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def reference(workdir: Path, cache: Path) -> tuple[float, float]:
    """Run the reference; returns (seconds to its `start` event, seconds in all)."""
    began = time.monotonic()
    proc = train(workdir, cache)
    started = None
    while proc.poll() is None:
        if started is None and rundir.read_events(workdir, "start"):
            started = time.monotonic() - began
        time.sleep(0.01)
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
    total = time.monotonic() - began
    return started if started is not None else total / 2, total


def left_behind(workdir: Path) -> str:
    """What a kill left: how far the run got, in words."""
    directory = workdir / rundir.CHECKPOINTS
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    done = sorted(int(n) for n in names if n.isdigit())
    partial = any("tmp" in n for n in names)
    if not rundir.read_events(workdir, "start"):
        return "starting up (no start event)"
    if not done:
        return "before the first checkpoint" + (" (first save under way)" if partial else "")
    return f"after checkpoint {done[-1]}" + (" (a save under way)" if partial else "")


def rerun(workdir: Path, cache: Path) -> int:
    """The same command until it no longer asks to be run again (exit 75); its last exit code."""
    for _ in range(5):
        proc = train(workdir, cache)
        _, err = proc.communicate()
        if proc.returncode != 75:
            if proc.returncode != 0:
                print(f"    rerun exit {proc.returncode}: {err.strip().splitlines()[-1:]}")
            return proc.returncode
    return 75


def trajectory(workdir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rundir.read_metrics(workdir)]


def same_run(workdir: Path, ref: Path) -> bool:
    """Bitwise the same final parameters and the same metrics (timings aside)."""
    import jax
    import numpy as np
    from flax import nnx

    from transformer.io.checkpoint import load

    leaves = [jax.tree.leaves(nnx.to_pure_dict(nnx.state(load(w)[1]))) for w in (workdir, ref)]
    same_params = len(leaves[0]) == len(leaves[1]) and all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves)
    )
    return same_params and trajectory(workdir) == trajectory(ref)


def kill_at_random(workdir: Path, cache: Path, rng: random.Random, training: bool, total: float) -> str:
    """Start the run and SIGKILL it at a random moment: of its whole life, or (`training`) of its
    training phase, from its own `start` event on. A run that ended first is started again in a
    fresh directory, the window halved. Returns the moment and what the kill left, in words."""
    for attempt in range(4):
        shutil.rmtree(workdir, ignore_errors=True)
        began = time.monotonic()
        proc = train(workdir, cache)
        while training and proc.poll() is None and not rundir.read_events(workdir, "start"):
            time.sleep(0.005)
        time.sleep(rng.uniform(0, total * 0.5**attempt))
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            return f"killed at {time.monotonic() - began:5.2f} s, {left_behind(workdir)}"
        if proc.returncode != 0:
            return f"it failed by itself (exit {proc.returncode}): {proc.stderr.read().strip().splitlines()[-1:]}"
    return "never killed: it always finished first"


def trial(i: int, rng: random.Random, root: Path, cache: Path, started: float, total: float) -> bool:
    """Kill one run at a random moment, run it again, compare with the reference."""
    workdir = root / f"trial-{i}"
    training = i % 2 == 1
    moment = kill_at_random(workdir, cache, rng, training, total - started if training else total)
    rc = rerun(workdir, cache)
    held = rc == 0 and same_run(workdir, root / "reference")
    print(f"trial {i}: {moment}; rerun exit {rc}; {'held' if held else 'NOT HELD'}", flush=True)
    return held


def sweep(workdir: Path, cache: Path) -> subprocess.Popen:
    """The sweep (two seeds of the same config) in its own process group, as a scheduler starts a job."""
    spec = workdir.parent / "sweep.yaml"
    spec.write_text(json.dumps({"sweep": {"seeds": [0, 1]}}))  # JSON is YAML
    argv = [sys.executable, "train.py", str(spec), *CONFIG, f"data.cache_dir={cache}", "--workdir", str(workdir)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def members(workdir: Path) -> list[str]:
    return [m["name"] for m in json.loads((workdir / "sweep.json").read_text())["members"]]


def sweep_trial(i: int, rng: random.Random, root: Path, cache: Path, total: float) -> bool:
    """SIGKILL a sweep's whole process group at a random moment (its members, in their own sessions,
    survive that), run the sweep again until it ends, compare every member with the reference's."""
    workdir = root / f"sweep-{i}"
    began, proc = time.monotonic(), sweep(workdir, cache)
    time.sleep(rng.uniform(0, total))
    moment = f"finished before the kill (exit {proc.poll()})"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        states = ", ".join(f"{m.name}: {left_behind(m)}" for m in sorted(workdir.glob("run-s*")))
        moment = f"killed at {time.monotonic() - began:5.2f} s ({states or 'no member started'})"
    rc = 75
    for _ in range(5):  # exit 75: interrupted (members preempted), run it again
        again = sweep(workdir, cache)
        _, err = again.communicate()
        rc = again.returncode
        if rc != 75:
            break
    reference = root / "sweep-reference"
    held = rc == 0 and all(same_run(workdir / m, reference / m) for m in members(reference))
    print(f"sweep trial {i}: {moment}; rerun exit {rc}; {'held' if held else 'NOT HELD'}", flush=True)
    if rc != 0:
        print(f"    {err.strip().splitlines()[-1:]}")
    return held


def sweep_reference(root: Path, cache: Path) -> float:
    began, proc = time.monotonic(), sweep(root / "sweep-reference", cache)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the reference sweep failed (exit {proc.returncode}): {err[-2000:]}")
    return time.monotonic() - began


def claim_trial(root: Path, cache: Path) -> bool:
    """A dead runner's claim with its takeover marker left behind, both an hour old: `--claim` must
    take the member over and finish it as the reference."""
    workdir = root / "claimed"
    workdir.mkdir(parents=True)
    import socket

    dead = {"host": socket.gethostname(), "pid": 2**22 + 17, "token": "t"}  # above any pid in use here
    from transformer.sweep.claims import claim_path

    claim_path(workdir).write_text(json.dumps(dead))
    claim_path(workdir).with_name(claim_path(workdir).name + ".t.takeover").write_text("")
    hour_ago = time.time() - 3600
    for path in workdir.iterdir():
        os.utime(path, (hour_ago, hour_ago))
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    argv = [sys.executable, "train.py", *CONFIG, f"data.cache_dir={cache}", "--workdir", str(workdir)]
    try:
        proc = subprocess.run(
            [*argv, "--claim", "--stale-after", "5"], cwd=ROOT, env=env, capture_output=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        print("claim: a leftover takeover marker wedged the member (no exit in 600 s): NOT HELD", flush=True)
        return False
    held = proc.returncode == 0 and same_run(workdir, root / "reference")
    print(
        f"claim: a dead runner's claim and takeover marker; exit {proc.returncode}; {'held' if held else 'NOT HELD'}",
        flush=True,
    )
    return held


def swap_trial(root: Path, cache: Path) -> bool:
    """The reference's checkpoints swapped for another run's (lr 1e-3, checksums intact) in a copy
    whose `end` is gone: the rerun must refuse them in one line, exit 1, not continue from them."""
    other, workdir = root / "other-lr", root / "swapped"
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    argv = [sys.executable, "train.py", *CONFIG, f"data.cache_dir={cache}", "optim.lr=1e-3", "--workdir", str(other)]
    subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, check=True)
    shutil.copytree(root / "reference", workdir)
    events = (workdir / rundir.EVENTS).read_text().splitlines()
    (workdir / rundir.EVENTS).write_text("".join(e + "\n" for e in events if json.loads(e)["event"] != "end"))
    shutil.rmtree(workdir / rundir.CHECKPOINTS)
    shutil.copytree(other / rundir.CHECKPOINTS, workdir / rundir.CHECKPOINTS)
    proc = train(workdir, cache)
    _, err = proc.communicate()
    lines = err.strip().splitlines()
    refused = proc.returncode == 1 and len(lines) == 1 and "another config" in lines[0]
    print(
        f"swap: another run's checkpoints; exit {proc.returncode}: {lines[-1:]}; {'refused' if refused else 'NOT REFUSED'}",
        flush=True,
    )
    return refused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--sweeps", type=int, default=2, help="trials that kill a sweep (two members)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    args = p.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="reliability-"))
    cache = root / "cache"
    reference(root / "reference", cache)  # compiles (or fills the compilation cache): slower than the rest
    started, total = reference(root / "timing", cache)  # as long as a trial's run lives
    if not same_run(root / "timing", root / "reference"):
        raise SystemExit("two uninterrupted runs differ: the comparison would mean nothing")
    print(f"an uninterrupted run: {total:.1f} s, training from {started:.1f} s", flush=True)
    rng = random.Random(args.seed)
    held = sum(trial(i, rng, root, cache, started, total) for i in range(args.trials))
    result = {"trials": args.trials, "held": held}
    if args.sweeps:
        sweep_total = sweep_reference(root, cache)
        print(f"an uninterrupted sweep: {sweep_total:.1f} s", flush=True)
        sweep_held = sum(sweep_trial(i, rng, root, cache, sweep_total) for i in range(args.sweeps))
        result.update(sweep_trials=args.sweeps, sweep_held=sweep_held)
    result.update(claim_held=claim_trial(root, cache), swap_refused=swap_trial(root, cache))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
