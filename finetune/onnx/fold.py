"""Constant folding with onnx's reference evaluator (standard ops only, any float type), and the
shape and type lookups it needs; the quantizer's equalisation and the conversion tools share it."""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from finetune.notices import Notice, warn

from .domains import DEFAULT_DOMAINS
from .graphs import all_graphs, graph_reads, has_subgraphs
from .normalize import default_opset, keep_only, shape_inference_notice, try_infer_shapes

logger = logging.getLogger(__name__)

# Ops never folded: random ops differ per run, and folding a Q/DQ pair would erase quantization.
NOT_FOLDED = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
})


def infer_types(model: onnx.ModelProto) -> None:
    """Replace the model's value_info by onnx's inferred shapes and types (in place); a ValueError
    when onnx cannot infer them."""
    failure = refresh_types(model)
    if failure is not None:
        raise ValueError(f"onnx shape inference failed on the model: {failure}")


def refresh_types(model: onnx.ModelProto) -> str | None:
    """Replace the model's value_info by onnx's inferred shapes and types (in place), so none is
    stale; a value onnx cannot type (the output of a custom op) keeps the type stored for it (by
    the exporter, say). When onnx cannot infer at all, the stored ones stay and the reason is returned."""
    stored = list(model.graph.value_info)
    del model.graph.value_info[:]
    failure = try_infer_shapes(model)
    if failure is not None:
        model.graph.value_info.extend(stored)
        return failure
    inferred = {info.name for info in model.graph.value_info}
    produced = {name for node in model.graph.node for name in node.output}
    model.graph.value_info.extend(info for info in stored if info.name in produced and info.name not in inferred)
    return None


def tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    """The tensor type (element type and shape) of every named value the model declares."""
    graph = model.graph
    types = {
        info.name: info.type.tensor_type
        for info in [*graph.input, *graph.value_info, *graph.output]
        if info.type.HasField("tensor_type")
    }
    for tensor in graph.initializer:
        types[tensor.name] = helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)).tensor_type
    return types


def fold_constants(
    model: onnx.ModelProto, only: Collection[str] | None = None, notices: list[Notice] | None = None,
) -> list[str]:
    """Replace every deterministic default-domain node whose inputs are all constant (initializers,
    or Shape of a statically shaped tensor) by initializers holding its outputs, in place; with
    `only`, just the nodes with an output named there. Where onnx cannot infer the types, folding
    goes on with the stored ones and says so (WARNING, `notices`)."""
    _refresh_or_warn(model, notices)
    graph = model.graph
    opset = default_opset(model)
    constants = {tensor.name: tensor for tensor in graph.initializer}
    shapes = static_shapes(model)
    outputs = {o.name for o in graph.output}
    chosen = None if only is None else set(only)
    kept, folded = [], 0
    for node in graph.node:
        values = _fold(node, constants, shapes, outputs, opset) if chosen is None or chosen.intersection(node.output) else None
        if values is None:
            kept.append(node)
            continue
        for name, value in zip(node.output, values):
            tensor = numpy_helper.from_array(np.asarray(value), name)
            constants[name] = tensor
            graph.initializer.append(tensor)
        folded += 1
    del graph.node[:]
    graph.node.extend(kept)
    removed = drop_unused_initializers(model)
    _refresh_or_warn(model, notices)
    return [f"folded {folded} constant node(s) into initializers"] * bool(folded) + removed


def _refresh_or_warn(model: onnx.ModelProto, notices: list[Notice] | None) -> None:
    """refresh_types, a failure logged at WARNING and added to `notices`."""
    failure = refresh_types(model)
    if failure is not None:
        warn(logger, notices, [shape_inference_notice(model, failure)])


def foldable(node: onnx.NodeProto) -> bool:
    """Whether the node is of a kind folding may replace: deterministic, default domain, no subgraphs."""
    if node.domain not in DEFAULT_DOMAINS or node.op_type in NOT_FOLDED:
        return False
    return not has_subgraphs(node)


def _fold(
    node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], shapes: dict[str, tuple[int, ...]],
    outputs: set[str], opset: int,
) -> list[np.ndarray] | None:
    """The node's output values if it can be folded, else None."""
    if not foldable(node) or outputs.intersection(node.output):
        return None
    if node.op_type == "Shape":
        return _static_shape_of(node, shapes)
    inputs = [name for name in node.input if name]
    if not inputs or not all(name in constants for name in inputs):
        return None
    feeds = {name: numpy_helper.to_array(constants[name]) for name in inputs}
    detached = onnx.NodeProto()  # the evaluator lives in reference cycles: given the model's own node, it kept the
    detached.CopyFrom(node)      # whole model (all its weights) alive until Python's cycle collector ran
    return ReferenceEvaluator(detached, opsets={"": opset}).run(None, feeds)


def _static_shape_of(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> list[np.ndarray] | None:
    """Shape(x)[start:end] when x's shape is fully known."""
    shape = shapes.get(node.input[0])
    if shape is None:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attributes.get("start", 0), attributes.get("end", len(shape))
    return [np.array(shape[start:end], np.int64)]


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Fully known shapes of the model's values."""
    shapes = {}
    for name, tensor_type in tensor_types(model).items():
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[name] = tuple(d.dim_value for d in dims)
    return shapes


def drop_unused_initializers(model: onnx.ModelProto) -> list[str]:
    """Remove initializers that no node reads (inside subgraphs included) and that are not graph
    outputs, in place, in the main graph and in every subgraph."""
    dropped = 0
    for graph in all_graphs(model.graph):
        unused = {tensor.name for tensor in graph.initializer} - graph_reads(graph)
        dropped += keep_only(graph.initializer, lambda tensor, unused=unused: tensor.name not in unused)
    return [f"removed {dropped} unused initializer(s)"] if dropped else []
