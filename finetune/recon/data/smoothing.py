"""Carry a quantizer's input smoothing into the float model, so that it stays the reference.

SmoothQuant (NNCF's `model_type=TRANSFORMER`) inserts `Mul(x, m)` before the input quantizer of a
MatMul or Gemm and stores the weight scaled by 1/m along the input channels: the function is the
same, but the float model's weights no longer quantize to the stored codes, and its layers see x
where the quantized layers see x * m. Inserting the same Mul into the float model and dividing its
weights by m gives the float model in the quantized model's coordinates: the same outputs, weights
that quantize to the stored codes, and unit inputs that match the quantized stream's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from finetune.lift.params import tensor_array
from finetune.lift.qdq import is_quantizer


def carry_smoothing(float_model: onnx.ModelProto, quantized: onnx.ModelProto, folder: Path | None = None) -> list[str]:
    """Insert into `float_model` (in place) every Mul by a constant that `quantized` has and it lacks,
    where the Mul reads a value of the float model and feeds, through quantizers only, MatMul or Gemm
    layers of the same names, each with a constant weight that it alone reads; returns one line per
    layer changed. Anything else is left as it is (the weight check then names its layer). A float
    model loaded without its external data reads a weight it divides from `folder`."""
    graph, theirs = float_model.graph, quantized.graph
    names = {n.name for n in graph.node}
    values = {v for n in graph.node for v in n.output} | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    constants = {t.name: t for t in theirs.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in theirs.node:
        for value in set(node.input):
            readers.setdefault(value, []).append(node)
    changes = []
    for mul in theirs.node:
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or mul.name in names or mul.output[0] in values:
            continue
        scale = next((v for v in mul.input if v in constants and v not in values), None)
        source = next((v for v in mul.input if v in values and v != scale), None)
        layers = _layers_behind(mul.output[0], readers) & names
        if scale is None or source is None or not layers:
            continue
        m = numpy_helper.to_array(constants[scale]).reshape(-1)
        scaled = [n for n in graph.node if n.name in layers and _divide_weight(graph, n, source, m, folder)]
        if not scaled:
            continue
        for node in scaled:
            node.input[list(node.input).index(source)] = mul.output[0]
        graph.initializer.append(constants[scale])
        nodes = list(graph.node)
        nodes.insert(min(nodes.index(node) for node in scaled), mul)  # before its first reader, after x's producer
        del graph.node[:]
        graph.node.extend(nodes)
        changes.extend(f"{node.name}: input scaled by {mul.name}, weight by its inverse" for node in scaled)
    return changes


def _layers_behind(value: str, readers: dict[str, list[onnx.NodeProto]]) -> set[str]:
    """The names of the MatMul and Gemm nodes that read `value` through quantize/dequantize nodes only."""
    layers, frontier = set(), [value]
    while frontier:
        for node in readers.get(frontier.pop(), []):
            if is_quantizer(node.domain, node.op_type):
                frontier.append(node.output[0])
            elif node.op_type in ("MatMul", "Gemm"):
                layers.add(node.name)
    return layers


def _divide_weight(graph: onnx.GraphProto, node: onnx.NodeProto, source: str, m: np.ndarray, folder: Path | None) -> bool:
    """Divide the weight of a MatMul or Gemm that reads `source` as its first operand, and a 2-D
    constant that no other node reads as its second, by `m` along its input channels; False,
    changing nothing, for any other layout."""
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.input[0] != source or source in node.input[1:] or attributes.get("transA", 0):
        return False
    weight = next((t for t in graph.initializer if t.name == node.input[1]), None)
    if weight is None or len(weight.dims) != 2 or sum(weight.name in n.input for n in graph.node) != 1:
        return False
    axis = 1 if attributes.get("transB", 0) else 0  # the input channels: B is [in, out], or [out, in] transposed
    array = tensor_array(weight, folder)
    if array.shape[axis] != m.size:
        return False
    shape = [1, 1]
    shape[axis] = -1
    weight.CopyFrom(numpy_helper.from_array((array / m.reshape(shape)).astype(array.dtype), weight.name))
    return True
