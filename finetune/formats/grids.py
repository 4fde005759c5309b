"""A weight's quantization grid frozen element by element, for algorithms that choose each
element's value one column at a time (GPTQ). Integer and float formats keep the scale and zero
point their QuantizeLinear node stores; the block formats (BFP, MX, OCP MX) take each block's
shared exponent, and each sub-block's shift, from the weight given (the original float weights),
exactly as the format computes them. Rounding a value on the frozen grid is then element-wise, so
a column can be rounded while later columns still change.

Why frozen grids stay exact: an element rounded on its block's frozen grid has a magnitude below
2**(shared exponent + 1), and on every format here a block whose largest element shrank gets a
grid at least as fine that still spans the values rounded on the old one. So a weight made of such
values goes through the format's own quantize-dequantize unchanged (tests/test_gptq.py checks it).
Elements of a block that is all zero stay zero (the format gives such a block no usable grid).
Not modelled: the flush of float32 subnormals in MX4/6/9 blocks whose largest element is itself
below about 2**-115 (no trained weight is that small)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .bfp import BFPSpec, round_codes
from .bits import EXPONENT_BIAS, exponent_field, quantize_scaled
from .blocks import broadcast_param, map_blocks, max_exponent_field
from .floats import FloatSpec, float_quantize_dequantize
from .integer import IntSpec, int_quantize_dequantize
from .mx import MXSpec, quantize_element

ElementFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class FixedGrid:
    """Per-element parameters of a frozen grid (each shaped like the weight, or laid out as the
    caller lays out the weight) and the element-wise rounding that reads them."""

    round_fn: ElementFn
    params: tuple[torch.Tensor, ...]

    def laid_out(self, layout: Callable[[torch.Tensor], torch.Tensor]) -> FixedGrid:
        """The grid with every parameter rearranged as `layout` rearranges the weight."""
        return FixedGrid(self.round_fn, tuple(layout(p) for p in self.params))

    def round(self, values: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
        """`values` (float32) rounded on the grid of the weight's columns `columns` (last axis)."""
        return self.round_fn(values, *(p[..., columns] for p in self.params))


def fixed_grid(weight: torch.Tensor, spec: IntSpec | FloatSpec | BFPSpec | MXSpec,
               scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None) -> FixedGrid:
    """The grid `spec` puts under `weight` (float32), frozen: rounding `weight` itself on it gives
    exactly the format's quantize-dequantize of `weight`."""
    w = weight.detach().float()
    if isinstance(spec, IntSpec):
        s = _per_element(scale, w, spec.axis, spec.block_size, torch.float32)
        # the zero point in its own dtype (integers, exact in it), not float64: rounding converts each column's slice
        zp = _per_element(zero_point, w, spec.axis, spec.block_size)
        elementwise = replace(spec, axis=0, block_size=1)  # one scale per element: a block of one along axis 0
        return FixedGrid(lambda v, s, zp: int_quantize_dequantize(v, s, zp, elementwise), (s, zp))
    if isinstance(spec, FloatSpec):
        s = _per_element(1.0 if scale is None else scale, w, spec.axis, None, torch.float32)
        zp = _per_element(0.0 if zero_point is None else zero_point, w, spec.axis, None, torch.float32)
        plain = FloatSpec(spec.dtype, spec.saturate)
        return FixedGrid(lambda v, s, zp: (float_quantize_dequantize(v / s + zp, plain) - zp) * s, (s, zp))
    if w.numel() <= 1:
        raise ValueError("a one-element weight is not quantized by block formats")
    if isinstance(spec, BFPSpec):
        return _bfp_grid(w, spec)
    if isinstance(spec, MXSpec):
        return _mx_grid(w, spec)
    raise TypeError(f"unknown format spec {spec!r}")


def _per_element(param: torch.Tensor | float, w: torch.Tensor, axis: int | None, block_size: int | None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """A scale or zero point (as QuantizeLinear reads it) for every element of w: where it holds one value
    throughout (a symmetric format's zero points, a per-tensor scale) a view of that value, which every
    layout keeps a view (no memory: a 4096x4096 weight's float32 zero points were 64 MiB); else a
    tensor of its own shaped like w (one value means the same at every granularity)."""
    compact = torch.as_tensor(param, dtype=dtype, device=w.device)
    if compact.numel() and bool((compact == compact.reshape(-1)[0]).all()):
        return compact.reshape(-1)[0].clone().expand_as(w)
    return broadcast_param(compact, w, axis, block_size, dtype).expand_as(w).contiguous()


def _bfp_grid(w: torch.Tensor, spec: BFPSpec) -> FixedGrid:
    """BFP / MX4/6/9: per element, the exponent k of its (sub-)block's scale 2**k, and whether its
    block holds anything (the bfloat16 pre-rounding, when the format asks for it, comes first)."""
    if spec.convert_to_bfloat_before_bfp:
        w = w.to(torch.bfloat16).float()
    max_code = float(2**spec.mantissa_bits - 1)

    def exponents(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if spec.bfp_method == "to_bfp":
            k = max_exponent_field(blocks, 2) - spec.scale_offset
        else:
            p, nb, b, q = blocks.shape
            sub = blocks.reshape(p, nb, b // spec.sub_block_size, spec.sub_block_size, q)
            sub_field = exponent_field(sub.abs().amax(dim=3, keepdim=True))
            shared = sub_field.amax(dim=2, keepdim=True)
            k = (shared - spec.scale_offset - torch.clamp(shared - sub_field, max=spec.max_sub_block_shift)).expand(sub.shape).reshape(blocks.shape)
        return k.expand(blocks.shape), _live(blocks)

    k, live = map_blocks(w, spec.axis, spec.block_size, exponents)

    def round_fn(v: torch.Tensor, k: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        if spec.convert_to_bfloat_before_bfp:
            v = v.to(torch.bfloat16).float()
        return quantize_scaled(v, k, lambda u: round_codes(u, spec, max_code))[0] * live

    return FixedGrid(round_fn, (k, live))


def _mx_grid(w: torch.Tensor, spec: MXSpec) -> FixedGrid:
    """OCP MX: per element, the exponent k of its block's scale 2**k and whether its block holds anything."""
    offset = EXPONENT_BIAS + spec.element.emax

    def exponents(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (max_exponent_field(blocks, 2) - offset).expand(blocks.shape), _live(blocks)

    k, live = map_blocks(w, spec.axis, spec.block_size, exponents)

    def round_fn(v: torch.Tensor, k: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return quantize_scaled(v, k, lambda u: quantize_element(u, spec))[0] * live

    return FixedGrid(round_fn, (k, live))


def _live(blocks: torch.Tensor) -> torch.Tensor:
    """1.0 for the elements of a block with a nonzero element, 0.0 for those of an all-zero block."""
    return (blocks.abs().amax(dim=2, keepdim=True) > 0).float().expand(blocks.shape)
