"""The function-body builder and the exact float32 arithmetic every body is made of: powers of two
of exponent fields, the rounding modes, and rounding to a scale or to a number of significant bits.

Exponents are taken without BitCast (opset 26) and without Log: `exponent_power` derives the power
of two of a float32 exponent field with exact float arithmetic. Every scale is a product of
representable powers of two, so every division and multiplication by a scale is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..domains import REDUCE_AXES_INPUT_OPSET, RESHAPE_ALLOWZERO_OPSET

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = 2.0**-126  # smallest normal float32


def pow2(k: int) -> float:
    """2^k as a float32-exact Python float (k in [-149, 127])."""
    return math.ldexp(1.0, k)


class Body:
    """Collects the nodes of one function body written for a given default-domain opset."""

    def __init__(self, opset: int, prefix: str = "t") -> None:
        self.opset = opset
        self.prefix = prefix  # distinct per body, so the names of an If's branches never clash
        self.nodes: list[onnx.NodeProto] = []
        self._constants: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    def op(self, op_type: str, *inputs: str, **attributes: Any) -> str:
        """Append a node with one fresh output and return that output's name."""
        output = f"{self.prefix}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], **attributes))
        return output

    def const(self, value: Any, dtype: type = np.float32) -> str:
        """A Constant of the given value and dtype, emitted once per body."""
        array = np.asarray(value, dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.op("Constant", value=numpy_helper.from_array(array))
        return self._constants[key]

    def reduce_max(self, x: str, axes: list[int]) -> str:
        """ReduceMax keeping dims, with axes as attribute or input as the opset demands."""
        if self.opset >= REDUCE_AXES_INPUT_OPSET:
            return self.op("ReduceMax", x, self.const(axes, np.int64), keepdims=1)
        return self.op("ReduceMax", x, axes=axes, keepdims=1)

    def reshape(self, data: str, shape: str) -> str:
        """Reshape in which a 0 in `shape` means an empty dimension (where the opset allows it)."""
        if self.opset >= RESHAPE_ALLOWZERO_OPSET:
            return self.op("Reshape", data, shape, allowzero=1)
        return self.op("Reshape", data, shape)

    def branch(self, output: str, name: str) -> onnx.GraphProto:
        """These nodes as a branch of an If, reading the enclosing bodies' values by name."""
        return helper.make_graph(self.nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])

    def choose(self, condition: str, then_branch: onnx.GraphProto, else_branch: onnx.GraphProto) -> str:
        """An If of two float32 branches on a one-element boolean."""
        return self.op("If", condition, then_branch=then_branch, else_branch=else_branch)

    def finish(self, output: str) -> list[onnx.NodeProto]:
        """The body with its last node writing the function output `y`."""
        assert self.nodes[-1].output[0] == output, "the result must come from the last node"
        self.nodes[-1].output[0] = "y"
        return self.nodes


def exponent_power(b: Body, v: str, bounded: bool = False) -> str:
    """2^(E-127) for the float32 exponent field E of each finite v >= 0 (2^-127 for zeros and
    subnormals), exactly: Rump-Ogita-Oishi's NextPowerTwo, (2^24 v + v) - 2^24 v, halved when above
    v, on v pre-scaled by 2^-64 where 2^24 v could overflow (never, where `bounded` promises v < 2^64).
    Selections are products with 0/1 masks (Where is many times slower in onnxruntime); each
    factor is 1 or a power of two (1 + 2^64 rounds to 2^64), so every product is exact."""
    lift = None
    if not bounded:
        large = b.op("Cast", b.op("GreaterOrEqual", v, b.const(pow2(64))), to=TensorProto.FLOAT)
        lift = b.op("Add", b.op("Mul", large, b.const(pow2(64))), b.const(1.0))  # 2^64 where large, else 1
        v = b.op("Div", v, lift)
    lifted = b.op("Mul", v, b.const(pow2(24)))
    ceiling = b.op("Sub", b.op("Add", lifted, v), lifted)  # 0 when v is a power of two
    exact = b.op("Cast", b.op("Equal", ceiling, b.const(0.0)), to=TensorProto.FLOAT)
    ceiling = b.op("Add", ceiling, b.op("Mul", v, exact))
    above = b.op("Cast", b.op("Greater", ceiling, v), to=TensorProto.FLOAT)
    floor = b.op("Mul", ceiling, b.op("Sub", b.const(1.0), b.op("Mul", above, b.const(0.5))))
    if lift is not None:
        floor = b.op("Mul", floor, lift)
    return b.op("Max", floor, b.const(pow2(-127)))


def _is_tie(b: Body, v: str) -> str:
    """Whether v lies exactly halfway between two integers (|v| - floor|v| is exact in float32)."""
    magnitude = b.op("Abs", v)
    return b.op("Equal", b.op("Sub", magnitude, b.op("Floor", magnitude)), b.const(0.5))


def _round_half_away(b: Body, v: str) -> str:
    """Round to nearest integer, ties away from zero (rounding_mode 0): floor(|v| + (1/2 - 2^-25))
    is exact for every finite v (the sum rounds to the next integer exactly when |v| is at or past
    a half; checked on all ties and their neighbours), times v / (|v| + 2^-149), which is +-1
    wherever the floor is nonzero and keeps the sign of a zero result (Sign(-0) is +0)."""
    magnitude = b.op("Abs", v)
    rounded = b.op("Floor", b.op("Add", magnitude, b.const(0.5 - pow2(-25))))
    return b.op("Mul", rounded, b.op("Div", v, b.op("Add", magnitude, b.const(pow2(-149)))))


def _round_half_up(b: Body, v: str) -> str:
    """Round to nearest integer, ties toward +inf (rounding_mode 1)."""
    return b.op("Where", _is_tie(b, v), b.op("Add", v, b.const(0.5)), b.op("Round", v))


def _round_half_even(b: Body, v: str) -> str:
    """Round to nearest integer, ties to even (rounding_mode 2; ONNX Round)."""
    return b.op("Round", v)


_ROUNDERS: dict[int, Callable[[Body, str], str]] = {0: _round_half_away, 1: _round_half_up, 2: _round_half_even}


def round_significand(b: Body, v: str, bits: int) -> str:
    """v rounded to `bits` significant bits, ties to even: Veltkamp's split (exact in float32 for
    normal v below 2^100; checked exhaustively over a binade for 2 to 4 bits)."""
    lifted = b.op("Mul", v, b.const(pow2(24 - bits) + 1.0))
    return b.op("Add", lifted, b.op("Sub", v, lifted))


def scaled_round(b: Body, v: str, scale: str, lo: float, hi: float, rounding: int) -> str:
    """round(v / scale) clamped to [lo, hi], times scale; exact because scale is a power of two
    and the product a multiple of 2^-149 with few significant bits."""
    code = _ROUNDERS[rounding](b, b.op("Div", v, scale))
    return b.op("Mul", b.op("Clip", code, b.const(lo), b.const(hi)), scale)
