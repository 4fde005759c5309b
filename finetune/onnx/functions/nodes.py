"""Reading one custom node into the specification of its function body: attribute names, types
and defaults as AMD Quark documents them, checked with errors that name the node."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import onnx
from onnx import TensorProto, helper

from finetune.formats import BFPSpec, MXSpec

from ..domains import BFP, DEQUANTIZE, MX, QUANTIZE
from .bfp import BFPBody
from .linear import CODE_TYPES, DequantizeSpec, QuantizeSpec
from .mx import MXBody

# Attribute names and defaults as AMD Quark documents and implements them: those of the spec
# dataclasses, plus a kernel-selection flag that Quark models carry and that changes no numerics.
_BFP_DEFAULTS: dict[str, Any] = {**dataclasses.asdict(BFPSpec()), "use_compiler_version_cpu_kernel": 0}
_MX_DEFAULTS: dict[str, Any] = dataclasses.asdict(MXSpec())
_QDQ_DEFAULTS: dict[str, Any] = {"axis": 1}

Spec = BFPBody | MXBody | QuantizeSpec | DequantizeSpec


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


def check_allowed(node: onnx.NodeProto, name: str, value: Any, allowed: Any, text: str | None = None) -> None:
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


def _quantize_spec(node: onnx.NodeProto, types: Mapping[str, int]) -> QuantizeSpec:
    """Validated ExtendedQuantizeLinear: the code type comes from the zero point, uint8 without one."""
    axis = _attributes(node, _QDQ_DEFAULTS)["axis"]
    if not _has_input(node, 2):
        return QuantizeSpec(TensorProto.UINT8, axis, False)
    dtype = types.get(node.input[2])
    if dtype is None:
        raise ValueError(f"{_describe(node)}: the type of zero point {node.input[2]!r} is unknown; "
                         "make it an initializer or Constant, or give it a value_info")
    allowed = sorted(TensorProto.DataType.Name(t) for t in CODE_TYPES)
    check_allowed(node, "zero_point type", TensorProto.DataType.Name(dtype), allowed)
    return QuantizeSpec(dtype, axis, True)


def _dequantize_spec(node: onnx.NodeProto) -> DequantizeSpec:
    """Validated ExtendedDequantizeLinear."""
    return DequantizeSpec(_attributes(node, _QDQ_DEFAULTS)["axis"], _has_input(node, 2))


def node_spec(node: onnx.NodeProto, types: Mapping[str, int]) -> Spec:
    """The specification of one custom node, given the element types known in its model; unknown
    op types and invalid attributes raise ValueError."""
    if node.op_type == BFP:
        return BFPBody(_format_spec(node, BFPSpec, _BFP_DEFAULTS))
    if node.op_type == MX:
        return MXBody(_format_spec(node, MXSpec, _MX_DEFAULTS))
    if node.op_type == QUANTIZE:
        return _quantize_spec(node, types)
    if node.op_type == DEQUANTIZE:
        return _dequantize_spec(node)
    raise ValueError(f"{_describe(node)}: unknown op type in domain {node.domain!r}; "
                     f"allowed: {[BFP, MX, QUANTIZE, DEQUANTIZE]}")
