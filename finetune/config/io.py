"""Configs in and out of files: load_config reads a preset (bundled in finetune/presets), a
YAML/JSON file or a mapping into a QuantConfig, merging `preset:` bases underneath; save_config and
to_dict write one back. A mapping with AMD Quark's option names (`quant_format`, `activation_type`,
`extra_options`, ...) is recognised, translated by `quark` and validated like any other mapping;
`config_format` forces either."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from finetune.files import write_text_atomic

from . import quark, quark_options
from .formats import FormatChoice
from .quant import QuantConfig, top_level_keys
from .schema import INHERIT, ConfigError, from_mapping

PRESET_DIR = Path(__file__).parent.parent / "presets"
CONFIG_FORMATS = ("auto", "finetune", "quark")


class _YamlLoader(yaml.SafeLoader):
    """Safe YAML loader that also reads exponent floats without a dot (1e-5), as YAML 1.2 does."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def available_presets() -> list[str]:
    """Names of the bundled presets (file stems in `PRESET_DIR`)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(source: QuantConfig | Mapping[str, Any] | str | Path, config_format: str = "auto") -> QuantConfig:
    """A QuantConfig from a preset name (case-insensitive), a YAML/JSON file, a mapping or a
    QuantConfig. `config_format` is auto (Quark option names are detected), finetune or quark."""
    if config_format not in CONFIG_FORMATS:
        raise ConfigError("config_format", f"must be one of {', '.join(CONFIG_FORMATS)}; got {config_format!r}")
    if isinstance(source, QuantConfig):
        return source
    if isinstance(source, Mapping):
        return _config_from_mapping(source, config_format, Path.cwd(), ())
    path = _locate(source, None, "")
    return _config_from_mapping(_read_yaml(path), config_format, path.parent, (path,))


def _config_from_mapping(
    data: Mapping[str, Any], config_format: str, base_dir: Path, seen: tuple[Path, ...]
) -> QuantConfig:
    if config_format == "quark" or (config_format == "auto" and _is_quark_style(data)):
        return from_quark(data)
    return from_mapping(QuantConfig, _resolve_preset(data, base_dir, seen))


def _is_quark_style(data: Mapping[str, Any]) -> bool:
    """Whether a config mapping uses Quark's option names; mixing them with ours is an error."""
    ours = [k for k in data if k in top_level_keys()]
    theirs = [k for k in data if k in quark_options.TOP_KEYS]
    if ours and theirs:
        problem = f"mixes finetune keys ({', '.join(ours)}) with Quark option names ({', '.join(theirs)})"
        raise ConfigError("", f"{problem}; use one or the other")
    return bool(theirs)


def from_quark(options: Mapping[str, Any]) -> QuantConfig:
    """The QuantConfig equivalent to a Quark `QuantizationConfig` given by its option names (or a
    `Config` mapping with only `global_quant_config`); errors name the Quark option."""
    mapping, explain = quark.translate(options)
    try:
        return from_mapping(QuantConfig, mapping)
    except ConfigError as error:
        raise explain(error) from None


def _resolve_preset(data: Mapping[str, Any], base_dir: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The mapping with its `preset:` (recursively) deep-merged underneath it."""
    if "preset" not in data:
        return dict(data)
    name = data["preset"]
    if not isinstance(name, (str, Path)):
        raise ConfigError("preset", f"expected a preset name or a path, got {name!r}")
    path = _locate(name, base_dir, "preset")
    if path in seen:
        raise ConfigError("preset", f"presets include each other in a cycle: {' -> '.join(map(str, (*seen, path)))}")
    base = _read_yaml(path)
    if _is_quark_style(base):
        base = to_dict(from_quark(base))
    base = _resolve_preset(base, path.parent, (*seen, path))
    return deep_merge(base, {k: v for k, v in data.items() if k != "preset"})


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` laid over `base`, recursing into mappings; null replaces (so it disables), and
    a mapping that names a different `format` replaces its base instead of merging into it."""
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        merged[key] = deep_merge(old, value) if _merges(old, value) else value
    return merged


def _merges(old: Any, new: Any) -> bool:
    """Whether `new` merges into `old`: both mappings, and `new` keeps the format of `old`."""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return False
    return new.get("format", old.get("format")) == old.get("format")


def _locate(name: str | Path, base_dir: Path | None, key: str) -> Path:
    """The file a config source names: a path (relative to `base_dir` first) or a preset name."""
    candidate = Path(name).expanduser()
    for path in ([base_dir / candidate] if base_dir and not candidate.is_absolute() else []) + [candidate]:
        if path.is_file():
            return path.resolve()
    by_name = {p.stem.lower(): p for p in PRESET_DIR.glob("*.yaml")}
    if str(name).lower() in by_name:
        return by_name[str(name).lower()].resolve()
    presets = ", ".join(available_presets())
    raise ConfigError(key, f"{str(name)!r} is neither a config file nor a preset; presets: {presets}")


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)
    except yaml.YAMLError as error:
        raise ConfigError(str(path), f"not valid YAML ({error})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), f"expected a mapping at the top level, got {data!r}")
    return data


def to_dict(config: Any) -> Any:
    """Plain YAML-ready data of a config (mappings, lists, scalars) that load_config reads back to
    an equal config; unset FormatChoice keys and inherited override keys are left out."""
    if dataclasses.is_dataclass(config):
        items = ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
        return {
            name: to_dict(value)
            for name, value in items
            if value is not INHERIT and not (value is None and isinstance(config, FormatChoice))
        }
    if isinstance(config, tuple):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def save_config(config: QuantConfig, path: str | Path, header: str = "") -> None:
    """Write the config as YAML (complete, no preset reference), readable by load_config, after
    `header` (comment lines), in one atomic write."""
    write_text_atomic(path, header + yaml.safe_dump(to_dict(config), sort_keys=False, allow_unicode=True))
