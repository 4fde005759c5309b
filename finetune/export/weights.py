"""Write the tuned parameters of a lifted module back into a copy of the original ONNX model,
without changing its topology, so stock onnxruntime runs what torch computed. A weight may live
in any graph of the model: the main graph or an If/Loop/Scan body."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from finetune.lift import LiftedModule, ParamSource
from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN, attach_custom_ops
from finetune.onnx.graphs import all_graphs
from finetune.onnx.io import load_model
from finetune.onnx.normalize import constant_of_shape_value
from finetune.onnx.qdq import bf16_pairs_to_casts

from .scales import write_quantizer_params


def export_model(module: LiftedModule, original_model: str | Path | onnx.ModelProto, attach_ops: bool = False,
                 bf16_as_cast: bool = False, in_place: bool = False) -> onnx.ModelProto:
    """A copy of `original_model` whose weights are the module's parameters: float initializers
    get the values, integer/float8 initializers the codes of the original scale and zero point.
    The model keeps its own form (domains, op types, attributes), so a model made for another
    toolchain (AMD Quark's com.amd.quark ops) stays deployable there; our com.finetune ops, which
    only we define, get their function bodies, and with `attach_ops` so do AMD Quark's, for stock
    onnxruntime to run them. With `bf16_as_cast`, our bfloat16 quantize-dequantize pairs become
    Cast pairs (onnx.qdq.bf16_pairs_to_casts). With `in_place`, `original_model` (a proto the caller
    owns) is changed and returned, each weight replaced as it is written: no second copy of the codes."""
    model = original_model if in_place and isinstance(original_model, onnx.ModelProto) else load_model(original_model)
    tensors = _writable_tensors(model.graph)
    write_quantizer_params(model, module, tensors)  # learned scales and zero points (recon.methods.scales)
    for name, source in module.finetune_params.items():
        source = _with_current_quantizer(module, source)
        tensor = _target_tensor(model.graph, tensors, source.initializer)
        tensor.CopyFrom(numpy_helper.from_array(_stored_array(module.get_parameter(name), source, tensor), tensor.name))
    if bf16_as_cast:
        bf16_pairs_to_casts(model)
    return attach_custom_ops(model, (CUSTOM_DOMAIN, QUARK_DOMAIN) if attach_ops else (CUSTOM_DOMAIN,), in_place=True)


def _stored_array(value: torch.Tensor, source: ParamSource, tensor: onnx.TensorProto) -> np.ndarray:
    """The parameter as the original tensor stores it (its codes, or float values of its type)."""
    if tuple(value.shape) != tuple(tensor.dims):
        raise ValueError(f"parameter of {source.initializer!r} has shape {tuple(value.shape)}, the model {tuple(tensor.dims)}")
    if source.transform is not None:
        return source.transform.encode(value)
    return value.detach().cpu().float().numpy().astype(helper.tensor_dtype_to_np_dtype(tensor.data_type))


def _with_current_quantizer(module: LiftedModule, source: ParamSource) -> ParamSource:
    """The source whose codes are encoded with its quantizer's scale and zero point as they are now
    (a learned scale, or an int32 bias following one, re-encodes them; write_quantizer_params writes those)."""
    if source.transform is None or source.quantizer is None:
        return source
    quantizer = module.get_submodule(source.quantizer)
    transform = dataclasses.replace(source.transform, scale=quantizer.scale.detach().cpu(),
                                    zero_point=quantizer.zero_point.detach().cpu())
    return dataclasses.replace(source, transform=transform)


def _target_tensor(graph: onnx.GraphProto, tensors: dict[str, onnx.TensorProto], name: str) -> onnx.TensorProto:
    """The tensor that defines `name` in the original model, made writable if a ConstantOfShape."""
    tensor = tensors[name] if name in tensors else _constant_of_shape_tensor(graph, tensors, name)
    if tensor is None:
        raise KeyError(f"{name!r} is neither an initializer nor a Constant of the original model")
    return tensor


def _writable_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant-node tensors, of the graph and its subgraphs, by the value name they define."""
    tensors = {}
    for each in all_graphs(graph):
        tensors.update((t.name, t) for t in each.initializer)
        for node in each.node:
            if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
                tensors[node.output[0]] = node.attribute[0].t
    return tensors


def _constant_of_shape_tensor(
    graph: onnx.GraphProto, tensors: dict[str, onnx.TensorProto], name: str
) -> onnx.TensorProto | None:
    """Replace the ConstantOfShape node producing `name` (in any graph) by a Constant node of the same
    value in the same place (so it can hold any values), and return that Constant's tensor; None if absent."""
    found = next(((each, i) for each in all_graphs(graph) for i, n in enumerate(each.node)
                  if n.op_type == "ConstantOfShape" and n.output[0] == name), None)
    if found is None:
        return None
    graph, index = found
    node = graph.node[index]
    value = constant_of_shape_value(node, numpy_helper.to_array(tensors[node.input[0]]))
    constant = helper.make_node("Constant", [], [name], name=node.name, value=numpy_helper.from_array(value, name))
    graph.node[index].CopyFrom(constant)
    return graph.node[index].attribute[0].t
