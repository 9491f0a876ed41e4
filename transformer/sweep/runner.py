"""Running a sweep's members: the manifest and member configs written (`prepare_sweep`), then each
member as its own `train.py` process into `DIR/<name>/`, claimed first so that several runners can
share a directory (`claims.py`), at most `parallel` at once, dying with the sweep. Members that
finished, or that the monitor stopped (a result, not a crash), are not run again; interrupted ones
resume."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformer import rundir
from transformer.config import ROOT, Config, ConfigError, config_changes
from transformer.errors import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USAGE
from transformer.rundir import FINAL, atomic_write, read_events
from transformer.sweep.claims import STALE_AFTER, Claim, claim_path, is_stale, read_claim
from transformer.sweep.expansion import LOGS_DIR, MANIFEST, MEMBERS_DIR, Member, Sweep, SweepError
from transformer.train import PARENT_PID_ENV

TRAIN_SCRIPT = ROOT / "train.py"
POLL_SECONDS = 0.2
PR_SET_PDEATHSIG = 1  # prctl(2), <linux/prctl.h>


def relative(path: Path) -> str:
    """`path` relative to the working directory when it is under it, as commands and messages show it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def member_config_path(workdir: Path, name: str) -> Path:
    """Where the sweep in `workdir` keeps member `name`'s resolved config."""
    return workdir / MEMBERS_DIR / f"{name}.yaml"


def command(member_config: Path, workdir: Path, python: str = "python", claim: bool = False) -> list[str]:
    """The train.py command line that runs one member into its run directory; with `claim`, one that
    claims the member first (transformer/sweep/claims.py), for commands run by others than a sweep runner."""
    return [python, relative(TRAIN_SCRIPT), relative(member_config), "--workdir", relative(workdir)] + (
        ["--claim"] if claim else []
    )


def prepare_sweep(sweep: Sweep, workdir: Path) -> dict[str, str]:
    """Write the manifest and member configs; refuse (before running anything) a member whose run
    directory holds a run of a different config. Returns each member's status."""
    for m in sweep.members:
        if rundir.has_config(workdir / m.name):
            try:
                saved = rundir.read_config(workdir / m.name)
            except ConfigError as e:  # another version's or a damaged config: its run stays as it is
                raise SweepError("", f"sweep member {m.name}: {e}; use a new --workdir") from None
            unsafe, _ = config_changes(saved, _as_saved_dtype(m.config, saved).with_vocab(saved.model.vocab_size))
            if unsafe:
                raise SweepError(
                    "",
                    f"sweep member {m.name}: {workdir / m.name} holds a run of another config: "
                    f"{'; '.join(unsafe[:3])}{' ...' if len(unsafe) > 3 else ''}; use a new --workdir",
                )
    (workdir / MEMBERS_DIR).mkdir(parents=True, exist_ok=True)
    for m in sweep.members:
        atomic_write(member_config_path(workdir, m.name), m.config.to_yaml())
    atomic_write(workdir / MANIFEST, json.dumps(sweep.manifest(), indent=1))
    return {m.name: rundir.status(workdir / m.name, m.config.train.steps) for m in sweep.members}


def _as_saved_dtype(member: Config, saved: Config) -> Config:
    """A member leaving `model.dtype` to `auto` is not refused here for the dtype its run directory
    recorded: auto is decided by the machine the member's train.py runs on (which refuses there if it
    is not the saved one), and deciding it in this process would take the accelerator from the runs."""
    if member.model.dtype != "auto":
        return member
    return dataclasses.replace(member, model=dataclasses.replace(member.model, dtype=saved.model.dtype))


def print_commands(sweep: Sweep, workdir: Path, log: Callable[[str], None] = print) -> None:
    """Prepare the sweep and print the command of each unfinished member, for a scheduler to run."""
    statuses = prepare_sweep(sweep, workdir)
    for m in sweep.members:
        if statuses[m.name] not in FINAL:
            log(shlex.join(command(member_config_path(workdir, m.name), workdir / m.name, claim=True)))
    log(f"# then: python eval.py --compare {shlex.quote(relative(workdir))}")


@dataclasses.dataclass(frozen=True)
class SweepOutcome:
    """How running a sweep ended. Writing its report is the caller's (the CLI's) step."""

    failed: list[str]  # members that exited with an error
    preempted: list[str]  # members that checkpointed and exited on a signal
    signalled: bool  # the sweep itself got SIGINT/SIGTERM

    @property
    def interrupted(self) -> bool:
        """Not run to the end: the same command resumes it (and its report is written then)."""
        return self.signalled or bool(self.preempted)

    @property
    def exit_code(self) -> int:
        """0 when every member finished (or was stopped by the monitor), 75 when interrupted (run the
        same command to go on), 1 when a member failed."""
        if self.interrupted:
            return EXIT_PREEMPTED
        return EXIT_FAILED if self.failed else 0

    def closing_line(self) -> str | None:
        """The sweep's last line: why it did not succeed, or None when it did."""
        if self.interrupted:
            return f"sweep interrupted: run the same command to resume ({len(self.preempted)} member(s) preempted)"
        if self.failed:
            return f"sweep: {len(self.failed)} member(s) failed: {', '.join(self.failed)}"
        return None


class SweepRunner:
    """Runs a prepared sweep's unfinished members as train.py processes, `parallel` at a time.

    The first SIGINT/SIGTERM to the sweep asks each running member to checkpoint and exit, a second
    makes them exit at once; either way nothing more is started. A member that fails with exit 2 (a
    user mistake, which would repeat in every member) stops the sweep from starting the rest.

    Each member is claimed before it starts (transformer/sweep/claims.py), so that other runners on the
    same directory (`--shared`) leave it alone; a member another runner holds is deferred, and taken
    up when its claim is let go (or goes stale) unfinished, or counted done when it finishes. (So a
    member that failed under another runner is tried once more here: it may have been that machine.)
    """

    def __init__(
        self,
        sweep: Sweep,
        workdir: Path,
        statuses: dict[str, str],
        parallel: int = 1,
        log: Callable[[str], None] = print,
        stale_after: float = STALE_AFTER,
    ):
        self.sweep, self.workdir, self.statuses, self.parallel, self.log = sweep, workdir, statuses, parallel, log
        self.stale_after = stale_after
        self.claims: dict[str, Claim] = {}  # the members this runner holds
        self.deferred: list[Member] = []  # members other runners hold
        self.holders: dict[str, str] = {}  # the holder last named for each deferred member
        self.pending = [m for m in sweep.members if statuses[m.name] not in FINAL]
        self.done = len(sweep.members) - len(self.pending)  # finished before this run
        self.launched = 0
        self.running: dict[str, tuple[Member, subprocess.Popen, float]] = {}  # name -> (member, process, start)
        self.signals: list[int] = []
        self.failed: list[str] = []
        self.preempted: list[str] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def run(self) -> SweepOutcome:
        """Run every pending member (or until a signal) and say how it went."""
        mode = "one at a time" if self.parallel == 1 else f"{self.parallel} at a time"
        total = len(self.sweep.members)
        self.log(f"sweep {self.workdir}: {total} members; {self.done} already done, {len(self.pending)} to run, {mode}")
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.pending or self.running or self.deferred:
                while self.pending and len(self.running) < self.parallel and not self.signals:
                    self.launch(self.pending.pop(0))
                if self.signals:
                    self.pending.clear()
                    self.deferred.clear()
                time.sleep(POLL_SECONDS)
                self.poll()
                self.recheck_deferred()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for claim in self.claims.values():
                claim.release()
        return SweepOutcome(self.failed, self.preempted, bool(self.signals))

    def on_signal(self, signum: int, frame: Any) -> None:
        """Pass the signal on to the running members: as SIGTERM the first time, SIGINT after."""
        self.signals.append(signum)
        for _, proc, _ in self.running.values():
            proc.send_signal(signal.SIGTERM if len(self.signals) == 1 else signal.SIGINT)

    def launch(self, m: Member) -> None:
        """Start one member's train.py, in its own session (so a Ctrl-C reaches only the sweep, which
        passes it on once, as SIGTERM), bound to die with the sweep (see `die_with`). A copy of the
        member still running from an earlier sweep (killed at once, before its members could stop)
        is waited for first, never run beside."""
        if not self.take(m):
            return
        out = None
        if self.parallel > 1:  # interleaved progress bars help nobody: each member logs to a file
            (self.workdir / LOGS_DIR).mkdir(exist_ok=True)
            out = open(self.workdir / LOGS_DIR / f"{m.name}.log", "a")
        self.launched += 1
        verb = "resuming" if self.statuses[m.name] == "interrupted" else "starting"
        self.log(f"[{self.done + self.launched}/{len(self.sweep.members)}] {m.name}: {verb}")
        cmd = command(member_config_path(self.workdir, m.name), self.workdir / m.name, sys.executable)
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env={**self.env, PARENT_PID_ENV: str(os.getpid())},
            start_new_session=True,
            preexec_fn=functools.partial(die_with, os.getpid(), prctl_function()),
        )
        if out is not None:
            out.close()
        self.running[m.name] = (m, proc, time.monotonic())

    def take(self, m: Member) -> bool:
        """Claim member `m` for this runner: False (and `m` deferred, or done) when another runner
        holds it or has finished it, or when `wait_for_earlier_copy` says not to launch it."""
        claim = Claim(self.workdir / m.name, self.stale_after, on_lost=functools.partial(self.on_lost, m.name))
        holder = claim.try_acquire()
        if holder is not None:
            if self.holders.get(m.name) != holder:  # said once per holder, not at every poll
                self.log(f"  {m.name}: claimed by {holder}; left to it")
                self.holders[m.name] = holder
            self.deferred.append(m)
            return False
        self.statuses[m.name] = rundir.status(self.workdir / m.name, m.config.train.steps)
        if self.statuses[m.name] not in FINAL and self.wait_for_earlier_copy(m):
            self.claims[m.name] = claim
            return True
        if self.statuses[m.name] in FINAL:
            self.done += 1
            self.log(
                f"  {m.name}: {self.statuses[m.name]} already (by another runner){result_summary(self.workdir / m.name)}"
            )
        claim.release()
        return False

    def on_lost(self, name: str) -> None:
        """Member `name`'s claim was taken over (this runner was frozen past the stale timeout): stop
        its process as a preemption, so that two never write the member at once for long."""
        self.log(f"  {name}: its claim was taken over by another runner; stopping it")
        if name in self.running:
            self.running[name][1].send_signal(signal.SIGTERM)

    def recheck_deferred(self) -> None:
        """Members other runners held: done once finished, back to pending once let go unfinished."""
        for m in list(self.deferred):
            status = rundir.status(self.workdir / m.name, m.config.train.steps)
            seen = read_claim(claim_path(self.workdir / m.name))
            if status in FINAL:
                self.deferred.remove(m)
                self.done += 1
                self.log(f"  {m.name}: {status} (by another runner){result_summary(self.workdir / m.name)}")
            elif seen is None or is_stale(*seen, self.stale_after):
                self.deferred.remove(m)
                self.pending.append(m)

    def wait_for_earlier_copy(self, m: Member) -> bool:
        """Wait while another process (an orphan of a killed sweep) holds member `m`'s run directory.
        False when `m` is not to be launched: the sweep was signalled, or the copy finished it."""
        holder = rundir.lock_holder(self.workdir / m.name)
        if holder is None:
            return True
        self.log(f"  {m.name}: waiting for {holder}, which still runs it (left by an earlier sweep)")
        while rundir.lock_holder(self.workdir / m.name) is not None and not self.signals:
            time.sleep(POLL_SECONDS)
            self.poll()
        self.statuses[m.name] = rundir.status(self.workdir / m.name, m.config.train.steps)
        return not self.signals and self.statuses[m.name] not in FINAL

    def poll(self) -> None:
        """Collect the members that have exited."""
        for name, (m, proc, started) in list(self.running.items()):
            rc = proc.poll()
            if rc is not None:
                del self.running[name]
                self.claims.pop(name).release()
                self.finish(m, rc, time.monotonic() - started)

    def finish(self, m: Member, rc: int, seconds: float) -> None:
        """Log how a member ended, and note a failure or a preemption."""
        status = rundir.status(self.workdir / m.name, m.config.train.steps)
        if rc == 0 or status in FINAL:
            self.log(f"  {m.name}: {status} in {seconds:.0f} s{result_summary(self.workdir / m.name)}")
        elif rc == EXIT_PREEMPTED:
            self.preempted.append(m.name)
            self.log(f"  {m.name}: preempted after {seconds:.0f} s; it resumes when the sweep is run again")
        else:
            self.failed.append(m.name)
            where = f"; see {relative(self.workdir / LOGS_DIR / (m.name + '.log'))}" if self.parallel > 1 else ""
            self.log(f"  {m.name}: failed (exit {rc}) after {seconds:.0f} s{where}")
            if rc == EXIT_USAGE and self.pending:  # a user mistake (config, data) would repeat in every member
                self.log(f"  not starting the {len(self.pending)} remaining member(s): exit 2 is a user mistake")
                self.pending.clear()


def run_sweep(
    sweep: Sweep,
    workdir: Path,
    parallel: int = 1,
    log: Callable[[str], None] = print,
    shared: bool = False,
    stale_after: float = STALE_AFTER,
) -> SweepOutcome:
    """Prepare the sweep in `workdir` and run its unfinished members, `parallel` at a time (see
    SweepRunner). The report is not written here: `transformer.report.render.write_report` does that.
    One sweep at a time runs in a directory (rundir.Busy names the one already running there), unless
    it is `shared`: then runners on any number of machines work on it together, member by member."""
    with contextlib.nullcontext() if shared else rundir.RunLock(workdir):
        return SweepRunner(sweep, workdir, prepare_sweep(sweep, workdir), parallel, log, stale_after).run()


def prctl_function() -> Callable[..., int] | None:
    """Linux's prctl(2), looked up before the fork (a child between fork and exec should do little)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the member's watchdog thread (signals.py) stands in
        return None


def die_with(sweep_pid: int, prctl: Callable[..., int] | None) -> None:
    """In a member, between fork and exec: have the kernel send it SIGTERM when the sweep dies, even
    by SIGKILL (it then checkpoints and exits 75, as on a Ctrl-C passed on), so that no member
    outlives its sweep to run beside the copy a rerun starts. If the sweep is gone already, it ends
    here (a signal would run the sweep's own handler, inherited by this fork, and nobody waits for it)."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != sweep_pid:
        os._exit(EXIT_PREEMPTED)


def result_summary(workdir: Path) -> str:
    """', val loss 1.234' from a finished member's end event, if it has one."""
    ends = read_events(workdir, "end")
    try:
        return f", val loss {float(ends[-1]['val_loss']):.4f}"
    except (IndexError, KeyError, ValueError, TypeError):
        return ""
