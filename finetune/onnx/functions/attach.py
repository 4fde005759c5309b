"""Standard-op function bodies for the quantize-dequantize custom ops, so stock onnxruntime runs them.

Every node of domain `com.finetune` or `com.amd.quark` gets a model-local FunctionProto, specialised
to the node's attributes through an IR-10 `overload`, whose body uses only default-domain ops of
the model's own opset (13 or newer). The numerics are those of FORMATS.md, bit for bit.

Exponents are taken without BitCast (opset 26) and without Log: `_exponent_power` derives the
power of two of a float32 exponent field with exact float arithmetic. Every scale is a product of
representable powers of two, so every division and multiplication by a scale is exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from finetune.formats import BFPSpec, MXElement, MXSpec

CUSTOM_DOMAIN = "com.finetune"
QUARK_DOMAIN = "com.amd.quark"
DOMAINS = (CUSTOM_DOMAIN, QUARK_DOMAIN)
DOMAIN_VERSION = 1
MIN_OPSET = 13  # the oldest default-domain opset the bodies are written and tested for
CASTLIKE_OPSET = 15  # below it the float16 round trip needs the input's type at attach time
REDUCE_AXES_INPUT_OPSET = 18  # ReduceMax takes axes as an input from opset 18
RESHAPE_ALLOWZERO_OPSET = 14  # empty tensors need Reshape's allowzero
OVERLOAD_IR_VERSION = 10  # the IR version that introduced FunctionProto.overload

BFP = "BFPQuantizeDequantize"
MX = "MXQuantizeDequantize"
QUANTIZE = "ExtendedQuantizeLinear"
DEQUANTIZE = "ExtendedDequantizeLinear"

_FLT_MAX = float(np.finfo(np.float32).max)
_FLT_MIN = 2.0**-126  # smallest normal float32
_INT64_MAX = np.iinfo(np.int64).max


# Attribute names and defaults as AMD Quark documents and implements them: those of the spec
# dataclasses, plus a kernel-selection flag that Quark models carry and that changes no numerics.
_BFP_DEFAULTS: dict[str, Any] = {**dataclasses.asdict(BFPSpec()), "use_compiler_version_cpu_kernel": 0}
_MX_DEFAULTS: dict[str, Any] = dataclasses.asdict(MXSpec())
_QDQ_DEFAULTS: dict[str, Any] = {"axis": 1}


# Integer code ranges; float codes saturate at their largest finite value.
_INT_RANGES = {
    TensorProto.INT8: (-(2**7), 2**7 - 1), TensorProto.UINT8: (0, 2**8 - 1),
    TensorProto.INT16: (-(2**15), 2**15 - 1), TensorProto.UINT16: (0, 2**16 - 1),
    TensorProto.INT32: (-(2**31), 2**31 - 1), TensorProto.UINT32: (0, 2**32 - 1),
}
_FLOAT_CODE_MAX = {TensorProto.FLOAT16: 65504.0, TensorProto.BFLOAT16: 3.3895313892515355e38}


def _pow2(k: int) -> float:
    """2^k as a float32-exact Python float (k in [-149, 127])."""
    return math.ldexp(1.0, k)


class _Body:
    """Collects the nodes of one function body written for a given default-domain opset."""

    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._constants: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    def op(self, op_type: str, *inputs: str, **attributes: Any) -> str:
        """Append a node with one fresh output and return that output's name."""
        output = f"t{len(self.nodes)}"
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

    def finish(self, output: str) -> list[onnx.NodeProto]:
        """The body with its last node writing the function output `y`."""
        assert self.nodes[-1].output[0] == output, "the result must come from the last node"
        self.nodes[-1].output[0] = "y"
        return self.nodes


# ---------------------------------------------------------------- exact arithmetic helpers


def _exponent_power(b: _Body, v: str) -> str:
    """2^(E-127) for the float32 exponent field E of each finite v >= 0 (2^-127 for zeros and
    subnormals), exactly: Rump-Ogita-Oishi's NextPowerTwo, (2^24 v + v) - 2^24 v, halved when above
    v, on v pre-scaled by 2^-64 where 2^24 v could overflow."""
    large = b.op("GreaterOrEqual", v, b.const(_pow2(64)))
    small = b.op("Where", large, b.op("Mul", v, b.const(_pow2(-64))), v)
    lifted = b.op("Mul", small, b.const(_pow2(24)))
    ceiling = b.op("Sub", b.op("Add", lifted, small), lifted)  # 0 when small is a power of two
    ceiling = b.op("Where", b.op("Equal", ceiling, b.const(0.0)), small, ceiling)
    floor = b.op("Where", b.op("Greater", ceiling, small), b.op("Mul", ceiling, b.const(0.5)), ceiling)
    restored = b.op("Where", large, b.op("Mul", floor, b.const(_pow2(64))), floor)
    return b.op("Max", restored, b.const(_pow2(-127)))


def _is_tie(b: _Body, v: str) -> str:
    """Whether v lies exactly halfway between two integers (|v| - floor|v| is exact in float32)."""
    magnitude = b.op("Abs", v)
    return b.op("Equal", b.op("Sub", magnitude, b.op("Floor", magnitude)), b.const(0.5))


def _round_half_away(b: _Body, v: str) -> str:
    """Round to nearest integer, ties away from zero (rounding_mode 0)."""
    away = b.op("Add", v, b.op("Mul", b.op("Sign", v), b.const(0.5)))
    return b.op("Where", _is_tie(b, v), away, b.op("Round", v))


def _round_half_up(b: _Body, v: str) -> str:
    """Round to nearest integer, ties toward +inf (rounding_mode 1)."""
    return b.op("Where", _is_tie(b, v), b.op("Add", v, b.const(0.5)), b.op("Round", v))


def _round_half_even(b: _Body, v: str) -> str:
    """Round to nearest integer, ties to even (rounding_mode 2; ONNX Round)."""
    return b.op("Round", v)


_ROUNDERS: dict[int, Callable[[_Body, str], str]] = {0: _round_half_away, 1: _round_half_up, 2: _round_half_even}


def _round_significand(b: _Body, v: str, bits: int) -> str:
    """v rounded to `bits` significant bits, ties to even: Veltkamp's split (exact in float32 for
    normal v below 2^100; checked exhaustively over a binade for 2 to 4 bits)."""
    lifted = b.op("Mul", v, b.const(_pow2(24 - bits) + 1.0))
    return b.op("Add", lifted, b.op("Sub", v, lifted))


def _scaled_round(b: _Body, v: str, scale: str, lo: float, hi: float, rounding: int) -> str:
    """round(v / scale) clamped to [lo, hi], times scale; exact because scale is a power of two
    and the product a multiple of 2^-149 with few significant bits."""
    code = _ROUNDERS[rounding](b, b.op("Div", v, scale))
    return b.op("Mul", b.op("Clip", code, b.const(lo), b.const(hi)), scale)


# ---------------------------------------------------------------- blocking


def _axis_index(b: _Body, rank: str, axis: int) -> str:
    """The axis as an index into x's shape, 0 for rank-1 x (AMD Quark ignores axis there); an
    out-of-range axis stays out of range, so the reshapes that follow fail instead of guessing."""
    index = b.const([axis], np.int64) if axis >= 0 else b.op("Add", rank, b.const([axis], np.int64))
    return b.op("Where", b.op("Equal", rank, b.const([1], np.int64)), b.const([0], np.int64), index)


def _to_blocks(b: _Body, x: str, axis: int, inner: list[int]) -> tuple[str, Callable[[str], str]]:
    """View x as [P, nb, *inner, Q] blocks along `axis` (rank-1 inputs use axis 0), zero-padding the
    axis to a multiple of the block; returns the blocks and the function that undoes the view.
    P and Q are the products of the dimensions before and after the axis, so nothing transposes."""
    block = math.prod(inner)
    one, zero = b.const([1], np.int64), b.const([0], np.int64)
    shape = b.op("Shape", x)
    at = _axis_index(b, b.op("Shape", shape), axis)
    after = b.op("Add", at, one)
    before_size = b.op("ReduceProd", b.op("Slice", shape, zero, at), keepdims=1)
    length = b.op("Slice", shape, at, after)
    after_size = b.op("ReduceProd", b.op("Slice", shape, after, b.const([_INT64_MAX], np.int64)), keepdims=1)
    size = b.const([block], np.int64)
    padding = b.op("Mod", b.op("Sub", size, b.op("Mod", length, size)), size)
    flat = b.reshape(x, b.op("Concat", before_size, length, after_size, axis=0))
    padded = b.op("Pad", flat, b.op("Concat", zero, zero, zero, zero, padding, zero, axis=0))
    padded_length = b.op("Add", length, padding)
    count = b.op("Div", padded_length, size)
    blocks = b.reshape(padded, b.op("Concat", before_size, count, b.const(inner, np.int64), after_size, axis=0))

    def undo(y: str) -> str:
        """Back to x's shape, dropping the padding."""
        rows = b.reshape(y, b.op("Concat", before_size, padded_length, after_size, axis=0))
        return b.reshape(b.op("Slice", rows, zero, length, one), shape)

    return blocks, undo


def _finite_split(b: _Body, blocks: str) -> tuple[str, str, str]:
    """The finite mask, |x| and x with NaN/Inf replaced by 0 (they pass through, outside E)."""
    magnitude = b.op("Abs", blocks)
    finite = b.op("LessOrEqual", magnitude, b.const(_FLT_MAX))
    return finite, magnitude, b.op("Where", finite, blocks, b.const(0.0))


# ---------------------------------------------------------------- op specifications


@dataclasses.dataclass(frozen=True)
class _BFPBody:
    """BFPQuantizeDequantize: to_bfp (BFP16) or to_bfp_prime (MX9/MX6/MX4 microexponents)."""

    spec: BFPSpec

    @property
    def overload(self) -> str:
        """A readable name that identifies the attribute set."""
        s = self.spec
        name = f"{s.bfp_method}_bw{s.bit_width}_b{s.block_size}"
        if s.bfp_method == "to_bfp_prime":
            name += f"_sb{s.sub_block_size}_sbs{s.sub_block_shift_bits}"
        return name + f"_ax{s.axis}_rm{s.rounding_mode}" + ("_bf16" if s.convert_to_bfloat_before_bfp else "")

    def prepare(self, b: _Body, x: str) -> str:
        """The optional bfloat16 pre-rounding (RNE, as onnxruntime's Cast does)."""
        if not self.spec.convert_to_bfloat_before_bfp:
            return x
        return b.op("Cast", b.op("Cast", x, to=TensorProto.BFLOAT16), to=TensorProto.FLOAT)

    def build(self, b: _Body, x: str) -> str:
        """y for float32 x, following FORMATS.md."""
        return self._prime(b, x) if self.spec.bfp_method == "to_bfp_prime" else self._plain(b, x)

    def _plain(self, b: _Body, x: str) -> str:
        """to_bfp: one shared exponent over the block's finite elements; NaN/Inf pass through."""
        m = self.spec.mantissa_bits
        blocks, undo = _to_blocks(b, x, self.spec.axis, [self.spec.block_size])
        finite, magnitude, values = _finite_split(b, blocks)
        shared = _exponent_power(b, b.reduce_max(b.op("Where", finite, magnitude, b.const(0.0)), [2]))
        scale = b.op("Mul", shared, b.const(_pow2(1 - m)))
        limit = 2.0**m - 1
        y = _scaled_round(b, values, scale, -limit, limit, self.spec.rounding_mode)
        return undo(b.op("Where", finite, y, blocks))

    def _prime(self, b: _Body, x: str) -> str:
        """to_bfp_prime: block exponent E, per-sub-block shift d <= 2^shift_bits - 1, subnormals
        flushed, and a block holding NaN or Inf becomes all NaN."""
        s = self.spec
        m = s.mantissa_bits
        inner = [s.block_size // s.sub_block_size, s.sub_block_size]
        blocks, undo = _to_blocks(b, x, s.axis, inner)
        magnitude = b.op("Abs", blocks)
        finite = b.op("LessOrEqual", magnitude, b.const(_FLT_MAX))
        ranked = b.op("Where", finite, magnitude, b.const(np.inf))
        sub_max = b.reduce_max(ranked, [3])
        block_max = b.reduce_max(sub_max, [2])
        poisoned = b.op("Greater", block_max, b.const(_FLT_MAX))
        shared = _exponent_power(b, b.op("Where", poisoned, b.const(0.0), block_max))
        scale = b.op("Div", b.op("Mul", shared, b.const(_pow2(1 - m))), self._shift_power(b, sub_max, shared))
        flushed = b.op("Where", b.op("Less", magnitude, b.const(_FLT_MIN)), b.const(0.0), blocks)
        limit = 2.0**m - 1
        y = _scaled_round(b, flushed, scale, -limit, limit, s.rounding_mode)
        return undo(b.op("Where", poisoned, b.const(np.nan), y))

    def _shift_power(self, b: _Body, sub_max: str, shared: str) -> str:
        """2^d per sub-block, d = min(E - e_sub, 2^shift_bits - 1), by comparing the sub-block
        maximum with 2^(E-127-k+1); a sub-block of zeros and subnormals may get a larger d, which
        cannot matter because all its elements flush to zero."""
        power = b.const(1.0)
        for k in range(1, 2**self.spec.sub_block_shift_bits):
            below = b.op("Less", sub_max, b.op("Mul", shared, b.const(_pow2(1 - k))))
            power = b.op("Mul", power, b.op("Where", below, b.const(2.0), b.const(1.0)))
        return power


@dataclasses.dataclass(frozen=True)
class _MXBody:
    """MXQuantizeDequantize: OCP microscaling with an FP or int8 element type."""

    spec: MXSpec

    @property
    def overload(self) -> str:
        """A readable name that identifies the attribute set (rounding matters for int8 only)."""
        s = self.spec
        name = f"{s.element_dtype}_b{s.block_size}_ax{s.axis}"
        return name + (f"_rm{s.rounding_mode}" if s.element.is_int else "")

    def prepare(self, b: _Body, x: str) -> str:
        """No pre-rounding for MX."""
        return x

    def build(self, b: _Body, x: str) -> str:
        """y for float32 x, following FORMATS.md: shared scale 2^(E-127-emax), no E8M0 clamp."""
        element = self.spec.element
        blocks, undo = _to_blocks(b, x, self.spec.axis, [self.spec.block_size])
        finite, magnitude, values = _finite_split(b, blocks)
        shared = _exponent_power(b, b.reduce_max(b.op("Where", finite, magnitude, b.const(0.0)), [2]))
        scale = b.op("Mul", shared, b.const(_pow2(-element.emax)))
        if element.is_int:
            step = b.op("Mul", scale, b.const(_pow2(-element.mantissa_bits)))
            y = _scaled_round(b, values, step, -128.0, 127.0, self.spec.rounding_mode)
        else:
            y = b.op("Mul", self._element_round(b, b.op("Div", values, scale), element), scale)
        return undo(b.op("Where", finite, y, blocks))

    @staticmethod
    def _element_round(b: _Body, v: str, element: MXElement) -> str:
        """v rounded to the element format (RNE, with its subnormals), saturated at its largest value."""
        subnormal_step = element.min_normal_exponent - element.mantissa_bits
        steps = b.op("Round", b.op("Mul", v, b.const(_pow2(-subnormal_step))))
        subnormal = b.op("Mul", steps, b.const(_pow2(subnormal_step)))
        normal = _round_significand(b, v, element.mantissa_bits + 1)
        is_subnormal = b.op("Less", b.op("Abs", v), b.const(_pow2(element.min_normal_exponent)))
        rounded = b.op("Where", is_subnormal, subnormal, normal)
        return b.op("Clip", rounded, b.const(-element.max_value), b.const(element.max_value))


def _broadcast_along(b: _Body, parameter: str, x: str, axis: int) -> str:
    """A 1-D per-axis parameter reshaped to [C, 1, ...] to broadcast against x along `axis`; a
    scalar stays a scalar (so a rank-0 x keeps its rank)."""
    rank = b.op("Shape", b.op("Shape", x))
    at = _axis_index(b, rank, axis)
    trailing = b.op("Max", b.op("Sub", b.op("Sub", rank, b.const([1], np.int64)), at), b.const([0], np.int64))
    parameter_shape = b.op("Shape", parameter)
    count = b.op("Mul", trailing, b.op("Size", parameter_shape))
    ones = b.op("ConstantOfShape", count, value=numpy_helper.from_array(np.array([1], np.int64)))
    return b.op("Reshape", parameter, b.op("Concat", parameter_shape, ones, axis=0))


@dataclasses.dataclass(frozen=True)
class _QuantizeSpec:
    """ExtendedQuantizeLinear: codes of the zero point's type (uint8 when it is absent)."""

    dtype: int
    axis: int
    has_zero_point: bool

    @property
    def overload(self) -> str:
        """A readable name that identifies the code type, axis and zero-point presence."""
        name = f"{TensorProto.DataType.Name(self.dtype).lower()}_ax{self.axis}"
        return name + ("" if self.has_zero_point else "_nozp")

    def build(self, b: _Body) -> str:
        """y = saturate(round(x / scale) + zero_point) in the code type."""
        x = b.op("Cast", "x", to=TensorProto.FLOAT)
        ratio = b.op("Div", x, _broadcast_along(b, "scale", x, self.axis))
        zero_point = _broadcast_along(b, "zero_point", x, self.axis) if self.has_zero_point else None
        if self.dtype in _FLOAT_CODE_MAX:
            return self._float_codes(b, ratio, zero_point)
        return self._int_codes(b, ratio, zero_point)

    def _int_codes(self, b: _Body, ratio: str, zero_point: str | None) -> str:
        """RNE of x / scale plus the zero point, clamped to the code range, all exact in double
        (onnxruntime 1.31's int64 Clip/Max/Min compare only the low 32 bits)."""
        codes = b.op("Cast", b.op("Round", ratio), to=TensorProto.DOUBLE)
        if zero_point is not None:
            codes = b.op("Add", codes, b.op("Cast", zero_point, to=TensorProto.DOUBLE))
        lo, hi = _INT_RANGES[self.dtype]
        clamped = b.op("Clip", codes, b.const(lo, np.float64), b.const(hi, np.float64))
        return b.op("Cast", clamped, to=self.dtype)

    def _float_codes(self, b: _Body, ratio: str, zero_point: str | None) -> str:
        """x / scale + zero_point, saturated at the type's largest finite value (NaN stays), cast RNE."""
        shifted = ratio if zero_point is None else b.op("Add", ratio, b.op("Cast", zero_point, to=TensorProto.FLOAT))
        largest = _FLOAT_CODE_MAX[self.dtype]
        beyond = b.op("Greater", b.op("Abs", shifted), b.const(largest))
        saturated = b.op("Where", beyond, b.op("Mul", b.op("Sign", shifted), b.const(largest)), shifted)
        return b.op("Cast", saturated, to=self.dtype)


@dataclasses.dataclass(frozen=True)
class _DequantizeSpec:
    """ExtendedDequantizeLinear: float32 y = (x - zero_point) * scale for any code type."""

    axis: int
    has_zero_point: bool

    @property
    def overload(self) -> str:
        """A readable name that identifies the axis and zero-point presence."""
        return f"ax{self.axis}" + ("" if self.has_zero_point else "_nozp")

    def build(self, b: _Body) -> str:
        """The difference is exact in double for every code type, then rounded once to float32."""
        codes = "x"
        if self.has_zero_point:
            zero_point = _broadcast_along(b, "zero_point", "x", self.axis)
            codes = b.op(
                "Sub", b.op("Cast", "x", to=TensorProto.DOUBLE), b.op("Cast", zero_point, to=TensorProto.DOUBLE)
            )
        value = b.op("Cast", codes, to=TensorProto.FLOAT)
        scale = b.op("Cast", _broadcast_along(b, "scale", "x", self.axis), to=TensorProto.FLOAT)
        return b.op("Mul", value, scale)


_Spec = _BFPBody | _MXBody | _QuantizeSpec | _DequantizeSpec


# ---------------------------------------------------------------- node -> spec


def _describe(node: onnx.NodeProto) -> str:
    """How errors name a node."""
    return f"node {node.name or '<unnamed>'!r} ({node.domain}::{node.op_type})"


def _attributes(node: onnx.NodeProto, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The node's attributes over the defaults; unknown names or wrong types raise ValueError."""
    values = dict(defaults)
    for attribute in node.attribute:
        if attribute.name not in defaults:
            raise ValueError(f"{_describe(node)}: unknown attribute {attribute.name!r}; allowed: {sorted(defaults)}")
        value = helper.get_attribute_value(attribute)
        value = value.decode() if isinstance(value, bytes) else value
        if type(value) is not type(defaults[attribute.name]):
            expected = type(defaults[attribute.name]).__name__
            raise ValueError(f"{_describe(node)}: attribute {attribute.name!r} must be {expected}, got {value!r}")
        values[attribute.name] = value
    return values


def _check(node: onnx.NodeProto, name: str, value: Any, allowed: Any, text: str | None = None) -> None:
    """Raise ValueError naming the node, the attribute (or input type) and the allowed values."""
    if value not in allowed:
        raise ValueError(f"{_describe(node)}: {name}={value!r} is invalid; allowed: {text or sorted(allowed)}")


def _format_spec(node: onnx.NodeProto, spec_type: type[BFPSpec | MXSpec], defaults: Mapping[str, Any]) -> Any:
    """The node's attributes as a validated format spec; invalid values raise ValueError naming the node."""
    attributes = _attributes(node, defaults)
    attributes.pop("use_compiler_version_cpu_kernel", None)
    try:
        return spec_type(**attributes)
    except ValueError as error:
        raise ValueError(f"{_describe(node)}: {error}") from error


def _has_input(node: onnx.NodeProto, index: int) -> bool:
    """Whether an optional input is present."""
    return len(node.input) > index and node.input[index] != ""


def _quantize_spec(node: onnx.NodeProto, types: Mapping[str, int]) -> _QuantizeSpec:
    """Validated ExtendedQuantizeLinear: the code type comes from the zero point, uint8 without one."""
    axis = _attributes(node, _QDQ_DEFAULTS)["axis"]
    if not _has_input(node, 2):
        return _QuantizeSpec(TensorProto.UINT8, axis, False)
    dtype = types.get(node.input[2])
    if dtype is None:
        raise ValueError(f"{_describe(node)}: the type of zero point {node.input[2]!r} is unknown; "
                         "make it an initializer or Constant, or give it a value_info")
    allowed = sorted(TensorProto.DataType.Name(t) for t in {**_INT_RANGES, **_FLOAT_CODE_MAX})
    _check(node, "zero_point type", TensorProto.DataType.Name(dtype), allowed)
    return _QuantizeSpec(dtype, axis, True)


def _dequantize_spec(node: onnx.NodeProto) -> _DequantizeSpec:
    """Validated ExtendedDequantizeLinear."""
    return _DequantizeSpec(_attributes(node, _QDQ_DEFAULTS)["axis"], _has_input(node, 2))


def _spec(node: onnx.NodeProto, types: Mapping[str, int]) -> _Spec:
    """The specification of one custom node; unknown op types raise ValueError."""
    if node.op_type == BFP:
        return _BFPBody(_format_spec(node, BFPSpec, _BFP_DEFAULTS))
    if node.op_type == MX:
        return _MXBody(_format_spec(node, MXSpec, _MX_DEFAULTS))
    if node.op_type == QUANTIZE:
        return _quantize_spec(node, types)
    if node.op_type == DEQUANTIZE:
        return _dequantize_spec(node)
    raise ValueError(f"{_describe(node)}: unknown op type in domain {node.domain!r}; "
                     f"allowed: {[BFP, MX, QUANTIZE, DEQUANTIZE]}")


# ---------------------------------------------------------------- functions


def _qdq_function(
    domain: str, op_type: str, spec: _BFPBody | _MXBody, opset: int, io_type: int | None
) -> onnx.FunctionProto:
    """y = qdq(x) in float32 for x of any float type (CastLike, or io_type below opset 15); a
    one-element x comes back unchanged apart from the pre-rounding, as AMD Quark's kernels do."""
    b = _Body(opset)
    x = spec.prepare(b, b.op("Cast", "x", to=TensorProto.FLOAT) if io_type != TensorProto.FLOAT else "x")
    y = spec.build(b, x)
    y = b.op("Where", b.op("Equal", b.op("Size", x), b.const(1, np.int64)), x, y)
    if io_type is None:
        y = b.op("CastLike", y, "x")
    elif io_type != TensorProto.FLOAT:
        y = b.op("Cast", y, to=io_type)
    return _function(domain, op_type, spec.overload + _io_suffix(io_type), ["x"], b.finish(y), opset)


def _linear_function(
    domain: str, op_type: str, spec: _QuantizeSpec | _DequantizeSpec, opset: int
) -> onnx.FunctionProto:
    """The function of an Extended(De)QuantizeLinear node."""
    b = _Body(opset)
    return _function(domain, op_type, spec.overload, ["x", "scale", "zero_point"], b.finish(spec.build(b)), opset)


def _function(
    domain: str, op_type: str, overload: str, inputs: list[str], nodes: list[onnx.NodeProto], opset: int
) -> onnx.FunctionProto:
    """A FunctionProto importing the default domain at the model's opset (as the checker requires)."""
    function = helper.make_function(domain, op_type, inputs, ["y"], nodes, [helper.make_opsetid("", opset)])
    function.overload = overload
    function.doc_string = "Generated by finetune.onnx.custom_ops from standard ONNX ops."
    return function


def _io_suffix(io_type: int | None) -> str:
    """Overload suffix for bodies specialised to a non-float32 input type."""
    return "" if io_type in (None, TensorProto.FLOAT) else "_" + TensorProto.DataType.Name(io_type).lower()


def _io_type(node: onnx.NodeProto, opset: int, types: Mapping[str, int]) -> int | None:
    """None (CastLike handles any float type) from opset 15; below, the input's known type or float32."""
    if opset >= CASTLIKE_OPSET:
        return None
    io_type = types.get(node.input[0], TensorProto.FLOAT)
    _check(node, "input type", TensorProto.DataType.Name(io_type), {"FLOAT", "FLOAT16"})
    return io_type


# ---------------------------------------------------------------- model traversal


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and, recursively, every subgraph of its If/Loop/Scan nodes."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _graphs(subgraph)


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types known without inference: graph inputs/outputs, value_info, initializers, Constants."""
    types: dict[str, int] = {}
    for graph in _graphs(model.graph):
        for info in [*graph.input, *graph.output, *graph.value_info]:
            if info.type.HasField("tensor_type"):
                types[info.name] = info.type.tensor_type.elem_type
        types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for attribute in node.attribute:
                    if attribute.type == onnx.AttributeProto.TENSOR:
                        types[node.output[0]] = attribute.t.data_type
    return types


def _default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset, at least MIN_OPSET."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise ValueError(
            f"custom-op function bodies need default-domain opset >= {MIN_OPSET}; the model imports {opset}"
        )
    return opset


def _import_domains(model: onnx.ModelProto, domains: set[str]) -> None:
    """Import each used custom domain at version 1, refusing other versions."""
    imported = {o.domain: o.version for o in model.opset_import}
    for domain in sorted(domains):
        if domain not in imported:
            model.opset_import.append(helper.make_opsetid(domain, DOMAIN_VERSION))
        elif imported[domain] != DOMAIN_VERSION:
            raise ValueError(
                f"the model imports {domain!r} at version {imported[domain]}; only {DOMAIN_VERSION} is defined"
            )


def attach_custom_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` in which every com.finetune / com.amd.quark node (subgraphs included) has a
    standard-op function body, so stock onnxruntime runs it; idempotent, the input is untouched."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    custom = [node for graph in _graphs(result.graph) for node in graph.node if node.domain in DOMAINS]
    if not custom:
        return result
    opset = _default_opset(result)
    types = _value_types(result)
    functions: dict[tuple[str, str, str], onnx.FunctionProto] = {}
    for node in custom:
        spec = _spec(node, types)
        io_type = _io_type(node, opset, types) if isinstance(spec, (_BFPBody, _MXBody)) else None
        node.overload = spec.overload + _io_suffix(io_type)
        key = (node.domain, node.op_type, node.overload)
        if key not in functions:
            if isinstance(spec, (_BFPBody, _MXBody)):
                functions[key] = _qdq_function(node.domain, node.op_type, spec, opset, io_type)
            else:
                functions[key] = _linear_function(node.domain, node.op_type, spec, opset)
    others = [f for f in result.functions if f.domain not in DOMAINS]
    del result.functions[:]
    result.functions.extend(others + [functions[key] for key in sorted(functions)])
    _import_domains(result, {node.domain for node in custom})
    result.ir_version = max(result.ir_version, OVERLOAD_IR_VERSION)
    return result
