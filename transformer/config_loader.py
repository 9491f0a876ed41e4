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

from transformer.config import DEFAULT_CONFIG, OBJECTIVES, Config, ConfigError, DataConfig, context_length, yaml_key
from transformer.errors import first_line

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


def _closest_in(key: str, names: list[str], prefix: str) -> str:
    """`_closest` for a key of the schema's sections; for one inside a list item (data.mixture[0].wieght),
    the closest of the item's own keys."""
    if "[" not in prefix:
        return _closest(prefix + key)
    match = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f" (did you mean {prefix}{match[0]}?)" if match else ""


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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "a mapping of keys"
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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # an item of data.mixture
        return from_dict(value, tp, key + ".")
    return _coerce_scalar(value, tp, key)


def from_dict(raw: dict[str, Any], cls: type = Config, prefix: str = "") -> Any:
    """Build a schema dataclass from plain data, checking every key, type and range."""
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip("."), f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(prefix + str(key), "unknown key" + _closest_in(str(key), list(fields), prefix))
    kwargs = {}
    if cls is Config:
        # The model's context defaults to the data's sequence length: build data first, so that a
        # model needing the length (learned positions) is validated with it.
        data = kwargs["data"] = from_dict(raw.get("data") or {}, DataConfig, "data.")
        model = raw.get("model") or {}
        if isinstance(model, dict) and model.get("max_seq_len") is None:
            arch = model.get("arch", "decoder")
            model = dict(model)
            model["max_seq_len"] = context_length(arch, data) if arch in OBJECTIVES else data.seq_len
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


# Bounds on what a config may be: a run config is a few kB. A "billion laughs" document (aliases of
# aliases) is small as text and parses into shared nodes, but every copy or walk of it expands them.
MAX_CONFIG_BYTES = 1_000_000
MAX_YAML_NODES = 100_000  # nodes of one document with its aliases expanded
TOP_LEVEL_KEYS = ("base", "sweep")  # besides the schema's sections


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses, before constructing anything, a document whose aliases expand
    to more than MAX_YAML_NODES nodes or refer to a node that contains them."""

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_size(node, {}, set())
        return super().construct_document(node)


class _YamlTooLarge(yaml.YAMLError):
    """A document refused by `_BoundedLoader`; its message is the whole explanation."""


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """The node count of `node` with every alias expanded (memoised: a shared node is counted once
    per reference without being walked again)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise _YamlTooLarge("a YAML alias refers to a node that contains it")
    open_nodes.add(id(node))
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    size = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    if size > MAX_YAML_NODES:
        raise _YamlTooLarge(f"YAML aliases expand to more than {MAX_YAML_NODES:,} values")
    open_nodes.discard(id(node))
    sizes[id(node)] = size
    return size


def safe_yaml(text: str) -> Any:
    """yaml.safe_load, bounded: a yaml.YAMLError for a document whose aliases expand past
    MAX_YAML_NODES values or refer to themselves, or that nests too deeply to parse."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass: safe
    except RecursionError:
        raise _YamlTooLarge("YAML nested too deeply") from None


def _read_text(path: Path) -> str:
    """A config file's text; too large, unreadable or not UTF-8 is one line that quotes none of it."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError("", f"{path} is {size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,}")
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("", f"{path} is not a YAML config file (not UTF-8 text)") from None


def _parse_yaml_file(path: Path, is_base: bool = False) -> dict[str, Any]:
    """One YAML file as a mapping of sections; a missing file or a syntax error is one line with its
    location. Nothing of a file that is not a config is quoted: `base:` may name any readable file,
    so a base's syntax error gives its line only (PyYAML's wording may quote an alias or a tag)."""
    try:
        raw = safe_yaml(_read_text(path)) or {}
    except _YamlTooLarge as e:
        raise ConfigError("", f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = "" if is_base else f": {getattr(e, 'problem', None) or first_line(e)}"
        raise ConfigError("", f"invalid YAML in {path}{where}{problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    sections = [yaml_key(f) for f in dataclasses.fields(Config)]
    for key in raw:
        if key in sections or key in TOP_LEVEL_KEYS:
            continue
        hint = difflib.get_close_matches(str(key), sections, n=1)
        if hint:  # a misspelled section: safe to quote, it is nearly a section's name
            raise ConfigError(str(key), f"unknown section in {path} (did you mean {hint[0]}?)")
        raise ConfigError("", f"{path} is not a run config: a top-level key is none of {', '.join(sections)}")
    return raw


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config with its `base:` chain merged in (each base relative to the file naming it)."""
    try:
        path = path.resolve()
        is_file = path.is_file()
    except OSError as e:  # e.g. a name longer than the file system allows
        raise ConfigError("", f"cannot read config file {str(path)[:80]}...: {e.strerror}") from None
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise ConfigError("base", f"inheritance cycle: {cycle}")
    if not is_file:
        where = f" (base of {chain[-1].name})" if chain else ""
        raise ConfigError("", f"config file not found: {path}{where}")
    raw = _parse_yaml_file(path, is_base=bool(chain))
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
        parsed = safe_yaml(value) if value.strip() else None
    except _YamlTooLarge as e:
        raise ConfigError(key, str(e)) from None
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
