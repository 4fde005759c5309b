"""The generic config validator: frozen dataclasses (Sections) whose fields are converted and
checked against their type hints and metadata, with errors that name the full key path, say what
is allowed and suggest the key that was probably meant. Knows nothing about quantization."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid config; `path` is the dotted key path and the message says what is allowed."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem

    def under(self, parent: str) -> ConfigError:
        """The same error seen from the mapping at `parent`, so its path stays complete."""
        return ConfigError(join_path(parent, self.path), self.problem)


class Inherit(enum.Enum):
    """Marks an override key that is not set, so the enclosing level's choice applies."""

    INHERIT = "inherit"


INHERIT = Inherit.INHERIT


def join_path(parent: str, child: str) -> str:
    """Dotted key path of `child` inside `parent` (mapping keys of dict fields come as [...])."""
    if not parent or not child:
        return parent or child
    return parent + child if child.startswith("[") else f"{parent}.{child}"


class Section:
    """Base of every config dataclass: after construction, each field is converted to and checked
    against its type hint and metadata (choices, bounds, pattern), then cross-field rules run."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = _convert(getattr(self, f.name), hints[f.name], f.name)
            _check_metadata(value, f)
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field rules and defaults that depend on other fields (none unless overridden)."""

    @classmethod
    def allowed_keys(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        """Keys that error messages list as allowed for a mapping of this section."""
        return tuple(f.name for f in dataclasses.fields(cls))


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build the config dataclass `cls` from a mapping; every error names its full key path."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping, got {data!r}")
    names = set(inspect.signature(cls).parameters)  # its fields, and keys it still reads into them (InitVar)
    for key in data:
        if key not in names:
            allowed = cls.allowed_keys(data)
            problem = f"unknown key; allowed: {', '.join(allowed)}{did_you_mean(key, allowed)}"
            raise ConfigError(join_path(path, str(key)), problem)
    for f in dataclasses.fields(cls):
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(join_path(path, f.name), f"required; {_describe_field(cls, f.name)}")
    try:
        return cls(**data)
    except ConfigError as error:
        raise error.under(path) from None


def did_you_mean(key: Any, allowed: Iterable[str], quote: bool = False) -> str:
    """' (did you mean X?)' for the closest allowed name (quoted, for names that may hold spaces), or ''."""
    close = difflib.get_close_matches(str(key), list(allowed), n=1)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quote else f" (did you mean {close[0]}?)"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe_field(cls: type, name: str) -> str:
    return f"expected {_describe(_hints(cls)[name])}"


def _convert(value: Any, hint: Any, path: str) -> Any:
    """`value` checked against `hint` and converted (lists to tuples, ints to floats, mappings to
    config dataclasses); raises ConfigError naming `path` and what was expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return _convert_union(value, args, path)
    if not _fits(value, hint):
        raise ConfigError(path, f"expected {_describe(hint)}, got {value!r}")
    if origin is Literal and not any(value == v for v in args):
        raise ConfigError(path, f"must be one of {', '.join(map(str, args))}; got {value!r}")
    if origin is tuple:
        return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        return {_convert(k, args[0], path): _convert(v, args[1], f"{path}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(hint) and not isinstance(value, hint):
        return from_mapping(hint, value, path)
    return float(value) if hint is float else value


def _convert_union(value: Any, args: tuple[Any, ...], path: str) -> Any:
    """Convert with the union member whose shape fits the value; a sole fitting mapping or list
    reports its own, more precise error (e.g. a bad key inside it)."""
    fitting = [arg for arg in args if _fits(value, arg)]
    if len(fitting) == 1 and _describe(fitting[0]) in ("a mapping", "a list"):
        return _convert(value, fitting[0], path)
    for arg in fitting:
        try:
            return _convert(value, arg, path)
        except ConfigError:
            continue
    expected = " or ".join(d for d in map(_describe, args) if d)
    raise ConfigError(path, f"expected {expected}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    """Whether the value has the shape of `hint` (its contents are checked by _convert)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(type(value) is type(v) for v in args)
    if origin is tuple:
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, Mapping)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (hint, Mapping))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


_SCALAR_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _describe(hint: Any) -> str:
    """What a value of `hint` looks like, for error messages ('' for internal markers)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(d for d in map(_describe, args) if d)
    if origin is Literal:
        return ", ".join(map(str, args))
    if origin is tuple:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(hint):
        return "a mapping"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ""
    return _SCALAR_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _check_metadata(value: Any, f: dataclasses.Field) -> None:
    """Field metadata constraints: `choices`, `min` (inclusive), `above` (exclusive), `max`, and
    `pattern` (full match, described by `pattern_help`)."""
    meta = f.metadata
    if value is None or not meta:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f.name, f"must be one of {', '.join(map(str, meta['choices']))}; got {value!r}")
    if isinstance(value, str) and "pattern" not in meta:
        return  # a word a numeric field also takes (lr: auto): its Literal is checked already
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f.name, f"must be >= {meta['min']}, got {value!r}")
    if "above" in meta and value <= meta["above"]:
        raise ConfigError(f.name, f"must be > {meta['above']}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f.name, f"must be <= {meta['max']}, got {value!r}")
    if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
        raise ConfigError(f.name, f"must be {meta['pattern_help']}; got {value!r}")

