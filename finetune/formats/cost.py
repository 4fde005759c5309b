"""Storage cost of each format in bits per element, shared scales and exponents included: the
cost model of mixed precision (MX4 = 4, MX6 = 6, MX9 = 9, BFP16 = 9, MXFP4 = 4.25, INT8 = 8)."""

from __future__ import annotations

import math

from .bfp import SHARED_EXPONENT_BITS, SIGN_BIT, BFPSpec
from .floats import FloatSpec
from .integer import INT_RANGES, IntSpec
from .mx import MXSpec

FLOAT32_BITS = 32.0  # an unquantized tensor, and each float32 scale of an INT block
MX_SCALE_BITS = 8  # one E8M0 shared scale per MX block


def bits_per_element(spec: IntSpec | FloatSpec | BFPSpec | MXSpec | None) -> float:
    """Bits one element costs in `spec` (None: float32), with its block's shared exponent or scale
    spread over the block; per-tensor and per-channel scales count as free."""
    if spec is None:
        return FLOAT32_BITS
    if isinstance(spec, IntSpec):
        low, high = INT_RANGES[spec.dtype]
        element = math.log2(high - low + 1)
        return element + (FLOAT32_BITS / spec.block_size if spec.block_size else 0.0)
    if isinstance(spec, FloatSpec):
        return float(spec.torch_dtype.itemsize * 8)
    if isinstance(spec, BFPSpec):
        shifts = spec.sub_block_shift_bits / spec.sub_block_size if spec.bfp_method == "to_bfp_prime" else 0.0
        return SIGN_BIT + spec.mantissa_bits + SHARED_EXPONENT_BITS / spec.block_size + shifts
    if isinstance(spec, MXSpec):
        element = spec.element
        width = 8 if element.is_int else SIGN_BIT + element.exponent_bits + element.mantissa_bits
        return width + MX_SCALE_BITS / spec.block_size
    raise TypeError(f"unknown format spec {spec!r}")
