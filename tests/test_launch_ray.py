"""The Ray launcher on a real local Ray instance (started once for the module): a 3-member sweep to a
report, a member killed mid-run reported with its log while the others finish, and resumed from its
checkpoint by the next invocation, which leaves the finished members alone."""

import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, TINY_SWEEP

from transformer import rundir
from transformer.sweep.claims import claim_path, read_claim

ray = pytest.importorskip("ray", reason="the Ray launcher's tests need ray (pip install '.[ray]')")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def sweep_cli(path, workdir, address):
    cmd = [sys.executable, str(ROOT / "train.py"), str(path), "--workdir", str(workdir)]
    return [*cmd, "--launcher", "ray", "--ray-address", address]


def test_a_ray_sweep_reports_a_killed_member_finishes_the_rest_and_resumes_it_next_time(ray_address, tmp_path):
    spec = {
        **TINY_SWEEP,
        "train": {**TINY_SWEEP["train"], "eval_every": 200},
        "checkpoint": {"every": 20, "async": False},
        "sweep": {
            "zip": [{"which": ["long", "a", "b"], "train.steps": [400, 12, 12]}],
            "name": "{which}",
            "ray": {"num_cpus": 1},
        },
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    workdir = tmp_path / "runs"
    sweep = subprocess.Popen(
        sweep_cli(tmp_path / "sweep.yaml", workdir, ray_address), stdout=subprocess.PIPE, text=True
    )
    long = workdir / "long"
    pid = wait_for_checkpoint(long, sweep)
    subprocess.run(["kill", "-KILL", str(pid)], check=True)  # the member's train.py, as the OOM killer would
    out, _ = sweep.communicate(timeout=600)
    assert sweep.returncode == 1, out
    assert "long: failed (exit -9); see " in out and "logs/long.log" in out, out
    assert (workdir / "logs" / "long.log").is_file()
    for name in ("a", "b"):
        assert rundir.status(workdir / name, 12) == "finished", out
    assert (workdir / "report.md").is_file()
    finished = {name: (workdir / name / "events.jsonl").read_text() for name in ("a", "b")}

    again = subprocess.run(sweep_cli(tmp_path / "sweep.yaml", workdir, ray_address), capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 already done, 1 to run" in again.stdout, again.stdout
    resumed = rundir.read_events(long, "resume")
    assert len(resumed) == 1 and resumed[0]["step"] >= 20 and rundir.status(long, 400) == "finished"
    assert {name: (workdir / name / "events.jsonl").read_text() for name in ("a", "b")} == finished
    assert not claim_path(long).exists()


def wait_for_checkpoint(member, sweep, timeout=300) -> int:
    """The pid of the member's train.py once it has written a checkpoint (its claim names it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sweep.poll() is None:
        seen = read_claim(claim_path(member))
        if seen and "pid" in seen[0] and rundir.has_checkpoints(member):
            return int(seen[0]["pid"])
        time.sleep(0.05)
    raise AssertionError(
        f"{member.name} wrote no checkpoint: {sweep.stdout.read() if sweep.poll() is not None else ''}"
    )
