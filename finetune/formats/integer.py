"""Integer quantize-dequantize with QuantizeLinear/DequantizeLinear semantics, int4..uint32, per
tensor / per channel / per block, with an optional rounding hook for AdaRound."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bits import RoundFn, compute_in_float32, pow2, round_half_even, straight_through, tracks_gradient
from .blocks import broadcast_param, in_slices

# Code range of each integer type. x / scale is float32, as in QuantizeLinear; the codes of the
# 32-bit types are handled in float64 so that codes and zero points beyond 2^24 stay exact.
INT_RANGES: dict[str, tuple[float, float]] = {
    "int4": (-8.0, 7.0),
    "uint4": (0.0, 15.0),
    "int8": (-128.0, 127.0),
    "uint8": (0.0, 255.0),
    "int16": (-32768.0, 32767.0),
    "uint16": (0.0, 65535.0),
    "int32": (-2147483648.0, 2147483647.0),
    "uint32": (0.0, 4294967295.0),
}

WIDE_TYPES = ("int32", "uint32")


@dataclass(frozen=True)
class IntSpec:
    """An integer format: element type, symmetry, granularity (per tensor when axis is None, per
    channel with an axis, per block with axis and block_size) and whether scales are powers of two."""

    dtype: str = "int8"
    symmetric: bool = True
    axis: int | None = None
    block_size: int | None = None
    power_of_two: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in INT_RANGES:
            raise ValueError(f"dtype must be one of {tuple(INT_RANGES)}, got {self.dtype!r}")
        if self.block_size is not None and (self.axis is None or self.block_size < 1):
            raise ValueError("a block_size needs an axis and must be positive")

    @property
    def qmin(self) -> float:
        return INT_RANGES[self.dtype][0]

    @property
    def qmax(self) -> float:
        return INT_RANGES[self.dtype][1]

    @property
    def signed(self) -> bool:
        return not self.dtype.startswith("u")


def int_quantize_dequantize(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    zero_point: torch.Tensor | float,
    spec: IntSpec,
    rounding: RoundFn | None = None,
) -> torch.Tensor:
    """y = (clamp(round(x / s) + zp, qmin, qmax) - zp) * s. The straight-through gradient passes
    inside the range and is zero where clamped; `rounding` replaces round-half-to-even (AdaRound)."""
    return compute_in_float32(lambda xf: _int_float32(xf, scale, zero_point, spec, rounding), x)


def _int_float32(
    x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float, spec: IntSpec, rounding: RoundFn | None
) -> torch.Tensor:
    if rounding is None and not (isinstance(scale, torch.Tensor) and scale.requires_grad):
        y, inside = int_values(x.detach(), scale, zero_point, spec, with_mask=tracks_gradient(x))
        return straight_through(x, y, inside)
    code_dtype = torch.float64 if spec.dtype in WIDE_TYPES else torch.float32
    s = broadcast_param(scale, x, spec.axis, spec.block_size, torch.float32)
    zp = broadcast_param(zero_point, x, spec.axis, spec.block_size, code_dtype)
    codes = (rounding or _ste_round)(x / s).to(code_dtype)
    return (torch.clamp(codes + zp, spec.qmin, spec.qmax) - zp).float() * s


def int_values(
    x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float, spec: IntSpec, with_mask: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized values of float32 x (no autograd) with round-half-to-even, and with
    `with_mask` where no code was clamped; a slice at a time on CPU (blocks.in_slices)."""
    return in_slices(lambda part, s, zp: _int_values(part, s, zp, spec, with_mask), x, spec.axis, scale, zero_point)


def _int_values(
    x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float, spec: IntSpec, with_mask: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int_values of x at once."""
    code_dtype = torch.float64 if spec.dtype in WIDE_TYPES else torch.float32
    s = broadcast_param(scale, x, spec.axis, spec.block_size, torch.float32)
    zp = broadcast_param(zero_point, x, spec.axis, spec.block_size, code_dtype)
    with torch.no_grad():
        codes = round_half_even(x / s).to(code_dtype).add_(zp)
        inside = (codes >= spec.qmin) & (codes <= spec.qmax) if with_mask else None
        y = codes.clamp_(spec.qmin, spec.qmax).sub_(zp).to(torch.float32).mul_(s)
    return y, inside


def int_range_clamp(
    x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float, spec: IntSpec
) -> torch.Tensor:
    """x clamped to the values the format can represent, (qmin - zp) * s .. (qmax - zp) * s, without
    rounding: the part of a quantizer that stands in for a Relu or Clip which a quantizer (onnxruntime's,
    with asymmetric activations) removed because the clamp does its work."""
    code_dtype = torch.float64 if spec.dtype in WIDE_TYPES else torch.float32
    s = broadcast_param(scale, x, spec.axis, spec.block_size, torch.float32)
    zp = broadcast_param(zero_point, x, spec.axis, spec.block_size, code_dtype)
    low = (spec.qmin - zp).to(torch.float32) * s
    high = (spec.qmax - zp).to(torch.float32) * s
    return torch.minimum(torch.maximum(x, low.to(x.dtype)), high.to(x.dtype))


def int_codes(
    x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float, spec: IntSpec
) -> torch.Tensor:
    """The integer codes QuantizeLinear stores for x, as float64 values (exact for every type)."""
    xf = x.detach().float()
    s = broadcast_param(scale, xf, spec.axis, spec.block_size, torch.float32)
    zp = broadcast_param(zero_point, xf, spec.axis, spec.block_size, torch.float64)
    return round_half_even(xf / s).double().add_(zp).clamp_(spec.qmin, spec.qmax)


def _ste_round(v: torch.Tensor) -> torch.Tensor:
    """Round half to even with an identity gradient."""
    return v + (round_half_even(v.detach()) - v).detach()


def int_scale_zero_point(
    min_value: torch.Tensor, max_value: torch.Tensor, spec: IntSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point that cover [min_value, max_value] (each widened to include 0), as
    QuantizeLinear expects them; power-of-two scales round up so nothing extra is clipped."""
    lo = torch.clamp(torch.as_tensor(min_value, dtype=torch.float32), max=0.0)
    hi = torch.clamp(torch.as_tensor(max_value, dtype=torch.float32), min=0.0)
    levels = spec.qmax - spec.qmin
    if spec.symmetric:
        scale = torch.maximum(-lo, hi) / (levels // 2)
    else:
        scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if spec.power_of_two:
        scale = pow2(torch.ceil(torch.log2(scale)).clamp(-126, 127))
    if spec.symmetric:
        mid = 0.0 if spec.signed else math.ceil(levels / 2)
        zero_point = torch.full_like(scale, mid)
    else:
        zero_point = torch.clamp(round_half_even(spec.qmin - lo / scale), spec.qmin, spec.qmax)
    return scale, zero_point


def dequantize_linear(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None, block_size: int | None
) -> torch.Tensor:
    """DequantizeLinear: float32 (codes - zero_point) * scale, the difference exact in float64 as
    onnxruntime computes it, for codes of any integer or narrow float type."""
    wide = codes.double()
    zp = broadcast_param(zero_point, wide, axis, block_size, torch.float64)
    shifted = (wide - zp).float()
    return shifted * broadcast_param(scale, shifted, axis, block_size, torch.float32)
