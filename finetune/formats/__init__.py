"""Exact numerics of every format as pure torch quantize-dequantize functions (see FORMATS.md)."""

from __future__ import annotations

import numpy as np
import torch

from .bfp import BFP16, MX4, MX6, MX9, BFPSpec, bfp_quantize_dequantize, bfp_values
from .bits import RoundFn
from .blocks import broadcast_param, quantizer_slices
from .cost import bits_per_element
from .floats import BF16, FP8_E4M3FN, FP8_E5M2, FP16, FloatSpec, float_codes, float_quantize_dequantize, float_values
from .integer import (
    INT_RANGES,
    IntSpec,
    dequantize_linear,
    int_codes,
    int_quantize_dequantize,
    int_range_clamp,
    int_scale_zero_point,
    int_values,
)
from .mx import (
    MX_ELEMENTS,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8_E4M3,
    MXFP8_E5M2,
    MXINT8,
    MXElement,
    MXSpec,
    mx_quantize_dequantize,
    mx_values,
)

FormatSpec = IntSpec | FloatSpec | BFPSpec | MXSpec

# The block formats by the names presets and users know them by (a spec matches on every attribute but its axis).
NAMED_BLOCK_FORMATS: dict[str, BFPSpec | MXSpec] = {
    "BFP16": BFP16, "MX4": MX4, "MX6": MX6, "MX9": MX9, "MXINT8": MXINT8, "MXFP8_E4M3": MXFP8_E4M3,
    "MXFP8_E5M2": MXFP8_E5M2, "MXFP6_E3M2": MXFP6_E3M2, "MXFP6_E2M3": MXFP6_E2M3, "MXFP4": MXFP4,
}

__all__ = [
    "BF16",
    "BFP16",
    "FP8_E4M3FN",
    "FP8_E5M2",
    "FP16",
    "INT_RANGES",
    "MX4",
    "MX6",
    "MX9",
    "MXFP4",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "MXINT8",
    "MX_ELEMENTS",
    "NAMED_BLOCK_FORMATS",
    "BFPSpec",
    "FloatSpec",
    "FormatSpec",
    "IntSpec",
    "MXElement",
    "MXSpec",
    "RoundFn",
    "bfp_quantize_dequantize",
    "bits_per_element",
    "broadcast_param",
    "codes_array",
    "dequantize_linear",
    "float_codes",
    "float_quantize_dequantize",
    "format_values",
    "int_codes",
    "int_quantize_dequantize",
    "int_range_clamp",
    "int_scale_zero_point",
    "mx_quantize_dequantize",
    "quantize_dequantize",
]


def quantize_dequantize(
    x: torch.Tensor,
    spec: FormatSpec,
    scale: torch.Tensor | float | None = None,
    zero_point: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Quantize-dequantize x in any format; INT needs a scale (zero point defaults to 0), float
    formats take an optional scale/zero point, block formats carry their scales in the data."""
    if isinstance(spec, IntSpec):
        if scale is None:
            raise ValueError("an integer format needs a scale")
        return int_quantize_dequantize(x, scale, 0.0 if zero_point is None else zero_point, spec)
    if isinstance(spec, FloatSpec):
        return float_quantize_dequantize(x, spec, 1.0 if scale is None else scale, 0.0 if zero_point is None else zero_point)
    if scale is not None or zero_point is not None:
        raise ValueError(f"{type(spec).__name__} derives its scales from the data; do not pass a scale or zero point")
    if isinstance(spec, BFPSpec):
        return bfp_quantize_dequantize(x, spec)
    if isinstance(spec, MXSpec):
        return mx_quantize_dequantize(x, spec)
    raise TypeError(f"unknown format spec {spec!r}")


def format_values(
    x: torch.Tensor, spec: FormatSpec, scale: torch.Tensor | None, zero_point: torch.Tensor | None, with_mask: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """quantize_dequantize's values of float32 x without autograd (integer formats with
    round-half-to-even), and with `with_mask` where its straight-through gradient passes (None:
    everywhere): the one computation the eager functions wrap and the compiled kernels trace."""
    if isinstance(spec, IntSpec):
        if scale is None:
            raise ValueError("an integer format needs a scale")
        return int_values(x, scale, 0.0 if zero_point is None else zero_point, spec, with_mask)
    if isinstance(spec, FloatSpec):
        return float_values(x, spec, 1.0 if scale is None else scale, 0.0 if zero_point is None else zero_point, with_mask)
    if isinstance(spec, BFPSpec):
        return bfp_values(x, spec, with_mask)
    if isinstance(spec, MXSpec):
        return mx_values(x, spec, with_mask)
    raise TypeError(f"unknown format spec {spec!r}")


def codes_array(
    values: np.ndarray | torch.Tensor, spec: IntSpec | FloatSpec, scale: np.ndarray | torch.Tensor,
    zero_point: np.ndarray | torch.Tensor, dtype: np.dtype,
) -> np.ndarray:
    """The codes QuantizeLinear stores for CPU `values` (round half to even, saturated) as an array of
    `dtype` (ml_dtypes for int4 and float8), built a slice at a time (blocks.quantizer_slices): the
    float32 copy and the float64 codes are a slice's, not the tensor's."""
    codes = np.empty(tuple(values.shape), dtype)
    params = (torch.as_tensor(scale), torch.as_tensor(zero_point))
    for index, (scale_part, zero_point_part) in quantizer_slices(tuple(values.shape), spec.axis, params):
        part = torch.from_numpy(np.array(values[index], np.float32)) if isinstance(values, np.ndarray) else values[index]
        if isinstance(spec, IntSpec):
            codes[index] = int_codes(part, scale_part, zero_point_part, spec).numpy()
        else:
            codes[index] = float_codes(part, spec, scale_part, zero_point_part).float().numpy()
    return codes
