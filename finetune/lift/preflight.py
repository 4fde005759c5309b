"""Whether a model can be lifted, asked before any work: every node of every graph (If/Loop/Scan
bodies included) is looked up, and all the ops that have no converter are named in one error,
so a fine-tuning run fails in seconds rather than at the first such op after calibration."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import onnx

from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.graphs import all_nodes
from finetune.onnx.io import external_header, load_model

from .builder import LiftError, normalized_for_lift
from .ops.control import is_control
from .qdq import QOPERATOR_OPS
from .registry import find_converter

SHOWN_NAMES = 5  # node names listed per op before "and N more"


def unliftable_ops(model: str | Path | onnx.ModelProto) -> dict[tuple[str, str, int | None], list[str]]:
    """The ops of the (normalised) model that cannot be lifted, as (domain, op type, opset) → the
    names of its nodes, in graph order; empty when every node can be."""
    normalized = normalized_for_lift(_graph_only(model))
    opsets = {("" if o.domain in DEFAULT_DOMAINS else o.domain): o.version for o in normalized.opset_import}
    found: dict[tuple[str, str, int | None], list[str]] = defaultdict(list)
    for node in all_nodes(normalized.graph):
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        if not _liftable(node, domain, opsets.get(domain)):
            found[(domain, node.op_type, opsets.get(domain))].append(node.name)
    return dict(found)


def _graph_only(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model whose large tensors refer to data it does not read (a file's stay in its data
    file): which ops a model has is read from its graph, and normalising reads no large tensor, so a
    check before any work costs no copy of the weights (issue 44: two copies, the peak of a 2.5 GB run)."""
    if isinstance(model, onnx.ModelProto):
        return external_header(model, "", None)
    return external_header(load_model(model, external_values=False), "", None)


def check_liftable(model: str | Path | onnx.ModelProto) -> None:
    """Raise LiftError naming every op of the model (with its domain, opset and nodes) that cannot be lifted."""
    found = unliftable_ops(model)
    if not found:
        return
    lines = [f"  {domain or 'ai.onnx'}::{op_type} ({_opset(opset)}): {len(names)} node(s) {_names(names)}"
             for (domain, op_type, opset), names in found.items()]
    raise LiftError(f"cannot lift {len(found)} op(s) of the model to torch, so it cannot be fine-tuned:\n" + "\n".join(lines))


def _liftable(node: onnx.NodeProto, domain: str, opset: int | None) -> bool:
    """Whether the builder has a way to lift the node (a converter, or our control-flow modules)."""
    if opset is None or node.op_type in QOPERATOR_OPS:
        return False
    if is_control(node):
        return True
    try:
        find_converter(domain, node.op_type, opset)
    except NotImplementedError:
        return False
    return True


def _opset(opset: int | None) -> str:
    """An opset as the message reads it."""
    return f"opset {opset}" if opset is not None else "domain not imported"


def _names(names: list[str]) -> str:
    """Node names as the message lists them."""
    shown = ", ".join(repr(n) for n in names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")
