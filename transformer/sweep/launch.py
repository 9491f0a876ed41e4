"""Launchers: where a sweep's members run. `local` (transformer/sweep/runner.py's SweepRunner, the default),
`ray` (each member a Ray task on a cluster, or on a Ray instance started here) and `slurm` (one job
array, one task per member, from a script written to DIR/slurm/ that can be read and resubmitted).

Every launcher runs the same thing: `train.py DIR/members/<name>.yaml --workdir DIR/<name>`, with
`--claim` where no sweep runner holds the member's claim for it (transformer/sweep/claims.py), so members
keep their own run directories: resume, preemption (SIGTERM -> checkpoint -> exit 75, or a requeue)
and `eval.py --compare DIR` work as they do locally. Launch options come from the sweep block
(`sweep.ray`, `sweep.slurm`) and, for SLURM, from the command line, which wins.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import math
import os
import shlex
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformer import rundir
from transformer.config import ROOT, Config
from transformer.errors import EXIT_PREEMPTED, EXIT_USAGE
from transformer.rundir import FINAL
from transformer.sweep.claims import STALE_AFTER, claim_path, run_claimed
from transformer.sweep.expansion import LOGS_DIR, Member, Sweep, SweepError
from transformer.sweep.runner import (
    TRAIN_SCRIPT,
    SweepOutcome,
    die_with,
    member_config_path,
    prctl_function,
    prepare_sweep,
    relative,
    result_summary,
)

LAUNCHERS = ("local", "ray", "slurm")
SLURM_DIR = "slurm"
SLURM_SCRIPT = "sweep.sbatch"
RAY_KEYS = ("num_cpus", "accelerator", "resources")
ACCELERATORS = ("none", "gpu", "tpu")
# sweep.slurm keys: each an sbatch option of the same name with '-' for '_' (max_parallel: the %P
# throttle of --array; extra: more #SBATCH lines as written)
SLURM_KEYS = (
    "partition",
    "time",
    "account",
    "qos",
    "nodes",
    "gpus_per_node",
    "cpus_per_task",
    "mem",
    "max_parallel",
    "extra",
)
SLURM_FLAGS = ("partition", "time", "account", "max_parallel")  # also on the command line: --slurm-<key>
SLURM_TEXT = ("partition", "time", "account", "qos", "mem")  # written as they are: one-line scalars


def add_arguments(p: argparse.ArgumentParser) -> None:
    """train.py's options for claims and launchers."""
    p.add_argument("--claim", action="store_true", help="claim the run directory first (a member run by a scheduler)")
    p.add_argument("--shared", action="store_true", help="sweeps: other runners may work on the same --workdir at once")
    p.add_argument(
        "--stale-after",
        type=float,
        default=STALE_AFTER,
        metavar="S",
        help=f"a claim whose heartbeat is older than S seconds is taken over (default {STALE_AFTER:g})",
    )
    p.add_argument("--launcher", choices=LAUNCHERS, default="local", help="sweeps: where members run")
    p.add_argument("--ray-address", default=None, help="--launcher ray: the cluster (default: start one here)")
    p.add_argument("--wait", action="store_true", help="--launcher slurm: wait for the array to finish")
    for key in SLURM_FLAGS:
        p.add_argument(f"--slurm-{key.replace('_', '-')}", default=None, metavar="VALUE", help=f"sbatch {key}")


def check_arguments(args: argparse.Namespace, sweep: Sweep | None) -> str | None:
    """What is wrong with the claim and launcher options for this command (a sweep file, or one run),
    or None; the sweep's launch blocks are checked whichever launcher runs it."""
    given = {f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k.startswith(("slurm_", "ray_")) and v}
    given |= {"--wait"} if args.wait else set()
    if args.stale_after <= 0:
        return f"--stale-after must be > 0, got {args.stale_after:g}"
    if sweep is None and args.claim and args.coordinator is not None:
        return "--claim is for single-process runs (a multi-process run is guarded by its run directory's lock)"
    if sweep is None:
        extra = given | {"--shared"} if args.shared else given
        return f"{', '.join(sorted(extra))}: for sweep files (a config with a sweep: block)" if extra else None
    if args.claim:
        return "--claim is for one member's run; a sweep claims its members itself"
    wrong = {o for o in given if not o.startswith(f"--{args.launcher}")} - (
        {"--wait"} if args.launcher == "slurm" else set()
    )
    if wrong:
        return f"{', '.join(sorted(wrong))}: not an option of --launcher {args.launcher}"
    if args.launcher != "local" and (args.shared or args.parallel != 1):
        return f"--shared and --parallel are for --launcher local; {args.launcher} schedules members itself"
    ray_options(sweep.launch.get("ray") or {})  # a mistake in either block is one, whichever launcher runs
    slurm_options(sweep.launch.get("slurm") or {}, args)
    return None


def claimed(cfg: Config, workdir: Path, stale_after: float, job: Callable[[], int]) -> int:
    """train.py --claim: run `job` under the run directory's claim; a finished run is left as it is.
    A claim that cannot be taken (a damaged run directory: rundir.Busy) is one line and exit 2."""
    try:
        return run_claimed(workdir, lambda: rundir.status(workdir, cfg.train.steps) in FINAL, job, stale_after)
    except rundir.Busy as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def launch(args: argparse.Namespace, sweep: Sweep, workdir: Path) -> SweepOutcome | None:
    """Run the sweep with `args.launcher` (ray or slurm); None when submitted and not waited for."""
    if args.launcher == "ray":
        if importlib.util.find_spec("ray") is None:
            raise SweepError("", "--launcher ray needs Ray: pip install 'transformer-ablations[ray]'")
        options = ray_options(sweep.launch.get("ray") or {})
        return RayLauncher(sweep, workdir, options, args.stale_after).run(args.ray_address)
    options = slurm_options(sweep.launch.get("slurm") or {}, args)
    return submit_slurm(sweep, workdir, options, args.wait)


def _check_keys(where: str, block: Any, keys: tuple[str, ...]) -> dict:
    if not isinstance(block, dict):
        raise SweepError(where, f"expected a mapping with {', '.join(keys)}, got {block!r}")
    for key in block:
        if key not in keys:
            match = difflib.get_close_matches(str(key), keys, n=1)
            raise SweepError(
                f"{where}.{key}", "unknown key" + (f" (did you mean {where}.{match[0]}?)" if match else "")
            )
    return block


def devices(cfg: Config) -> int:
    """Accelerators one member asks for: its mesh's size (an axis of -1 fills with what there is: 1)."""
    return math.prod(max(1, size) for size in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))


# --- Ray -----------------------------------------------------------------------------------------


def ray_options(block: dict) -> dict:
    """sweep.ray, checked: {num_cpus (per member, default 1), accelerator (none|gpu|tpu: one per
    mesh device), resources (custom Ray resources per member)}."""
    block = _check_keys("sweep.ray", block, RAY_KEYS)
    options = {"num_cpus": 1, "accelerator": "none", "resources": {}, **block}
    if not isinstance(options["num_cpus"], (int, float)) or options["num_cpus"] < 0:
        raise SweepError("sweep.ray.num_cpus", f"expected a number >= 0, got {options['num_cpus']!r}")
    if options["accelerator"] not in ACCELERATORS:
        raise SweepError("sweep.ray.accelerator", f"expected one of {', '.join(ACCELERATORS)}")
    if not isinstance(options["resources"], dict):
        raise SweepError("sweep.ray.resources", "expected a mapping of resource: amount")
    return options


def member_resources(options: dict, cfg: Config) -> dict[str, Any]:
    """The Ray resources one member's task asks for."""
    resources: dict[str, Any] = {"num_cpus": options["num_cpus"], "resources": dict(options["resources"])}
    if options["accelerator"] == "gpu":
        resources["num_gpus"] = devices(cfg)
    elif options["accelerator"] == "tpu":
        resources["resources"]["TPU"] = devices(cfg)
    return resources


def run_member(cmd: list[str], log_path: str) -> int:
    """A Ray task: one member's train.py, its output appended to its log. Cancelling the task (the
    sweep was interrupted) asks the member to checkpoint and exit, as SIGTERM does locally. (A sweep
    killed outright takes its tasks down with it: Ray kills a dead driver's workers and their
    children, so such a member resumes from its last periodic checkpoint.)"""
    import signal

    with contextlib.suppress(ValueError):  # (not the main thread: Ray interrupts it otherwise)
        # ray.cancel interrupts the task as SIGINT would, which does nothing where SIGINT is ignored
        # (a worker of a sweep started in the background by a shell)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(log_path, "a") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=_death_signal(), start_new_session=True
        )
        try:
            while proc.poll() is None:  # not a blocking wait: ray.cancel's KeyboardInterrupt needs bytecode to land
                time.sleep(0.5)
            return proc.returncode
        except KeyboardInterrupt:  # ray.cancel
            proc.send_signal(signal.SIGTERM)
            return proc.wait()


def _death_signal() -> Callable[[], None]:
    import functools

    return functools.partial(die_with, os.getpid(), prctl_function())


class RayLauncher:
    """Submits each unfinished member as a Ray task, follows them with a progress bar, and says how
    the sweep went (the report is the caller's, as for the local runner)."""

    def __init__(self, sweep: Sweep, workdir: Path, options: dict, stale_after: float = STALE_AFTER):
        self.sweep, self.workdir, self.options, self.stale_after = sweep, workdir.resolve(), options, stale_after
        self.failed: list[str] = []
        self.preempted: list[str] = []
        self.done = 0
        self.signalled = False

    def run(self, address: str | None) -> SweepOutcome:
        import ray

        statuses = prepare_sweep(self.sweep, self.workdir)
        pending = [m for m in self.sweep.members if statuses[m.name] not in FINAL]
        self.done = len(self.sweep.members) - len(pending)
        # workers import this package (run_member) from this checkout: a cluster's nodes share its file system
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        runtime_env = {"env_vars": {"PYTHONPATH": path}}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
        where = address or "a Ray instance started here"
        print(
            f"sweep {self.workdir}: {len(self.sweep.members)} members; {self.done} already done, {len(pending)} to run on {where}"
        )
        try:
            tasks = {self.submit(ray, m): m for m in pending}
            self.follow(ray, tasks)
        finally:
            ray.shutdown()
        return SweepOutcome(self.failed, self.preempted, self.signalled)

    def submit(self, ray: Any, m: Member) -> Any:
        (self.workdir / LOGS_DIR).mkdir(exist_ok=True)
        # absolute paths: a worker's working directory is Ray's to choose
        config, run = member_config_path(self.workdir, m.name), self.workdir / m.name
        cmd = [sys.executable, str(TRAIN_SCRIPT), str(config), "--workdir", str(run), "--claim"]
        cmd += ["--stale-after", str(self.stale_after)]
        remote = ray.remote(max_retries=0, **member_resources(self.options, m.config))(run_member)
        return remote.remote(cmd, str(self.log_path(m)))

    def log_path(self, m: Member) -> Path:
        return self.workdir / LOGS_DIR / f"{m.name}.log"

    def follow(self, ray: Any, tasks: dict) -> None:
        """Wait for the tasks, one line per member as it ends, and a bar of members done."""
        import signal

        from tqdm import tqdm

        bar = tqdm(total=len(self.sweep.members), initial=self.done, unit="member", disable=None)
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        cancelled = False
        try:
            while tasks:
                if self.signalled and not cancelled:  # once: a second interrupt would cut the checkpoint short
                    for ref in tasks:
                        ray.cancel(ref)
                    cancelled = True
                ready, _ = ray.wait(list(tasks), num_returns=1, timeout=1.0)
                for ref in ready:
                    self.finish(tasks.pop(ref), _exit_code(ray, ref), bar.write)
                    bar.update(1)
                running = sum(claim_path(self.workdir / tasks[ref].name).exists() for ref in tasks)
                bar.set_postfix_str(f"running {running}, queued {len(tasks) - running}, failed {len(self.failed)}")
        finally:
            bar.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def finish(self, m: Member, rc: int, log: Callable[[str], None]) -> None:
        status = rundir.status(self.workdir / m.name, m.config.train.steps)
        if rc == 0 or status in FINAL:
            self.done += 1
            log(f"  {m.name}: {status}{result_summary(self.workdir / m.name)}")
        elif rc == EXIT_PREEMPTED:
            self.preempted.append(m.name)
            log(f"  {m.name}: preempted; it resumes when the sweep is run again")
        else:
            self.failed.append(m.name)
            log(f"  {m.name}: failed (exit {rc}); see {relative(self.log_path(m))}")


def _exit_code(ray: Any, ref: Any) -> int:
    """A finished task's exit code: the member's, or 75 for a cancelled task, 1 for a lost one."""
    try:
        return int(ray.get(ref))
    except ray.exceptions.TaskCancelledError:
        return EXIT_PREEMPTED
    except ray.exceptions.RayError:  # the worker or its node died
        return 1


# --- SLURM ---------------------------------------------------------------------------------------


def slurm_options(block: dict, args: argparse.Namespace) -> dict:
    """sweep.slurm with the --slurm-* flags over it, checked. Every value becomes a line of the batch
    script, so none may hold a newline or another control character (it would be a shell command)."""
    options = dict(_check_keys("sweep.slurm", block, SLURM_KEYS))
    where = {key: f"sweep.slurm.{key}" for key in options}
    for key in SLURM_FLAGS:
        value = getattr(args, f"slurm_{key}")
        if value is not None:
            options[key], where[key] = value, f"--slurm-{key.replace('_', '-')}"
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "max_parallel"):
        value = options.get(key)
        if value is not None and not (str(value).isdigit() and int(value) >= 1):
            raise SweepError(where[key], f"expected an integer >= 1, got {value!r}")
    for key in SLURM_TEXT:
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise SweepError(where[key], f"expected a string, got {value!r}")
    extra = options.get("extra", [])
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise SweepError("sweep.slurm.extra", "expected a list of sbatch options, e.g. ['--constraint=a100']")
    for key, value in options.items():
        for item in value if key == "extra" else [value]:
            _one_line(where[key], item)
    return options


def _one_line(where: str, value: object) -> None:
    """Refuse (SweepError naming `where`) a value for the batch script holding a newline or another
    control character: written into the script, it could end its line and start a command."""
    text = str(value)
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text):
        raise SweepError(
            where, f"{text!r} holds a newline or another control character; it would be written into the batch script"
        )


def sbatch_lines(options: dict, n_members: int, workdir: Path) -> list[str]:
    """The #SBATCH header: one array task per member, logs beside the members' own."""
    throttle = f"%{options['max_parallel']}" if options.get("max_parallel") else ""
    lines = [
        f"--job-name={workdir.name}",
        f"--array=0-{n_members - 1}{throttle}",
        f"--output={workdir / LOGS_DIR}/slurm-%A_%a.log",
        "--open-mode=append",  # a requeued task appends to its log
        "--requeue",
        "--signal=B:TERM@120",  # SIGTERM 2 minutes before the time limit: the member checkpoints
        "--ntasks-per-node=1",
    ]
    for key in ("partition", "time", "account", "qos", "nodes", "gpus_per_node", "cpus_per_task", "mem"):
        if options.get(key) is not None:
            lines.append(f"--{key.replace('_', '-')}={options[key]}")
    return ["#SBATCH " + line for line in lines + list(options.get("extra", []))]


def slurm_script(sweep: Sweep, workdir: Path, options: dict) -> str:
    """The job array's batch script: task i runs member i, claimed (a requeued task takes its own
    claim back at once) and resumed from its checkpoint when it has one. A member that stops on the
    time limit's SIGTERM (exit 75) requeues its task. Multi-node members run one process per node
    under srun, joined by jax.distributed.initialize() from SLURM's environment, unclaimed: their
    processes cannot share one claim, and process 0's run-directory lock keeps a second copy out."""
    workdir = workdir.resolve()
    _one_line("--workdir", workdir)  # in #SBATCH lines and comments, where quoting does not help
    _one_line("sweep file", sweep.source)
    names = " ".join(shlex.quote(m.name) for m in sweep.members)
    multi = int(options.get("nodes") or 1) > 1
    train = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'train.py'))}"
    member = f'{shlex.quote(str(workdir))}/members/"$NAME".yaml --workdir {shlex.quote(str(workdir))}/"$NAME"'
    run = f"srun {train} {member} --coordinator auto" if multi else f"{train} {member} --claim"
    header = "\n".join(sbatch_lines(options, len(sweep.members), workdir))
    return f"""#!/bin/bash
# A sweep of {len(sweep.members)} members from {sweep.source}: task i runs member i into its own run
# directory. Resubmit it as it is (sbatch {relative(workdir / SLURM_DIR / SLURM_SCRIPT)}): finished members end at once,
# interrupted ones resume. Compare what has finished: python eval.py --compare {relative(workdir)}
{header}
set -u
MEMBERS=({names})
NAME=${{MEMBERS[$SLURM_ARRAY_TASK_ID]}}
cd {shlex.quote(str(ROOT))}
{run} &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM INT
wait $child
rc=$?
if [ $rc -gt 128 ]; then wait $child; rc=$?; fi  # the trap woke the first wait: wait for the checkpoint
if [ $rc -eq {EXIT_PREEMPTED} ]; then scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"; fi
exit $rc
"""


def submit_slurm(sweep: Sweep, workdir: Path, options: dict, wait: bool) -> SweepOutcome | None:
    """Write DIR/slurm/sweep.sbatch and submit the unfinished members' tasks; with `wait`, block until
    the array is done and say how it went."""
    statuses = prepare_sweep(sweep, workdir)
    todo = [i for i, m in enumerate(sweep.members) if statuses[m.name] not in FINAL]
    script = workdir / SLURM_DIR / SLURM_SCRIPT
    rundir.atomic_write(script, slurm_script(sweep, workdir, options))
    (workdir / LOGS_DIR).mkdir(exist_ok=True)
    print(f"sweep {workdir}: {len(sweep.members)} members; {len(sweep.members) - len(todo)} already done")
    if not todo:
        return SweepOutcome([], [], False)
    throttle = f"%{options['max_parallel']}" if options.get("max_parallel") else ""
    cmd = ["sbatch", "--parsable", f"--array={','.join(map(str, todo))}{throttle}"] + (["--wait"] if wait else [])
    cmd.append(str(script))
    out = _sbatch(cmd, wait)
    job = out.strip().split(";")[0]
    if not wait:
        print(
            f"submitted job array {job} ({len(todo)} tasks): squeue -j {job}; when done: python eval.py --compare {relative(workdir)}"
        )
        return None
    statuses = {m.name: rundir.status(workdir / m.name, m.config.train.steps) for m in sweep.members}
    failed = [m.name for m in sweep.members if statuses[m.name] not in FINAL]
    for name in failed:
        print(f"  {name}: {statuses[name]}; see {relative(workdir / LOGS_DIR)}/slurm-{job}_*.log")
    return SweepOutcome(failed, [], False)


def _sbatch(cmd: list[str], wait: bool) -> str:
    """Run sbatch; a missing sbatch or a refused submission is one SweepError."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise SweepError("", "--launcher slurm: sbatch not found; run on a SLURM login node") from None
    if out.returncode != 0 and not (wait and out.stdout.strip()):  # --wait exits non-zero when a task failed
        lines = out.stderr.strip().splitlines()
        raise SweepError("", f"sbatch refused the array: {lines[-1] if lines else out.returncode}")
    return out.stdout
