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

from finetune.formats import BFPSpec, FloatSpec, FormatSpec, IntSpec, MXSpec
from finetune.formats.floats import FLOAT_TYPES
from finetune.formats.integer import INT_RANGES

from .schema import INHERIT, ConfigError, Inherit, Section, from_mapping, join_path

PRESET_DIR = Path(__file__).parent.parent / "configs"
DEFAULT_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul")
AUTO = "auto"
ALL = "all"
DEFAULT_INT_BLOCK = 32
DEFAULT_PERCENTILE = 99.999
CONFIG_FORMATS = ("auto", "finetune", "quark")

# --- the format of one tensor -------------------------------------------------------------------

FormatName = Literal["int", "float", "bfp", "mx"]
Calibration = Literal["minmax", "percentile", "mse", "pot_minmse", "entropy"]

# format -> (spec dataclass, keys beyond the spec's fields)
_FAMILIES: dict[str, tuple[type, tuple[str, ...]]] = {
    "int": (IntSpec, ("granularity", "calibration", "percentile")),
    "float": (FloatSpec, ("granularity", "calibration", "percentile")),
    "bfp": (BFPSpec, ()),
    "mx": (MXSpec, ()),
}
_DTYPES = {"int": tuple(INT_RANGES), "float": tuple(FLOAT_TYPES)}
_BLOCK_FORMATS = ("bfp", "mx")


def family_keys(format_name: str) -> tuple[str, ...]:
    """The YAML keys of one format: `format`, the spec's fields and the calibration keys."""
    spec_type, extras = _FAMILIES[format_name]
    return ("format", *(f.name for f in dataclasses.fields(spec_type)), *extras)


@dataclass(frozen=True)
class FormatChoice(Section):
    """A tensor's format as configured: the keys of one `finetune.formats` spec plus granularity
    and calibration. Unset keys take the spec's defaults; `axis: auto` (the default) lets the
    quantizer pick the axis per op (see `spec`). Keys of other formats must stay unset (null).

    - int: dtype (int8), symmetric (true), granularity tensor|channel|block (tensor), axis,
      block_size (32 for block), power_of_two (false), calibration (minmax), percentile (99.999,
      with calibration percentile only). `pot_minmse` needs power_of_two.
    - float: dtype (bfloat16), saturate (true), granularity tensor|channel (channel for float8
      only), axis; float8 calibrates its scale (minmax), bfloat16/float16 take none (scale 1).
    - bfp: BFPSpec's keys (to_bfp, 16 bits, block 8, ...); mx: MXSpec's keys (int8, block 32).
    """

    format: FormatName
    dtype: str | None = None
    symmetric: bool | None = None
    granularity: Literal["tensor", "channel", "block"] | None = None
    axis: int | Literal["auto"] | None = None
    block_size: int | None = field(default=None, metadata={"min": 1})
    power_of_two: bool | None = None
    saturate: bool | None = None
    calibration: Calibration | None = None
    percentile: float | None = field(default=None, metadata={"above": 0, "max": 100})
    bfp_method: str | None = None
    bit_width: int | None = None
    sub_block_size: int | None = None
    sub_block_shift_bits: int | None = None
    rounding_mode: int | None = None
    convert_to_bfloat_before_bfp: int | None = None
    element_dtype: str | None = None

    @classmethod
    def allowed_keys(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        fmt = data.get("format")
        return family_keys(fmt) if fmt in _FAMILIES else super().allowed_keys(data)

    def _check(self) -> None:
        self._reject_foreign_keys()
        self._fill_spec_defaults()
        if self.format in _DTYPES and self.dtype not in _DTYPES[self.format]:
            allowed = ", ".join(_DTYPES[self.format])
            raise ConfigError("dtype", f"must be one of {allowed} for format {self.format}; got {self.dtype!r}")
        if self.format in _BLOCK_FORMATS:
            self._set_default("axis", AUTO)
        else:
            self._check_granularity()
            self._check_calibration()
        self._validate_spec()

    def _reject_foreign_keys(self) -> None:
        """Keys of other formats must be unset (null), so a typo'd family never passes silently."""
        allowed = family_keys(self.format)
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None and f.name not in allowed:
                raise ConfigError(f.name, f"not a key of format {self.format}; allowed: {', '.join(allowed)}")

    def _fill_spec_defaults(self) -> None:
        """Unset spec keys take the spec dataclass's defaults (axis and INT block size depend on
        the granularity and are filled later)."""
        unfilled = ("axis", "block_size") if self.format == "int" else ("axis",)
        for f in dataclasses.fields(_FAMILIES[self.format][0]):
            if f.name not in unfilled:
                self._set_default(f.name, f.default)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _set_default(self, name: str, value: Any) -> None:
        if getattr(self, name) is None:
            self._set(name, value)

    def _check_granularity(self) -> None:
        """Per tensor: no axis (`auto` is dropped); per channel: an axis; per block: axis + size."""
        self._set_default("granularity", "tensor")
        if self.granularity == "block" and self.format != "int":
            raise ConfigError("granularity", "must be tensor or channel for format float; got 'block'")
        if self.granularity == "channel" and self.format == "float" and not self.dtype.startswith("float8"):
            raise ConfigError("granularity", f"must be tensor for {self.dtype} (it has no scale); got 'channel'")
        if self.granularity == "tensor":
            if self.axis not in (None, AUTO):
                raise ConfigError("axis", "applies to granularity channel or block only (set it to null or auto)")
            self._set("axis", None)
        else:
            self._set_default("axis", AUTO)
        if self.granularity == "block":
            self._set_default("block_size", DEFAULT_INT_BLOCK)
        elif self.block_size is not None:
            raise ConfigError("block_size", "applies to granularity block only (set it to null)")

    def _check_calibration(self) -> None:
        """INT and FP8 calibrate their scales (minmax unless set); BF16/FP16 use scale 1."""
        if self.format == "float" and not self.dtype.startswith("float8"):
            if self.calibration is not None or self.percentile is not None:
                raise ConfigError("calibration", f"{self.dtype} takes no calibration (scale 1); set it to null")
            return
        self._set_default("calibration", "minmax")
        if self.calibration == "pot_minmse" and not self.power_of_two:
            raise ConfigError("calibration", "pot_minmse searches power-of-two scales: it needs power_of_two: true")
        if self.calibration == "percentile":
            self._set_default("percentile", DEFAULT_PERCENTILE)
        elif self.percentile is not None:
            raise ConfigError("percentile", "applies with calibration: percentile only (set it to null)")

    def _validate_spec(self) -> None:
        """Build a spec once so that the spec's own checks (ranges, block sizes) run at load time."""
        try:
            self.spec(output_axis=1, input_axis=1)
        except ValueError as error:
            key, _, rest = str(error).partition(" ")
            if key in family_keys(self.format):
                raise ConfigError(key, rest) from None
            raise ConfigError("", str(error)) from None

    @property
    def per_channel(self) -> bool:
        """Whether the format has one scale per channel (INT or FP8 with granularity channel)."""
        return self.granularity == "channel"

    def spec(
        self, rank: int | None = None, output_axis: int | None = None, input_axis: int | None = None
    ) -> FormatSpec:
        """The concrete format of one tensor. `axis: auto` becomes the op's output-channel axis
        for per-channel scales and its input-channel (reduction) axis for blocks (BFP, MX, INT
        blocks), or 1 where the op gives none; with `rank`, negative axes count from the end."""
        axis = self.axis
        if axis == AUTO:
            picked = output_axis if self.per_channel else input_axis
            axis = 1 if picked is None else picked
        if axis is not None and rank is not None:
            axis = _normalize_axis(axis, rank, self.format in _BLOCK_FORMATS)
        spec_type = _FAMILIES[self.format][0]
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(spec_type)}
        return spec_type(**{**values, "axis": axis})


def _normalize_axis(axis: int, rank: int, blocked: bool) -> int:
    """Non-negative axis of a tensor of `rank`; block formats ignore the axis of rank-0/1 tensors."""
    if blocked and rank <= 1:
        return 0
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


# --- overrides, fast finetune, the whole config -------------------------------------------------

Bias = Literal["auto", "float", "int32"]


@dataclass(frozen=True)
class Override(Section):
    """Layer-wise formats for an op type or a node; unset keys keep the global choice and null
    leaves that part float."""

    activation: FormatChoice | Inherit | None = INHERIT
    weight: FormatChoice | Inherit | None = INHERIT
    bias: Bias | Inherit = INHERIT

    def _check(self) -> None:
        if all(getattr(self, f.name) is INHERIT for f in dataclasses.fields(self)):
            raise ConfigError("", "sets nothing; give activation, weight or bias")

    def apply(self, activation: FormatChoice | None, weight: FormatChoice | None, bias: str) -> tuple[Any, Any, Any]:
        """The (activation, weight, bias) choices with this override laid over them."""
        pairs = zip((activation, weight, bias), (self.activation, self.weight, self.bias), strict=True)
        return tuple(old if new is INHERIT else new for old, new in pairs)


@dataclass(frozen=True)
class EarlyStop(Section):
    """Stop a unit's optimisation once its loss has not improved by `min_delta` for `patience`
    iterations, counting only after `warmup` iterations (defaults: off, 100, 0.0, 0)."""

    enabled: bool = False
    patience: int = field(default=100, metadata={"min": 1})
    min_delta: float = field(default=0.0, metadata={"min": 0})
    warmup: int = field(default=0, metadata={"min": 0})


DEFAULT_LR = {"adaround": 0.1, "adaquant": 1e-3}  # adaquant: Quark says 1e-5, which barely moves 4-bit weights
DEVICE_PATTERN = r"cpu|(?:cuda|hip)(?::\d+)?"
DEVICE_HELP = "cpu, cuda, cuda:N, hip or hip:N"


@dataclass(frozen=True)
class FastFinetune(Section):
    """AdaRound / AdaQuant reconstruction after quantization (run by the fine-tuning stage).

    Defaults: adaround, 1000 iterations, lr 0.1 for adaround and 1e-3 for adaquant (decaying
    along a cosine), batches of 16 samples, all calibration data (data_size null), no early stop,
    seed 0, cpu, the default op types, no bias update (adaquant only), output quantizers left out
    (a layer's activation is always in its unit), drop_ratio 0.5 (share of unit inputs taken from
    the quantized rather than the float model), 2 GiB of cached activations in memory, layer-wise
    units (`block`: the layers of one exporter scope tuned together, as in BRECQ)."""

    algorithm: Literal["adaround", "adaquant"] = "adaround"
    iterations: int = field(default=1000, metadata={"min": 1})
    lr: float | None = field(default=None, metadata={"above": 0})
    batch_size: int = field(default=16, metadata={"min": 1})
    data_size: int | None = field(default=None, metadata={"min": 1})
    early_stop: EarlyStop = field(default_factory=EarlyStop)
    seed: int = 0
    device: str = field(default="cpu", metadata={"pattern": DEVICE_PATTERN, "pattern_help": DEVICE_HELP})
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    update_bias: bool = False
    include_output_quant: bool = False
    drop_ratio: float = field(default=0.5, metadata={"min": 0, "max": 1})
    cache_budget_bytes: int = field(default=2**31, metadata={"min": 1})
    unit: Literal["layer", "block"] = "layer"

    def _check(self) -> None:
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.algorithm])
        if self.update_bias and self.algorithm != "adaquant":
            raise ConfigError("update_bias", "applies to algorithm adaquant only (adaround learns roundings)")
        if self.include_output_quant and self.unit == "block":
            raise ConfigError("include_output_quant", "applies to unit: layer only (a block ends where one value is live; "
                              "the quantizers reading it belong to the next block)")


BiasFormat = Literal["int32"] | None


@dataclass(frozen=True)
class NodeFormats:
    """Resolved formats of one node: its activation inputs, its weights and its bias
    ('int32' with scale s_input * s_weight, a FormatChoice, or None for float)."""

    activation: FormatChoice | None
    weight: FormatChoice | None
    bias: BiasFormat


def resolve_bias(bias: str, activation: FormatChoice | None, weight: FormatChoice | None) -> BiasFormat:
    """The bias format that `bias` means next to these input and weight formats: auto is int32
    when both are INT (FORMATS.md quantizes only an integer bias), float otherwise."""
    both_int = all(c is not None and c.format == "int" for c in (activation, weight))
    if bias == "int32" and not both_int:
        raise ValueError("int32 needs INT activations and weights (its scale is s_input * s_weight)")
    return "int32" if bias == "int32" or (bias == "auto" and both_int) else None


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
