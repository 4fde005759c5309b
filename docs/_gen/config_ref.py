"""The config reference, generated from the config dataclasses themselves (`finetune.config`): every
section reachable from QuantConfig, each key with its type, default and allowed values as the
validator enforces them, so a key added to the code appears here without anyone copying it.
Also the table of presets with their formats and bits per element (`finetune.formats.bits_per_element`)."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, Union

from descriptions import DESCRIPTIONS

from finetune.config import FormatChoice, QuantConfig, available_presets, load_config, to_dict
from finetune.config.formats import family_keys
from finetune.config.schema import Section
from finetune.formats import INT_RANGES, MX_ELEMENTS, bits_per_element
from finetune.formats.floats import FLOAT_TYPES

FORMAT_FAMILIES = ("int", "float", "bfp", "mx")
# Allowed values of FormatChoice keys that live in format tables rather than in type hints.
FAMILY_VALUES = {("int", "dtype"): tuple(INT_RANGES), ("float", "dtype"): tuple(FLOAT_TYPES),
                 ("mx", "element_dtype"): tuple(MX_ELEMENTS)}


def describe_type(hint: Any) -> str:
    """A type hint as a reader of YAML sees it (the validator's conversions: lists are tuples,
    mappings are dicts or sections)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(d for d in map(describe_type, args) if d)
    if origin is Literal:
        return " \\| ".join(f"`{_yaml(v)}`" for v in args)
    if origin is tuple:
        return f"list of {describe_type(args[0])}"
    if origin is dict:
        return f"mapping of {describe_type(args[0])} to {describe_type(args[1])}"
    if dataclasses.is_dataclass(hint):
        return f"[{hint.__name__}](#{_anchor(hint)})"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ""  # internal markers (an override key left unset)
    return {bool: "bool", int: "int", float: "number", str: "string", type(None): "null"}.get(hint, str(hint))


def _yaml(value: Any) -> str:
    """A value as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return "(inherited)"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def _default(field: dataclasses.Field) -> str:
    """The field's default as YAML, or 'required'."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    value = to_dict(value) if dataclasses.is_dataclass(value) else value
    return f"`{_yaml(value)}`"


def _bounds(field: dataclasses.Field) -> str:
    """The metadata constraints the validator checks (choices, bounds, pattern)."""
    meta = field.metadata
    parts = []
    if "choices" in meta:
        parts.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
    if "min" in meta:
        parts.append(f"≥ {meta['min']}")
    if "above" in meta:
        parts.append(f"> {meta['above']}")
    if "max" in meta:
        parts.append(f"≤ {meta['max']}")
    if "pattern_help" in meta:
        parts.append(meta["pattern_help"])
    return ", ".join(parts)


def sections(root: type = QuantConfig) -> list[type]:
    """Every config section reachable from `root` through its fields' type hints, root first."""
    found: list[type] = []

    def visit(cls: type) -> None:
        if cls in found:
            return
        found.append(cls)
        for hint in typing.get_type_hints(cls).values():
            for inner in _dataclasses_in(hint):
                visit(inner)

    visit(root)
    return found


def _dataclasses_in(hint: Any) -> Iterator[type]:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and issubclass(hint, Section):
        yield hint
    for arg in typing.get_args(hint):
        yield from _dataclasses_in(arg)


def _source_comments(cls: type) -> dict[str, str]:
    """Trailing `# comments` on the field lines of a class, the code's own word on a key."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+):[^#]*#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def description(cls: type, key: str) -> str:
    """What a key means: the guide's sentence for it, else the code's comment on it, else nothing."""
    return DESCRIPTIONS.get(f"{cls.__name__}.{key}") or _source_comments(cls).get(key, "")


def section_table(cls: type) -> str:
    """One section as a heading, its docstring and a table of its keys."""
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    if cls is QuantConfig:
        rows.append("| `preset` | string | none | a preset name or a YAML path | "
                    f"{DESCRIPTIONS['QuantConfig.preset']} |")
    for field in dataclasses.fields(cls):
        default = "per format, below" if cls is FormatChoice and field.name != "format" else _default(field)
        rows.append(f"| `{field.name}` | {describe_type(hints[field.name])} | {default} | {_bounds(field)} | "
                    f"{_cell(description(cls, field.name))} |")
    doc = inspect.cleandoc(cls.__doc__ or "")
    return f"### {cls.__name__} {{#{_anchor(cls)}}}\n\n{doc}\n\n" + "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_table(family: str) -> str:
    """The keys of one format family with the defaults the validator fills in (an empty choice of
    that format, built by the code) and the values each takes."""
    filled = FormatChoice(format=family)
    hints = typing.get_type_hints(FormatChoice)
    rows = [f"#### format: {family}\n", "| key | default | type or values |", "|---|---|---|"]
    for key in family_keys(family)[1:]:
        allowed = FAMILY_VALUES.get((family, key))
        text = ", ".join(f"`{v}`" for v in allowed) if allowed else describe_type(hints[key])
        field = next(f for f in dataclasses.fields(FormatChoice) if f.name == key)
        bounds = _bounds(field)
        rows.append(f"| `{key}` | `{_yaml(getattr(filled, key))}` | {text}{'; ' + bounds if bounds else ''} |")
    return "\n".join(rows) + "\n"


def config_reference() -> str:
    """The whole reference: the top level, every format family, then every other section."""
    parts = []
    for cls in sections():
        parts.append(section_table(cls))
        if cls is FormatChoice:
            parts.append("Each format takes only its own keys (the others must stay unset); unset keys take "
                         "these defaults, filled in by the validator:\n")
            parts += [format_table(family) for family in FORMAT_FAMILIES]
    return "\n".join(parts)


def _format_text(choice: Any) -> str:
    """A format choice in a few words: family, element type, granularity."""
    if choice is None:
        return "float"
    data = to_dict(choice)
    if choice.format == "int":
        scale = ", power-of-two" if choice.power_of_two else ""
        sym = "" if choice.symmetric else ", asymmetric"
        return f"{choice.dtype} per {choice.granularity}{sym}{scale}, {choice.calibration}"
    if choice.format == "float":
        return choice.dtype
    if choice.format == "bfp":
        return f"{data['bfp_method']} {data['bit_width']} bits, block {data['block_size']}"
    return f"{choice.element_dtype}, block {choice.block_size}"


def _bits(choice: Any) -> str:
    return f"{bits_per_element(None if choice is None else choice.spec(output_axis=1, input_axis=1)):g}"


def presets_table() -> str:
    """Every bundled preset: its activation and weight formats, bits per element of each, and its
    fine-tuning section if it has one."""
    rows = ["| preset | activations | weights | bits/element (act. / wt.) | fast finetune |", "|---|---|---|---|---|"]
    for name in available_presets():
        config = load_config(name)
        tuning = config.fast_finetune
        tune = f"{tuning.algorithm}, {tuning.iterations} it." if tuning else ""
        rows.append(f"| `{name}` | {_format_text(config.activation)} | {_format_text(config.weight)} | "
                    f"{_bits(config.activation)} / {_bits(config.weight)} | {tune} |")
    return "\n".join(rows) + "\n"
