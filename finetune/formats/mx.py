"""OCP Microscaling (MXFP8/6/4, MXINT8): a power-of-two scale shared by a block of small floats or
int8 fixed-point elements, exactly as FORMATS.md (no clamp of the scale to the E8M0 range)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bits import (
    EXPONENT_BIAS,
    compute_in_float32,
    fields_within,
    power_of_two_below,
    quantize_scaled,
    round_half_even,
    rounder,
    straight_through,
    tracks_gradient,
)
from .blocks import check_block_attributes, map_blocks, normal_scale_fields, shared_exponent_field


@dataclass(frozen=True)
class MXElement:
    """An MX element type: exponent/mantissa bits, its largest exponent and largest finite value."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    emax: int
    max_value: float

    @property
    def is_int(self) -> bool:
        return self.exponent_bits == 0

    @property
    def min_normal_exponent(self) -> int:
        """Exponent of the smallest normal element; below it the element is subnormal."""
        return 2 - 2 ** (self.exponent_bits - 1)


INT8_FRACTION_BITS = 6
MX_ELEMENTS: dict[str, MXElement] = {
    e.name: e
    for e in (
        MXElement("fp8_e5m2", 5, 2, 15, 57344.0),
        MXElement("fp8_e4m3", 4, 3, 8, 448.0),
        MXElement("fp6_e3m2", 3, 2, 4, 28.0),
        MXElement("fp6_e2m3", 2, 3, 2, 7.5),
        MXElement("fp4_e2m1", 2, 1, 2, 6.0),
        MXElement("int8", 0, INT8_FRACTION_BITS, 0, 127 / 64),
    )
}


@dataclass(frozen=True)
class MXSpec:
    """Attributes of `MXQuantizeDequantize`; field names are the ONNX attribute names."""

    element_dtype: str = "int8"
    block_size: int = 32
    axis: int = 1
    rounding_mode: int = 0

    def __post_init__(self) -> None:
        if self.element_dtype not in MX_ELEMENTS:
            raise ValueError(f"element_dtype must be one of {tuple(MX_ELEMENTS)}, got {self.element_dtype!r}")
        check_block_attributes(self.block_size, self.rounding_mode)

    @property
    def element(self) -> MXElement:
        return MX_ELEMENTS[self.element_dtype]


MXINT8 = MXSpec("int8", rounding_mode=2)
MXFP8_E4M3 = MXSpec("fp8_e4m3")
MXFP8_E5M2 = MXSpec("fp8_e5m2")
MXFP6_E3M2 = MXSpec("fp6_e3m2")
MXFP6_E2M3 = MXSpec("fp6_e2m3")
MXFP4 = MXSpec("fp4_e2m1")


def mx_quantize_dequantize(x: torch.Tensor, spec: MXSpec) -> torch.Tensor:
    """Quantize-dequantize x in the OCP MX format `spec`, with a straight-through gradient inside
    the element range and zero gradient where an element saturated."""
    return compute_in_float32(lambda xf: _mx_float32(xf, spec), x)


def _mx_float32(x: torch.Tensor, spec: MXSpec) -> torch.Tensor:
    """The format on float32 x, its gradient straight through where no element saturated."""
    y, passes = mx_values(x.detach(), spec, with_mask=tracks_gradient(x))
    return straight_through(x, y, passes)


def mx_values(x: torch.Tensor, spec: MXSpec, with_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized values of float32 x (no autograd), and with `with_mask` where no element
    saturated (None: everywhere). A one-element x (rank 0 included, whatever the axis) comes back
    as it is, as AMD Quark's kernels return it."""
    if x.numel() <= 1:
        return x, None
    return _mx_map(x, spec, with_mask)


def _mx_map(x: torch.Tensor, spec: MXSpec, with_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized values of x, and with `with_mask` also where no element saturated."""
    max_value, offset = spec.element.max_value, _scale_offset(spec)

    def per_block(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shared, finite, ordinary = shared_exponent_field(blocks, 2, *normal_scale_fields(offset))
        scale_exp = shared - offset
        y, scaled = quantize_scaled(blocks, scale_exp, lambda v: quantize_element(v, spec), normal=ordinary)
        if finite is not None:
            y = torch.where(finite, y, blocks)
        return (y, ~(scaled.abs() > max_value)) if with_mask else (y,)

    with torch.no_grad():
        y, *passes = map_blocks(x.detach(), spec.axis, spec.block_size, per_block)
    return y, passes[0] if with_mask else None


def _scale_offset(spec: MXSpec) -> int:
    """A block's scale is 2**(shared exponent field - this): its largest element spans the binade of
    the element type's largest exponent."""
    return EXPONENT_BIAS + spec.element.emax


def ordinary_input(x: torch.Tensor, spec: MXSpec) -> torch.Tensor:
    """Element-wise, whether an element of float32 x is zero or has an exponent field that gives a
    scale normal both ways: where it holds for every element, it holds for every block's largest
    one, and mx_values takes its ordinary path."""
    return fields_within(x, *normal_scale_fields(_scale_offset(spec)))


def quantize_element(v: torch.Tensor, spec: MXSpec) -> torch.Tensor:
    """Round block-scaled values to the element grid and saturate at the largest element."""
    element = spec.element
    if element.is_int:
        step = 2.0**INT8_FRACTION_BITS
        return rounder(spec.rounding_mode)(v * step).clamp_(-128, 127).div_(step)
    binade = power_of_two_below(v).clamp_(min=2.0**element.min_normal_exponent)
    steps = 2.0**element.mantissa_bits
    rounded = round_half_even(v * steps / binade).mul_(binade).div_(steps)
    return rounded.clamp_(-element.max_value, element.max_value)
