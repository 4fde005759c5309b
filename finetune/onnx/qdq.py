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
from .graphs import all_nodes, graph_reads

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


def bf16_pairs_to_casts(model: onnx.ModelProto) -> int:
    """Rewrite, in place, each bfloat16 quantize-dequantize pair of scale 1 and zero point 0 (our
    Extended pair) as Cast to bfloat16 and Cast back to float32, the form runtimes without our
    ops take; returns how many. The values are the same (both round to nearest even) but beyond
    bfloat16's largest finite value, where Cast gives inf and the pair saturates. Their scale and
    zero point initializers go with them."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    parameters: set[str] = set()  # scales and zero points of the rewritten pairs
    rewritten = 0
    for node in graph.node:
        if node.op_type != QUANTIZE or node.domain != CUSTOM_DOMAIN or not _bf16_identity_params(node, initializers):
            continue
        pair = readers.get(node.output[0], [])
        if not pair or node.output[0] in outputs or not all(
                r.op_type == DEQUANTIZE and r.domain == CUSTOM_DOMAIN and r.input[1:] == node.input[1:] for r in pair):
            continue
        parameters.update(node.input[1:])
        _become_cast(node, onnx.TensorProto.BFLOAT16)
        for dequantize in pair:
            _become_cast(dequantize, onnx.TensorProto.FLOAT)
        rewritten += 1
    unread = parameters - graph_reads(graph)
    kept_initializers = [t for t in graph.initializer if t.name not in unread]
    del graph.initializer[:]
    graph.initializer.extend(kept_initializers)
    used = {(n.domain, n.op_type, n.overload) for n in all_nodes(graph)}
    kept = [f for f in model.functions if f.domain != CUSTOM_DOMAIN or (f.domain, f.name, f.overload) in used]
    del model.functions[:]
    model.functions.extend(kept)
    return rewritten


def _bf16_identity_params(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> bool:
    """Whether a quantize node's zero point is a bfloat16 0 and its scale 1 (per tensor)."""
    if len(node.input) < 3 or node.input[1] not in initializers or node.input[2] not in initializers:
        return False
    scale, zero_point = initializers[node.input[1]], initializers[node.input[2]]
    return (zero_point.data_type == onnx.TensorProto.BFLOAT16 and numpy_helper.to_array(scale).size == 1
            and float(numpy_helper.to_array(scale)) == 1.0 and float(numpy_helper.to_array(zero_point).astype(np.float32)) == 0.0)


def _become_cast(node: onnx.NodeProto, to: int) -> None:
    """Turn a quantize or dequantize node into a default-domain Cast of its first input."""
    source = node.input[0]
    del node.input[:]
    node.input.append(source)
    del node.attribute[:]
    node.attribute.append(helper.make_attribute("to", to))
    node.op_type, node.domain, node.overload = "Cast", "", ""
