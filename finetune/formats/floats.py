"""FP16, BF16 and FP8 (E4M3FN, E5M2) quantize-dequantize with an optional scale and zero point,
round-to-nearest-even, and saturation to the largest finite value instead of inf."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bits import compute_in_float32, straight_through, tracks_gradient
from .blocks import broadcast_param, in_slices

FLOAT_TYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class FloatSpec:
    """A narrow float format; `saturate` clamps overflow to the largest finite value (the default)."""

    dtype: str = "bfloat16"
    saturate: bool = True
    axis: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_TYPES:
            raise ValueError(f"dtype must be one of {tuple(FLOAT_TYPES)}, got {self.dtype!r}")
        if self.dtype.startswith("float8") and not self.saturate:
            raise ValueError("FP8 formats are supported with saturate=True only (QuantizeLinear's default)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return FLOAT_TYPES[self.dtype]

    @property
    def max_value(self) -> float:
        return float(torch.finfo(self.torch_dtype).max)


BF16 = FloatSpec("bfloat16")
FP16 = FloatSpec("float16")
FP8_E4M3FN = FloatSpec("float8_e4m3fn")
FP8_E5M2 = FloatSpec("float8_e5m2")


def float_quantize_dequantize(
    x: torch.Tensor,
    spec: FloatSpec,
    scale: torch.Tensor | float = 1.0,
    zero_point: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """y = (float(round_to_type(x / s + zp)) - zp) * s; NaN stays NaN, overflow saturates when
    `spec.saturate`, and the straight-through gradient is zero where a value saturated."""
    return compute_in_float32(lambda xf: _float_float32(xf, spec, scale, zero_point), x)


def _float_float32(x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor | float, zero_point: torch.Tensor | float) -> torch.Tensor:
    """The format on float32 x, its gradient straight through where nothing saturated."""
    y, inside = float_values(x.detach(), spec, scale, zero_point, with_mask=tracks_gradient(x))
    return straight_through(x, y, inside)


def float_values(
    x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor | float, zero_point: torch.Tensor | float, with_mask: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized values of float32 x (no autograd), and with `with_mask` where no value
    saturated; a slice at a time on CPU (blocks.in_slices)."""
    return in_slices(lambda part, s, zp: _float_values(part, spec, s, zp, with_mask), x, spec.axis, scale, zero_point)


def _float_values(
    x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor | float, zero_point: torch.Tensor | float, with_mask: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float_values of x at once."""
    s = broadcast_param(scale, x, spec.axis, None, torch.float32)
    zp = broadcast_param(zero_point, x, spec.axis, None, torch.float32)
    with torch.no_grad():
        v = (x / s).add_(zp)
        inside = ~(v.abs() > spec.max_value) if with_mask else None
        return _saturating_cast(v, spec).to(torch.float32).sub_(zp).mul_(s), inside


def float_codes(x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor | float = 1.0, zero_point: torch.Tensor | float = 0.0) -> torch.Tensor:
    """The codes QuantizeLinear stores for x, as a tensor of the narrow float type."""
    xf = x.detach().float()
    s = broadcast_param(scale, xf, spec.axis, None, torch.float32)
    zp = broadcast_param(zero_point, xf, spec.axis, None, torch.float32)
    return _saturating_cast(xf / s + zp, spec)


def _saturating_cast(v: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    """Round to the narrow type (RNE), clamping to its largest finite value first when saturating."""
    if spec.saturate:
        v = v.clamp(-spec.max_value, spec.max_value)
    return v.to(spec.torch_dtype)
