"""Converters that lift quantize-dequantize patterns to FakeQuantize modules: QuantizeLinear →
DequantizeLinear pairs (standard or onnxruntime's com.microsoft contrib pair, and the Extended pair
of com.finetune / com.amd.quark), a lone
DequantizeLinear of a quantized initializer, and BFPQuantizeDequantize / MXQuantizeDequantize."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from onnx import TensorProto
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult

from finetune.formats import INT_RANGES, BFPSpec, FloatSpec, IntSpec, MXSpec
from finetune.formats.floats import FLOAT_TYPES
from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN
from finetune.onnx.domains import ONNXRUNTIME_DOMAIN
from finetune.onnx.dtypes import type_name

from ..fake_quant import FakeQuantize
from ..qdq import QUANTIZE_TO_DEQUANTIZE
from ..registry import register, schema_versions
from .common import converted, node_mapping

_ACCEPTED_KERNEL_CHOICE = "use_compiler_version_cpu_kernel"  # selects a Quark CPU kernel; 0 only
_FLOAT32_ONLY = {"QuantizeLinear": "precision", "DequantizeLinear": "output_dtype"}  # opset-23 attributes


@register("QuantizeLinear", schema_versions("", "QuantizeLinear"))
@register("QuantizeLinear", (1,), domain=ONNXRUNTIME_DOMAIN)
@register("ExtendedQuantizeLinear", (1,), domain=CUSTOM_DOMAIN)
@register("ExtendedQuantizeLinear", (1,), domain=QUARK_DOMAIN)
def _quantize(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """A quantize node left after pairing has consumers other than its dequantize node."""
    raise NotImplementedError(
        "only QuantizeLinear followed by DequantizeLinear is lifted; this one's output (integer codes) "
        "also feeds other nodes or is a graph output"
    )


@register("DequantizeLinear", schema_versions("", "DequantizeLinear"))
@register("DequantizeLinear", (1,), domain=ONNXRUNTIME_DOMAIN)
@register("ExtendedDequantizeLinear", (1,), domain=CUSTOM_DOMAIN)
@register("ExtendedDequantizeLinear", (1,), domain=QUARK_DOMAIN)
def _dequantize(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """A Q→DQ pair, or DQ of a quantized initializer, as one FakeQuantize on the float input."""
    source = node.input_values[0]
    producer = _producer(source, graph)
    if producer is not None and QUANTIZE_TO_DEQUANTIZE.get(producer.operation_type) == node.operation_type:
        return _pair(producer, node, graph)
    if source in graph.initializers:
        spec, scale, zero_point = linear_spec(node, graph, graph.initializers[source].proto.data_type)
        return converted(FakeQuantize(spec, scale, zero_point, (node.name,)), node_mapping(node, (source,)))
    raise NotImplementedError(
        f"{node.operation_type} of {source!r} has neither a QuantizeLinear before it nor an initializer as input"
    )


def _pair(quantize: OnnxNode, dequantize: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """One FakeQuantize for a quantize → dequantize pair whose parameters agree."""
    code_type = quantize_code_type(quantize, graph)
    spec, scale, zero_point = linear_spec(quantize, graph, code_type)
    dq_spec, dq_scale, dq_zero_point = linear_spec(dequantize, graph, code_type)
    if dq_spec != spec or not torch.equal(dq_scale, scale) or not torch.equal(dq_zero_point, zero_point):
        raise NotImplementedError(
            f"{quantize.name!r} and {dequantize.name!r} use different scales, zero points or axes (a requantization)"
        )
    module = FakeQuantize(spec, scale, zero_point, (quantize.name, dequantize.name))
    return converted(module, node_mapping(dequantize, (quantize.input_values[0],)))


@register("BFPQuantizeDequantize", (1,), domain=CUSTOM_DOMAIN)
@register("BFPQuantizeDequantize", (1,), domain=QUARK_DOMAIN)
@register("MXQuantizeDequantize", (1,), domain=CUSTOM_DOMAIN)
@register("MXQuantizeDequantize", (1,), domain=QUARK_DOMAIN)
def _block_format(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """A block-format quantize-dequantize node; the spec's defaults are the op's attribute defaults."""
    spec_type = BFPSpec if node.operation_type == "BFPQuantizeDequantize" else MXSpec
    spec = spec_type(**_format_attributes(node, spec_type))
    return converted(FakeQuantize(spec, source=(node.name,)), node_mapping(node, (node.input_values[0],)))


def _format_attributes(node: OnnxNode, spec_type: type) -> dict[str, Any]:
    """The node's attributes as spec fields; unknown attributes raise."""
    attributes = dict(node.attributes)
    if attributes.pop(_ACCEPTED_KERNEL_CHOICE, 0) != 0:
        raise NotImplementedError(f"{_ACCEPTED_KERNEL_CHOICE}=1 selects a kernel whose numerics are not specified")
    unknown = set(attributes) - {f.name for f in dataclasses.fields(spec_type)}
    if unknown:
        raise NotImplementedError(f"unknown attribute(s) {sorted(unknown)} for {spec_type.__name__}")
    return attributes


def quantize_code_type(node: OnnxNode, graph: OnnxGraph) -> int:
    """The code type of a quantize node: its zero point's type, else output_dtype, else uint8."""
    if len(node.input_values) > 2 and node.input_values[2]:
        return _constant(node.input_values[2], graph).data_type
    return node.attributes.get("output_dtype", 0) or TensorProto.UINT8


def linear_spec(node: OnnxNode, graph: OnnxGraph, code_type: int) -> tuple[IntSpec | FloatSpec, torch.Tensor, torch.Tensor]:
    """Format, scale and zero point of a (Extended)QuantizeLinear / DequantizeLinear node."""
    _check_float32_arithmetic(node)
    scale = torch.from_numpy(_constant_values(node.input_values[1], graph).astype(np.float32))
    has_zero_point = len(node.input_values) > 2 and node.input_values[2]
    zero_point = (
        torch.from_numpy(_constant_values(node.input_values[2], graph).astype(np.float32))
        if has_zero_point
        else torch.zeros_like(scale)
    )
    block_size = node.attributes.get("block_size", 0) or None
    per_tensor = scale.numel() == 1 and scale.dim() <= 1 and block_size is None
    axis = None if per_tensor else node.attributes.get("axis", 1)
    name = type_name(code_type)
    if name in INT_RANGES:
        spec = IntSpec(name, _is_symmetric(name, zero_point), axis, block_size, _is_pow2(scale))
        return spec, scale, zero_point
    if name in FLOAT_TYPES and block_size is None:
        return FloatSpec(name, bool(node.attributes.get("saturate", 1)), axis), scale, zero_point
    kind = "blocked " if block_size else ""
    raise NotImplementedError(f"{kind}{TensorProto.DataType.Name(code_type)} codes are not supported")


def _check_float32_arithmetic(node: OnnxNode) -> None:
    """Refuse QuantizeLinear-23 `precision` and DequantizeLinear-23 `output_dtype` other than float32."""
    name = _FLOAT32_ONLY.get(node.operation_type)
    value = node.attributes.get(name, 0) if name else 0
    if value not in (0, TensorProto.FLOAT):
        raise NotImplementedError(f"{name}={TensorProto.DataType.Name(value)} (only float32 arithmetic is lifted)")


def _producer(value: str, graph: OnnxGraph) -> OnnxNode | None:
    """The node that outputs `value`, or None for graph inputs and initializers."""
    try:
        return graph.value_as_node_output(value)[0]
    except KeyError:
        return None


def _constant(name: str, graph: OnnxGraph) -> Any:
    """The initializer proto behind a scale or zero point; computed values are not supported."""
    if name not in graph.initializers:
        raise NotImplementedError(f"scale/zero point {name!r} is computed, not a constant")
    return graph.initializers[name].proto


def _constant_values(name: str, graph: OnnxGraph) -> np.ndarray:
    """The values of a scale or zero point (read from the data folder of a model loaded without them)."""
    _constant(name, graph)
    return graph.initializers[name].to_numpy()


def _is_symmetric(name: str, zero_point: torch.Tensor) -> bool:
    """Whether every zero point sits at 0 (signed) or the middle code (unsigned)."""
    middle = 0.0 if not name.startswith("u") else float(2 ** (int(name[4:]) - 1))
    return bool(torch.all(zero_point == middle))


def _is_pow2(scale: torch.Tensor) -> bool:
    """Whether every scale is a power of two."""
    mantissa, _ = torch.frexp(scale)
    return bool(torch.all((scale > 0) & (mantissa == 0.5)))
