"""BatchNormalization folded into the Conv or Gemm before it, as deployment toolchains do before
quantizing (AMD Quark's FoldBatchNorm, on by default; onnxruntime's graph optimisations): the layer's
weight is scaled per output channel by k = scale / sqrt(var + eps) and its bias becomes
(bias - mean) * k + B. The quantized layer then holds the weights the deployed one runs, with a bias
to correct, and one activation quantizer fewer sits between the two.

The float function changes only by float rounding (the factors are computed in float64 and stored in
the weight's type). A BatchNormalization is left as it is where folding would change anything else:
its input is read elsewhere or is a graph output, a parameter is not an initializer, the layer's
weight or bias is shared, or it is in training mode."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from finetune.notices import Notice

from .domains import DEFAULT_DOMAINS
from .fold import drop_unused_initializers
from .graphs import all_nodes, node_reads, unique_name
from .normalize import infer_shapes, keep_only

logger = logging.getLogger(__name__)

FOLDED_INTO = ("Conv", "Gemm")
FOLD_CHANGE = "fold_batch_norm:"  # how the list of changes starts its entry, which the quantizer's checks read


def fold_batch_norms(model: onnx.ModelProto, notices: list[Notice] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of a normalised, constant-folded float `model` with every foldable BatchNormalization of
    its main graph folded into the Conv or Gemm before it, and what changed; the input is never
    modified (a model without BatchNormalization is handed back as it is: no copy of its weights).
    Subgraph bodies are left as they are."""
    if not any(node.op_type == "BatchNormalization" for node in model.graph.node):
        return model, []
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    readers = Counter(name for node in all_nodes(graph) for name in node_reads(node))
    outputs = {o.name for o in graph.output}
    taken = {name for node in all_nodes(graph) for name in (*node.input, *node.output)} | set(initializers)
    folded = [bn for bn in list(graph.node) if _fold(bn, producers, initializers, readers, outputs, taken)]
    stored = {t.name for t in graph.initializer}
    graph.initializer.extend(tensor for name, tensor in initializers.items() if name not in stored)  # biases added
    if not folded:
        return result, []
    removed = {id(bn) for bn in folded}
    keep_only(graph.node, lambda node: id(node) not in removed)
    changes = [f"{FOLD_CHANGE} {len(folded)} BatchNormalization node(s) folded into the Conv/Gemm before them",
               *drop_unused_initializers(result)]
    for change in changes:
        logger.info(change)
    return result, [*changes, *infer_shapes(result, notices)]


def _fold(bn: onnx.NodeProto, producers: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto],
          readers: Counter[str], outputs: set[str], taken: set[str]) -> bool:
    """Fold `bn` into its producer in place (the producer then writes bn's output) where nothing
    else changes; whether it did."""
    if bn.op_type != "BatchNormalization" or bn.domain not in DEFAULT_DOMAINS or len([o for o in bn.output if o]) != 1:
        return False
    layer = producers.get(bn.input[0])
    if layer is None or layer.op_type not in FOLDED_INTO or layer.domain not in DEFAULT_DOMAINS:
        return False
    if readers.get(bn.input[0], 0) != 1 or bn.input[0] in outputs or any(a.name == "training_mode" and a.i for a in bn.attribute):
        return False
    if len(bn.input) < 5 or not all(name in initializers for name in bn.input[1:5]):
        return False
    parameters = [name for name in layer.input[1:3] if name]
    if not parameters or not all(name in initializers and readers.get(name, 0) == 1 for name in parameters):
        return False
    factors = _factors(bn, initializers)
    if factors is None or not _scale_layer(layer, factors, initializers, taken):
        return False
    layer.output[0] = bn.output[0]
    return True


def _factors(bn: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> tuple[np.ndarray, np.ndarray] | None:
    """k = scale / sqrt(var + eps) and the shift B - mean * k, per channel, in float64."""
    scale, shift, mean, var = (numpy_helper.to_array(initializers[name]).astype(np.float64) for name in bn.input[1:5])
    if not scale.ndim == shift.ndim == mean.ndim == var.ndim == 1:
        return None
    epsilon = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
    k = scale / np.sqrt(var + np.float64(epsilon))
    return k, shift - mean * k


def _scale_layer(layer: onnx.NodeProto, factors: tuple[np.ndarray, np.ndarray], initializers: dict[str, onnx.TensorProto],
                 taken: set[str]) -> bool:
    """Scale the layer's weight by k per output channel and set its bias to bias * k + shift (a bias is
    added where it had none); whether the shapes allowed it."""
    k, shift = factors
    weight = initializers[layer.input[1]]
    w = numpy_helper.to_array(weight)
    if not np.issubdtype(w.dtype, np.floating):
        return False
    if layer.op_type == "Conv":
        axis = 0
    else:  # Gemm: Y = alpha * A @ op(B) + beta * C, output features along B's rows when transB
        attributes = {a.name: helper.get_attribute_value(a) for a in layer.attribute}
        axis = 0 if attributes.get("transB", 0) else 1
        if w.ndim != 2 or attributes.get("beta", 1.0) != 1.0:
            return False
    if w.ndim < 2 or w.shape[axis] != k.size:
        return False
    bias = numpy_helper.to_array(initializers[layer.input[2]]) if len(layer.input) > 2 and layer.input[2] else None
    if bias is not None and bias.shape != k.shape:
        return False
    shape = [1] * w.ndim
    shape[axis] = k.size
    weight.CopyFrom(numpy_helper.from_array((w.astype(np.float64) * k.reshape(shape)).astype(w.dtype), weight.name))
    new_bias = (shift if bias is None else bias.astype(np.float64) * k + shift).astype(w.dtype)
    if bias is None:
        while len(layer.input) < 3:
            layer.input.append("")
        layer.input[2] = unique_name(f"{layer.input[1]}_folded_bias", taken)
        initializers[layer.input[2]] = onnx.TensorProto()  # added to the graph by fold_batch_norms
    initializers[layer.input[2]].CopyFrom(numpy_helper.from_array(new_bias, layer.input[2]))
    return True
