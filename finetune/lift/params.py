"""Which initializers become trainable parameters (after folding the ops that compute a weight from
initializers), and how a parameter's value maps back to the initializer it came from (float values
as they are, integer or float8 codes through their dequantization)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import external_data_helper, helper, numpy_helper
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_tensor import OnnxTensor

from finetune.formats import FloatSpec, IntSpec, codes_array, dequantize_linear, quantize_dequantize
from finetune.formats.blocks import SLICE_ELEMENTS, quantizer_slices
from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.dtypes import TORCH_LACKS, to_torch, torch_dtype
from finetune.onnx.fold import fold_constants, foldable
from finetune.onnx.io import external_array, loaded_tensor
from finetune.onnx.layers import PARAMETER_INPUTS

from .qdq import is_quantizer


@dataclass(frozen=True, eq=False)
class Dequantize:
    """A parameter that holds dequantized codes: value = (codes - zero_point) * scale, and back
    (compared by identity: its tensors have no single truth value)."""

    data_type: int
    spec: IntSpec | FloatSpec
    scale: torch.Tensor
    zero_point: torch.Tensor

    def apply(self, codes: np.ndarray) -> torch.Tensor:
        """float32 values of the codes; the difference is exact in float64, as onnxruntime computes it
        (a piece at a time: the float64 temporaries are a piece's, not the tensor's)."""
        values = torch.empty(codes.shape, dtype=torch.float32)
        for part, piece, codes_piece in self._pieces(values, codes):
            piece.copy_(part._dequantized(codes_piece))
        return values

    def _dequantized(self, codes: np.ndarray) -> torch.Tensor:
        """apply's values of the codes, all at once."""
        block = self.spec.block_size if isinstance(self.spec, IntSpec) else None
        return dequantize_linear(torch.from_numpy(codes.astype(np.float64)), self.scale, self.zero_point, self.spec.axis, block)

    def encode(self, values: torch.Tensor) -> np.ndarray:
        """The codes QuantizeLinear gives for `values` (round half to even, saturated), in the ONNX type."""
        return codes_array(values.detach().cpu(), self.spec, self.scale, self.zero_point, helper.tensor_dtype_to_np_dtype(self.data_type))

    def stands_for(self, values: torch.Tensor, codes: np.ndarray) -> bool:
        """Whether a parameter holding float `values` in place of these codes' dequantization computes
        and writes back what they do: `values` encode to exactly `codes`, and quantize-dequantize to
        exactly the codes' dequantized values (lifting a model of codes into its float weights)."""
        if values.shape != codes.shape or values.dtype != torch.float32 or values.is_meta:
            return False
        with torch.no_grad():
            return all(np.array_equal(part.encode(piece), codes_piece)
                       and torch.equal(quantize_dequantize(piece, part.spec, part.scale, part.zero_point),
                                       part._dequantized(codes_piece))
                       for part, piece, codes_piece in self._pieces(values.detach().cpu(), codes))

    def _pieces(self, values: torch.Tensor, codes: np.ndarray) -> Iterator[tuple[Dequantize, torch.Tensor, np.ndarray]]:
        """The tensor and its codes cut into formats.blocks.quantizer_slices, each with this
        dequantization cut to it: checks and conversions then hold float64 temporaries of a slice
        (about 0.7 GiB for a 4096x4096 weight whole)."""
        slices = quantizer_slices(values.shape, self.spec.axis, (self.scale, self.zero_point))
        if len(slices) == 1:
            yield self, values, codes
            return
        for index, (scale, zero_point) in slices:
            yield dataclasses.replace(self, scale=scale, zero_point=zero_point), values[index], codes[index]


@dataclass(frozen=True)
class ParamSource:
    """Where a trainable parameter came from: the initializer (or Constant output) of the original
    model, the fake-quant module that quantizes it, the modules that use it, and the dequantization
    that relates its value to integer codes when the initializer stores codes."""

    initializer: str
    quantizer: str | None = None
    consumers: tuple[str, ...] = ()
    transform: Dequantize | None = None


def tensor_array(tensor: onnx.TensorProto, folder: Path | None = None) -> np.ndarray:
    """The value of a tensor proto as numpy (ml_dtypes for int4, bfloat16, float8), read from its
    external data file in `folder` where the model was loaded without it (onnx.io.external_array,
    else loaded_tensor)."""
    if folder is not None and external_data_helper.uses_external_data(tensor) and not tensor.HasField("raw_data"):
        array = external_array(tensor, folder)
        if array is not None:
            return array
    return numpy_helper.to_array(loaded_tensor(tensor, folder))


def shared_or_made(existing: torch.Tensor | None, array: np.ndarray) -> torch.Tensor:
    """`existing` (detached) where it holds bit for bit the tensor to_torch makes of `array`, else that
    tensor: the array is compared in place, a slice of bytes at a time, so a table both models hold
    (250 MiB for a decoder's embedding) is not copied only to be compared; widened types are compared
    once made."""
    made = to_torch(array) if array.dtype.name in TORCH_LACKS else None
    values, dtype = (array, torch_dtype(array.dtype.name)) if made is None else (made.numpy(), made.dtype)
    if _same_bytes(existing, values, dtype):
        return existing.detach()  # type: ignore[union-attr]  (_same_bytes checked it)
    return made if made is not None else to_torch(array)


def _same_bytes(existing: torch.Tensor | None, values: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether a contiguous CPU tensor of `dtype` and values' shape holds values' bytes, compared a slice at a time."""
    if existing is None or existing.device.type != "cpu" or existing.dtype != dtype or tuple(existing.shape) != values.shape \
            or not existing.is_contiguous():
        return False
    mine = existing.detach().reshape(-1).view(torch.uint8).numpy()
    theirs = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    return all(np.array_equal(mine[i : i + SLICE_ELEMENTS], theirs[i : i + SLICE_ELEMENTS]) for i in range(0, mine.size, SLICE_ELEMENTS))


class StoredTensor(OnnxTensor):
    """An initializer whose values are still in its external data file: its proto is the reference
    (name, type, shape), its values are read from `folder` each time a converter asks for them."""

    def __init__(self, proto: onnx.TensorProto, folder: Path) -> None:
        super().__init__(proto)
        self.folder = folder

    def to_numpy(self) -> np.ndarray:
        """The values, read from the data file."""
        return tensor_array(self.proto, self.folder).copy()


class FolderGraph(OnnxGraph):
    """onnx2torch's graph of a model loaded without its external data (or set aside): converters that
    read an initializer's values (OnnxTensor.to_numpy, to_torch) get them from `folder`."""

    def __init__(self, graph: onnx.GraphProto, folder: Path | None) -> None:
        super().__init__(graph)
        if folder is not None:
            for name, tensor in list(self._initializers.items()):
                if external_data_helper.uses_external_data(tensor.proto) and not tensor.proto.HasField("raw_data"):
                    self._initializers[name] = StoredTensor(tensor.proto, folder)


def trainable_initializers(graph: onnx.GraphProto) -> set[str]:
    """Initializers that feed a weight or bias input of Conv, ConvTranspose, Gemm, MatMul, LSTM or GRU,
    directly or through quantize-dequantize nodes, and the 1-D bias a lone Add puts after a
    MatMul (a Linear layer as exporters write it)."""
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for value in node.input:
            readers.setdefault(value, []).append(node)
    vectors = {t.name for t in graph.initializer if len(t.dims) == 1}
    initializers = {t.name for t in graph.initializer}
    found = {source for source in _weight_sources(graph, producers) if source in initializers}
    for node in graph.node:
        after = readers.get(node.output[0], []) if node.op_type == "MatMul" and node.domain in DEFAULT_DOMAINS else []
        if len(after) == 1 and after[0].op_type == "Add" and after[0].domain in DEFAULT_DOMAINS:
            found.update(value for value in after[0].input if value in vectors)
    return found


def fold_computed_weights(model: onnx.ModelProto) -> list[str]:
    """Fold the ops that compute a layer's weight or bias from initializers alone, ahead of its
    quantizers (Transpose(W), as some exporters write it), into initializers, in place, so lifting
    makes that weight trainable; returns the changes made (none when nothing computes a weight)."""
    computed = _computed_weights(model.graph)
    return fold_constants(model, only=computed) if computed else []


def _computed_weights(graph: onnx.GraphProto) -> set[str]:
    """Outputs of the nodes that compute a layer's weight or bias from initializers alone, ahead of
    its quantizers, when folding may replace them all."""
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {t.name for t in graph.initializer}
    found: set[str] = set()
    for source in _weight_sources(graph, producers):
        found |= _constant_producers(source, producers, initializers)
    return found


def _weight_sources(graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> Iterator[str]:
    """The value behind the quantizers of each weight or bias input of a Conv, ConvTranspose, Gemm, LSTM, GRU
    or MatMul."""
    for node in graph.node:
        if node.domain in DEFAULT_DOMAINS:
            for index in PARAMETER_INPUTS.get(node.op_type, ()):
                if index < len(node.input):
                    yield _behind_quantizers(node.input[index], producers)


def _constant_producers(value: str, producers: dict[str, onnx.NodeProto], initializers: set[str]) -> set[str]:
    """Outputs of the nodes computing `value` from initializers, or none when a graph input, a
    node folding may not replace or nothing at all (an initializer) is behind it."""
    outputs: set[str] = set()
    stack = [value]
    while stack:
        current = stack.pop()
        if current in initializers or current in outputs or not current:
            continue
        producer = producers.get(current)
        if producer is None or not foldable(producer):
            return set()
        outputs.update(producer.output)
        stack.extend(producer.input)
    return outputs


def _behind_quantizers(value: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The value that reaches `value` through quantize/dequantize nodes."""
    producer = producers.get(value)
    while producer is not None and is_quantizer(producer.domain, producer.op_type):
        value = producer.input[0]
        producer = producers.get(value)
    return value
