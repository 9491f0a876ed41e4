"""Claims: which process runs a sweep member, when several runners share one sweep directory.

Runners on other machines (or a scheduler's jobs running `--print-commands` lines) cannot see each
other's processes, and flock(2) is not dependable on every shared file system, so a member is claimed
by a file, `DIR/<member>/.claim`, created exclusively (O_CREAT | O_EXCL, atomic on local file systems
and NFSv3+). It holds who claimed it: {"host", "pid", "token", "since", and the SLURM array task if
any}; its modification time is the heartbeat, touched by the holder every `HEARTBEAT_SECONDS` (a
touch is atomic, rewriting the file would not be). A claim is stale when its heartbeat is older than
`stale_after` seconds (clocks must agree to well within that), or at once when its holder is a dead
process on this host or an earlier attempt of this very SLURM array task (a requeue). A `.claim` that
is not a regular file (a directory, a link, a FIFO) is damage, refused (rundir.Busy), not waited on.

A stale claim is taken over by one runner only: the taker creates a marker `.claim.<token>.takeover`
exclusively (for the stale token it saw, holding the taker's own), then checks that the claim still
is that stale one and the marker still its own, replaces the claim (os.replace) and removes the marker.
A taker killed between creating its marker and removing it leaves the marker behind, which would
keep every later taker out for good; so a marker older than `stale_after` (a taker needs
milliseconds) is abandoned. It is passed over, never removed and made again under the same name: two
takers that both judged it abandoned would each remove the other's new one. Past an abandoned marker
the taker tries the next level, `.claim.<token>.takeover.2` (then .3, ...), created exclusively too,
so of the takers that judged level n abandoned exactly one creates level n+1 and the others, finding
it fresh, back off. Only the winner (or a taker undoing its own marker) removes markers: after its
replace, all levels up to its own. A taker that creates a level after that re-reads the claim, finds
another token and backs off, so no stale token is taken over twice. The one assumption is that of the
heartbeat: no taker is frozen for longer than `stale_after` between its marker and its replace. One that
is finds its marker gone (removed by the winner that passed it over) and backs off; frozen in the
instant between that check and its replace, it displaces the winner, which is told at its next
heartbeat, as below (and the run directory's lock keeps a second trainer out meanwhile).

A holder whose claim was taken over (it was frozen for longer than `stale_after`) finds another
token in the file at its next heartbeat and is told by `lost`.

A finished member is never run again: callers check the run's status (rundir) before claiming and
again once the claim is theirs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from transformer.rundir import Busy, open_in_run

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
    """(record, heartbeat age in seconds), or None when unclaimed. A file without a readable record
    ({}: being written, emptied by a crash, not UTF-8 JSON, unreadable) is stale once its age passes
    the timeout, like any other. A `.claim` that is not a regular file is rundir.Busy (damage)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block
    except FileNotFoundError:
        return None
    except OSError:
        return _unreadable(path)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _damaged(path)
    with os.fdopen(fd, "rb") as f:
        try:
            record = json.loads(f.read().decode())
        except (OSError, ValueError):  # being written, left empty by a crash, not UTF-8: judged by its age
            record = {}
    return (record if isinstance(record, dict) else {}), time.time() - info.st_mtime


def _unreadable(path: Path) -> tuple[dict, float] | None:
    """A claim that cannot be opened: damage unless a regular file (then judged by its age)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return {}, 0.0  # nothing to judge by: a holder, as far as we know
    if not stat.S_ISREG(info.st_mode):
        raise _damaged(path)
    return {}, time.time() - info.st_mtime


def _damaged(path: Path) -> Busy:
    return Busy(
        f"{path} is not a claim file (a directory, a link or a FIFO): the run directory is damaged; "
        "remove it once no runner works on this member"
    )


def _marker(path: Path, token: object, level: int) -> Path:
    """The takeover marker of level `level` for the stale claim `token` (see the module's docstring);
    a token that is not a plain name (a damaged record) by its hash, to stay a file beside the claim."""
    name = token if isinstance(token, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", token) else None
    name = name or hashlib.sha256(repr(token).encode()).hexdigest()[:32]
    return path.with_name(f"{CLAIM}.{name}.takeover" + (f".{level}" if level > 1 else ""))


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
        """Take the claim: None when it is ours now, else who holds it. A member directory where
        no claim can be written is rundir.Busy."""
        record = {**_identity(), "token": self.token, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        text = json.dumps(record) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return self._take_over(text)
        except OSError as e:
            raise Busy(f"cannot claim {self.path.parent}: {e.strerror or e}") from None
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
        markers = self._mark(record.get("token"))
        if markers is None:
            return "another runner, taking over a stale claim"
        again = read_claim(self.path)  # still the stale claim we saw? (another taker may have been quicker)
        if again is None or again[0].get("token") != record.get("token") or not self._mine(markers[-1]):
            if self._mine(markers[-1]):
                markers[-1].unlink(missing_ok=True)
            return "another runner, which took over a stale claim"
        tmp = self.path.with_name(f"{CLAIM}.{self.token}.tmp")
        with os.fdopen(open_in_run(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
            f.write(text)
        os.replace(tmp, self.path)
        for marker in reversed(markers):  # safe: a later taker re-reads the claim and finds our token
            marker.unlink(missing_ok=True)
        self._hold()
        return None

    def _mark(self, token: object) -> list[Path] | None:
        """Create the first takeover marker for `token` past the abandoned ones: the markers from
        level 1 to ours, or None when another taker is at work (a fresh marker)."""
        markers = []
        for level in itertools.count(1):
            markers.append(_marker(self.path, token, level))
            try:
                fd = os.open(markers[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    age = time.time() - os.lstat(markers[-1]).st_mtime
                except FileNotFoundError:
                    return None  # its taker just finished or backed off: try again later
                if age <= self.stale_after:
                    return None
                continue  # abandoned: its taker died (or froze) between creating it and removing it
            except OSError as e:
                raise Busy(f"cannot claim {self.path.parent}: {e.strerror or e}") from None
            with os.fdopen(fd, "w") as f:
                f.write(self.token)
            return markers
        raise AssertionError("unreachable")

    def _mine(self, marker: Path) -> bool:
        try:
            return marker.read_text() == self.token
        except (OSError, ValueError):
            return False

    def _hold(self) -> None:
        self.held = True
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"claim-{self.path.parent.name}")
        self._thread.start()

    def owned(self) -> bool:
        try:
            seen = read_claim(self.path)
        except Busy:  # no longer a claim file at all: not ours
            return False
        return seen is not None and seen[0].get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.owned():
                self.lost.set()
                if self.on_lost is not None:
                    self.on_lost()
                return
            try:
                os.utime(self.path, follow_symlinks=False)
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
