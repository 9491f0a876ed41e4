"""Loading a run configuration: YAML files with `base:` inheritance, `key.path=value` overrides, and
the checked conversion of plain data into the schema of `transformer.config`.

Every value is checked against its field's annotation before any dataclass is built, so a user
mistake becomes one `ConfigError` naming the dotted key (with the closest valid key or choice for a
typo) instead of a traceback from deep inside JAX. The schema itself, its defaults and its
validation live in `transformer.config`; this module only reads and converts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer.config import DEFAULT_CONFIG, Config, ConfigError, DataConfig, yaml_key

# --- schema walking ------------------------------------------------------------------------------


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema, e.g. 'model.n_heads'."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = prefix + yaml_key(field)
        if dataclasses.is_dataclass(hints[field.name]):
            keys += all_keys(hints[field.name], key + ".")
        else:
            keys.append(key)
    return keys


def _closest(key: str) -> str:
    """' (did you mean model.d_model?)' for an unknown key, or '' when nothing is close."""
    sections = [f.name for f in dataclasses.fields(Config)]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
    leaf = key.rsplit(".", 1)[-1]
    if "." in key and leaf in by_leaf:  # a valid key put in the wrong section
        return f" (did you mean {by_leaf[leaf]}?)"
    match = difflib.get_close_matches(key, all_keys() + sections, n=1, cutoff=0.6)
    if not match:  # a key written without its section: match the last part
        leaf_match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        match = [by_leaf[leaf_match[0]]] if leaf_match else []
    return f" (did you mean {match[0]}?)" if match else ""


def _closest_choice(value: str, choices: tuple) -> str:
    """' (did you mean pre?)' for a value that is not one of a Literal's choices, or ''."""
    names = [str(c) for c in choices]
    # 'prenorm' means 'pre', though 'deepnorm' is the closer string
    prefixed = [c for c in names if value.startswith(c) or c.startswith(value)]
    close = prefixed[:1] or difflib.get_close_matches(value, names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _describe(tp: Any) -> str:
    """An annotation in the words an error message uses: 'an integer or null', 'one of pre, post'."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of ({_describe(typing.get_args(tp)[0])})"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


# --- checking values against annotations ---------------------------------------------------------


def _number(value: Any) -> float | None:
    """A finite float from a YAML number, or from a string such as '3e-4' (YAML 1.1 wants a dot)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # X | None: X's own, more precise, error
        return _coerce(value, options[0], key)
    for arg in options:
        try:
            return _coerce(value, arg, key)
        except ConfigError:
            pass
    raise ConfigError(key, f"expected {_describe(tp)}, got {value!r}")


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _number(value)
        # beyond 2**53 a float no longer holds every integer: '1e20' would not mean what it says
        if number is not None and number.is_integer() and abs(number) < 2**53:
            return int(number)
    elif tp is float:
        number = _number(value)
        if number is not None:
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(key, f"expected {_describe(tp)}, got {value!r}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` (as parsed from YAML) against annotation `tp`; return it in the schema's type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and not isinstance(value, bool):
            return value
        hint = _closest_choice(str(value), choices)
        raise ConfigError(key, f"{value!r} is not one of {', '.join(map(str, choices))}{hint}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected {_describe(tp)}, got {value!r}")
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    return _coerce_scalar(value, tp, key)


def from_dict(raw: dict[str, Any], cls: type = Config, prefix: str = "") -> Any:
    """Build a schema dataclass from plain data, checking every key, type and range."""
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip("."), f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(prefix + str(key), "unknown key" + _closest(prefix + str(key)))
    kwargs = {}
    if cls is Config:
        # The model's context defaults to the data's sequence length: build data first, so that a
        # model needing the length (learned positions) is validated with it.
        data = kwargs["data"] = from_dict(raw.get("data") or {}, DataConfig, "data.")
        model = raw.get("model") or {}
        if isinstance(model, dict) and model.get("max_seq_len") is None:
            model = dict(model)
            model["max_seq_len"] = data.seq_len
        raw = {**raw, "model": model}
    for key, value in raw.items():
        if key in kwargs:
            continue
        field = fields[key]
        tp = hints[field.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[field.name] = from_dict(value if value is not None else {}, tp, prefix + key + ".")
        else:
            kwargs[field.name] = _coerce(value, tp, prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.under(prefix.rstrip(".")) if prefix and not e.key.startswith(prefix) else e) from None


# --- files and overrides -------------------------------------------------------------------------


def _parse_yaml_file(path: Path) -> dict[str, Any]:
    """One YAML file as a mapping; a missing file or a syntax error is one line with its location."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError("", f"invalid YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config with its `base:` chain merged in (each base relative to the file naming it)."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise ConfigError("base", f"inheritance cycle: {cycle}")
    if not path.is_file():
        where = f" (base of {chain[-1].name})" if chain else ""
        raise ConfigError("", f"config file not found: {path}{where}")
    raw = _parse_yaml_file(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError("base", f"expected a path to another YAML file, got {base!r}")
    return _merge(_read_yaml(path.parent / base, (*chain, path)), raw)


def _merge(base: dict, child: dict) -> dict:
    """`child` over `base`, section by section; neither input is modified."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'model.window=128' -> (['model', 'window'], 128); the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("", f"override {text!r} is not of the form key.path=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        raise ConfigError(key, f"cannot parse the value {value!r} as YAML") from None
    return key.split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`raw` with each `key.path=value` set, creating sections as needed; `raw` itself is untouched."""
    raw = _merge({}, raw)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(path[: i + 1]), "is a value, not a section")
            else:  # copied: the caller's nested sections stay as they were
                child = node[part] = dict(child)
            node = child
        node[path[-1]] = value
    return raw


def load_raw(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A YAML run config as plain data: `base:` links followed and overrides applied, not validated."""
    return apply_overrides(_read_yaml(Path(path) if path is not None else DEFAULT_CONFIG), overrides)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML run config (following `base:` links), apply `key.path=value` overrides, validate."""
    return from_dict(load_raw(path, overrides))
