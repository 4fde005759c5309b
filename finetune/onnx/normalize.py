"""Bring a real-world ONNX export into the regular form the lifter and the quantizer expect:
weights as initializers, unique node names, a recent opset and inferred shapes."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from finetune.notices import Notice, warn

from .domains import DEFAULT_DOMAINS, MIN_OPSET
from .graphs import all_graphs, all_nodes, node_reads, rename_reads
from .io import convert_version_of, infer_shapes_of

logger = logging.getLogger(__name__)


OPSET_KEPT = "kept opset"  # how a change reports a failed opset upgrade

# Constant attributes other than a tensor, with the numpy type of their value.
_CONSTANT_ATTRIBUTES: dict[str, type] = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def normalize_model(
    model: onnx.ModelProto, min_opset: int = MIN_OPSET, notices: list[Notice] | None = None, in_place: bool = False,
) -> tuple[onnx.ModelProto, list[str]]:
    """A normalised copy of `model` (with `in_place`, the model itself, for a caller that owns it:
    no second copy of the weights) and a readable list of what changed (each item also logged);
    what could not be done (shape inference) is logged at WARNING and added to `notices`."""
    result = model
    if not in_place:
        result = onnx.ModelProto()
        result.CopyFrom(model)
    steps: list[Callable[[onnx.ModelProto], list[str]]] = [
        _sort_topologically,
        lambda m: _upgrade_opset(m, min_opset),
        _constants_to_initializers,
        _bypass_initializer_identities,
        _drop_initializer_inputs,
        _drop_initializer_value_info,
        _name_nodes,
        lambda m: infer_shapes(m, notices),
    ]
    changes: list[str] = []
    for step in steps:
        for change in step(result):
            logger.info(change)
            changes.append(change)
    return result, changes


def default_opset(model: onnx.ModelProto) -> int | None:
    """The version of the default ONNX domain the model imports, or None."""
    return next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), None)


def _upgrade_opset(model: onnx.ModelProto, min_opset: int) -> list[str]:
    """Convert the default domain up to `min_opset` with onnx's version converter; a model the
    converter cannot handle stays as it is and the reason is reported."""
    opset = default_opset(model)
    if opset is None or opset >= min_opset:
        return []
    try:
        convert_version_of(model, min_opset)
    except Exception as error:  # the converter raises RuntimeError or onnx's C++ errors
        return [f"{OPSET_KEPT} {opset}: onnx's version converter could not upgrade to {min_opset} ({error})"]
    return [f"upgraded the default opset from {opset} to {min_opset}"]


def _constants_to_initializers(model: onnx.ModelProto) -> list[str]:
    """Turn Constant nodes, then ConstantOfShape nodes of a constant shape, into initializers of
    their own graph (subgraphs included: exporters write a branch's weights as Constants)."""
    folded = {"Constant": 0, "ConstantOfShape": 0}
    for graph in reversed(list(all_graphs(model.graph))):  # innermost first: rebuilding a graph's nodes copies them
        outputs = {o.name for o in graph.output}
        kept = []
        for node in graph.node:
            value = _constant_value(node, graph) if node.output and node.output[0] not in outputs else None
            if value is None:
                kept.append(node)
                continue
            graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
            folded[node.op_type] += 1
        del graph.node[:]
        graph.node.extend(kept)
    return [f"turned {count} {op} node(s) into initializers" for op, count in folded.items() if count]


def _constant_value(node: onnx.NodeProto, graph: onnx.GraphProto) -> np.ndarray | None:
    """The value a Constant or constant-shaped ConstantOfShape node produces, else None."""
    if node.domain not in DEFAULT_DOMAINS:
        return None
    if node.op_type == "Constant":
        return _constant_attribute(node)
    if node.op_type == "ConstantOfShape":
        shape = _initializer(graph, node.input[0])
        return None if shape is None else constant_of_shape_value(node, shape)
    return None


def constant_of_shape_value(node: onnx.NodeProto, shape: np.ndarray) -> np.ndarray:
    """What a ConstantOfShape node produces for a given shape (its `value`, by default float 0)."""
    fill = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), np.zeros(1, np.float32))
    return np.full(tuple(int(d) for d in shape), fill.reshape(-1)[0], dtype=fill.dtype)


def _constant_attribute(node: onnx.NodeProto) -> np.ndarray | None:
    """The tensor of a Constant node (value or value_float(s)/value_int(s)); None for sparse or string values."""
    attribute = node.attribute[0] if len(node.attribute) == 1 else None
    if attribute is None:
        return None
    if attribute.name == "value":
        return numpy_helper.to_array(attribute.t)
    if attribute.name in _CONSTANT_ATTRIBUTES:
        return np.array(helper.get_attribute_value(attribute), dtype=_CONSTANT_ATTRIBUTES[attribute.name])
    return None


def _initializer(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of an initializer by name, or None."""
    tensor = next((t for t in graph.initializer if t.name == name), None)
    return None if tensor is None else numpy_helper.to_array(tensor)


def _bypass_initializer_identities(model: onnx.ModelProto) -> list[str]:
    """Let consumers of Identity(initializer) read the initializer itself, as exporters that share
    weights write them, so each weight is one initializer again."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    renames = {
        node.output[0]: node.input[0]
        for node in graph.node
        if node.op_type == "Identity" and node.domain in DEFAULT_DOMAINS
        and node.input[0] in initializers and node.output[0] not in outputs
    }
    if not renames:
        return []
    keep_only(graph.node, lambda node: not (node.op_type == "Identity" and node.output and node.output[0] in renames))
    rename_reads(graph.node, renames)
    return [f"bypassed {len(renames)} Identity node(s) of initializers"]


def _drop_initializer_inputs(model: onnx.ModelProto) -> list[str]:
    """Remove initializers from the graph inputs (older IRs list them there), so the inputs are the data."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    dropped = keep_only(graph.input, lambda value: value.name not in initializers)
    return [f"removed {dropped} initializer(s) from the graph inputs"] if dropped else []


def _drop_initializer_value_info(model: onnx.ModelProto) -> list[str]:
    """Remove the value_info entries of initializers: the tensor itself gives their type and shape,
    and a stale entry fails shape inference (onnxruntime-genai's builder types a [1] constant as a scalar)."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    dropped = keep_only(graph.value_info, lambda value: value.name not in initializers)
    return [f"removed the value_info of {dropped} initializer(s)"] if dropped else []


def keep_only(items: Any, keep: Callable[[Any], bool]) -> int:
    """Keep the entries of a protobuf repeated field that `keep` accepts, in order and in place;
    returns how many were removed."""
    dropped = sum(not keep(item) for item in items)
    if dropped:  # a stable sort moves no message and keeps the order; re-adding the kept ones would copy them (all the weights)
        items.sort(key=lambda item: not keep(item))
        del items[len(items) - dropped:]
    return dropped


def _sort_topologically(model: onnx.ModelProto) -> list[str]:
    """Order the nodes so each follows the producers of its inputs (subgraphs' outer reads
    included), keeping the given order where
    it allows (AMD Quark writes some nodes after their readers: onnxruntime sorts, the checker, the
    version converter and the lifter need the order)."""
    graph = model.graph
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    waiting_on = [{producer[name] for name in node_reads(node) if name in producer} - {index}
                  for index, node in enumerate(graph.node)]
    readers: dict[int, list[int]] = {}
    for index, needs in enumerate(waiting_on):
        for needed in needs:
            readers.setdefault(needed, []).append(index)
    ready = [index for index, needs in enumerate(waiting_on) if not needs]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, []):
            waiting_on[reader].discard(index)
            if not waiting_on[reader]:
                heapq.heappush(ready, reader)
    if order == list(range(len(graph.node))) or len(order) < len(graph.node):  # sorted already, or a cycle: left as is
        return []
    nodes = [graph.node[index] for index in order]
    moved = sum(position != index for position, index in enumerate(order))
    del graph.node[:]
    graph.node.extend(nodes)
    return [f"sorted the nodes topologically ({moved} moved)"]


def _name_nodes(model: onnx.ModelProto) -> list[str]:
    """Give every node, subgraphs' included, a name unique in the model (op type and index where
    it had none or a duplicate): plans, overrides and lifted modules find nodes by name."""
    nodes = list(all_nodes(model.graph))
    taken = {node.name for node in nodes if node.name}
    seen: set[str] = set()
    renamed = 0
    for index, node in enumerate(nodes):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        name = f"{node.op_type}_{index}"
        while name in taken or name in seen:
            name += "_"
        node.name = name
        seen.add(name)
        renamed += 1
    return [f"named {renamed} node(s) that had no name or a duplicate one"] if renamed else []


def infer_shapes(model: onnx.ModelProto, notices: list[Notice] | None = None) -> list[str]:
    """Run onnx shape inference with data propagation, in place; a failure is not raised but
    logged at WARNING and added to `notices`: shapes stay as stored (values it would have typed
    stay untyped, and the quantizer leaves those float, saying so)."""
    before = len(model.graph.value_info)
    failure = try_infer_shapes(model)
    if failure is not None:
        warn(logger, notices, [shape_inference_notice(model, failure)])
        return []
    added = len(model.graph.value_info) - before
    return [f"inferred the shapes of {added} value(s)"] if added else []


def try_infer_shapes(model: onnx.ModelProto) -> str | None:
    """Run onnx shape inference with data propagation, in place; the reason it could not, if so
    (the model is then unchanged)."""
    try:
        infer_shapes_of(model)
    except Exception as error:  # onnx raises InferenceError and C++ runtime errors
        return " ".join(str(error).split())
    return None


def shape_inference_notice(model: onnx.ModelProto, failure: str) -> Notice:
    """The notice of a shape inference that failed for `failure`."""
    name = model.graph.name or "(unnamed graph)"
    return Notice("model", name, f"onnx shape inference failed ({failure}); shapes stay as stored")
