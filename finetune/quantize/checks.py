"""What can be checked between planning and calibration (the long work): errors for what cannot
work (an opset too old for a planned format, NaN/Inf in a weight, config entries that name
nothing in the model) and notices for what works, but not as configured (compact storage without
a compact form, one-element block-format tensors, MX rounding modes without effect)."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import onnx
from onnx import numpy_helper

from finetune.config import QuantConfig
from finetune.config.schema import did_you_mean
from finetune.formats import BFPSpec, MXSpec
from finetune.notices import Notice, warn
from finetune.onnx.batchnorm import FOLD_CHANGE
from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.fold import static_shapes
from finetune.onnx.normalize import OPSET_KEPT, default_opset

from .insert import has_compact_form
from .plan import Use, opset_for, with_producer_formats
from .summary import display_name

logger = logging.getLogger(__name__)

ONE_ELEMENT = "one element: block formats leave a one-element tensor as it is (as AMD Quark's kernels do), so it stays float"


def check_plan(model: onnx.ModelProto, config: QuantConfig, uses: list[Use], changes: list[str], notices: list[Notice]) -> None:
    """Raise a ValueError for what cannot work, and add notices (WARNING) for what the run does
    other than the config says, before any calibration."""
    check_names(model, config, notices, any(c.startswith(FOLD_CHANGE) for c in changes))
    check_opset(model, uses, changes)
    check_weights_finite(model, uses)
    warn(logger, notices, format_notices(model, uses, config.weight_storage != "float"))


def check_opset(model: onnx.ModelProto, uses: list[Use], changes: list[str]) -> None:
    """The model's default opset must hold every planned quantize-dequantize node (after
    upgrade_opset, which fails where onnx's version converter does); else a ValueError naming the
    format, the opset it needs, the model's opset and the converter's reason."""
    opset = default_opset(model) or 0
    short = [use for use in with_producer_formats(uses) if opset_for(use.spec) > opset]
    if not short:
        return
    use = max(short, key=lambda u: opset_for(u.spec))
    needed = opset_for(use.spec)
    why = next((f" ({change})" for change in reversed(changes) if change.startswith(OPSET_KEPT)), "")
    raise ValueError(
        f"{display_name(use.spec)} on tensor {use.tensor!r} needs default-domain opset {needed}, but the model has opset "
        f"{opset}{why}; convert the model to opset {needed} or newer first, or choose a format opset {opset} holds"
    )


def check_weights_finite(model: onnx.ModelProto, uses: list[Use]) -> None:
    """A weight about to be quantized must be finite: scales and codes would hide NaN/Inf (XINT8's
    search turns them into ordinary codes). A ValueError naming each such weight."""
    initializers = {t.name: t for t in model.graph.initializer}
    bad = []
    for name in dict.fromkeys(use.tensor for use in uses if use.tensor in initializers):
        values = numpy_helper.to_array(initializers[name])
        count = values.size - int(np.count_nonzero(np.isfinite(values)))
        if count:
            bad.append(f"{name!r} ({count} of {values.size} values)")
    if bad:
        raise ValueError(f"NaN or Inf in weights to quantize: {', '.join(bad)}; fix the float model's weights")


def check_names(model: onnx.ModelProto, config: QuantConfig, notices: list[Notice], folded: bool = False) -> None:
    """Every override and exclusion must name something the (normalised) model has: a ValueError
    listing each that does not, with the closest name (and, where batch norms were `folded`, that
    their nodes and the layers' outputs before them are gone); a tensor override no quantized node
    reads and an op type override of a valid op type the model lacks change nothing (notices)."""
    graph = model.graph
    nodes = [node.name for node in graph.node]
    tensors = {name for node in graph.node for name in (*node.input, *node.output) if name}
    tensors |= {t.name for t in graph.initializer} | {v.name for v in (*graph.input, *graph.output)}
    unmatched = [
        *(f"tensor_overrides[{name!r}] names no tensor{did_you_mean(name, tensors, quote=True)}"
          for name in config.tensor_overrides if name not in tensors),
        *(f"node_overrides[{name!r}] names no node{did_you_mean(name, nodes, quote=True)}"
          for name in config.node_overrides if name not in nodes),
        *(f"exclude_nodes[{i}] {pattern!r} matches no node{did_you_mean(pattern, nodes, quote=True)}"
          for i, pattern in enumerate(config.exclude_nodes) if not any(_excludes(pattern, name) for name in nodes)),
        *(f"op_type_overrides[{op_type!r}] is no ONNX op type{did_you_mean(op_type, _onnx_op_types(), quote=True)}"
          for op_type in config.op_type_overrides if not onnx.defs.has(op_type)),
    ]
    if unmatched:
        hint = ("; fold_batch_norm folded the model's BatchNormalization nodes into the layers before them (their "
                "outputs now come from those layers): name those, or set fold_batch_norm: false") if folded else ""
        raise ValueError(f"the config names what the model does not have: {'; '.join(unmatched)}{hint}")
    warn(logger, notices, _names_without_effect(model, config))


def _names_without_effect(model: onnx.ModelProto, config: QuantConfig) -> list[Notice]:
    """Tensor overrides of tensors no quantized node reads, op type overrides of op types the
    model does not use: valid, but they change nothing in this model."""
    graph = model.graph
    quantized = [node for node in graph.node if node.domain in DEFAULT_DOMAINS and config.selects(node.name, node.op_type)]
    read = {name for node in quantized for name in node.input}
    op_types = {node.op_type for node in graph.node if node.domain in DEFAULT_DOMAINS}
    return [
        *(Notice("config", f"tensor_overrides[{name!r}]", "no quantized node reads this tensor, so the override changes nothing")
          for name in config.tensor_overrides if name not in read),
        *(Notice("config", f"op_type_overrides[{op_type!r}]", "the model has no node of this op type, so the override changes nothing")
          for op_type in config.op_type_overrides if op_type not in op_types),
    ]


def _excludes(pattern: str, node_name: str) -> bool:
    """Whether one exclude_nodes entry names the node (exactly, or as a full-match regular expression)."""
    return node_name == pattern or re.fullmatch(pattern, node_name) is not None


def _onnx_op_types() -> list[str]:
    return [schema.name for schema in onnx.defs.get_all_schemas() if schema.domain in DEFAULT_DOMAINS]


def format_notices(model: onnx.ModelProto, uses: list[Use], compact: bool) -> list[Notice]:
    """Per tensor, what its format does other than configured: a compact weight stored as float,
    a one-element tensor a block format leaves float, an MX rounding mode float elements ignore."""
    initializers = {t.name for t in model.graph.initializer}
    shapes = static_shapes(model)
    notices = []
    for use in with_producer_formats(uses):
        spec, tensor = use.spec, use.tensor
        if compact and tensor in initializers and not has_compact_form(use):
            reason = f"weight_storage compact: {display_name(spec)} has no compact form onnxruntime runs, so it stays float"
            notices.append(Notice("tensor", tensor, reason))
        if isinstance(spec, (BFPSpec, MXSpec)) and tensor in shapes and math.prod(shapes[tensor]) == 1:
            notices.append(Notice("tensor", tensor, ONE_ELEMENT))
        if isinstance(spec, MXSpec) and not spec.element.is_int and spec.rounding_mode != MXSpec.rounding_mode:
            reason = (f"MX rounding_mode {spec.rounding_mode} has no effect: {spec.element_dtype} elements always round "
                      "half to even (as AMD Quark's kernels do)")
            notices.append(Notice("tensor", tensor, reason))
    return notices
