"""Quantization config: which tensors get which format and how they are calibrated, as frozen
dataclasses built in Python or loaded from YAML (presets by name, files, mappings), with errors
that name the full key path and the allowed values.

Schema (YAML keys are the dataclass field names; `preset:` is the one extra key):

    preset: MX9            # start from a preset (name or path), then deep-merge the rest over it
    activation: {...}      # FormatChoice of op inputs, or null to leave them float
    weight: {...}          # FormatChoice of weights
    bias: auto             # auto | float | int32
    op_types: [Conv, ConvTranspose, Gemm, MatMul]   # or `all`
    op_type_overrides: {Add: {activation: {...}}}   # Override per op type (layer-wise)
    node_overrides: {"/layer1/conv": {weight: {...}}}  # Override per node
    tensor_overrides: {"input.1": {...}}            # FormatChoice (or null) per tensor
    exclude_nodes: ["/head/.*"]                     # exact names or full-match regular expressions
    dual_quant: false
    cross_layer_equalization: false  # rescale Conv pairs to equal channel ranges before quantizing
    weight_storage: float  # float | compact
    fast_finetune: null    # or a FastFinetune mapping

A mapping with AMD Quark's option names (`quant_format`, `activation_type`, `extra_options`, ...)
is recognised and converted by `finetune.quark_config.from_quark`; `config_format` forces either.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .finetune import FastFinetune
from .formats import ALL, DEFAULT_OP_TYPES, Bias, FormatChoice, NodeFormats, Override, resolve_bias
from .schema import INHERIT, ConfigError, Section, from_mapping, join_path

PRESET_DIR = Path(__file__).parent.parent / "configs"
CONFIG_FORMATS = ("auto", "finetune", "quark")


@dataclass(frozen=True)
class QuantConfig(Section):
    """Everything the quantizer needs to know. Precedence: tensor_overrides > node_overrides >
    op_type_overrides > activation/weight/bias; exclude_nodes wins over all. Op types and nodes
    named in overrides are quantized even when `op_types` does not list them."""

    activation: FormatChoice | None = None
    weight: FormatChoice | None = None
    bias: Bias = "auto"
    op_types: tuple[str, ...] | Literal["all"] = DEFAULT_OP_TYPES
    op_type_overrides: dict[str, Override] = field(default_factory=dict)
    node_overrides: dict[str, Override] = field(default_factory=dict)
    tensor_overrides: dict[str, FormatChoice | None] = field(default_factory=dict)
    exclude_nodes: tuple[str, ...] = ()
    dual_quant: bool = False
    cross_layer_equalization: bool = False
    weight_storage: Literal["float", "compact"] = "float"
    fast_finetune: FastFinetune | None = None

    @classmethod
    def allowed_keys(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        return top_level_keys()

    def _check(self) -> None:
        for i, pattern in enumerate(self.exclude_nodes):
            try:
                re.compile(pattern)
            except re.error as error:
                raise ConfigError(f"exclude_nodes[{i}]", f"not a valid regular expression ({error})") from None
        self._check_bias("bias", self.bias, self.activation, self.weight)
        for kind in ("op_type_overrides", "node_overrides"):
            for name, override in getattr(self, kind).items():
                path = f"{kind}[{name!r}]"
                if kind == "node_overrides" and self.excludes(name):
                    raise ConfigError(path, "this node is also matched by exclude_nodes")
                activation, weight, bias = override.apply(self.activation, self.weight, self.bias)
                self._check_bias(join_path(path, "bias"), bias, activation, weight)

    @staticmethod
    def _check_bias(path: str, bias: str, activation: FormatChoice | None, weight: FormatChoice | None) -> None:
        try:
            resolve_bias(bias, activation, weight)
        except ValueError as error:
            raise ConfigError(path, str(error)) from None

    def excludes(self, node_name: str) -> bool:
        """Whether exclude_nodes names this node, exactly or as a full-match regular expression."""
        return any(node_name == p or re.fullmatch(p, node_name) for p in self.exclude_nodes)

    def selects(self, node_name: str, op_type: str) -> bool:
        """Whether the node is quantized: not excluded, and its op type listed or overridden."""
        listed = self.op_types == ALL or op_type in self.op_types
        named = op_type in self.op_type_overrides or node_name in self.node_overrides
        return (listed or named) and not self.excludes(node_name)

    def node_formats(self, node_name: str, op_type: str) -> NodeFormats | None:
        """Formats of a node's inputs, weights and bias after its op-type and node overrides
        (tensor_overrides still apply per tensor); None when the node is not quantized."""
        if not self.selects(node_name, op_type):
            return None
        choices = (self.activation, self.weight, self.bias)
        for override in (self.op_type_overrides.get(op_type), self.node_overrides.get(node_name)):
            if override is not None:
                choices = override.apply(*choices)
        activation, weight, bias = choices
        return NodeFormats(activation, weight, resolve_bias(bias, activation, weight))


# --- YAML: loading, presets, saving ------------------------------------------------------------


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
    from finetune import quark_config

    if config_format == "quark" or (config_format == "auto" and quark_config.is_quark_style(data)):
        return quark_config.from_quark(data)
    return from_mapping(QuantConfig, _resolve_preset(data, base_dir, seen))


def top_level_keys() -> tuple[str, ...]:
    """Keys a finetune config mapping may hold at its top level."""
    return ("preset", *(f.name for f in dataclasses.fields(QuantConfig)))


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
    from finetune import quark_config

    base = _read_yaml(path)
    if quark_config.is_quark_style(base):
        base = to_dict(quark_config.from_quark(base))
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


def save_config(config: QuantConfig, path: str | Path) -> None:
    """Write the config as YAML (complete, no preset reference), readable by load_config."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False, allow_unicode=True)
    Path(path).write_text(text, encoding="utf-8")
