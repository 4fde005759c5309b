"""Block floating point (`to_bfp`, e.g. BFP16) and Microexponents (`to_bfp_prime`, MX4/MX6/MX9):
one shared 8-bit exponent per block of sign-magnitude integers, exactly as FORMATS.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bits import (
    EXPONENT_BIAS,
    EXPONENT_FIELD_INF_NAN,
    ROUNDING_MODES,
    compute_in_float32,
    exponent_field,
    rounder,
    scale_by_pow2,
    straight_through,
)
from .blocks import to_blocks

BFP_METHODS = ("to_bfp", "to_bfp_prime")
SHARED_EXPONENT_BITS = 8
SIGN_BIT = 1


@dataclass(frozen=True)
class BFPSpec:
    """Attributes of `BFPQuantizeDequantize`; field names are the ONNX attribute names."""

    bfp_method: str = "to_bfp"
    bit_width: int = 16
    block_size: int = 8
    axis: int = 1
    rounding_mode: int = 0
    sub_block_size: int = 2
    sub_block_shift_bits: int = 1
    convert_to_bfloat_before_bfp: int = 0

    def __post_init__(self) -> None:
        if self.bfp_method not in BFP_METHODS:
            raise ValueError(f"bfp_method must be one of {BFP_METHODS}, got {self.bfp_method!r}")
        if not 10 <= self.bit_width <= 32:
            raise ValueError(f"bit_width must be in 10..32 (8 shared exponent bits + sign + >=1 mantissa bit), got {self.bit_width}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.rounding_mode not in ROUNDING_MODES:
            raise ValueError(f"rounding_mode must be one of {ROUNDING_MODES}, got {self.rounding_mode!r}")
        if self.convert_to_bfloat_before_bfp not in (0, 1):
            raise ValueError(f"convert_to_bfloat_before_bfp must be 0 or 1, got {self.convert_to_bfloat_before_bfp!r}")
        if self.bfp_method == "to_bfp_prime":
            if self.sub_block_size < 1 or self.block_size % self.sub_block_size:
                raise ValueError(
                    f"sub_block_size ({self.sub_block_size}) must be positive and divide block_size ({self.block_size})"
                )
            if not 0 <= self.sub_block_shift_bits <= 8:
                raise ValueError(f"sub_block_shift_bits must be in 0..8, got {self.sub_block_shift_bits}")

    @property
    def mantissa_bits(self) -> int:
        """Bits of each element's magnitude: bit_width minus the shared exponent and the sign."""
        return self.bit_width - SHARED_EXPONENT_BITS - SIGN_BIT


BFP16 = BFPSpec("to_bfp", bit_width=16, block_size=8)
MX9 = BFPSpec("to_bfp_prime", bit_width=16, block_size=16, sub_block_size=2, sub_block_shift_bits=1)
MX6 = BFPSpec("to_bfp_prime", bit_width=13, block_size=16, sub_block_size=2, sub_block_shift_bits=1)
MX4 = BFPSpec("to_bfp_prime", bit_width=11, block_size=16, sub_block_size=2, sub_block_shift_bits=1)


def bfp_quantize_dequantize(x: torch.Tensor, spec: BFPSpec) -> torch.Tensor:
    """Quantize-dequantize x in the block format `spec`, with a straight-through gradient inside the
    representable range and zero gradient where an element was clamped."""
    return compute_in_float32(lambda xf: _bfp_float32(xf, spec), x)


def _bfp_float32(x: torch.Tensor, spec: BFPSpec) -> torch.Tensor:
    if spec.convert_to_bfloat_before_bfp:
        x = straight_through(x, x.detach().to(torch.bfloat16).float(), None)
    if x.numel() == 1:
        return x
    with torch.no_grad():
        blocks, layout = to_blocks(x.detach(), spec.axis, spec.block_size)
        method = _to_bfp if spec.bfp_method == "to_bfp" else _to_bfp_prime
        y_blocks, inside_blocks = method(blocks, spec)
        y, inside = layout.restore(y_blocks), layout.restore(inside_blocks)
    return straight_through(x, y, inside)


def _round_codes(
    scaled: torch.Tensor, spec: BFPSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round scaled values to integer codes, clamped to the sign-magnitude range ±(2^m - 1)."""
    max_code = float(2**spec.mantissa_bits - 1)
    codes = rounder(spec.rounding_mode)(scaled)
    return codes.clamp(-max_code, max_code), scaled.abs() <= max_code


def _to_bfp(blocks: torch.Tensor, spec: BFPSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent = largest finite exponent field of the block; NaN/Inf pass through."""
    field = exponent_field(blocks)
    finite = field != EXPONENT_FIELD_INF_NAN
    shared = torch.where(finite, field, 0).amax(dim=2, keepdim=True)
    scale_exp = shared - EXPONENT_BIAS - (spec.mantissa_bits - 1)
    codes, inside = _round_codes(scale_by_pow2(blocks, -scale_exp), spec)
    y = torch.where(finite, scale_by_pow2(codes, scale_exp), blocks)
    return y, inside | ~finite


def _to_bfp_prime(blocks: torch.Tensor, spec: BFPSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent per block plus a small per-sub-block downshift; a block holding NaN/Inf
    becomes all NaN and float32 subnormals flush to zero."""
    p, nb, b, q = blocks.shape
    sub = blocks.reshape(p, nb, b // spec.sub_block_size, spec.sub_block_size, q)
    field = exponent_field(sub)
    sub_max = field.amax(dim=3, keepdim=True)
    shared = sub_max.amax(dim=2, keepdim=True)
    shift = torch.clamp(shared - sub_max, max=2**spec.sub_block_shift_bits - 1)
    scale_exp = shared - EXPONENT_BIAS - shift + 1 - spec.mantissa_bits
    codes, inside = _round_codes(scale_by_pow2(sub, -scale_exp), spec)
    y = scale_by_pow2(codes, scale_exp)
    y = torch.where(field == 0, torch.zeros_like(y), y)
    y = torch.where(shared == EXPONENT_FIELD_INF_NAN, torch.full_like(y, float("nan")), y)
    return y.reshape(p, nb, b, q), inside.reshape(p, nb, b, q)
