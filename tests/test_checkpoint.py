"""Checkpoints: exact resume (clean stop, SIGKILL, SIGTERM), reshard on restore, config changes on
resume, damaged and unwritable directories, retention, and nothing non-finite saved."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, assert_bitwise_equal, final_params, logged, read_events, tiny_run_overrides, write_corpus

from transformer import rundir
from transformer.config import ConfigError
from transformer.config_loader import load_config
from transformer.io.checkpoint import CheckpointError, load
from transformer.train.job import run


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("ckpt-corpus") / "docs.jsonl", seed=1)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt-cache")


def args(corpus, cache, *extra):
    return tiny_run_overrides(
        corpus, cache, "train.eval_every=20", "checkpoint.every=10", "optim.warmup_steps=5", *extra
    )


def run_in_process(corpus, cache, workdir, *extra):
    return run(load_config(None, args(corpus, cache, *extra)), workdir, log=lambda _: None)


def cli(*argv, env=None, **kw):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, "train.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kw
    )


def losses(workdir: Path) -> dict[int, float]:
    return logged(workdir, "loss")


def val_losses(workdir: Path) -> dict[int, float]:
    return logged(workdir, "val_loss")


events = read_events


@pytest.fixture(scope="session")
def straight(corpus, cache, tmp_path_factory):
    """The uninterrupted reference: 60 steps in one go."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    run_in_process(corpus, cache, workdir, "train.steps=60")
    return workdir


# µP with CompleteP away from its base shape (twice the base width and depth): the per-parameter
# multipliers, the branch multiplier and the optimiser chain they make resume like the standard ones
MUP_AWAY = ("model.parametrization=mup", "model.mup_base_d_model=16", "model.depth_scaling=complete_p")
MUP_AWAY += ("model.mup_base_n_layers=1",)


# Muon's momentum and the AdamW group's moments, in optax's partitioned state; AdEMAMix's slow EMA
# and the counts its alpha and b3 schedules read (a warm-up of its own: by default it is train.steps,
# which this test changes, like the cosine schedule it leaves out)
MUON = ("optim.name=muon", "optim.muon.ns=polar_express")
OTHERS = [("optim.name=ademamix", "optim.ademamix.warmup=20"), ("optim.name=lion",), ("optim.name=adafactor",)]
OTHERS += [("optim.name=schedule_free_adamw",)]  # its z sequence, weight sum and largest lr
OTHERS += [("optim.name=soap", "optim.soap.precondition_every=7")]  # factors and bases, refreshed across the stop
OTHERS += [("optim.name=muon", "model.qk_clip=0.03")]  # MuonClip, the clip acting in most steps (logits ~0.06)
OTHERS += [("optim.independent_decay=true", "optim.weight_decay=1e-3")]  # the decay's own update count


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [(), MUP_AWAY, MUON, *OTHERS],
    ids=[
        "standard",
        "mup-complete-p",
        "muon",
        "ademamix",
        "lion",
        "adafactor",
        "schedule-free",
        "soap",
        "muonclip",
        "independent-decay",
    ],
)
def test_clean_stop_and_resume_is_bitwise_exact(corpus, cache, tmp_path, extra):
    # a schedule that does not depend on train.steps, so stopping at 30 is on the 60-step trajectory
    reference = tmp_path / "reference"
    run_in_process(corpus, cache, reference, "train.steps=60", "optim.schedule=constant", *extra)
    resumed = tmp_path / "resumed"
    run_in_process(corpus, cache, resumed, "train.steps=30", "optim.schedule=constant", *extra)
    run_in_process(corpus, cache, resumed, "train.steps=60", "optim.schedule=constant", *extra)
    assert losses(resumed) == losses(reference)
    assert sorted(losses(resumed)) == list(range(1, 61))
    assert_bitwise_equal(final_params(resumed), final_params(reference))
    kinds = [e["event"] for e in events(resumed)]
    assert kinds == ["start", "end", "resume", "config_change", "start", "end"]
    assert events(resumed)[2]["step"] == 30
    assert events(resumed)[3]["changes"] == ["train.steps: 30 -> 60"]


def wait_for(path: Path, proc: subprocess.Popen, timeout=300):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def start_cli(corpus, cache, workdir, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "train.py", *args(corpus, cache, "train.steps=60", *extra), "--workdir", str(workdir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_sigkill_then_resume_ends_bitwise_identical(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "killed"
    proc = start_cli(corpus, cache, workdir, "checkpoint.async=false")
    wait_for(workdir / "checkpoints" / "20", proc)
    time.sleep(0.3)  # somewhere after the checkpoint: mid-step, mid-log or mid-save
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    out = cli(*args(corpus, cache, "train.steps=60"), "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr[-3000:]
    resume = [e for e in events(workdir) if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] >= 20
    assert losses(workdir) == losses(straight)
    assert_bitwise_equal(final_params(workdir), final_params(straight))


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_75(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "preempted"
    proc = start_cli(corpus, cache, workdir)
    wait_for(workdir / "checkpoints" / "10", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    preempted = [e for e in events(workdir) if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["signal"] == "SIGTERM"
    step = preempted[0]["step"]
    assert (workdir / "checkpoints" / str(step)).is_dir()
    assert "run the same command to resume" in err
    out = cli(*args(corpus, cache, "train.steps=60"), "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e["step"] for e in events(workdir) if e["event"] == "resume"] == [step]
    assert_bitwise_equal(final_params(workdir), final_params(straight))


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, restored_on", [(8, 1), (1, 8)])
def test_reshard_on_restore(corpus, cache, tmp_path, saved_on, restored_on):
    def devices(n):
        return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}

    def mesh(n):
        return ["mesh.data=1", "mesh.fsdp=8"] if n == 8 else ["mesh.data=1", "mesh.fsdp=1"]

    extra = ("optim.schedule=constant",)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    out = cli(*args(corpus, cache, "train.steps=40", *extra), *mesh(1), "--workdir", str(reference), env=devices(1))
    assert out.returncode == 0, out.stderr[-3000:]
    first = cli(
        *args(corpus, cache, "train.steps=20", *extra),
        *mesh(saved_on),
        "--workdir",
        str(resumed),
        env=devices(saved_on),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = cli(
        *args(corpus, cache, "train.steps=40", *extra),
        *mesh(restored_on),
        "--workdir",
        str(resumed),
        env=devices(restored_on),
    )
    assert second.returncode == 0, second.stderr[-3000:]
    got, want = losses(resumed), losses(reference)
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
    change = next(e for e in events(resumed) if e["event"] == "config_change")
    assert any(c.startswith("mesh.fsdp") for c in change["changes"])


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


@pytest.mark.parametrize(
    "change, named",
    [
        ("model.n_layers=3", "model.n_layers: 2 -> 3"),
        ("data.seq_len=16", "data.seq_len: 32 -> 16"),
        ("train.seed=1", "train.seed: 0 -> 1"),
        ("optim.lr=0.01", "optim.lr: 0.003 -> 0.01"),
    ],
)
@pytest.mark.slow
def test_unsafe_config_change_is_refused_and_touches_nothing(corpus, cache, straight, tmp_path, change, named):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    before = snapshot(workdir)
    out = cli(*args(corpus, cache, "train.steps=60", change), "--workdir", str(workdir))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "cannot resume" in lines[0]
    assert snapshot(workdir) == before


@pytest.mark.slow
def test_safe_change_on_a_finished_run_is_accepted_and_logged(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    run_in_process(corpus, cache, workdir, "train.steps=70", "logging.every=5", "checkpoint.keep=3")
    change = [e for e in events(workdir) if e["event"] == "config_change"][-1]
    assert set(change["changes"]) == {"train.steps: 60 -> 70", "logging.every: 1 -> 5", "checkpoint.keep: 2 -> 3"}
    assert max(losses(workdir)) == 70


@pytest.mark.slow
def test_interrupted_save_is_ignored_and_cleaned(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    partial = workdir / "checkpoints" / "70.orbax-checkpoint-tmp-1234567"
    partial.mkdir()
    (partial / "junk").write_text("half a checkpoint")
    run_in_process(corpus, cache, workdir, "train.steps=70")
    assert not partial.exists()
    resume = [e for e in events(workdir) if e["event"] == "resume"]
    assert resume[0]["step"] == 60
    assert [e["names"] for e in events(workdir) if e["event"] == "partial_checkpoint_removed"] == [[partial.name]]


def damage(step_dir: Path) -> None:
    """Truncate every data file of the parameters: the kind of damage a full disk or a crash leaves."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert files
    for p in files:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


@pytest.mark.slow
def test_corrupted_latest_falls_back_to_the_previous(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    damage(workdir / "checkpoints" / "60")
    run_in_process(corpus, cache, workdir, "train.steps=70")
    corrupt = [e for e in events(workdir) if e["event"] == "checkpoint_corrupt"]
    assert [e["step"] for e in corrupt] == [60]
    assert [e["step"] for e in events(workdir) if e["event"] == "resume"] == [50]
    assert (workdir / "checkpoints" / "60.corrupt").is_dir()  # set aside, not deleted
    assert (workdir / "checkpoints" / "60").is_dir()  # written again by the resumed run


@pytest.mark.slow
def test_no_valid_checkpoint_exits_1_and_deletes_nothing(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    for step_dir in (workdir / "checkpoints").iterdir():
        if step_dir.name.isdigit():
            damage(step_dir)
    before = {p for p in workdir.rglob("*")}
    out = cli(*args(corpus, cache, "train.steps=70"), "--workdir", str(workdir))
    assert out.returncode == 1
    assert "no usable checkpoint" in out.stderr and "nothing was deleted" in out.stderr
    assert "Traceback" not in out.stderr
    assert before <= {p for p in workdir.rglob("*")}


@pytest.mark.slow
def test_unwritable_checkpoint_directory(corpus, cache, straight, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("a file where the checkpoint directory should be")
    with pytest.raises(ConfigError, match="cannot write checkpoints to"):
        run_in_process(corpus, cache, workdir, "train.steps=10")
    out = cli(*args(corpus, cache, "train.steps=10"), "--workdir", str(workdir))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert (workdir / "checkpoints").read_text().startswith("a file")


@pytest.mark.slow
def test_keep_latest_and_best(corpus, cache, tmp_path):
    """Kept: the latest `keep` checkpoints plus the `keep_best` best by validation loss, also after a
    resume (a new process must still know each kept checkpoint's validation loss)."""
    from transformer.config import CheckpointConfig
    from transformer.io.checkpoint import Checkpointer

    workdir = tmp_path / "run"
    policy = (
        "train.eval_every=10",
        "checkpoint.keep=2",
        "checkpoint.keep_best=1",
        "optim.lr=0.2",
        "optim.clip_norm=null",
        "optim.schedule=constant",
    )
    for steps, latest in ((60, {50, 60}), (80, {70, 80})):
        run_in_process(corpus, cache, workdir, f"train.steps={steps}", *policy)
        val = val_losses(workdir)
        kept = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
        assert kept == sorted(latest | {min(val, key=val.get)})
        reopened = Checkpointer(workdir, CheckpointConfig(), read_only=True)
        assert {s: reopened.manager.metrics(s)["val_loss"] for s in kept} == pytest.approx({s: val[s] for s in kept})
        reopened.close()


@pytest.mark.slow
def test_resuming_a_finished_run_says_so(corpus, cache, straight, tmp_path):
    """The same command again: nothing to do, exit 0 and nothing written (a scheduler's "rerun until
    it exits 0" ends); fewer steps than it trained: refused."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    before = {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()}
    out = cli(*args(corpus, cache, "train.steps=60"), "--workdir", str(workdir))
    assert out.returncode == 0, out.stderr
    assert f"{workdir} is already trained to step 60; nothing to do" in out.stdout
    assert {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file() and p.name in before} == before
    out = cli(*args(corpus, cache, "train.steps=50"), "--workdir", str(workdir))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"train.py: error: config: train.steps: {workdir} is already trained to step 60; raise train.steps to continue it"
    ]


@pytest.mark.slow
def test_a_checkpoint_copied_in_from_another_run_is_refused(corpus, cache, straight, tmp_path):
    """Run B's checkpoint (another learning rate, its checksums intact) in run A's directory: A must
    not continue on B's parameters."""
    a, b = tmp_path / "a", tmp_path / "b"
    run_in_process(corpus, cache, b, "train.steps=30", "optim.lr=1e-3")
    shutil.copytree(straight, a)
    events = (a / rundir.EVENTS).read_text().splitlines()
    (a / rundir.EVENTS).write_text("".join(line + "\n" for line in events if '"end"' not in line))  # interrupted
    shutil.rmtree(a / "checkpoints")
    shutil.copytree(b / "checkpoints", a / "checkpoints")
    out = cli(*args(corpus, cache, "train.steps=60"), "--workdir", str(a))
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert "was written by a run of another config (optim.lr: 0.001 ->" in line and "not this run's" in line


@pytest.mark.slow
def test_non_finite_state_is_never_saved(corpus, cache, tmp_path):
    from transformer.train.monitor import MonitorStop

    workdir = tmp_path / "run"
    with pytest.raises(MonitorStop, match="non-finite steps in a row"):  # the monitor gives up, too
        run_in_process(
            corpus,
            cache,
            workdir,
            "train.steps=30",
            "optim.lr=1e30",
            "optim.clip_norm=null",
            "optim.warmup_steps=0",
            "optim.name=sgd",
            "checkpoint.every=1",
        )
    not_saved = [e["step"] for e in events(workdir) if e["event"] == "not_saved"]
    assert not_saved, "the run never went non-finite: the test needs a stronger push"
    kept = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert not set(kept) & set(not_saved)
    for step in kept:
        assert all(np.all(np.isfinite(np.asarray(x))) for x in final_params(workdir, step))


def test_load_errors(tmp_path, straight):
    with pytest.raises(CheckpointError, match=r"no config\.yaml"):
        load(tmp_path)
    with pytest.raises(CheckpointError, match="was not kept"):
        load(straight, step=7)


# --- integrity: checksums, failed saves, damaged metrics records, eval's fall-back ------------------
SHORT = ("checkpoint.every=5", "train.eval_every=5", "optim.schedule=constant")


def run_logged(corpus, cache, workdir, *extra) -> list[str]:
    """Run in-process; the lines the job logged."""
    lines: list[str] = []
    run(load_config(None, args(corpus, cache, *SHORT, *extra)), workdir, log=lines.append)
    return lines


@pytest.fixture(scope="session")
def ten(corpus, cache, tmp_path_factory):
    """10 steps, checkpoints at 5 and 10, each with its validation loss."""
    workdir = tmp_path_factory.mktemp("ten") / "run"
    run_logged(corpus, cache, workdir, "train.steps=10")
    return workdir


@pytest.fixture(scope="session")
def fifteen(corpus, cache, tmp_path_factory):
    """The uninterrupted 15-step run of the same config."""
    workdir = tmp_path_factory.mktemp("fifteen") / "run"
    run_logged(corpus, cache, workdir, "train.steps=15")
    return workdir


def raw_arrays(workdir: Path, step: int, item: str = "params") -> list[np.ndarray]:
    """A checkpoint's arrays of one item of the state (`params`, `opt_state`) as orbax alone reads
    them back (no checksums checked)."""
    import orbax.checkpoint as ocp

    from transformer.config import CheckpointConfig
    from transformer.io.checkpoint import Checkpointer

    ckpt = Checkpointer(workdir, CheckpointConfig(), read_only=True)
    try:
        restored = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return [np.asarray(x) for x in jax.tree.leaves(restored["state"][item])]
    finally:
        ckpt.close()


def data_files(step_dir: Path) -> list[Path]:
    """The files holding a checkpoint's array data (OCDBT's `d/` files)."""
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def flip_silently(workdir: Path, step: int) -> None:
    """Damage the step's parameter data where orbax notices nothing: it restores without an error,
    other numbers (the damage a checksum must catch). A flipped byte where one is found; which file
    holds the parameters and which bytes are compressed depends on how the async writes fell, so
    where none is found in a bounded search, one value is rewritten through orbax itself, the saved
    checksums left as they were."""
    before = raw_arrays(workdir, step)
    for path in sorted(data_files(workdir / "checkpoints" / str(step)), key=lambda p: -p.stat().st_size):
        original = path.read_bytes()
        for offset in range(len(original) // 4, len(original), max(1, len(original) // 24)):
            path.write_bytes(original[:offset] + bytes([original[offset] ^ 0x10]) + original[offset + 1 :])
            try:
                after = raw_arrays(workdir, step)
            except Exception:
                continue
            if any(not np.array_equal(a, b) for a, b in zip(before, after)):
                return
        path.write_bytes(original)
    rewrite_one_parameter(workdir, step)


def rewrite_one_parameter(workdir: Path, step: int) -> None:
    """Replace the step's state item by a valid orbax item whose first parameter differs in one value."""
    import orbax.checkpoint as ocp

    from transformer.config import CheckpointConfig
    from transformer.io.checkpoint import Checkpointer

    ckpt = Checkpointer(workdir, CheckpointConfig(), read_only=True)
    try:
        state = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    finally:
        ckpt.close()
    state = jax.tree.map(np.array, state)  # writable copies
    first = jax.tree_util.tree_leaves_with_path(state["params"])[0][1]
    first.reshape(-1)[0] += 1.0
    item = workdir / "checkpoints" / str(step) / "state"
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as writer:
        writer.save(item, state)


@pytest.mark.slow
def test_flipped_byte_is_detected_and_the_run_resumes_bitwise_from_the_previous(corpus, cache, ten, fifteen, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(ten, workdir)
    flip_silently(workdir, 10)
    lines = run_logged(corpus, cache, workdir, "train.steps=15")
    assert [e["step"] for e in events(workdir) if e["event"] == "checkpoint_corrupt"] == [10]
    assert "checksum mismatch" in next(e for e in events(workdir) if e["event"] == "checkpoint_corrupt")["error"]
    assert [e["step"] for e in events(workdir) if e["event"] == "resume"] == [5]
    damaged = [line for line in lines if "step 10" in line and "damaged" in line]
    assert len(damaged) == 1 and "checksum mismatch" in damaged[0], lines
    assert (workdir / "checkpoints" / "10.corrupt").is_dir()  # set aside, not deleted
    assert_bitwise_equal(final_params(workdir), final_params(fifteen))
    assert losses(workdir) == losses(fifteen)


def test_checksums_see_every_element_and_no_sharding():
    from transformer.io.checkpoint import tree_checksums, verify_checksums

    tree = {"w": jax.numpy.arange(24, dtype=jax.numpy.float32).reshape(4, 6), "b": jax.numpy.ones(3, "bfloat16")}
    saved = tree_checksums(tree)
    verify_checksums(tree, saved)
    for leaf, index in (("w", (3, 5)), ("w", (0, 0)), ("b", (1,))):
        changed = {**tree, leaf: tree[leaf].at[index].set(tree[leaf][index] + 1)}
        with pytest.raises(ValueError, match=f"checksum mismatch in \\['{leaf}'\\]"):
            verify_checksums(changed, saved)
    swapped = {**tree, "w": tree["w"][::-1]}  # the same numbers in other places
    with pytest.raises(ValueError, match="checksum mismatch"):
        verify_checksums(swapped, saved)
    verify_checksums(tree, None)  # a checkpoint from before checksums passes


# train.py with the directory of step 10's checkpoint refused (as a read-only file system or a
# permission change would; root ignores chmod, so the refusal is patched into the path library orbax
# uses). On exit it prints how many of orbax's writer threads are left waiting for a signal: each
# would hold the process for orbax's 300 s barrier timeout.
DENY_STEP_10 = """
import sys, threading
from etils.epath import gpath
real = gpath._GPath.mkdir
def denied(self, *a, **kw):
    if "10.orbax-checkpoint-tmp" in str(self):
        raise PermissionError(13, "Permission denied", str(self))
    return real(self, *a, **kw)
gpath._GPath.mkdir = denied
from transformer.cli import train_main
rc = train_main(sys.argv[1:])
print("waiting threads:", sum(type(t).__name__ == "_SignalingThread" and t.is_alive() for t in threading.enumerate()))
sys.exit(rc)
"""


@pytest.mark.slow
def test_failed_save_names_its_step_is_journaled_and_exits_at_once(corpus, cache, ten, tmp_path):
    del ten  # its run fills the token cache: the subprocess's stderr then holds only what the run says
    workdir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [*args(corpus, cache, *SHORT, "train.steps=20"), "--workdir", str(workdir)]
    # the timeout only guards against a hang: the property is "no thread left waiting", printed below
    out = subprocess.run(
        [sys.executable, "-c", DENY_STEP_10, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]  # no orbax/asyncio tracebacks before the error
    assert "saving the checkpoint of step 10 failed" in lines[0] and "Permission denied" in lines[0]
    assert "the newest good checkpoint is step 5" in lines[0]
    assert "waiting threads: 0" in out.stdout
    failed = [e for e in events(workdir) if e["event"] == "save_failed"]
    assert [(e["step"], e["newest_checkpoint"]) for e in failed] == [(10, 5)]
    assert (workdir / "checkpoints" / "5").is_dir()


# a full disk without root: writes past the limit fail with EFBIG (SIGXFSZ ignored), in train.py's
# own process (the limit and the ignored signal survive exec)
LIMITED_TRAIN = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execv(sys.executable, [sys.executable, "train.py", *sys.argv[2:]])
"""


@pytest.mark.slow
def test_a_save_that_runs_out_of_space_is_one_line(corpus, cache, ten, tmp_path):
    """The writes of a failed tensorstore save that were still in flight hand their results to a loop
    orbax has closed (dozens of 'Event loop is closed' tracebacks) and leave tasks whose errors nobody
    retrieves: none of it may reach the user around the one line that reports the failure, and that
    line names the error without tensorstore's 2,000-character spec."""
    del ten  # its run fills the token cache: the subprocess's stderr then holds only what the run says
    workdir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [*args(corpus, cache, *SHORT, "checkpoint.every=1", "train.steps=6"), "--workdir", str(workdir)]
    out = subprocess.run(
        [sys.executable, "-c", LIMITED_TRAIN, "100000", *argv],  # bytes: less than the optimiser state
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert "train.py: error: checkpoint: saving the checkpoint of step" in lines[0]
    assert "tensorstore_spec" not in lines[0] and len(lines[0]) < 1000, lines[0]


def test_a_failed_async_write_is_reported_for_its_own_step(tmp_path, monkeypatch):
    """A write that fails in orbax's background thread (a full disk) surfaces at the next save or
    wait, named for the step it belonged to, not for the step that found it."""
    import errno

    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    from transformer.config import CheckpointConfig
    from transformer.io.checkpoint import Checkpointer, SaveFailed

    real = handler.JsonCheckpointHandler._save_fn

    async def full_disk(self, x, directory):
        if "/2.orbax-checkpoint-tmp" in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", full_disk)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_=True))
    state = {"w": jax.numpy.ones(4)}
    ckpt.save(1, state, {})
    ckpt.save(2, state, {})
    with pytest.raises(
        SaveFailed, match=r"step 2 failed: OSError: .*No space left on device.*newest good checkpoint is step 1"
    ):
        ckpt.save(3, state, {})
    with pytest.raises(SaveFailed, match="step 2 failed"):  # reported again, never waited on again
        ckpt.wait()
    ckpt.close()
    assert ckpt.failed is not None and ckpt.failed.step == 2


def garble(record: Path) -> None:
    assert record.is_file()
    record.write_text("garbage{")


@pytest.mark.slow
def test_garbage_in_a_kept_best_record_is_repaired_on_resume(corpus, cache, ten, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(ten, workdir)
    record = workdir / "checkpoints" / "10" / "metrics" / "metrics"
    garble(record)
    run_logged(corpus, cache, workdir, "train.steps=15")
    assert [e["step"] for e in events(workdir) if e["event"] == "resume"] == [10]
    repaired = [e for e in events(workdir) if e["event"] == "checkpoint_metrics_repaired"]
    assert [e["step"] for e in repaired] == [10] and "rewritten" in repaired[0]["action"]
    assert json.loads(record.read_text())["val_loss"] == pytest.approx(val_losses(ten)[10])


def test_garbage_in_a_kept_best_record_without_a_logged_loss_is_set_aside(tmp_path):
    from transformer.config import CheckpointConfig
    from transformer.io.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_=False))
    ckpt.save(1, {"w": jax.numpy.ones(4)}, {}, val_loss=2.0, wait=True)
    ckpt.close()
    record = tmp_path / "checkpoints" / "1" / "metrics" / "metrics"
    garble(record)
    reopened = Checkpointer(tmp_path, CheckpointConfig(async_=False))
    assert reopened.steps() == [1] and reopened.manager.metrics(1) is None
    reopened.close()
    assert record.with_name("metrics.corrupt").read_text() == "garbage{"  # kept for inspection
    assert [e["event"] for e in events(tmp_path)] == ["checkpoint_metrics_repaired"]


def eval_cli(*argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "eval.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_eval_ignores_garbage_in_a_kept_best_record(ten, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(ten, workdir)
    garble(workdir / "checkpoints" / "10" / "metrics" / "metrics")
    out = eval_cli("--workdir", str(workdir), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["step"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_eval_falls_back_from_damaged_parameters(ten, tmp_path, how):
    workdir = tmp_path / "run"
    shutil.copytree(ten, workdir)
    if how == "truncated":
        damage(workdir / "checkpoints" / "10")
    else:
        flip_silently(workdir, 10)
    out = eval_cli("--workdir", str(workdir), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["step"] == 5
    notes = [line for line in out.stderr.splitlines() if "step 10" in line]
    assert len(notes) == 1 and "damaged" in notes[0] and "Traceback" not in out.stderr
    named = eval_cli("--workdir", str(workdir), "--step", "10")
    assert named.returncode == 2
    lines = named.stderr.strip().splitlines()
    assert len(lines) == 1 and "step 10" in lines[0] and "damaged" in lines[0], named.stderr[-3000:]
    assert (workdir / "checkpoints" / "10").is_dir()  # a reader sets nothing aside


def test_a_checkpoint_of_another_state_tree_is_said_to_be_one_not_damaged_and_kept(tmp_path):
    """Intact files of another version's (or config's) state tree: the line says so, nothing is set aside."""
    from transformer.config import CheckpointConfig
    from transformer.io.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    state = {"params": {"w": jax.numpy.ones((2, 3))}, "opt": ({"mu": jax.numpy.zeros((2, 3))},)}
    ckpt.save(4, state, {}, wait=True)
    f32 = jax.numpy.float32
    other = {"params": {"w": jax.ShapeDtypeStruct((2, 3), f32)}, "opt": ({"mu": jax.ShapeDtypeStruct((2, 3), f32)}, {})}
    lines: list[str] = []
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.restore(other, log=lines.append)
    assert len(lines) == 1 and "holds another state tree" in lines[0] and "damaged" not in lines[0], lines
    assert ckpt.steps() == [4] and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]
    ckpt.close()
