"""ONNX nodes that quantize-dequantize one tensor in any format: standard QuantizeLinear /
DequantizeLinear where they express the format, our `com.finetune` ops otherwise."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from finetune.formats import BFPSpec, FloatSpec, FormatSpec, IntSpec, MXSpec

from .dtypes import numpy_dtype
from .functions import BFP, CUSTOM_DOMAIN, DEQUANTIZE, MX, QUANTIZE

# Code types the standard QuantizeLinear/DequantizeLinear (opset 21) take; the rest use our ops.
STANDARD_CODES = ("int4", "uint4", "int8", "uint8", "int16", "uint16", "float8_e4m3fn", "float8_e5m2")
STANDARD_QDQ_OPSET = 21  # int4/uint4, int16 and blocked scales need QuantizeLinear-21


@dataclasses.dataclass
class QDQ:
    """The nodes and initializers that turn tensor `source` into its quantize-dequantized `output`."""

    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]


def uses_standard_ops(spec: FormatSpec) -> bool:
    """Whether the format is expressed with standard QuantizeLinear/DequantizeLinear."""
    return isinstance(spec, (IntSpec, FloatSpec)) and spec.dtype in STANDARD_CODES


def make_qdq(
    source: str, output: str, spec: FormatSpec, name: str,
    scale: np.ndarray | None = None, zero_point: np.ndarray | None = None,
) -> QDQ:
    """Nodes named after `name` that compute output = qdq(source) in `spec`; INT and scaled float
    formats need their scale (zero point 0 when absent), block formats take none."""
    if isinstance(spec, (BFPSpec, MXSpec)):
        if scale is not None or zero_point is not None:
            raise ValueError(f"{name}: {type(spec).__name__} derives its scales from the data; no scale/zero point")
        op_type = BFP if isinstance(spec, BFPSpec) else MX
        node = helper.make_node(op_type, [source], [output], name=name, domain=CUSTOM_DOMAIN, **dataclasses.asdict(spec))
        return QDQ([node], [])
    if isinstance(spec, FloatSpec) and not spec.saturate:
        raise ValueError(f"{name}: {spec.dtype} without saturation has no ONNX quantize op here; use saturate=True")
    if scale is None:
        if isinstance(spec, IntSpec):
            raise ValueError(f"{name}: an integer format needs a scale")
        scale = np.ones((), np.float32)
    scale = np.asarray(scale, np.float32)
    zero_point = np.zeros(scale.shape, np.float32) if zero_point is None else np.asarray(zero_point)
    initializers = [
        numpy_helper.from_array(scale, f"{name}_scale"),
        numpy_helper.from_array(zero_point.astype(numpy_dtype(spec.dtype)), f"{name}_zero_point"),
    ]
    inputs = [f"{name}_scale", f"{name}_zero_point"]
    attributes = _linear_attributes(spec, scale)
    if uses_standard_ops(spec):
        quantize, dequantize, domain = "QuantizeLinear", "DequantizeLinear", ""
    else:
        quantize, dequantize, domain = QUANTIZE, DEQUANTIZE, CUSTOM_DOMAIN
    codes = f"{name}_codes"
    nodes = [
        helper.make_node(quantize, [source, *inputs], [codes], name=f"{name}_q", domain=domain, **attributes),
        helper.make_node(dequantize, [codes, *inputs], [output], name=f"{name}_dq", domain=domain, **attributes),
    ]
    return QDQ(nodes, initializers)


def _linear_attributes(spec: IntSpec | FloatSpec, scale: np.ndarray) -> dict[str, int]:
    """axis/block_size attributes for (Extended)QuantizeLinear; none for a per-tensor scale."""
    if scale.ndim == 0:
        return {}
    if spec.axis is None:
        raise ValueError(f"a scale of shape {scale.shape} needs an axis in {spec}")
    block_size = getattr(spec, "block_size", None)
    if block_size and not uses_standard_ops(spec):
        raise ValueError(f"blocked scales need a standard QuantizeLinear type, not {spec.dtype}")
    return {"axis": spec.axis, **({"block_size": block_size} if block_size else {})}
