"""onnxruntime's fused decoder ops rewritten, exactly, into the ops they fuse, for the torch lift:
SkipSimplifiedLayerNormalization into the residual Add(s) and a SimplifiedLayerNormalization, so a
decoder whose residual joins are fused into its norms (onnxruntime-genai's model builder writes them
so) shows the Adds that residual block finding follows. onnxruntime adds input + skip, then the bias,
in float: the same sums in the same order."""

from __future__ import annotations

import onnx
from onnx import helper

from .domains import ONNXRUNTIME_DOMAIN
from .graphs import all_graphs, unique_name

SKIP_NORM = "SkipSimplifiedLayerNormalization"


def split_skip_norms(model: onnx.ModelProto) -> int:
    """Replace, in place, every SkipSimplifiedLayerNormalization whose mean output (which an RMS norm
    does not compute) nothing reads by its Adds and a SimplifiedLayerNormalization; the count replaced."""
    replaced = 0
    for graph in all_graphs(model.graph):
        taken = {name for node in graph.node for name in (*node.input, *node.output, node.name)}
        nodes = []
        for node in graph.node:
            if node.op_type == SKIP_NORM and node.domain == ONNXRUNTIME_DOMAIN and not _output(node, 1):
                nodes.extend(_split(node, taken))
                replaced += 1
            else:
                nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    return replaced


def _output(node: onnx.NodeProto, index: int) -> str:
    """The node's output at `index`, "" when absent."""
    return node.output[index] if index < len(node.output) else ""


def _split(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The Adds (input + skip, then + bias) and the RMS norm one SkipSimplifiedLayerNormalization fuses,
    its outputs keeping their names (the sum gets a new one where the node left it unnamed)."""
    x, skip, gamma, *rest = node.input
    bias = rest[0] if rest else ""
    summed = _output(node, 3) or unique_name(f"{node.name}/input_skip_bias_sum", taken)
    first = unique_name(f"{node.name}/input_skip", taken) if bias else summed
    adds = [helper.make_node("Add", [x, skip], [first], name=unique_name(f"{node.name}/skip_add", taken))]
    if bias:
        adds.append(helper.make_node("Add", [first, bias], [summed], name=unique_name(f"{node.name}/bias_add", taken)))
    epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    outputs = [node.output[0], *([_output(node, 2)] if _output(node, 2) else [])]
    norm = helper.make_node("SimplifiedLayerNormalization", [summed, gamma], outputs, name=node.name, axis=-1,
                            epsilon=epsilon, stash_type=1)
    return [*adds, norm]
