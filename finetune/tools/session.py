"""onnxruntime sessions for the tools: custom-op bodies attached, and a list of every node a
provider has no kernel for instead of onnxruntime's first NOT_IMPLEMENTED error."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from finetune.onnx import attach_custom_ops
from finetune.onnx.fold import infer_types, tensor_types
from finetune.onnx.io import load_model
from finetune.onnx.session import DEFAULT_PROVIDERS, EXACT, inference_session

Signature = tuple[str, str, tuple[int, ...], tuple[int, ...]]


def make_session(
    model: str | os.PathLike | onnx.ModelProto, providers: Sequence[str] = DEFAULT_PROVIDERS, optimization: str = EXACT,
) -> ort.InferenceSession:
    """A session on `providers` for the model with its custom ops attached; a provider lacking
    kernels raises ValueError listing every node concerned."""
    model = attach_custom_ops(load_model(model), in_place=True)
    try:
        return inference_session(model, providers, optimization)
    except Exception as error:  # onnxruntime raises its own exception types, one per status code
        if "NOT_IMPLEMENTED" not in str(error):
            raise
        missing = missing_kernels(model, providers[0])
        raise ValueError(
            f"onnxruntime's {providers[0]} has no kernel for some nodes of the model:\n{describe_missing(missing)}"
        ) from error


def missing_kernels(model: onnx.ModelProto, provider: str = "CPUExecutionProvider") -> dict[str, list[str]]:
    """Node names by op signature (e.g. 'MatMul(bfloat16, bfloat16)') for which `provider` has no
    kernel, found by creating a one-node session per distinct signature."""
    model = load_model(model)
    infer_types(model)
    types = {name: t.elem_type for name, t in tensor_types(model).items()}
    verdicts: dict[Signature, bool] = {}
    missing: dict[str, list[str]] = defaultdict(list)
    for node in model.graph.node:
        signature = _signature(node, types)
        if signature is None:
            continue
        if signature not in verdicts:
            verdicts[signature] = _has_kernel(model, node, types, provider)
        if not verdicts[signature]:
            missing[_label(signature)].append(node.name or node.output[0])
    return dict(missing)


def describe_missing(missing: dict[str, list[str]]) -> str:
    """One line per op signature with the nodes that lack a kernel."""
    return "\n".join(f"  {label}: {len(nodes)} node(s): {', '.join(nodes)}" for label, nodes in sorted(missing.items()))


def _signature(node: onnx.NodeProto, types: dict[str, int]) -> Signature | None:
    """Domain, op type and element types of inputs and outputs; None when a type is unknown."""
    inputs = tuple(types.get(name, 0) if name else -1 for name in node.input)
    outputs = tuple(types.get(name, 0) for name in node.output)
    if 0 in inputs or 0 in outputs:
        return None
    return node.domain, node.op_type, inputs, outputs


def _label(signature: Signature) -> str:
    """'Op(type, type)' with the domain prefixed when it is not the default one."""
    domain, op_type, inputs, _ = signature
    names = ", ".join("" if t < 0 else TensorProto.DataType.Name(t).lower() for t in inputs)
    return f"{domain + '::' if domain else ''}{op_type}({names})"


def _has_kernel(model: onnx.ModelProto, node: onnx.NodeProto, types: dict[str, int], provider: str) -> bool:
    """Whether a session of just this node (inputs fed as graph inputs) can be created on `provider`."""
    inputs = [helper.make_tensor_value_info(name, types[name], None) for name in dict.fromkeys(node.input) if name]
    outputs = [onnx.ValueInfoProto(name=name) for name in node.output if name]
    probe = helper.make_model(
        helper.make_graph([node], "probe", inputs, outputs), opset_imports=list(model.opset_import),
        ir_version=model.ir_version, functions=list(model.functions),
    )
    try:
        inference_session(probe, [provider])
    except Exception as error:  # onnxruntime raises its own exception types, one per status code
        if "NOT_IMPLEMENTED" in str(error):
            return False
        raise ValueError(f"onnxruntime cannot load node {node.name!r} ({node.op_type}) on its own: {error}") from error
    return True
