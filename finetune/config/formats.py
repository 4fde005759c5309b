"""The formats a config gives tensors and nodes: FormatChoice (one tensor's format family, dtype,
granularity and calibration, turned into a `finetune.formats` spec), the layer-wise Override of
an op type or node, the resolved NodeFormats with their bias, and the op types quantized by default."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from finetune.calibrate.histograms import DEFAULT_BINS
from finetune.formats import BFPSpec, FloatSpec, FormatSpec, IntSpec, MXSpec
from finetune.formats.floats import FLOAT_TYPES
from finetune.formats.integer import INT_RANGES

from .schema import INHERIT, ConfigError, Inherit, Section

# Quantized (and fine-tuned) unless told otherwise: the layers with weights.
DEFAULT_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU")
ALL = "all"  # op_types value that quantizes every op type
AUTO = "auto"  # axis value that lets the quantizer pick the axis per op
DEFAULT_INT_BLOCK = 32
DEFAULT_PERCENTILE = 99.999

FormatName = Literal["int", "float", "bfp", "mx"]
Calibration = Literal["minmax", "percentile", "mse", "pot_minmse", "entropy"]
BLOCK_CALIBRATIONS = ("minmax",)  # the calibrations with per-block scales (finetune.calibrate's observers)
ENTROPY_BINS = DEFAULT_BINS // 2  # the bins of |x| among which the entropy observer picks its threshold

# format -> (spec dataclass, keys beyond the spec's fields)
_FAMILIES: dict[str, tuple[type, tuple[str, ...]]] = {
    "int": (IntSpec, ("granularity", "calibration", "percentile")),
    "float": (FloatSpec, ("granularity", "calibration", "percentile")),
    "bfp": (BFPSpec, ()),
    "mx": (MXSpec, ()),
}
_DTYPES = {"int": tuple(INT_RANGES), "float": tuple(FLOAT_TYPES)}
_BLOCK_FORMATS = ("bfp", "mx")


def format_family(spec: FormatSpec | None) -> str | None:
    """The `format` family of a spec ("int", "float", "bfp", "mx"); None for no spec (a tensor left float)."""
    return None if spec is None else next(name for name, (spec_type, _) in _FAMILIES.items() if isinstance(spec, spec_type))


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
      block_size (32 for block), power_of_two (false), calibration (minmax, the only one for
      blocks; entropy up to 8 bits), percentile (99.999, with calibration percentile only).
      `pot_minmse` needs power_of_two.
    - float: dtype (bfloat16), saturate (true), granularity tensor|channel (channel for float8
      only), axis; float8 calibrates its scale (minmax; not entropy), bfloat16/float16 take none
      (scale 1).
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
        self._check_observable()
        if self.calibration == "percentile":
            self._set_default("percentile", DEFAULT_PERCENTILE)
        elif self.percentile is not None:
            raise ConfigError("percentile", "applies with calibration: percentile only (set it to null)")

    def _check_observable(self) -> None:
        """Refuse what finetune.calibrate's observers cannot serve: only minmax keeps per-block
        ranges, and entropy searches integer levels, fewer than its histogram's bins (with more it
        would clip nothing, i.e. be minmax)."""
        if self.granularity == "block" and self.calibration not in BLOCK_CALIBRATIONS:
            raise ConfigError("calibration", f"{self.calibration} cannot calibrate per-block scales (granularity "
                                             f"block); use {' or '.join(BLOCK_CALIBRATIONS)}")
        if self.calibration != "entropy":
            return
        if self.format == "float":
            problem = "it searches integer levels"
        else:
            low, high = INT_RANGES[self.dtype]
            magnitudes = int(high - low + 1) // 2
            if magnitudes < ENTROPY_BINS:
                return
            problem = f"its {magnitudes:,} levels of |x| outnumber the {ENTROPY_BINS} histogram bins, so it would clip nothing"
        raise ConfigError("calibration", f"entropy cannot calibrate {self.dtype}: {problem}; use minmax, percentile or mse")

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
