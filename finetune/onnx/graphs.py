"""Names across subgraphs: what a node reads, counting the outer-scope names its If/Loop/Scan
bodies use without an explicit input. Every pass that removes, renames, folds or sorts reads
names through these helpers, so a value read only inside a branch is never dropped or left
behind its reader."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import onnx

from .domains import DEFAULT_DOMAINS

_SUBGRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The node's own subgraphs (then/else branches, Loop and Scan bodies), not nested ones."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def has_subgraphs(node: onnx.NodeProto) -> bool:
    """Whether the node carries a subgraph (If, Loop, Scan, or a custom op with a graph attribute)."""
    return any(attribute.type in _SUBGRAPH_TYPES for attribute in node.attribute)


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and, recursively, every subgraph of its nodes."""
    yield graph
    for node in graph.node:
        for subgraph in subgraphs(node):
            yield from all_graphs(subgraph)


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of the graph and of its subgraphs, at any depth."""
    for each in all_graphs(graph):
        yield from each.node


def element_types(graph: onnx.GraphProto) -> dict[str, int]:
    """Element types known without inference, in the graph and its subgraphs: inputs, outputs,
    value_info, initializers and Constant nodes' tensors (0 where a value_info leaves it open)."""
    types: dict[str, int] = {}
    for each in all_graphs(graph):
        for info in [*each.input, *each.output, *each.value_info]:
            if info.type.HasField("tensor_type"):
                types[info.name] = info.type.tensor_type.elem_type
        types.update({tensor.name: tensor.data_type for tensor in each.initializer})
        for node in each.node:
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
                for attribute in node.attribute:
                    if attribute.type == onnx.AttributeProto.TENSOR:
                        types[node.output[0]] = attribute.t.data_type
    return types


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes: used by its nodes (or theirs, at any depth)
    or returned as outputs, but neither its inputs, its initializers nor produced inside it."""
    local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    local |= {t.values.name for t in graph.sparse_initializer}
    local |= {name for node in graph.node for name in node.output if name}
    used = {name for node in graph.node for name in node_reads(node)} | {o.name for o in graph.output}
    return {name for name in used if name and name not in local}


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The node's explicit inputs, then the outer-scope names its subgraphs read (in a stable order)."""
    explicit = [name for name in node.input if name]
    implicit = sorted(set().union(*(outer_reads(subgraph) for subgraph in subgraphs(node))) - set(explicit))
    return explicit + implicit


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every name the graph's nodes read (subgraphs included) or returns as an output."""
    return {name for node in graph.node for name in node_reads(node)} | {o.name for o in graph.output}


def rename_reads(nodes: Iterable[onnx.NodeProto], renames: Mapping[str, str]) -> None:
    """Point reads of renamed values at their new names, in place, in the nodes and in every
    subgraph that reads them from outside (a subgraph that defines the name itself keeps it)."""
    for node in nodes:
        for index, name in enumerate(node.input):
            node.input[index] = renames.get(name, name)
        for subgraph in subgraphs(node):
            _rename_in_subgraph(subgraph, renames)


def _rename_in_subgraph(graph: onnx.GraphProto, renames: Mapping[str, str]) -> None:
    """rename_reads inside a subgraph, leaving names it shadows alone."""
    local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    local |= {name for node in graph.node for name in node.output}
    visible = {old: new for old, new in renames.items() if old not in local}
    if not visible:
        return
    rename_reads(graph.node, visible)
    for output in graph.output:
        if output.name in visible:  # a branch returning an outer value directly
            output.name = visible[output.name]


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, suffixed with a number when already taken; recorded as taken (for the names a pass adds)."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
