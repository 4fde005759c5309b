"""The nodes of an online rotation (QuaRot's online Hadamard; finetune.onnx.rotate plans which
layers get one and rotates their weights): a layer's input x of width n becomes x H with H the
Kronecker product of Hadamard matrices A (Sylvester's, order a near sqrt(n)) and B (order n / a),
applied as two small products instead of one n x n product: x reshaped to [-1, a, n / a], times B
on the right, A (symmetric) times that on the left, and reshaped back to x's shape. The factors hold
±1, exact in any format; the layer's weight takes the 1 / n."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graphs import unique_name
from .hadamard import online_factors


def insert_online(graph: onnx.GraphProto, layers: dict[str, int]) -> list[str]:
    """Insert the online rotation of each named layer's input (of the given width) before the layer,
    in place; the names of the inserted MatMuls, which the quantizer leaves float."""
    taken = {t.name for t in graph.initializer} | {n for node in graph.node for n in (*node.input, *node.output, node.name)}
    taken |= {v.name for v in graph.input}
    before: dict[str, list[onnx.NodeProto]] = {}
    products: list[str] = []
    for node in graph.node:
        if node.name in layers:
            before[node.name] = _rotation_nodes(graph, node, layers[node.name], taken)
            products += [n.name for n in before[node.name] if n.op_type == "MatMul"]
    rebuilt = [new for node in graph.node for new in (*before.get(node.name, ()), node)]
    del graph.node[:]
    graph.node.extend(rebuilt)
    return products


def _rotation_nodes(graph: onnx.GraphProto, layer: onnx.NodeProto, width: int, taken: set[str]) -> list[onnx.NodeProto]:
    """Shape, Reshape, x C, S (x C), Reshape back: the layer then reads x H."""
    left, right = online_factors(width)
    prefix = f"{layer.name}/online_rotation"
    element = next(t.data_type for t in graph.initializer if t.name == layer.input[1])  # the layer's weight's: its input's
    dtype = helper.tensor_dtype_to_np_dtype(element)

    def name(suffix: str) -> str:
        return unique_name(f"{prefix}/{suffix}", taken)

    def constant(suffix: str, array: np.ndarray) -> str:
        tensor = numpy_helper.from_array(array, name(suffix))
        graph.initializer.append(tensor)
        return tensor.name

    x, shape, blocks = layer.input[0], name("shape"), name("blocks")
    nodes = [helper.make_node("Shape", [x], [shape], name=name("Shape")),
             helper.make_node("Reshape", [x, constant("block_shape", np.array([-1, left.shape[0], right.shape[0]]))],
                              [blocks], name=name("Reshape"))]
    current = blocks
    if right.shape[0] > 1:
        nodes.append(helper.make_node("MatMul", [current, constant("right", right.astype(dtype))], [name("by_right")],
                                      name=name("MatMul_right")))
        current = nodes[-1].output[0]
    if left.shape[0] > 1:
        nodes.append(helper.make_node("MatMul", [constant("left", left.astype(dtype)), current],
                                      [name("by_left")], name=name("MatMul_left")))
        current = nodes[-1].output[0]
    rotated = name("output")
    nodes.append(helper.make_node("Reshape", [current, shape], [rotated], name=name("Reshape_back")))
    layer.input[0] = rotated
    for node in nodes[1:]:  # their element type, which the quantizer's planning reads
        graph.value_info.append(helper.make_tensor_value_info(node.output[0], element, None))
    return nodes
