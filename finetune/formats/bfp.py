"""Block floating point (`to_bfp`, e.g. BFP16) and Microexponents (`to_bfp_prime`, MX4/MX6/MX9):
one shared 8-bit exponent per block of sign-magnitude integers, exactly as FORMATS.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bits import (
    EXPONENT_BIAS,
    EXPONENT_FIELD_INF_NAN,
    F32_MIN_NORMAL,
    compute_in_float32,
    exponent_field,
    fields_within,
    needs,
    quantize_scaled,
    rounder,
    straight_through,
    tracks_gradient,
)
from .blocks import check_block_attributes, map_blocks, normal_scale_fields, ordinary_fields, shared_exponent_field

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
        widest = 32 - self.max_sub_block_shift
        if not 10 <= self.bit_width <= widest:
            raise ValueError(
                f"bit_width must be in 10..{widest} (8 shared exponent bits, a sign, at least one mantissa bit, and "
                f"every scale a float32 power of two), got {self.bit_width}"
            )
        check_block_attributes(self.block_size, self.rounding_mode)
        if self.convert_to_bfloat_before_bfp not in (0, 1):
            raise ValueError(f"convert_to_bfloat_before_bfp must be 0 or 1, got {self.convert_to_bfloat_before_bfp!r}")
        if self.bfp_method == "to_bfp_prime":
            if self.sub_block_size < 1 or self.block_size % self.sub_block_size:
                raise ValueError(
                    f"sub_block_size ({self.sub_block_size}) must be positive and divide block_size ({self.block_size})"
                )
            if not 0 <= self.sub_block_shift_bits <= 4:
                raise ValueError(f"sub_block_shift_bits must be in 0..4, got {self.sub_block_shift_bits}")

    @property
    def max_sub_block_shift(self) -> int:
        """Largest per-sub-block exponent downshift (0 for to_bfp, which has no sub-blocks)."""
        return 2**self.sub_block_shift_bits - 1 if self.bfp_method == "to_bfp_prime" else 0

    @property
    def mantissa_bits(self) -> int:
        """Bits of each element's magnitude: bit_width minus the shared exponent and the sign."""
        return self.bit_width - SHARED_EXPONENT_BITS - SIGN_BIT

    @property
    def scale_offset(self) -> int:
        """A block's scale is 2**(shared exponent field - scale_offset) (less a sub-block's shift):
        its largest code, mantissa_bits ones, then spans the largest element's binade."""
        return EXPONENT_BIAS + self.mantissa_bits - 1


BFP16 = BFPSpec("to_bfp", bit_width=16, block_size=8)
MX9 = BFPSpec("to_bfp_prime", bit_width=16, block_size=16, sub_block_size=2, sub_block_shift_bits=1)
MX6 = BFPSpec("to_bfp_prime", bit_width=13, block_size=16, sub_block_size=2, sub_block_shift_bits=1)
MX4 = BFPSpec("to_bfp_prime", bit_width=11, block_size=16, sub_block_size=2, sub_block_shift_bits=1)


def bfp_quantize_dequantize(x: torch.Tensor, spec: BFPSpec) -> torch.Tensor:
    """Quantize-dequantize x in the block format `spec`, with a straight-through gradient inside the
    representable range and zero gradient where an element was clamped."""
    return compute_in_float32(lambda xf: _bfp_float32(xf, spec), x)


def _bfp_float32(x: torch.Tensor, spec: BFPSpec) -> torch.Tensor:
    """The format on float32 x, its gradient straight through where nothing was clamped."""
    y, passes = bfp_values(x.detach(), spec, with_mask=tracks_gradient(x))
    return straight_through(x, y, passes)


def bfp_values(x: torch.Tensor, spec: BFPSpec, with_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized values of float32 x (no autograd), and with `with_mask` where no clamping
    happened (None: everywhere). A one-element x (rank 0 included, whatever the axis) comes back as
    it is apart from the bfloat16 pre-rounding, as AMD Quark's kernels return it."""
    if spec.convert_to_bfloat_before_bfp:
        x = x.to(torch.bfloat16).float()
    if x.numel() <= 1:
        return x, None
    return _bfp_map(x, spec, with_mask)


def _bfp_map(x: torch.Tensor, spec: BFPSpec, with_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized values of x, and with `with_mask` also where no clamping happened."""
    method = _to_bfp if spec.bfp_method == "to_bfp" else _to_bfp_prime
    max_code = float(2**spec.mantissa_bits - 1)

    def per_block(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, scaled = method(blocks, spec, max_code)
        return (y, (scaled.abs() <= max_code).reshape(y.shape)) if with_mask else (y,)

    with torch.no_grad():
        y, *passes = map_blocks(x.detach(), spec.axis, spec.block_size, per_block)
    return y, passes[0] if with_mask else None


def ordinary_input(x: torch.Tensor, spec: BFPSpec) -> torch.Tensor:
    """Element-wise, whether an element of float32 x is zero or, after the bfloat16 pre-rounding
    where asked, has its exponent field in ordinary_field_range: where it holds for every element,
    it holds for every block's and sub-block's largest one, and bfp_values takes its ordinary path."""
    if spec.convert_to_bfloat_before_bfp:
        x = x.to(torch.bfloat16).float()
    return fields_within(x, *ordinary_field_range(spec))


def ordinary_field_range(spec: BFPSpec) -> tuple[int, int]:
    """The exponent fields of a block's largest magnitude (to_bfp) or of each sub-block's
    (to_bfp_prime) with which the block needs no rare-case fix. to_bfp: its scales are normal
    both ways. to_bfp_prime: scales are 2**(field - scale_offset - shift), 0 <= shift <=
    max_sub_block_shift; from headroom + 2 on the smallest is normal both ways (from headroom
    on) and no float32 subnormal gets a nonzero code, so none needs the flush."""
    lowest, highest = normal_scale_fields(spec.scale_offset)
    if spec.bfp_method == "to_bfp":
        return lowest, highest
    return spec.mantissa_bits + spec.max_sub_block_shift + 2, highest


def round_codes(scaled: torch.Tensor, spec: BFPSpec, max_code: float) -> torch.Tensor:
    """Round scaled values to integer codes, clamped to the sign-magnitude range ±max_code."""
    return rounder(spec.rounding_mode)(scaled).clamp_(-max_code, max_code)


def _to_bfp(blocks: torch.Tensor, spec: BFPSpec, max_code: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent = largest finite exponent field of the block; NaN/Inf pass through.
    Returns the result and the scaled values (for the gradient mask)."""
    shared, finite, ordinary = shared_exponent_field(blocks, 2, *ordinary_field_range(spec))
    scale_exp = shared - spec.scale_offset
    y, scaled = quantize_scaled(blocks, scale_exp, lambda v: round_codes(v, spec, max_code), normal=ordinary)
    if finite is not None:
        y = torch.where(finite, y, blocks)
    return y, scaled


def _to_bfp_prime(blocks: torch.Tensor, spec: BFPSpec, max_code: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent per block plus a small per-sub-block downshift; a block holding NaN/Inf
    becomes all NaN and float32 subnormals flush to zero."""
    p, nb, b, q = blocks.shape
    sub = blocks.reshape(p, nb, b // spec.sub_block_size, spec.sub_block_size, q)
    sub_max_abs = sub.abs().amax(dim=3, keepdim=True)
    max_shift = spec.max_sub_block_shift
    headroom = spec.mantissa_bits + max_shift
    sub_max = ordinary_fields(sub_max_abs, *ordinary_field_range(spec))
    ordinary = sub_max is not None
    if sub_max is None:
        sub_max = exponent_field(sub_max_abs)
    shared = sub_max.amax(dim=2, keepdim=True)
    shift = torch.clamp(shared - sub_max, max=max_shift)
    scale_exp = shared - spec.scale_offset - shift
    y, scaled = quantize_scaled(sub, scale_exp, lambda v: round_codes(v, spec, max_code), normal=ordinary)
    if not ordinary:
        if needs(_subnormals_may_round_to_nonzero(sub_max_abs, shared, headroom)):
            y = y * (sub.abs() >= F32_MIN_NORMAL)
        has_nan_or_inf = shared == EXPONENT_FIELD_INF_NAN
        if needs(has_nan_or_inf):
            y = torch.where(has_nan_or_inf, float("nan"), y)
    return y.reshape(blocks.shape), scaled


def _subnormals_may_round_to_nonzero(sub_max_abs: torch.Tensor, shared: torch.Tensor, headroom: int) -> torch.Tensor:
    """Per block, whether a float32 subnormal could get a nonzero code: only in a block that is not
    all zero and whose shared exponent field is at most headroom + 1. Checked per block, this spares
    the per-element flush on ordinary data; elsewhere the codes of subnormals are already ±0, so the
    flush, when it runs anyway, changes no bit."""
    block_max_abs = sub_max_abs.amax(dim=2, keepdim=True)
    return (shared <= headroom + 1) & (block_max_abs > 0)
