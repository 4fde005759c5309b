"""Graph optimisations run before a precision conversion: constant folding with onnx's reference
evaluator (standard ops only, any float type), and fusing parallel MatMuls that share an input
and have constant weights (Q/K/V projections) into one MatMul and a Split."""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

from finetune.onnx.normalize import DEFAULT_DOMAINS, default_opset, keep_only

logger = logging.getLogger(__name__)

# Ops never folded: random ops differ per run, and folding a Q/DQ pair would erase quantization.
NOT_FOLDED = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
})


def optimize(model: onnx.ModelProto) -> list[str]:
    """Fold constants, then fuse parallel MatMuls, in place; returns what changed (also logged)."""
    changes = [*fold_constants(model), *fuse_parallel_matmuls(model)]
    for change in changes:
        logger.info(change)
    return changes


def infer_types(model: onnx.ModelProto) -> None:
    """Replace the model's value_info by onnx's inferred shapes and types (in place)."""
    del model.graph.value_info[:]
    model.CopyFrom(shape_inference.infer_shapes(model, strict_mode=False, data_prop=True))


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


def fold_constants(model: onnx.ModelProto) -> list[str]:
    """Replace every deterministic default-domain node whose inputs are all constant (initializers,
    or Shape of a statically shaped tensor) by initializers holding its outputs, in place."""
    infer_types(model)
    graph = model.graph
    opset = default_opset(model)
    constants = {tensor.name: tensor for tensor in graph.initializer}
    shapes = _static_shapes(model)
    outputs = {o.name for o in graph.output}
    kept, folded = [], 0
    for node in graph.node:
        values = _fold(node, constants, shapes, outputs, opset)
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
    infer_types(model)
    return [f"folded {folded} constant node(s) into initializers"] * bool(folded) + removed


def _fold(
    node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], shapes: dict[str, tuple[int, ...]],
    outputs: set[str], opset: int,
) -> list[np.ndarray] | None:
    """The node's output values if it can be folded, else None."""
    if node.domain not in DEFAULT_DOMAINS or node.op_type in NOT_FOLDED or outputs.intersection(node.output):
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if node.op_type == "Shape":
        return _static_shape_of(node, shapes)
    inputs = [name for name in node.input if name]
    if not inputs or not all(name in constants for name in inputs):
        return None
    feeds = {name: numpy_helper.to_array(constants[name]) for name in inputs}
    return ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)


def _static_shape_of(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> list[np.ndarray] | None:
    """Shape(x)[start:end] when x's shape is fully known."""
    shape = shapes.get(node.input[0])
    if shape is None:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attributes.get("start", 0), attributes.get("end", len(shape))
    return [np.array(shape[start:end], np.int64)]


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
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
    """Remove initializers that no node reads and that are not graph outputs, in place."""
    graph = model.graph
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    dropped = keep_only(graph.initializer, lambda tensor: tensor.name in used)
    return [f"removed {dropped} unused initializer(s)"] if dropped else []


def fuse_parallel_matmuls(model: onnx.ModelProto) -> list[str]:
    """Replace MatMuls that read the same input with 2-D constant weights of one type and the same
    first dimension by one MatMul over the concatenated weights and a Split, in place; each output
    element is the same dot product, so results differ at most by float summation order."""
    graph = model.graph
    weights = {tensor.name: tensor for tensor in graph.initializer}
    groups: dict[tuple[str, int, int], list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and node.domain in DEFAULT_DOMAINS else None
        if weight is not None and len(weight.dims) == 2:
            groups[(node.input[0], weight.data_type, weight.dims[0])].append(node)
    fusions = {id(group[0]): group for group in groups.values() if len(group) > 1}
    if not fusions:
        return []
    names = NameSource(model)
    fused_away = {id(node) for group in fusions.values() for node in group}
    nodes = []
    for node in graph.node:
        if id(node) in fusions:
            nodes.extend(_fuse(fusions[id(node)], weights, graph, names))
        elif id(node) not in fused_away:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unused_initializers(model)
    infer_types(model)
    sizes = ", ".join(str(len(group)) for group in fusions.values())
    return [f"fused {len(fusions)} group(s) of parallel MatMuls ({sizes} MatMuls) into MatMul + Split"]


def _fuse(
    group: list[onnx.NodeProto], weights: dict[str, onnx.TensorProto], graph: onnx.GraphProto, names: NameSource,
) -> list[onnx.NodeProto]:
    """One MatMul over the weights concatenated along their columns and a Split into the original outputs."""
    arrays = [numpy_helper.to_array(weights[node.input[1]]) for node in group]
    base = group[0].name or group[0].output[0]
    weight_name, sizes_name = names.take(f"{base}_fused_weight"), names.take(f"{base}_split_sizes")
    fused_name = names.take(f"{base}_fused")
    graph.initializer.extend([
        numpy_helper.from_array(np.concatenate(arrays, axis=1), weight_name),
        numpy_helper.from_array(np.array([a.shape[1] for a in arrays], np.int64), sizes_name),
    ])
    return [
        helper.make_node("MatMul", [group[0].input[0], weight_name], [fused_name], name=names.take(f"{base}_fused_matmul")),
        helper.make_node("Split", [fused_name, sizes_name], [n.output[0] for n in group], name=names.take(f"{base}_split"), axis=-1),
    ]


class NameSource:
    """Fresh tensor and node names that clash with none in the model."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.taken = {t.name for t in graph.initializer} | {i.name for i in [*graph.input, *graph.output]}
        self.taken |= {name for node in graph.node for name in [node.name, *node.input, *node.output]}

    def take(self, wanted: str) -> str:
        """`wanted`, or `wanted` with a numeric suffix when it is already used."""
        name, index = wanted, 1
        while name in self.taken:
            name, index = f"{wanted}_{index}", index + 1
        self.taken.add(name)
        return name

