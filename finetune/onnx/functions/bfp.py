"""The body of BFPQuantizeDequantize: block floating point (`to_bfp`, BFP16) and Microexponents
(`to_bfp_prime`, MX9/MX6/MX4), bit for bit as FORMATS.md."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from finetune.formats import BFPSpec

from .arithmetic import FLT_MAX, FLT_MIN, Body, exponent_power, pow2, scaled_round
from .blocks import BlockBody, BlockView


class BFPBody(BlockBody[BFPSpec]):
    """BFPQuantizeDequantize: to_bfp (BFP16) or to_bfp_prime (MX9/MX6/MX4 microexponents)."""

    @property
    def overload(self) -> str:
        """A readable name that identifies the attribute set."""
        s = self.spec
        name = f"{s.bfp_method}_bw{s.bit_width}_b{s.block_size}"
        if s.bfp_method == "to_bfp_prime":
            name += f"_sb{s.sub_block_size}_sbs{s.sub_block_shift_bits}"
        return name + f"_ax{s.axis}_rm{s.rounding_mode}" + ("_bf16" if s.convert_to_bfloat_before_bfp else "")

    def prepare(self, b: Body, x: str) -> str:
        """The optional bfloat16 pre-rounding (RNE, as onnxruntime's Cast does)."""
        if not self.spec.convert_to_bfloat_before_bfp:
            return x
        return b.op("Cast", b.op("Cast", x, to=TensorProto.BFLOAT16), to=TensorProto.FLOAT)

    @property
    def inner(self) -> list[int]:
        """A block, or to_bfp_prime's sub-blocks within it."""
        s = self.spec
        return [s.block_size // s.sub_block_size, s.sub_block_size] if s.bfp_method == "to_bfp_prime" else [s.block_size]

    def quantize(self, b: Body, view: BlockView, ordinary: bool) -> str:
        """y at level 0 of `view`, following FORMATS.md (`ordinary`: see BlockBody.quantize)."""
        return (self._prime if self.spec.bfp_method == "to_bfp_prime" else self._plain)(b, view, ordinary)

    def finish_ordinary(self, b: Body, y: str) -> str:
        """+ 0 for to_bfp; to_bfp_prime keeps -0 in both bodies (its general body's NaN Where
        broadcasts, which keeps -0)."""
        return y if self.spec.bfp_method == "to_bfp_prime" else super().finish_ordinary(b, y)

    def _plain(self, b: Body, view: BlockView, ordinary: bool) -> str:
        """to_bfp: one shared exponent over the block's finite elements; NaN/Inf pass through."""
        m = self.spec.mantissa_bits
        limit = 2.0**m - 1

        def quantize(values: str, scale: str) -> str:
            return scaled_round(b, values, scale, -limit, limit, self.spec.rounding_mode)

        return self.shared_quantize(b, view, lambda shared: b.op("Mul", shared, b.const(pow2(1 - m))), quantize,
                                    ordinary)

    def _prime(self, b: Body, view: BlockView, ordinary: bool) -> str:
        """to_bfp_prime: block exponent E, per-sub-block shift d <= 2^shift_bits - 1, subnormals
        flushed (x * [|x| >= 2^-126] + 0, which is +0 as Where's 0 is), and a block holding NaN
        or Inf becomes all NaN (the general body's view broadcasts the block's flag)."""
        m = self.spec.mantissa_bits
        blocks = view.blocks
        magnitude = b.op("Abs", blocks)
        ranked = magnitude
        if not ordinary:
            ranked = b.op("Where", b.op("LessOrEqual", magnitude, b.const(FLT_MAX)), magnitude, b.const(np.inf))
        sub_max = view.reduce_max(ranked, 0)
        block_max = view.reduce_max(sub_max, 1)
        poisoned = None if ordinary else b.op("Greater", block_max, b.const(FLT_MAX))
        finite_max = block_max if ordinary else b.op("Where", poisoned, b.const(0.0), block_max)
        shared = view.spread(exponent_power(b, finite_max, bounded=ordinary), 2, 1)
        scale = b.op("Div", b.op("Mul", shared, b.const(pow2(1 - m))), self._shift_power(b, sub_max, shared))
        normal = b.op("Cast", b.op("GreaterOrEqual", magnitude, b.const(FLT_MIN)), to=TensorProto.FLOAT)
        flushed = b.op("Add", b.op("Mul", blocks, normal), b.const(0.0))
        limit = 2.0**m - 1
        y = scaled_round(b, flushed, view.spread(scale, 1), -limit, limit, self.spec.rounding_mode)
        return y if poisoned is None else b.op("Where", poisoned, b.const(np.nan), y)

    def _shift_power(self, b: Body, sub_max: str, shared: str) -> str:
        """2^d per sub-block, d = min(E - e_sub, 2^shift_bits - 1), by comparing the sub-block
        maximum with 2^(E-127-k+1) (`shared`, 2^(E-127), is spread to the sub-blocks) through
        factors 1 + [below], exactly 1 or 2; a sub-block of zeros and subnormals may get a larger
        d, which cannot matter because all its elements flush to zero."""
        power = b.const(1.0)
        for k in range(1, 2**self.spec.sub_block_shift_bits):
            below = b.op("Cast", b.op("Less", sub_max, b.op("Mul", shared, b.const(pow2(1 - k)))), to=TensorProto.FLOAT)
            power = b.op("Mul", power, b.op("Add", below, b.const(1.0)))
        return power
