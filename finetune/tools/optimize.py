"""Graph optimisations run before a precision conversion: constant folding (finetune.onnx.fold),
and fusing parallel MatMuls that share an input and have constant weights (Q/K/V projections)
into one MatMul and a Split."""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.fold import drop_unused_initializers, fold_constants, infer_types

logger = logging.getLogger(__name__)


def optimize(model: onnx.ModelProto) -> list[str]:
    """Fold constants, then fuse parallel MatMuls, in place; returns what changed (also logged)."""
    changes = [*fold_constants(model), *fuse_parallel_matmuls(model)]
    for change in changes:
        logger.info(change)
    return changes


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

