"""Ablation sweeps: a config file with a `sweep:` block expands into named member runs.

    sweep:
      grid:                          # every combination of these values
        model.norm_position: [pre, post]
        optim.lr: [1.0e-3, 3.0e-3]
      zip:                           # each group's lists vary together; an undotted key is a label
        - attention: [mha, mqa]
          model.n_kv_heads: [4, 1]
      seeds: [0, 1]                  # train.seed of each member; members are named <variant>-s<seed>
      name: "{model.norm_position}-lr{optim.lr}-{attention}"   # default: the varied values joined
      compare: model.norm_position   # what the report's verdict compares (default: the first varied key)

Everything outside `sweep:` is the base config every member shares. A member is the base with its
values set, validated whole before any member starts. Running a sweep into DIR writes
`DIR/sweep.json` (the expansion, read by the report), `DIR/members/<name>.yaml` (each member's
resolved config, so that `--print-commands` can hand self-contained commands to a scheduler) and
runs each member as its own `train.py` process into `DIR/<name>/`. Members that finished, or that
the monitor stopped (a result, not a crash), are not run again; interrupted ones resume.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformer import rundir
from transformer.config import ROOT, Config, ConfigError, all_keys, config_changes, flatten, from_dict
from transformer.errors import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USAGE
from transformer.rundir import FINAL, atomic_write, read_events

SWEEP_KEYS = ("grid", "zip", "seeds", "name", "compare")
MANIFEST = "sweep.json"
MEMBERS_DIR = "members"  # resolved member configs
LOGS_DIR = "logs"  # member output when several run at once
RESERVED = {MEMBERS_DIR, LOGS_DIR, "plots"}
TRAIN_SCRIPT = ROOT / "train.py"


class SweepError(ConfigError):
    """A mistake in a sweep file or in one of its members (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    variant: str  # the name without the seed: members of one variant differ only in train.seed
    values: dict[str, Any]  # the swept config keys, dotted, with this member's values
    labels: dict[str, Any]  # zip labels (undotted keys), for names and the report
    seed: int
    config: Config


@dataclasses.dataclass(frozen=True)
class Sweep:
    source: str
    members: tuple[Member, ...]
    keys: tuple[str, ...]  # varied config keys and labels, in file order (train.seed not included)
    compare: str

    def manifest(self) -> dict:
        return {
            "source": self.source,
            "keys": list(self.keys),
            "compare": self.compare,
            "members": [
                {"name": m.name, "variant": m.variant, "seed": m.seed, "values": m.values, "labels": m.labels}
                for m in self.members
            ],
        }


def _check_key(where: str, key: str) -> None:
    keys = all_keys()
    if key not in keys:
        match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        hint = f" (did you mean {match[0]}?)" if match else ""
        raise SweepError(f"{where}.{key}", f"unknown config key{hint}")
    if key == "train.seed":
        raise SweepError(f"{where}.{key}", "use sweep.seeds to repeat runs over seeds")


def _values(where: str, values: Any) -> list:
    if not isinstance(values, list) or not values:
        raise SweepError(where, f"expected a non-empty list of values, got {values!r}")
    return values


def _axes(spec: dict) -> tuple[list[list[dict]], list[str], set[str]]:
    """The sweep's independent axes, each a list of points {key: value}; the varied keys; the labels."""
    axes, keys, labels = [], [], set()
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict):
        raise SweepError("sweep.grid", "expected a mapping of key: [values]")
    for key, values in flatten(grid).items():  # dotted keys (optim.lr) or nested sections (optim: {lr: ...})
        _check_key("sweep.grid", key)
        axes.append([{key: v} for v in _values(f"sweep.grid.{key}", values)])
        keys.append(key)
    groups = spec.get("zip") or []
    if not isinstance(groups, list):
        raise SweepError("sweep.zip", "expected a list of groups, each a mapping of key: [values]")
    for i, group in enumerate(groups):
        where = f"sweep.zip[{i}]"
        if not isinstance(group, dict) or not group:
            raise SweepError(where, "expected a mapping of key: [values]")
        lengths = {key: len(_values(f"{where}.{key}", v)) for key, v in group.items()}
        if len(set(lengths.values())) != 1:
            raise SweepError(where, "lists of different lengths: " + ", ".join(f"{k} {n}" for k, n in lengths.items()))
        for key in group:
            if "." in key:
                _check_key(where, key)
            else:
                labels.add(key)
        axes.append([dict(zip(group, point)) for point in zip(*group.values())])
        keys += list(group)
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise SweepError("sweep", f"{repeated[0]} is swept twice (in grid and zip, or in two zip groups)")
    return axes, keys, labels


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "+".join(map(_text, value))
    return str(value)


def _render(template: str, lookup: Callable[[str], Any]) -> str:
    def one(match: re.Match) -> str:
        key, fmt = match.group(1), match.group(2)
        value = lookup(key)
        try:
            return format(value, fmt) if fmt else _text(value)
        except (ValueError, TypeError) as e:
            raise SweepError("sweep.name", f"cannot format {{{key}:{fmt}}} with {value!r}: {e}") from None

    return re.sub(r"\{([A-Za-z_][\w.]*)(?::([^}]*))?\}", one, template)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._,+-]+", "_", name).strip("._") or "run"


def expand(raw: dict[str, Any], source: str = "", overrides: tuple[str, ...] = ()) -> Sweep:
    """Expand a raw config with a `sweep:` block (as `config.load_raw` returns it) into validated
    members. Any mistake raises SweepError naming the member, when there is one, and the key."""
    raw = dict(raw)
    spec = raw.pop("sweep")
    if not isinstance(spec, dict):
        raise SweepError("sweep", f"expected a mapping with {', '.join(SWEEP_KEYS)}, got {spec!r}")
    for key in spec:
        if key not in SWEEP_KEYS:
            match = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            raise SweepError(f"sweep.{key}", "unknown key" + (f" (did you mean sweep.{match[0]}?)" if match else ""))
    axes, keys, labels = _axes(spec)
    for text in overrides:  # `train.py sweep.yaml optim.lr=1` would be silently overwritten by the sweep
        key = text.partition("=")[0]
        if key in keys:
            raise SweepError(key, "is swept; change its values in the sweep block instead of overriding it")
    seeds = spec.get("seeds")
    if seeds is not None:
        seeds = _values("sweep.seeds", seeds)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) or len(set(seeds)) != len(seeds):
            raise SweepError("sweep.seeds", f"expected distinct integers, got {seeds!r}")
    template = spec.get("name")
    if template is not None and not isinstance(template, str):
        raise SweepError(
            "sweep.name", f"expected a template string such as '{{model.norm_position}}', got {template!r}"
        )
    if template is not None and "{seed" in template:
        raise SweepError("sweep.name", "the seed is appended to every name as -s<seed>; leave {seed} out")
    compare = spec.get("compare", next((k for k in keys if k != "optim.lr"), keys[0] if keys else ""))
    if keys and compare not in keys:
        raise SweepError("sweep.compare", f"{compare!r} is not a swept key ({', '.join(keys)})")

    members, names = [], {}
    for point in itertools.product(*axes) if axes else [()]:
        assigned = {k: v for part in point for k, v in part.items()}
        values = {k: v for k, v in assigned.items() if k not in labels}
        for seed in seeds if seeds is not None else [None]:
            member_raw = dict(raw)
            for key, value in list(values.items()) + ([("train.seed", seed)] if seed is not None else []):
                section, _, leaf = key.partition(".")
                member_raw[section] = {**(member_raw.get(section) or {}), leaf: value}
            suffix = f"-s{seed}" if seed is not None else ""
            try:
                cfg = from_dict(member_raw)
            except ConfigError as e:
                raise SweepError(e.key, f"{e.message} (in sweep member {_default_name(assigned)}{suffix})") from None
            variant = _default_name(assigned) if template is None else _safe(_render(template, _lookup(cfg, assigned)))
            name = variant + suffix
            if name in names:
                raise SweepError(
                    "sweep.name",
                    f"two members are both named {name!r} ({names[name]} and {assigned}); "
                    "put the varied keys in the name template",
                )
            if name in RESERVED:
                raise SweepError("sweep.name", f"{name!r} is reserved for the sweep's own files; rename the member")
            names[name] = assigned
            labelled = {k: v for k, v in assigned.items() if k in labels}
            members.append(Member(name, variant, values, labelled, cfg.train.seed, cfg))
    return Sweep(source, tuple(members), tuple(keys), compare)


def _lookup(cfg: Config, assigned: dict) -> Callable[[str], Any]:
    """A name template may use any config key, e.g. {model.d_model}, and the zip labels."""
    known = {**flatten(cfg.to_dict()), **assigned}

    def get(key: str) -> Any:
        if key not in known:
            raise SweepError("sweep.name", f"{{{key}}} is neither a config key nor a zip label")
        return known[key]

    return get


def _default_name(assigned: dict) -> str:
    """'norm_position-pre,lr-0.001,mqa' from the varied values (labels stand alone). No '=': a
    path with one would read as an override on train.py's command line."""
    if not assigned:
        return "run"
    parts = [_text(v) if "." not in k else f"{k.rsplit('.', 1)[-1]}-{_text(v)}" for k, v in assigned.items()]
    return _safe(",".join(parts))


# --- running -------------------------------------------------------------------------------------


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def command(member_config: Path, workdir: Path, python: str = "python") -> list[str]:
    return [python, _relative(TRAIN_SCRIPT), _relative(member_config), "--workdir", _relative(workdir)]


def prepare(sweep: Sweep, workdir: Path) -> dict[str, str]:
    """Write the manifest and member configs; refuse (before running anything) a member whose run
    directory holds a run of a different config. Returns each member's status."""
    for m in sweep.members:
        if rundir.has_config(workdir / m.name):
            saved = rundir.read_config(workdir / m.name)
            unsafe, _ = config_changes(saved, m.config.with_vocab(saved.model.vocab_size))
            if unsafe:
                raise SweepError(
                    "",
                    f"sweep member {m.name}: {workdir / m.name} holds a run of another config: "
                    f"{'; '.join(unsafe[:3])}{' ...' if len(unsafe) > 3 else ''}; use a new --workdir",
                )
    (workdir / MEMBERS_DIR).mkdir(parents=True, exist_ok=True)
    for m in sweep.members:
        atomic_write(workdir / MEMBERS_DIR / f"{m.name}.yaml", m.config.to_yaml())
    atomic_write(workdir / MANIFEST, json.dumps(sweep.manifest(), indent=1))
    return {m.name: rundir.status(workdir / m.name, m.config.train.steps) for m in sweep.members}


def print_commands(sweep: Sweep, workdir: Path, log: Callable[[str], None] = print) -> None:
    statuses = prepare(sweep, workdir)
    for m in sweep.members:
        if statuses[m.name] not in FINAL:
            log(shlex.join(command(workdir / MEMBERS_DIR / f"{m.name}.yaml", workdir / m.name)))
    log(f"# then: python eval.py --compare {shlex.quote(_relative(workdir))}")


def run_sweep(sweep: Sweep, workdir: Path, parallel: int = 1, log: Callable[[str], None] = print) -> int:
    """Run the unfinished members, `parallel` at a time, then write the report. Returns the exit
    code: 0 when every member finished (or was stopped by the monitor), 75 when interrupted by a
    signal (run the same command to go on), 1 when a member failed."""
    statuses = prepare(sweep, workdir)
    todo = [m for m in sweep.members if statuses[m.name] not in FINAL]
    done = len(sweep.members) - len(todo)
    mode = "one at a time" if parallel == 1 else f"{parallel} at a time"
    log(f"sweep {workdir}: {len(sweep.members)} members; {done} already done, {len(todo)} to run, {mode}")

    signals: list[int] = []
    running: dict[str, tuple[subprocess.Popen, float]] = {}

    def on_signal(signum, frame):
        signals.append(signum)
        # the first signal asks each member to checkpoint and exit; a second makes them exit at once
        for proc, _ in running.values():
            proc.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGINT)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failed, preempted = [], []
    pending, launched = list(todo), 0
    steps = {m.name: m.config.train.steps for m in sweep.members}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        while pending or running:
            while pending and len(running) < parallel and not signals:
                m = pending.pop(0)
                cmd = command(workdir / MEMBERS_DIR / f"{m.name}.yaml", workdir / m.name, sys.executable)
                out = None
                if parallel > 1:  # interleaved progress bars help nobody: each member logs to a file
                    (workdir / LOGS_DIR).mkdir(exist_ok=True)
                    out = open(workdir / LOGS_DIR / f"{m.name}.log", "a")
                launched += 1
                log(
                    f"[{done + launched}/{len(sweep.members)}] {m.name}: {'resuming' if statuses[m.name] == 'interrupted' else 'starting'}"
                )
                # own session: a Ctrl-C reaches the sweep, which passes it on once, as SIGTERM
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env, start_new_session=True
                )
                if out is not None:
                    out.close()
                running[m.name] = (proc, time.monotonic())
            if pending and signals:
                pending.clear()
            time.sleep(0.2)
            for name, (proc, started) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[name]
                status = rundir.status(workdir / name, steps[name])
                seconds = time.monotonic() - started
                if rc == 0 or status in FINAL:
                    log(f"  {name}: {status} in {seconds:.0f} s{_summary(workdir / name)}")
                elif rc == EXIT_PREEMPTED:
                    preempted.append(name)
                    log(f"  {name}: preempted after {seconds:.0f} s; it resumes when the sweep is run again")
                else:
                    failed.append(name)
                    where = f"; see {_relative(workdir / LOGS_DIR / (name + '.log'))}" if parallel > 1 else ""
                    log(f"  {name}: failed (exit {rc}) after {seconds:.0f} s{where}")
                    if rc == EXIT_USAGE and pending:  # a user mistake (config, data) would repeat in every member
                        log(f"  not starting the {len(pending)} remaining member(s): exit 2 is a user mistake")
                        pending.clear()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals or preempted:
        log(f"sweep interrupted: run the same command to resume ({len(preempted)} member(s) preempted)")
        return EXIT_PREEMPTED
    from transformer.report import write_report

    report = write_report(workdir, log=log)
    log(f"report: {_relative(report)}")
    if failed:
        log(f"sweep: {len(failed)} member(s) failed: {', '.join(failed)}")
        return EXIT_FAILED
    return 0


def _summary(workdir: Path) -> str:
    """', val loss 1.234' from a finished member's end event, if it has one."""
    ends = read_events(workdir, "end")
    try:
        return f", val loss {float(ends[-1]['val_loss']):.4f}"
    except (IndexError, KeyError, ValueError, TypeError):
        return ""


def load_sweep(path: str | None, overrides: list[str]) -> Sweep | None:
    """The sweep in a config file, or None when the file has no `sweep:` block."""
    from transformer.config import load_raw

    raw = load_raw(path, overrides)
    if "sweep" not in raw:
        return None
    return expand(raw, str(path), tuple(overrides))
