"""Configs are data: frozen dataclasses built from YAML mappings and ``key=value`` overrides.

Unknown keys and values of the wrong type fail at load time, naming the dotted key::

    cfg = load_config(MyConfig, "configs/x.yaml", ["model.num_layers=4", "seed=1"])
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e-4`` is a number (YAML 1.1, which PyYAML
    follows, wants ``1.0e-4`` and reads ``1e-4`` as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """A YAML document (a config file, an override's value) as Python data, ``1e-4`` a float."""
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A config key is unknown, missing or has a bad value; the message names the dotted key."""


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build the frozen dataclass ``cls`` from a (nested) mapping, checking keys and types."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        names = ", ".join(_join(prefix, k) for k in unknown)
        what = "unknown config key" + ("s" if len(unknown) > 1 else "")
        raise ConfigError(f"{names}: {what}; known: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(prefix, name))
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    except ConfigError as e:  # raised by __post_init__ with the field's name: add the prefix
        raise ConfigError(f"{prefix}.{e}" if prefix else str(e)) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, YAML-serialisable dict of a config dataclass (tuples become lists)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a copy of a nested dict."""
    out = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = parse_yaml(raw) if raw.strip() else ""
    return out


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: leaf}`` (an empty mapping is kept as a leaf)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = _join(prefix, str(key))
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


UNSET = "<unset>"


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The leaves two (nested) configs disagree on: ``[(dotted key, old, new)]`` sorted by key;
    a key present on one side only has ``UNSET`` on the other."""
    a, b = flatten(old), flatten(new)
    keys = sorted(set(a) | set(b))
    diff = [(k, a.get(k, UNSET), b.get(k, UNSET)) for k in keys]
    return [(k, x, y) for k, x, y in diff if x != y]


def format_diff(diff: Sequence[tuple[str, Any, Any]]) -> str:
    """``key old -> new, ...`` on one line (values as YAML flow scalars)."""

    def show(v):
        if v is UNSET:
            return v
        return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...").strip()

    return ", ".join(f"{k} {show(a)} -> {show(b)}" for k, a, b in diff)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = parse_yaml(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _deepcopy(d):
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: bad value {value!r}")
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            items = [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
        elif origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            items = [
                _convert(a, v, f"{key}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            ]
        else:
            elem = args[0] if args else Any
            items = [_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value
