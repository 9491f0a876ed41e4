"""The run directory: its file names, its one writer, and its readers.

```
DIR/
  config.yaml     the resolved config: written at start, compared on resume, read by eval and reports
  metrics.jsonl   one JSON object per logged step: {"step": ..., "loss": ..., ...}
  events.jsonl    one JSON object per event: {"event": "start" | "resume" | "spike" | ..., "step": ...}
  checkpoints/    orbax checkpoints (transformer/io/checkpoint.py)
  tb/             TensorBoard event files
  .lock           held (flock) by the one process that writes the run; names its host and pid
```

Only `RunWriter` appends to the two journals (process 0 of a run); everything else reads them here.
No file here is written through a symbolic link or into a FIFO, device or directory standing in its
place (a damaged or hostile directory): `open_in_run` refuses them, naming the path (Busy), and
`atomic_write` replaces the name, never what it points to.
A line torn by a crash mid-write is skipped by every reader, and dropped by `truncate_metrics`.
One process writes a run directory at a time: `RunLock` (taken by train.py's process 0 and by a
sweep on its own directory) refuses a second writer, naming the first.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import stat
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from transformer.config import Config

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"
LOCK = ".lock"  # a leading dot: no sweep member can be named so (member names never start with ".")

FINAL = ("finished", "stopped")  # statuses whose numbers are final (see run_status)


# --- files ---------------------------------------------------------------------------------------


def atomic_write(path: Path, text: str | bytes) -> None:
    """Write `text` (or bytes) to `path` so that a reader (or a crash) sees the old file or the new,
    never half. A symbolic link at `path` is replaced, not written through; the temporary file is a
    new one; a directory of it that is a link (planted to send the write elsewhere) is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent.is_symlink():
        raise Busy(f"{path.parent} is a symbolic link: refusing to write {path.name} through it")
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with os.fdopen(
        open_in_run(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb" if isinstance(text, bytes) else "w"
    ) as f:
        f.write(text)
    os.replace(tmp, path)


def open_in_run(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open(path, flags, mode) for writing a file of ours, never through a symbolic link (O_NOFOLLOW)
    nor into anything but a regular file (a FIFO would block, a device be written): Busy in one line
    naming `path` otherwise, as for a file that cannot be opened at all."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)  # O_NONBLOCK: a FIFO must not block
    except OSError as e:
        raise _refusal(Path(path), e) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refusal(Path(path), None)
    os.set_blocking(fd, True)
    return fd


def _refusal(path: Path, error: OSError | None) -> Busy:
    """Why `path` cannot be opened as a run's file: what stands in its place, or the OS's reason."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return Busy(
            f"{path} is a symbolic link: refusing to write through it (remove it if this run directory is yours)"
        )
    if mode is not None and not stat.S_ISREG(mode):
        return Busy(f"{path} is not a regular file: the run directory is damaged (remove it if the directory is yours)")
    return Busy(f"cannot write to {path}: {error.strerror if error is not None and error.strerror else error}")


def has_config(workdir: Path) -> bool:
    return (workdir / CONFIG).is_file()


def read_config(workdir: Path) -> Config:
    """The run's resolved config (a config.yaml written by this framework holds no `base:` links).
    A file that cannot be read, is not UTF-8 YAML, is empty or does not validate is one ConfigError
    naming it (eval.py and a resume both read it)."""
    from transformer.config import ConfigError
    from transformer.config_loader import load_config

    path = workdir / CONFIG
    damaged = f"the run's config {path} is damaged"
    try:
        if not path.read_bytes().strip():  # a resolved config always has sections: not the defaults
            raise ConfigError("", f"{damaged}: it is empty")
        return load_config(path)
    except OSError as e:
        raise ConfigError("", f"cannot read the run's config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError("", f"{damaged}: it is not UTF-8 text") from None
    except RecursionError:
        raise ConfigError("", f"{damaged}: it is nested too deeply") from None
    except ConfigError as e:
        if str(path) in str(e):  # the loader's own message names the file (invalid YAML at a line)
            raise
        raise ConfigError("", f"{damaged}: {e}") from None


def write_config(workdir: Path, cfg: Config) -> None:
    atomic_write(workdir / CONFIG, cfg.to_yaml())


def has_checkpoints(workdir: Path) -> bool:
    """A run to resume: a config and at least one finished checkpoint."""
    directory = workdir / CHECKPOINTS
    return has_config(workdir) and directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def has_metrics(workdir: Path) -> bool:
    return (workdir / METRICS).exists()


def _records(path: Path) -> list[dict]:
    """The JSON objects of a journal, one per line; a torn last line (a crash mid-write) is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_metrics(workdir: Path) -> list[dict]:
    """Every logged record, in the order written (after a rollback, abandoned steps come first)."""
    return [r for r in _records(workdir / METRICS) if "step" in r]


def metric_series(workdir: Path) -> dict[str, dict[int, Any]]:
    """key -> {step: value}: the last record per step and key wins."""
    series: dict[str, dict[int, Any]] = {}
    for record in read_metrics(workdir):
        step = int(record.pop("step"))
        for key, value in record.items():
            series.setdefault(key, {})[step] = value
    return series


def read_events(workdir: Path, kind: str | None = None) -> list[dict]:
    """The run's events in order, or only those of one kind."""
    return [e for e in _records(workdir / EVENTS) if "event" in e and (kind is None or e["event"] == kind)]


def run_status(events: list[dict], steps: int | None = None) -> str:
    """'pending' (never started), 'finished' (trained to `steps`, when given), 'stopped' (by the
    monitor), or 'interrupted'. A run that ended short of `steps` (train.steps was raised since) is
    'interrupted': running it again continues it from its last checkpoint."""
    status = "pending"
    for e in events:
        if e["event"] == "start":
            status = "interrupted"
        elif e["event"] == "end":
            status = "finished" if steps is None or e.get("step", 0) >= steps else "interrupted"
        elif e["event"] == "stopped":
            status = "stopped"
    return status


def status(workdir: Path, steps: int | None = None) -> str:
    """The status (see run_status) of the run in `workdir`, judged against `steps`."""
    return run_status(read_events(workdir), steps)


def truncate_metrics(workdir: Path, step: int, history: int = 0) -> int:
    """Drop metrics logged after `step` (a resumed run logs them again; 0: all of them), and torn
    lines; returns how many lines went. The first `history` bytes (the file as it was at the last
    rollback: `RunWriter.metrics_size`) hold the trajectories rollbacks abandoned, steps past `step`
    included, which no resumed run logs again: they stay, as an uninterrupted run keeps them."""
    path = workdir / METRICS
    if not path.exists():
        return 0
    data = path.read_bytes()
    kept, rest = (part.decode(errors="replace").splitlines() for part in (data[:history], data[history:]))
    keep = [line for line in kept if _step_of(line) >= 0] + [line for line in rest if 0 <= _step_of(line) <= step]
    if len(keep) != len(kept) + len(rest):
        atomic_write(path, "".join(line + "\n" for line in keep))
    return len(kept) + len(rest) - len(keep)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1  # a torn last line from a crash: dropped


# --- the writer ----------------------------------------------------------------------------------


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic) or hasattr(value, "__array__"):
        value = np.asarray(value).item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than invalid
    return value


def _append(path: Path):
    """A journal opened for appending (text), refused (Busy) when a link or not a file (see open_in_run)."""
    return os.fdopen(open_in_run(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")


class ScalarSink(Protocol):
    """Somewhere else the scalars go, as TensorBoard's tags (transformer/train/wandb_sink.py)."""

    def scalars(self, step: int, tags: list[tuple[str, float]]) -> None: ...

    def close(self) -> None: ...


def scalar_tags(values: dict[str, Any]) -> list[tuple[str, float]]:
    """The scalars of a metrics record as TensorBoard shows them: per-layer lists one tag per layer."""
    tags = []
    for k, v in values.items():
        if isinstance(v, (list, tuple)):
            tags += [(f"{k}/layer_{i}", float(x)) for i, x in enumerate(v)]
        elif isinstance(v, (int, float, np.generic)):
            tags.append((k, float(v)))
    return tags


class RunWriter:
    """Appends one run's metrics and events (and TensorBoard scalars, and those of `sinks`). On
    processes other than 0, or without a directory, every call is a no-op."""

    def __init__(self, workdir: Path | None, enabled: bool, tensorboard: bool, sinks: Sequence[ScalarSink] = ()):
        self.enabled = enabled and workdir is not None
        self.tb = None
        self.sinks = sinks
        if workdir is None or not self.enabled:
            return
        workdir.mkdir(parents=True, exist_ok=True)
        self.metrics = _append(workdir / METRICS)
        try:
            self.events = _append(workdir / EVENTS)
        except Busy:
            self.metrics.close()
            raise
        if tensorboard:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self.tb = EventFileWriter(str(workdir / TENSORBOARD))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        tags = scalar_tags(values)
        if self.tb is not None:
            self._tensorboard(step, tags)
        for sink in self.sinks:
            sink.scalars(step, tags)

    def metrics_size(self) -> int:
        """The bytes written to metrics.jsonl so far (0 where this process writes none)."""
        if not self.enabled:
            return 0
        self.metrics.flush()
        return os.fstat(self.metrics.fileno()).st_size

    def _tensorboard(self, step: int, tags: list[tuple[str, float]]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(x)) for tag, x in tags]
        )
        assert self.tb is not None
        self.tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def event(self, kind: str, step: int, **fields) -> None:
        if not self.enabled:
            return
        record = {"event": kind, "step": step, "time": time.time(), **{k: _jsonable(v) for k, v in fields.items()}}
        self.events.write(json.dumps(record) + "\n")
        self.events.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.metrics.close()
        self.events.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close()


# --- the one writer --------------------------------------------------------------------------------


class Busy(Exception):
    """The directory cannot be taken as this process's to write (exit 2): another live process
    writes it (one writer per run directory), or it cannot be written at all."""


class RunLock:
    """An exclusive lock on a run directory, held from `acquire` to `release` (or the process's end).

    flock(2) on DIR/.lock: the kernel drops it when its holder dies, however it dies (SIGKILL, OOM,
    a lost node's NFS client), so a lock is never stale and nothing needs cleaning. The file says
    who holds it (host, pid, since), for the refusal; an empty or old content means nothing.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise Busy naming its holder."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Busy(f"cannot write to {self.directory}: {e.strerror or e}") from None
        fd = open_in_run(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(
                f"{self.directory} is in use by {lock_holder(self.directory) or 'another process'}: one writer "
                "per run directory; wait for it to end (or stop it), or use another --workdir"
            ) from None
        except OSError:  # a file system without locks (some NFS mounts): run unguarded rather than not at all
            os.close(fd)
            return
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(record) + "\n").encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty file: nobody holds it
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(directory: Path) -> str | None:
    """'pid 123 on host h (since ...)' when a live process holds `directory`'s lock, else None.
    (It probes by taking the lock for an instant: call it only where no writer may be starting.)"""
    try:
        fd = open_in_run(Path(directory) / LOCK, os.O_RDWR)
    except Busy:
        return None  # no lock file (never locked), or none that a writer could hold
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe_holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _describe_holder(fd: int) -> str:
    """Who holds the lock, from its file; the holder writes it just after locking, so wait a moment."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode())
            return f"pid {int(record['pid'])} on host {record['host']} (since {record['since']})"
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            time.sleep(0.05)
    return "another process"
