"""Values computed inside If/Loop/Scan bodies made visible to calibration: onnxruntime returns only
the main graph's values, so each wanted value is passed out of every body that holds it as an
extra output of the body and of its node, up to the main graph.

An If branch without the value returns an empty tensor in its place (observers skip empty
batches); a Loop or Scan returns the value of every iteration stacked on a new first axis, which
per-tensor statistics read as they read one tensor."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from finetune.onnx.graphs import all_nodes, subgraphs, unique_name

_EXPOSED = "_calibration"  # suffix of the outputs added to nodes


def expose_inner_values(graph: onnx.GraphProto, names: set[str], types: Mapping[str, int]) -> dict[str, str]:
    """For each of `names` computed inside a subgraph, the name of the new main-graph value that
    carries it out (the graph is changed in place; the caller adds these as graph outputs).
    `types` holds the element types of the values (float where unknown)."""
    taken = {name for node in all_nodes(graph) for name in (*node.input, *node.output)}
    return {name: carried for name, carried in _expose(graph, names, types, taken).items() if carried != name}


def _expose(graph: onnx.GraphProto, names: set[str], types: Mapping[str, int], taken: set[str]) -> dict[str, str]:
    """The value of `graph` carrying each wanted name computed in it or in its bodies."""
    local = {v.name for v in graph.input} | {name for node in graph.node for name in node.output}
    found = {name: name for name in names if name in local}
    for node in list(graph.node):
        bodies = list(subgraphs(node))
        inner = [_expose(body, names - set(found), types, taken) for body in bodies]
        wanted = sorted(set().union(*inner))
        if not wanted:
            continue
        _check_supported(node)
        for name in wanted:
            for body, carried in zip(bodies, inner):
                body.output.append(_output_info(body, carried.get(name), types.get(name, onnx.TensorProto.FLOAT), taken))
            if node.op_type == "Scan":
                _extend_scan_attributes(node)
            found[name] = unique_name(f"{name}{_EXPOSED}", taken)
            node.output.append(found[name])
    return found


def _check_supported(node: onnx.NodeProto) -> None:
    """Only If, Loop and Scan have bodies whose outputs calibration knows how to extend."""
    if node.op_type not in ("If", "Loop", "Scan") or node.domain not in ("", "ai.onnx"):
        raise ValueError(f"node {node.name!r} ({node.domain or 'ai.onnx'}::{node.op_type}) holds a subgraph whose values "
                         "calibration cannot reach; exclude the nodes inside it (exclude_nodes) or use a block format")


def _output_info(body: onnx.GraphProto, carried: str | None, elem_type: int, taken: set[str]) -> onnx.ValueInfoProto:
    """The new output of one body: the carried value, or (an If branch without it) an empty tensor.
    A body input goes out through an Identity: onnxruntime's Scan returned garbage for a scan
    output that names a body input directly."""
    if carried is None:
        carried = unique_name(f"empty{_EXPOSED}", taken)
        empty = numpy_helper.from_array(np.zeros([0], helper.tensor_dtype_to_np_dtype(elem_type)))
        body.node.append(helper.make_node("Constant", [], [carried], name=carried, value=empty))
    elif carried in {value.name for value in body.input}:
        copy = unique_name(f"{carried}{_EXPOSED}", taken)
        body.node.append(helper.make_node("Identity", [carried], [copy], name=copy))
        carried = copy
    return helper.make_tensor_value_info(carried, elem_type, None)


def _extend_scan_attributes(node: onnx.NodeProto) -> None:
    """A Scan's per-output attribute lists get an entry for the new scan output (axis 0, forward)."""
    for attribute in node.attribute:
        if attribute.name in ("scan_output_axes", "scan_output_directions") and attribute.ints:
            attribute.ints.append(0)

