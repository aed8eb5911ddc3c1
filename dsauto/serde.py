"""Strict conversion between frozen dataclasses and plain dicts (for YAML and JSON).

``from_dict`` refuses unknown keys, missing required keys and values of the wrong type, naming
the offending key, so that a typo in a plan or spec file is reported instead of ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

from dsauto.errors import DsautoError

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """Converts a dataclass (recursively) into dicts, lists and scalars, in field order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def content_dict(obj: Any) -> Any:
    """:func:`to_dict` without the dataclass fields that hold their defaults: what identifies a value
    (a plan's id, a study's or a profile's key), unchanged when a later dsauto adds a field with a
    default that keeps the old meaning."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
                continue
            out[f.name] = content_dict(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [content_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: content_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Builds ``cls`` from ``data``; ``where`` names the source in error messages."""
    if not isinstance(data, dict):
        raise DsautoError(f"{where} must be a mapping of keys to values, got {type(data).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise DsautoError(
            f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; known keys are "
            f"{', '.join(fields)}."
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise DsautoError(f"{where} is missing the required key {name!r}.")
            continue
        kwargs[name] = _convert(hints[name], data[name], f"{where}: {name}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise DsautoError(f"{where} is invalid: {exc}; correct that value.") from None


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise DsautoError(f"{where} must be a list, got {value!r}.")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise DsautoError(f"{where} must have {len(args)} entries, got {len(value)}.")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise DsautoError(f"{where} must be a mapping, got {value!r}.")
        return {str(k): _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise DsautoError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}.")
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            raise DsautoError(f"{where} must be true or false, got {value!r}.")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise DsautoError(f"{where} must be a whole number, got {value!r}.")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DsautoError(f"{where} must be a number, got {value!r}.")
        if not math.isfinite(value):  # YAML's .nan / .inf and JSON's NaN / Infinity parse as floats
            raise DsautoError(f"{where} must be a finite number, got {value!r}.")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise DsautoError(f"{where} must be text, got {value!r}.")
        return value
    return value


class _Readable(Protocol):
    """A file or a packaged resource (importlib.resources)."""

    name: str

    def read_text(self, encoding: str = ...) -> str: ...


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads ``1e-5`` and ``312e12`` as numbers.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent (``1.0e-5``); plain
    ``312e12`` would arrive as the text "312e12". YAML 1.2 and JSON read both as numbers.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_data(source: Path | _Readable, where: str) -> Any:
    """The plain data in a YAML or (by its suffix) JSON file; a file that cannot be read or parsed
    raises DsautoError naming ``where`` and the line at fault."""
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "it is not UTF-8 text"
        raise DsautoError(f"Cannot read {where} ({reason}); give a readable YAML or JSON file.") from None
    try:
        if source.name.endswith(".json"):
            return json.loads(text)
        return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader: builds plain data only
    except json.JSONDecodeError as exc:
        raise DsautoError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}; fix the syntax there.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise DsautoError(f"{where} is not valid YAML: {problem}{at}; fix the syntax there.") from None


def write_json(path: Path | str, data: Any) -> Path:
    """Write ``data`` as indented JSON at ``path`` through a temporary file and a rename (atomic on
    one file system), so a reader never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path
