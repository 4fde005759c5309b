"""The bodies of ExtendedQuantizeLinear and ExtendedDequantizeLinear: QuantizeLinear and
DequantizeLinear for the code types, per-axis parameters and opsets the standard ops lack."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
from onnx import TensorProto

from finetune.formats import INT_RANGES

from ..dtypes import numpy_dtype, onnx_type, type_name
from .arithmetic import Body
from .blocks import broadcast_along

# The zero-point (code) types ExtendedQuantizeLinear takes: integer codes clamp to their type's
# range, float codes saturate at their largest finite value.
_INT_CODES = ("int8", "uint8", "int16", "uint16", "int32", "uint32")
_FLOAT_CODES = ("float16", "bfloat16")
CODE_TYPES = tuple(onnx_type(name) for name in (*_INT_CODES, *_FLOAT_CODES))


@dataclasses.dataclass(frozen=True)
class QuantizeSpec:
    """ExtendedQuantizeLinear: codes of the zero point's type (uint8 when it is absent)."""

    dtype: int
    axis: int
    has_zero_point: bool

    @property
    def overload(self) -> str:
        """A readable name that identifies the code type, axis and zero-point presence."""
        name = f"{TensorProto.DataType.Name(self.dtype).lower()}_ax{self.axis}"
        return name + ("" if self.has_zero_point else "_nozp")

    def build(self, b: Body) -> str:
        """y = saturate(round(x / scale) + zero_point) in the code type."""
        x = b.op("Cast", "x", to=TensorProto.FLOAT)
        ratio = b.op("Div", x, broadcast_along(b, "scale", x, self.axis))
        zero_point = broadcast_along(b, "zero_point", x, self.axis) if self.has_zero_point else None
        if type_name(self.dtype) in _FLOAT_CODES:
            return self._float_codes(b, ratio, zero_point)
        return self._int_codes(b, ratio, zero_point)

    def _int_codes(self, b: Body, ratio: str, zero_point: str | None) -> str:
        """RNE of x / scale plus the zero point, clamped to the code range, all exact in double
        (onnxruntime 1.31's int64 Clip/Max/Min compare only the low 32 bits)."""
        codes = b.op("Cast", b.op("Round", ratio), to=TensorProto.DOUBLE)
        if zero_point is not None:
            codes = b.op("Add", codes, b.op("Cast", zero_point, to=TensorProto.DOUBLE))
        lo, hi = INT_RANGES[type_name(self.dtype)]
        clamped = b.op("Clip", codes, b.const(lo, np.float64), b.const(hi, np.float64))
        return b.op("Cast", clamped, to=self.dtype)

    def _float_codes(self, b: Body, ratio: str, zero_point: str | None) -> str:
        """x / scale + zero_point, saturated at the type's largest finite value (NaN stays), cast RNE."""
        shifted = ratio if zero_point is None else b.op("Add", ratio, b.op("Cast", zero_point, to=TensorProto.FLOAT))
        largest = float(ml_dtypes.finfo(numpy_dtype(type_name(self.dtype))).max)
        beyond = b.op("Greater", b.op("Abs", shifted), b.const(largest))
        saturated = b.op("Where", beyond, b.op("Mul", b.op("Sign", shifted), b.const(largest)), shifted)
        return b.op("Cast", saturated, to=self.dtype)


@dataclasses.dataclass(frozen=True)
class DequantizeSpec:
    """ExtendedDequantizeLinear: float32 y = (x - zero_point) * scale for any code type."""

    axis: int
    has_zero_point: bool

    @property
    def overload(self) -> str:
        """A readable name that identifies the axis and zero-point presence."""
        return f"ax{self.axis}" + ("" if self.has_zero_point else "_nozp")

    def build(self, b: Body) -> str:
        """The difference is exact in double for every code type, then rounded once to float32."""
        codes = "x"
        if self.has_zero_point:
            zero_point = broadcast_along(b, "zero_point", "x", self.axis)
            codes = b.op(
                "Sub", b.op("Cast", "x", to=TensorProto.DOUBLE), b.op("Cast", zero_point, to=TensorProto.DOUBLE)
            )
        value = b.op("Cast", codes, to=TensorProto.FLOAT)
        scale = b.op("Cast", broadcast_along(b, "scale", "x", self.axis), to=TensorProto.FLOAT)
        return b.op("Mul", value, scale)


LinearSpec = QuantizeSpec | DequantizeSpec
