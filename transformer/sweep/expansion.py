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
      ladder: {params: [1.0e5, 1.0e6], tokens_per_param: 20}   # model sizes (transformer/sweep/ladder.py)
      ray: {num_cpus: 1}             # --launcher ray / slurm options (transformer/sweep/launch.py)
      slurm: {partition: gpu, time: "04:00:00"}

Everything outside `sweep:` is the base config every member shares. A member is the base with its
values set, validated whole before any member starts. Running a sweep into DIR writes
`DIR/sweep.json` (the expansion, read by the report), `DIR/members/<name>.yaml` (each member's
resolved config, so that `--print-commands` can hand self-contained commands to a scheduler) and
runs each member as its own `train.py` process into `DIR/<name>/` (`runner.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
from collections.abc import Callable
from typing import Any

from transformer.config import Config, ConfigError, flatten
from transformer.config_loader import all_keys, from_dict, load_raw
from transformer.sweep.ladder import Ladder, build_ladder, check_derived

# ray, slurm: transformer/sweep/launch.py; ladder: transformer/sweep/ladder.py
SWEEP_KEYS = ("grid", "zip", "seeds", "name", "compare", "ladder", "ray", "slurm")
MANIFEST = "sweep.json"
MEMBERS_DIR = "members"  # resolved member configs
LOGS_DIR = "logs"  # member output when several run at once
# Names a member's directory cannot take: the sweep's own files beside the members, and the report
# (transformer/report/render.py writes report.md, report.html, report.json and plots/ into the sweep's directory; the
# sweep cannot import it, so the names are repeated here).
RESERVED = {MANIFEST, MEMBERS_DIR, LOGS_DIR, "plots", "report.md", "report.html", "report.json"}
LR_KEY = "optim.lr"


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
    # the config as written, before the config derived its sizes (what --coord-check re-derives at
    # each width from)
    raw: dict[str, Any] = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Sweep:
    source: str
    members: tuple[Member, ...]
    keys: tuple[str, ...]  # varied config keys and labels, in file order (train.seed not included)
    compare: str
    launch: dict[str, Any] = dataclasses.field(default_factory=dict)  # sweep.ray, sweep.slurm (launch.py checks them)
    ladder: Ladder | None = None

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


def _axes(spec: dict, ladder: Ladder | None) -> tuple[list[list[dict]], list[str], set[str]]:
    """The sweep's independent axes, each a list of points {key: value}; the varied keys; the labels.
    A ladder's axis comes first, so that a sweep runs every variant at a rung before the next rung."""
    axes, keys, labels = [], [], set()
    if ladder is not None:
        axes.append(ladder.axis())
        keys += ladder.keys
        labels |= {k for k in ladder.keys if "." not in k}
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
        raise SweepError(
            "sweep", f"{repeated[0]} is swept twice (in grid and zip, in two zip groups, or by the ladder)"
        )
    return axes, keys, labels


def name_part(value: Any) -> str:
    """A value as it reads inside a member's name: 0.001, none, local+global."""
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "+".join(map(name_part, value))
    return str(value)


def _fill_template(template: str, lookup: Callable[[str], Any]) -> str:
    def one(match: re.Match) -> str:
        key, fmt = match.group(1), match.group(2)
        value = lookup(key)
        try:
            return format(value, fmt) if fmt else name_part(value)
        except (ValueError, TypeError) as e:
            raise SweepError("sweep.name", f"cannot format {{{key}:{fmt}}} with {value!r}: {e}") from None

    return re.sub(r"\{([A-Za-z_][\w.]*)(?::([^}]*))?\}", one, template)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._,+-]+", "_", name).strip("._") or "run"


def default_compare(keys: list[str] | tuple[str, ...]) -> str:
    """The key a report compares unless told: the first varied key that is not the learning rate
    (the LR sensitivity spans the learning rate), else the first; "" when nothing varies."""
    return next((k for k in keys if k != LR_KEY), keys[0] if keys else "")


def expand(raw: dict[str, Any], source: str = "", overrides: tuple[str, ...] = ()) -> Sweep:
    """Expand a raw config with a `sweep:` block (as `config_loader.load_raw` returns it) into
    validated members. Any mistake raises SweepError naming the member, when there is one, and the key."""
    raw = dict(raw)
    spec = _spec(raw.pop("sweep"))
    try:
        ladder = build_ladder(raw, spec["ladder"]) if "ladder" in spec else None
        if ladder is not None and ladder.pinned:
            raw["model"] = {**(raw.get("model") or {}), **ladder.pinned}
        axes, keys, labels = _axes(spec, ladder)
        if ladder is not None:
            check_derived({k: True for k in keys}, "the sweep varies it")
    except SweepError:
        raise
    except ConfigError as e:  # the ladder's own mistakes, as the sweep's
        raise SweepError(e.key, e.message) from None
    for text in overrides:  # `train.py sweep.yaml optim.lr=1` would be silently overwritten by the sweep
        key = text.partition("=")[0]
        if key in keys:
            raise SweepError(key, "is swept; change its values in the sweep block instead of overriding it")
    seeds, template = _seeds(spec), _template(spec)
    compare = spec.get("compare", default_compare([k for k in keys if ladder is None or k not in ladder.keys]))
    if keys and compare not in keys and not (compare == "" and ladder is not None):  # a ladder of one variant
        raise SweepError("sweep.compare", f"{compare!r} is not a swept key ({', '.join(keys)})")
    members: list[Member] = []
    names: dict[str, dict] = {}
    # a rung's sizes and steps follow from its name; a default member name leaves them out
    unnamed = {k for k in ladder.keys if k not in ("rung", "budget", LR_KEY)} if ladder is not None else set()
    for point in itertools.product(*axes) if axes else [()]:
        assigned = {k: v for part in point for k, v in part.items()}
        for seed in seeds if seeds is not None else [None]:
            member = _member(raw, assigned, labels, seed, template, unnamed)
            _check_name(member.name, assigned, names)
            names[member.name] = assigned
            members.append(member)
    launch = {k: spec[k] for k in ("ray", "slurm") if k in spec}
    return Sweep(source, tuple(members), tuple(keys), compare, launch, ladder)


def _spec(spec: Any) -> dict:
    """The `sweep:` block, its keys checked."""
    if not isinstance(spec, dict):
        raise SweepError("sweep", f"expected a mapping with {', '.join(SWEEP_KEYS)}, got {spec!r}")
    for key in spec:
        if key not in SWEEP_KEYS:
            match = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            raise SweepError(f"sweep.{key}", "unknown key" + (f" (did you mean sweep.{match[0]}?)" if match else ""))
    return spec


def _seeds(spec: dict) -> list[int] | None:
    seeds = spec.get("seeds")
    if seeds is not None:
        seeds = _values("sweep.seeds", seeds)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) or len(set(seeds)) != len(seeds):
            raise SweepError("sweep.seeds", f"expected distinct integers, got {seeds!r}")
    return seeds


def _template(spec: dict) -> str | None:
    template = spec.get("name")
    if template is not None and not isinstance(template, str):
        raise SweepError(
            "sweep.name", f"expected a template string such as '{{model.norm_position}}', got {template!r}"
        )
    if template is not None and "{seed" in template:
        raise SweepError("sweep.name", "the seed is appended to every name as -s<seed>; leave {seed} out")
    return template


def _member(
    raw: dict[str, Any], assigned: dict, labels: set[str], seed: int | None, template: str | None, unnamed: set[str]
) -> Member:
    """The base config with one point of the sweep (`assigned`: keys and labels) and `seed` set, validated."""
    values = {k: v for k, v in assigned.items() if k not in labels}
    member_raw = dict(raw)
    for key, value in list(values.items()) + ([("train.seed", seed)] if seed is not None else []):
        section, _, leaf = key.partition(".")
        member_raw[section] = {**(member_raw.get(section) or {}), leaf: value}
    suffix = f"-s{seed}" if seed is not None else ""
    default = _default_name({k: v for k, v in assigned.items() if k not in unnamed})
    try:
        cfg = from_dict(member_raw)
    except ConfigError as e:
        raise SweepError(e.key, f"{e.message} (in sweep member {default}{suffix})") from None
    variant = default if template is None else _safe(_fill_template(template, _lookup(cfg, assigned)))
    labelled = {k: v for k, v in assigned.items() if k in labels}
    return Member(variant + suffix, variant, values, labelled, cfg.train.seed, cfg, member_raw)


def _check_name(name: str, assigned: dict, names: dict[str, dict]) -> None:
    """Refuse a member name already taken, by another member (`names`) or by the sweep's own files."""
    if name in names:
        raise SweepError(
            "sweep.name",
            f"two members are both named {name!r} ({names[name]} and {assigned}); put the varied keys in the name template",
        )
    if name in RESERVED:
        raise SweepError(
            "sweep.name", f"member {name!r}: the name is reserved for the sweep's own files; rename the member"
        )
    if name.startswith("-"):  # its path would read as an option on train.py's command line
        raise SweepError("sweep.name", f"member {name!r}: a name cannot start with '-'; rename the member")


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
    parts = [name_part(v) if "." not in k else f"{k.rsplit('.', 1)[-1]}-{name_part(v)}" for k, v in assigned.items()]
    return _safe(",".join(parts))


def load_sweep(path: str | None, overrides: list[str]) -> Sweep | None:
    """The sweep in a config file, or None when the file has no `sweep:` block."""
    raw = load_raw(path, overrides)
    if "sweep" not in raw:
        return None
    return expand(raw, str(path), tuple(overrides))
