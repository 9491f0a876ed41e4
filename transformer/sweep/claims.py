"""Claims: which process runs a sweep member, when several runners share one sweep directory.

Runners on other machines (or a scheduler's jobs running `--print-commands` lines) cannot see each
other's processes, and flock(2) is not dependable on every shared file system, so a member is claimed
by a file, `DIR/<member>/.claim`, created exclusively (O_CREAT | O_EXCL, atomic on local file systems
and NFSv3+). It holds who claimed it: {"host", "pid", "token", "since", and the SLURM array task if
any}; its modification time is the heartbeat, touched by the holder every `HEARTBEAT_SECONDS` (a
touch is atomic, rewriting the file would not be). A claim is stale when its heartbeat is older than
`stale_after` seconds (clocks must agree to well within that), or at once when its holder is a dead
process on this host or an earlier attempt of this very SLURM array task (a requeue). A stale claim
is taken over by one runner only: the taker first creates `.claim.<token>.takeover` exclusively
(for the stale token it saw), then checks that the claim still is that stale one, and replaces it.
A holder whose claim was taken over (it was frozen for longer than `stale_after`) finds another
token in the file at its next heartbeat and is told by `lost`.

A finished member is never run again: callers check the run's status (rundir) before claiming and
again once the claim is theirs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

CLAIM = ".claim"  # beside rundir's .lock, in the member's run directory; member names never start with "."
HEARTBEAT_SECONDS = 5.0
STALE_AFTER = 120.0  # the default: a heartbeat missed for this long means its holder is gone
SLURM_TASK_ENV = ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")


def claim_path(member_dir: Path) -> Path:
    return Path(member_dir) / CLAIM


def _identity() -> dict:
    record = {"host": socket.gethostname(), "pid": os.getpid()}
    slurm = [os.environ.get(k) for k in SLURM_TASK_ENV]
    if all(slurm):
        record["slurm_task"] = "_".join(slurm)  # type: ignore[arg-type]
    return record


def read_claim(path: Path) -> tuple[dict, float] | None:
    """(record, heartbeat age in seconds), or None when unclaimed (or the file is being replaced).
    A file without a record ({}) is stale once its age passes the timeout, like any other."""
    try:
        age = time.time() - path.stat().st_mtime
        text = path.read_text()
    except OSError:
        return None
    try:
        record = json.loads(text)
    except ValueError:  # being written, or left empty by a crash just after its creation: judged by its age
        record = {}
    return (record if isinstance(record, dict) else {}), age


def describe(record: dict, age: float) -> str:
    if "pid" not in record:
        return "another runner (its claim is being written)"
    return f"pid {record.get('pid')} on host {record.get('host')} (heartbeat {age:.0f} s ago)"


def _alive_here(pid: object) -> bool:
    try:
        os.kill(int(pid), 0)  # type: ignore[call-overload]
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True  # someone else's process, or a record we cannot judge: trust the heartbeat
    return True


def is_stale(record: dict, age: float, stale_after: float) -> bool:
    """Whether a claim's holder is gone: a missed heartbeat, a dead process on this host, or an
    earlier attempt of this SLURM array task (requeued: it is this task's to resume)."""
    me = _identity()
    if age > stale_after:
        return True
    if record.get("host") == me["host"] and record.get("pid") != me["pid"] and not _alive_here(record.get("pid")):
        return True
    return "slurm_task" in me and record.get("slurm_task") == me["slurm_task"] and record.get("pid") != me["pid"]


class Claim:
    """One member's claim, held by this process from a successful `try_acquire` to `release`, with a
    heartbeat thread touching it meanwhile."""

    def __init__(
        self,
        member_dir: Path,
        stale_after: float = STALE_AFTER,
        heartbeat: float = HEARTBEAT_SECONDS,
        on_lost: Callable[[], None] | None = None,
    ):
        self.path = claim_path(member_dir)
        self.on_lost = on_lost  # called (from the heartbeat thread) once the claim was taken over
        self.stale_after, self.heartbeat = stale_after, heartbeat
        self.token = uuid.uuid4().hex
        self.held = False
        self.lost = threading.Event()  # set when another runner took the claim over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self) -> str | None:
        """Take the claim: None when it is ours now, else who holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {**_identity(), "token": self.token, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        text = json.dumps(record) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return self._take_over(text)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        self._hold()
        return None

    def _take_over(self, text: str) -> str | None:
        seen = read_claim(self.path)
        if seen is None:
            return "another runner (its claim is being written or replaced)"
        record, age = seen
        if not is_stale(record, age, self.stale_after):
            return describe(record, age)
        marker = self.path.with_name(f"{CLAIM}.{record.get('token')}.takeover")
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return "another runner, taking over a stale claim"
        again = read_claim(self.path)  # still the stale claim we saw? (another taker may have been quicker)
        if again is None or again[0].get("token") != record.get("token"):
            marker.unlink(missing_ok=True)
            return "another runner, which took over a stale claim"
        tmp = self.path.with_name(f"{CLAIM}.{self.token}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        marker.unlink(missing_ok=True)  # safe: a later taker re-reads the claim and finds our token
        self._hold()
        return None

    def _hold(self) -> None:
        self.held = True
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"claim-{self.path.parent.name}")
        self._thread.start()

    def owned(self) -> bool:
        seen = read_claim(self.path)
        return seen is not None and seen[0].get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.owned():
                self.lost.set()
                if self.on_lost is not None:
                    self.on_lost()
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # a file system hiccup: the next beat tries again; a long one lets the claim go stale

    def release(self) -> None:
        """Let the claim go (only if it is still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.held and self.owned():
            self.path.unlink(missing_ok=True)
        self.held = False


def run_claimed(
    member_dir: Path,
    is_done: Callable[[], bool],
    run: Callable[[], int],
    stale_after: float = STALE_AFTER,
    log: Callable[[str], None] = print,
    poll: float = 1.0,
) -> int:
    """`run()` under the member's claim (train.py --claim: a scheduler's job, a Ray task, a SLURM
    array task). A member finished already is not run again (0). A member claimed by a live holder is
    waited for: 0 once that holder finishes it, or it is run here once the claim goes stale. A claim
    taken over while running stops this run as SIGTERM does: checkpoint, exit 75."""
    claim = Claim(member_dir, stale_after, on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    waiting = False
    while True:
        if is_done():
            log(f"{member_dir}: finished already{' (by that runner)' if waiting else ''}; nothing to do")
            return 0
        holder = claim.try_acquire()
        if holder is None:
            break
        if not waiting:
            log(f"{member_dir}: claimed by {holder}; waiting for it to finish or go stale")
            waiting = True
        time.sleep(poll)
    try:
        if is_done():  # finished by the holder just before it let go
            return 0
        return run()
    finally:
        claim.release()
