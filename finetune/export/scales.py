"""The scales and zero points of quantizers that tuning changed (learned scales: recon.methods.scales),
written into the QDQ graph's initializers in their own types, so onnxruntime quantizes with what
torch quantized with. An initializer other nodes read too is copied for the quantizer's nodes
first, so the others keep their values."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from finetune.formats import IntSpec
from finetune.lift import FakeQuantize, LiftedModule
from finetune.onnx.graphs import all_graphs

# Inputs of QuantizeLinear / DequantizeLinear holding the scale and the zero point, by buffer name.
PARAM_INPUTS = {"scale": 1, "zero_point": 2}


def write_quantizer_params(model: onnx.ModelProto, module: LiftedModule, tensors: dict[str, onnx.TensorProto]) -> None:
    """In place: each INT quantizer's scale and zero point, where they differ from the values its
    nodes read, into those nodes' initializers (`tensors`: the model's writable tensors by name)."""
    nodes = {node.name: node for graph in all_graphs(model.graph) for node in graph.node}
    readers = Counter(value for node in nodes.values() for value in node.input)
    for name, quantizer in module.named_modules():
        if not isinstance(quantizer, FakeQuantize) or not isinstance(quantizer.spec, IntSpec):
            continue
        owned = [nodes[source] for source in quantizer.source if source in nodes]
        for buffer, index in PARAM_INPUTS.items():
            value = getattr(quantizer, buffer).detach().cpu()
            stored = {node.input[index] for node in owned if len(node.input) > index and node.input[index]}
            for tensor_name in stored:
                if not _same(tensors[tensor_name], value):
                    _write(model, tensors, owned, index, tensor_name, value, readers, f"{name}.{buffer}")
            if not stored and buffer == "zero_point" and bool(value.any()):
                raise NotImplementedError(f"{name}: its learned zero point has no initializer to go to (its nodes take "
                                          "none); tune it with learn_scales: false")


def _same(tensor: onnx.TensorProto, value: torch.Tensor) -> bool:
    """Whether the tensor holds `value` (compared as float64)."""
    stored = numpy_helper.to_array(tensor).astype(np.float64).reshape(-1)
    return stored.shape == (value.numel(),) and bool(np.array_equal(stored, value.double().numpy().reshape(-1)))


def _write(model: onnx.ModelProto, tensors: dict[str, onnx.TensorProto], owned: list[onnx.NodeProto], index: int,
           tensor_name: str, value: torch.Tensor, readers: Counter[str], what: str) -> None:
    """Store `value` in the tensor's type and shape, after giving the quantizer's nodes their own
    copy if other nodes read it too; a value the type cannot hold exactly is an error."""
    tensor = tensors[tensor_name]
    mine = [node for node in owned if len(node.input) > index and node.input[index] == tensor_name]
    if readers[tensor_name] > len(mine):
        tensor = _own_copy(model, tensors, mine, index, tensor_name)
    array = value.double().numpy().reshape(tuple(tensor.dims)).astype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    if not np.array_equal(array.astype(np.float64), value.double().numpy().reshape(array.shape)):
        raise ValueError(f"{what}: the learned value is not exact in the type of {tensor_name!r} "
                         f"({onnx.TensorProto.DataType.Name(tensor.data_type)})")
    tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))


def _own_copy(model: onnx.ModelProto, tensors: dict[str, onnx.TensorProto], mine: list[onnx.NodeProto], index: int,
              tensor_name: str) -> onnx.TensorProto:
    """A new main-graph initializer copying `tensor_name`, which the quantizer's nodes now read instead."""
    names = set(tensors) | {value for graph in all_graphs(model.graph) for node in graph.node for value in node.output}
    new_name, k = f"{tensor_name}_learned", 1
    while new_name in names:
        k += 1
        new_name = f"{tensor_name}_learned_{k}"
    copy = onnx.TensorProto()
    copy.CopyFrom(tensors[tensor_name])
    copy.name = new_name
    model.graph.initializer.append(copy)
    tensors[new_name] = model.graph.initializer[-1]
    for node in mine:
        node.input[index] = new_name
    return tensors[new_name]
