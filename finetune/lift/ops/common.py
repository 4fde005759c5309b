"""What every converter of this package needs: the node's ONNX mapping and result, its optional
constant inputs, which of its outputs something reads, and the refusal of nodes whose optional
outputs something reads."""

from __future__ import annotations

from collections.abc import Sequence

from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult
from torch import nn

from finetune.onnx.graphs import all_nodes


def node_mapping(node: OnnxNode, inputs: Sequence[str] | None = None, outputs: int = 1) -> OnnxMapping:
    """The node's inputs (or the given ones) and its first `outputs` outputs."""
    return OnnxMapping(inputs=tuple(node.input_values if inputs is None else inputs), outputs=node.output_values[:outputs])


def converted(module: nn.Module, mapping: OnnxMapping) -> OperationConverterResult:
    """The converter result of a module and its ONNX mapping."""
    return OperationConverterResult(torch_module=module, onnx_mapping=mapping)


def require_unused_outputs(node: OnnxNode, graph: OnnxGraph) -> None:
    """Refuse a node whose optional outputs after the first are read by anything (not lifted)."""
    extra = {name for name in node.output_values[1:] if name}
    if not extra:
        return
    used = extra & ({i for n in graph.proto.node for i in n.input} | {o.name for o in graph.proto.output})
    if used:
        raise NotImplementedError(f"optional output(s) {sorted(used)} are used; only the main output is lifted")


def constant_ints(node: OnnxNode, graph: OnnxGraph, index: int) -> tuple[int, ...] | None:
    """An optional integer input given as an initializer, as a tuple; None when absent or computed."""
    name = node.input_values[index] if index < len(node.input_values) else ""
    if not name or name not in graph.initializers:
        return None
    return tuple(int(v) for v in graph.initializers[name].to_torch().reshape(-1).tolist())


def is_constant_or_absent(node: OnnxNode, graph: OnnxGraph, index: int) -> bool:
    """Whether an optional input is missing or an initializer."""
    name = node.input_values[index] if index < len(node.input_values) else ""
    return not name or name in graph.initializers


def used_outputs(node: OnnxNode, graph: OnnxGraph) -> tuple[int, ...]:
    """Indices of the outputs something reads (a node, a subgraph's node or a graph output); the
    first alone when none is read. A module returning these only returns one tensor where its first
    output alone is read (as a reconstruction unit's target must be: an LSTM's Y)."""
    read = {name for n in all_nodes(graph.proto) for name in n.input} | {o.name for o in graph.proto.output}
    used = tuple(i for i, name in enumerate(node.output_values) if name and name in read)
    return used or (0,)
