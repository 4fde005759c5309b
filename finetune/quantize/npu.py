"""The NPU CNN constraints of config `npu_cnn` (AMD Quark's enable_npu_cnn; which ops, in
finetune.config.npu) applied to a plan and its calibrated scales, so that a Vitis AI / Ryzen AI
NPU compiler takes the model as it is:

- before calibration, the constant operand of an element-wise op (Add, Mul, ...) takes the format
  of the op's activations, so both operands are one integer type (Quark's AlignEltwiseQuantType);
- after calibration, Concat's inputs and output, and the input and output of pooling, Pad and
  Slice, share one scale: the largest among them, which clips none of them (Vitis AI's AlignConcat,
  AlignPool, AlignPad, AlignSlice, which take the smallest fix position). Tensors joined through
  several such ops (Concat -> MaxPool) share one scale, the fixed point of Vitis's repeated passes.

Each change is a record ({"nodes", "tensor", and the scale or format before and after}), logged at
INFO and listed in the summary. Vitis's shift constraints are not applied: a notice on every run."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import onnx

from finetune.config import QuantConfig
from finetune.config.npu import CONCAT_OPS, ELTWISE_OPS, NOT_APPLIED, SAME_SCALE_OPS
from finetune.formats import IntSpec
from finetune.notices import Notice, warn
from finetune.onnx.domains import DEFAULT_DOMAINS

from .calibrate import QParams, int32_bias_qparams
from .plan import Use
from .summary import display_name

logger = logging.getLogger(__name__)

NOT_APPLIED_NOTICE = Notice(
    "config", "npu_cnn", f"these Vitis AI NPU constraints are not applied: {', '.join(NOT_APPLIED)}; the model's "
    "shifts and op forms are as quantized, so check it with the NPU compiler",
)


def align_eltwise_formats(
    model: onnx.ModelProto, config: QuantConfig, uses: list[Use],
) -> tuple[list[Use], list[dict[str, Any]]]:
    """The uses with each constant operand of an element-wise op in that op's activation format
    (unless a tensor override names it), and a record per operand changed."""
    op_types = {node.name: node.op_type for node in model.graph.node}
    aligned, records = [], []
    for use in uses:
        op_type = op_types[use.node]
        if use.role == "weight" and op_type in ELTWISE_OPS and use.tensor not in config.tensor_overrides:
            formats = config.node_formats(use.node, op_type)
            activation = None if formats is None else formats.activation
            if activation is not None and activation.spec() != use.spec:
                spec = activation.spec()
                before, after = display_name(use.spec), display_name(spec)
                records.append(_record([f"{use.node} ({op_type})"], use.tensor, "format", before, after))
                use = dataclasses.replace(use, choice=activation, spec=spec)
        aligned.append(use)
    return aligned, records


def align_scales(model: onnx.ModelProto, config: QuantConfig, uses: list[Use], qparams: QParams,
                 notices: list[Notice]) -> list[dict[str, Any]]:
    """Give every group of tensors joined by Concat, pooling, Pad or Slice (nodes the config
    quantizes) the largest scale among its quantized members, in place; int32 biases follow their
    new input scales. A record per scale changed; the constraints not applied are a notice."""
    warn(logger, notices, [NOT_APPLIED_NOTICE])
    biases = {(use.tensor, use.spec) for use in uses if use.choice == "int32"}
    by_tensor: dict[str, list[tuple]] = {}
    for key in qparams:
        if isinstance(key[1], IntSpec) and key not in biases:
            by_tensor.setdefault(key[0], []).append(key)
    records = []
    for nodes, tensors in _groups(model, config):
        keys = [key for tensor in tensors for key in by_tensor.get(tensor, [])]
        if len(keys) < 2:
            continue
        target = max(float(qparams[key][0]) for key in keys)
        for key in keys:
            scale, zero_point = qparams[key]
            if float(scale) != target:
                records.append(_record(nodes, key[0], "scale", float(scale), target))
                qparams[key] = (np.full_like(scale, target), zero_point)
    qparams.update(int32_bias_qparams(uses, qparams))
    return records


def _groups(model: onnx.ModelProto, config: QuantConfig) -> list[tuple[list[str], list[str]]]:
    """(nodes, tensors) of each set of tensors that must share a scale, in graph order: the union
    of Concat's inputs and output and of the data input and output of the same-scale ops."""
    parent: dict[str, str] = {}

    def root(tensor: str) -> str:
        while parent.setdefault(tensor, tensor) != tensor:
            tensor = parent[tensor]
        return tensor

    joined: list[tuple[str, list[str]]] = []
    for node in model.graph.node:
        if node.domain not in DEFAULT_DOMAINS or not config.selects(node.name, node.op_type):
            continue
        if node.op_type in CONCAT_OPS:
            tensors = [name for name in node.input if name] + [node.output[0]]
        elif node.op_type in SAME_SCALE_OPS:
            tensors = [node.input[0], node.output[0]]
        else:
            continue
        joined.append((f"{node.name} ({node.op_type})", tensors))
        for tensor in tensors[1:]:
            parent[root(tensor)] = root(tensors[0])
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for label, tensors in joined:
        nodes, members = groups.setdefault(root(tensors[0]), ([], []))
        nodes.append(label)
        members.extend(t for t in tensors if t not in members)
    return list(groups.values())


def _record(nodes: list[str], tensor: str, what: str, before: Any, after: Any) -> dict[str, Any]:
    """One alignment, logged at INFO."""
    logger.info("npu_cnn: %s of tensor %s %s -> %s (aligned for %s)", what, tensor, before, after, ", ".join(nodes))
    return {"nodes": list(nodes), "tensor": tensor, f"{what}_before": before, f"{what}_after": after}
