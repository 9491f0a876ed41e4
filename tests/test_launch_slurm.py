"""The SLURM launcher: the job array's script (options from the sweep block and the command line,
valid bash), and, where SLURM is installed (Debian: slurm-wlm, munge), a real single-node SLURM
started by the fixture running a 2-member array to a report, then the same script resubmitted as
it is, which finds both members finished and runs nothing again."""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, TINY_SWEEP

from transformer import rundir
from transformer.sweep import SweepError, expand
from transformer.sweep.launch import SLURM_FLAGS, slurm_options, slurm_script

TINY = {k: v for k, v in TINY_SWEEP.items() if k != "sweep"}
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "munged", "scontrol", "sinfo")


def flags(**given) -> argparse.Namespace:
    return argparse.Namespace(**{f"slurm_{k}": given.get(k) for k in SLURM_FLAGS})


def test_the_array_script_takes_the_sweep_block_with_the_command_line_over_it(tmp_path):
    block = {"partition": "gpu", "time": "01:00:00", "gpus_per_node": 8, "max_parallel": 4, "extra": ["--exclusive"]}
    sweep = expand({"train": {"steps": 10}, "sweep": {"grid": {"optim.lr": [1e-3, 1e-2, 3e-2]}, "slurm": block}})
    options = slurm_options(sweep.launch["slurm"], flags(partition="debug", account="lab"))
    script = slurm_script(sweep, tmp_path, options)
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for line in ("--array=0-2%4", "--partition=debug", "--account=lab", "--time=01:00:00", "--gpus-per-node=8"):
        assert f"#SBATCH {line}" in header, header
    assert "#SBATCH --exclusive" in header and "#SBATCH --requeue" in header
    assert "MEMBERS=(lr-0.001 lr-0.01 lr-0.03)" in script and "--claim" in script and "srun" not in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # it parses
    multi = slurm_script(sweep, tmp_path, {**options, "nodes": 2})
    assert "srun " in multi and "--coordinator auto" in multi and "--claim" not in multi


@pytest.mark.parametrize(
    "block, key",
    [
        ({"partiton": "gpu"}, "sweep.slurm.partiton"),
        ({"nodes": 0}, "sweep.slurm.nodes"),
        ({"extra": "-x"}, "sweep.slurm.extra"),
    ],
)
def test_a_bad_slurm_option_names_its_key(block, key):
    with pytest.raises(SweepError) as e:
        slurm_options(block, flags())
    assert e.value.key == key


@pytest.mark.parametrize(
    "block, given, key",
    [
        ({"extra": ["--exclusive", "--constraint=a100\ntouch /tmp/x\n#"]}, {}, "sweep.slurm.extra"),
        ({"partition": "gpu\rx"}, {}, "sweep.slurm.partition"),
        ({"account": "lab\x1b[2J"}, {}, "sweep.slurm.account"),
        ({"qos": "high\u2028x"}, {}, "sweep.slurm.qos"),
        ({"mem": "16G\tx"}, {}, "sweep.slurm.mem"),
        ({"time": ["1:00:00"]}, {}, "sweep.slurm.time"),
        ({}, {"time": "1:00:00\nrm -rf ~"}, "--slurm-time"),
    ],
)
def test_a_slurm_option_with_a_newline_or_control_character_is_refused(block, given, key):
    """Each option becomes a line of the batch script: a newline in one would be a shell command."""
    with pytest.raises(SweepError) as e:
        slurm_options(block, flags(**given))
    assert e.value.key == key and "\n" not in str(e.value)


def test_a_workdir_or_sweep_file_with_a_newline_is_not_written_into_the_script(tmp_path):
    sweep = expand({"train": {"steps": 10}, "sweep": {"grid": {"optim.lr": [1e-3, 1e-2]}}}, source="s\nt.yaml")
    with pytest.raises(SweepError, match="control character"):
        slurm_script(sweep, tmp_path, {})
    sweep = expand({"train": {"steps": 10}, "sweep": {"grid": {"optim.lr": [1e-3, 1e-2]}}}, source="s.yaml")
    with pytest.raises(SweepError, match="control character"):
        slurm_script(sweep, tmp_path / "a\ntouch x", {})
    assert subprocess.run(["bash", "-n"], input=slurm_script(sweep, tmp_path, {}), text=True).returncode == 0


# --- a real single-node SLURM --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SLURM_CONF = """ClusterName=test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def start_munge() -> int | None:
    """Start munged unless it runs already; the pid of the one started here."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return None  # already running: not ours to stop
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], check=True)
    return int(open("/run/munge/munged.pid").read())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A controller and one compute node on this machine, as root; their environment (SLURM_CONF)."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("a test SLURM's daemons run as root")
    directory = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    conf = SLURM_CONF.format(
        host=socket.gethostname(), ctld_port=free_port(), d_port=free_port(), dir=directory, cpus=os.cpu_count()
    )
    (directory / "slurm.conf").write_text(conf)
    env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
    munged = start_munge()
    try:
        subprocess.run(["slurmctld", "-f", env["SLURM_CONF"]], env=env, check=True)
        subprocess.run(["slurmd", "-f", env["SLURM_CONF"]], env=env, check=True)
        wait_for_idle_node(env, directory)
        yield env
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        if munged is not None:
            os.kill(munged, signal.SIGTERM)


def wait_for_idle_node(env, directory, timeout=60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if out.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    raise AssertionError("the test SLURM's node never came up: " + (directory / "slurmctld.log").read_text()[-2000:])


@pytest.mark.slow
def test_a_slurm_array_runs_the_sweep_and_a_resubmitted_script_runs_nothing_again(slurm, tmp_path):
    spec = {**TINY, "sweep": {"grid": {"model.norm_position": ["pre", "post"]}, "slurm": {"partition": "debug"}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    workdir = tmp_path / "runs"
    cmd = [sys.executable, str(ROOT / "train.py"), str(tmp_path / "sweep.yaml"), "--workdir", str(workdir)]
    out = subprocess.run([*cmd, "--launcher", "slurm", "--wait"], env=slurm, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    members = [workdir / "norm_position-pre", workdir / "norm_position-post"]
    assert all(rundir.status(m, 12) == "finished" for m in members), out.stdout
    assert (workdir / "report.md").is_file() and "report:" in out.stdout
    logs = sorted((workdir / "logs").glob("slurm-*_*.log"))
    assert len(logs) == 2, logs
    ended = [(m / rundir.EVENTS).read_text() for m in members]

    script = workdir / "slurm" / "sweep.sbatch"  # resubmitted by hand, as it is
    again = subprocess.run(["sbatch", "--wait", str(script)], env=slurm, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [(m / rundir.EVENTS).read_text() for m in members] == ended  # finished members are not rerun
    assert "finished already" in "".join(p.read_text() for p in (workdir / "logs").glob("slurm-*_*.log"))


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--launcher", "ray", "--parallel", "2"], "--parallel are for --launcher local"),
        (["--launcher", "ray", "--wait"], "--wait: not an option of --launcher ray"),
        (["--slurm-partition", "gpu"], "--slurm-partition: not an option of --launcher local"),
        (["--claim"], "--claim is for one member's run"),
        (["--stale-after", "0"], "--stale-after must be > 0"),
        (["--launcher", "slurm", "--slurm-max-parallel", "0"], "--slurm-max-parallel: expected an integer"),
    ],
)
def test_launcher_options_that_do_not_fit_are_refused_in_one_line(argv, words):
    from transformer.cli import train_parser
    from transformer.sweep.launch import check_arguments

    sweep = expand({"train": {"steps": 10}, "sweep": {"grid": {"optim.lr": [1e-3, 1e-2]}}})
    args = train_parser().parse_args(["s.yaml", *argv])
    try:
        problem = check_arguments(args, sweep)
    except SweepError as e:
        problem = str(e)
    assert problem is not None and words in problem and "\n" not in problem, problem
