"""Insertion of the planned quantize-dequantize nodes: one chain per distinct (tensor, formats),
shared by the consumers that read it, placed before its first consumer; compact storage keeps
weights as their codes."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper

from finetune.formats import FormatSpec, codes_array
from finetune.onnx.dtypes import numpy_dtype
from finetune.onnx.fold import drop_unused_initializers
from finetune.onnx.graphs import all_graphs, graph_reads
from finetune.onnx.io import copy_without_initializers
from finetune.onnx.qdq import make_qdq, uses_standard_ops

from .calibrate import QParams
from .plan import Use, tensor_types_and_ranks
from .summary import format_label


def insert_qdq(model: onnx.ModelProto, uses: list[Use], qparams: QParams, weight_storage: str) -> onnx.ModelProto:
    """A copy with one quantize-dequantize per distinct (tensor, format chain), each consumer
    rewired to the one of its format; compact weight storage keeps codes + DequantizeLinear where
    standard (int32 biases always); float16 tensors are quantized in float32 between Casts
    (FORMATS.md). Only the initializers the copy still reads are copied (weights stored as codes
    are not: on a large model, no second copy of the weights)."""
    result = copy_without_initializers(model)
    types, _ = tensor_types_and_ranks(model)
    half = {name for name, elem_type in types.items() if elem_type == onnx.TensorProto.FLOAT16}
    inserter = _Inserter(result.graph, {t.name: t for t in model.graph.initializer}, qparams, weight_storage != "float", half)
    for use in uses:
        inserter.rewire(use)
    inserter.finish()
    added = list(result.graph.initializer)  # the quantizers' scales, zero points and codes: after the model's own
    read = graph_reads(result.graph)
    del result.graph.initializer[:]
    result.graph.initializer.extend(tensor for tensor in model.graph.initializer if tensor.name in read)
    result.graph.initializer.extend(added)
    drop_unused_initializers(result)
    return result


class _Inserter:
    """Adds the QDQ chains to a graph and its subgraphs: each created once per graph that reads
    it, placed before its first consumer there; new initializers go to the main graph, which
    every subgraph sees. `weights`: the main graph's initializers, read where the graph has none."""

    def __init__(
        self, graph: onnx.GraphProto, weights: dict[str, onnx.TensorProto], qparams: QParams, compact: bool, half: set[str],
    ) -> None:
        self.graph, self.qparams, self.compact, self.half = graph, qparams, compact, half
        self.graphs = list(all_graphs(graph))
        self.owner = {n.name: index for index, each in enumerate(self.graphs) for n in each.node}
        self.nodes = {n.name: n for each in self.graphs for n in each.node}
        self.initializers = {**weights, **{t.name: t for each in self.graphs for t in each.initializer}}
        self.outputs: dict[tuple, str] = {}
        self.added: dict[str, list[onnx.NodeProto]] = defaultdict(list)

    def rewire(self, use: Use) -> None:
        """Point the use's node input at the output of its (possibly dual) QDQ chain."""
        source = use.tensor if use.before is None else self._ensure(use.before, use.tensor, use.node, False)
        # a constant int32 bias is always its codes + a standard DequantizeLinear: no Quantize node, and
        # a model a QDQ toolchain (an NPU compiler) takes; its dequantized values are those of the pair
        compact = (self.compact or use.choice == "int32") and use.tensor in self.initializers
        self.nodes[use.node].input[use.index] = self._ensure(use, source, use.node, compact)

    def finish(self) -> None:
        """Insert the new nodes before their consumers and drop initializers nothing reads."""
        for graph in reversed(self.graphs):  # innermost first: rebuilding a graph's nodes copies its subgraphs
            ordered = []
            for node in graph.node:
                ordered.extend(self.added.get(node.name, []))
                ordered.append(node)
            del graph.node[:]
            graph.node.extend(ordered)

    def _ensure(self, use: Use, source: str, consumer: str, compact: bool) -> str:
        """The output of `use`'s quantize-dequantize of `source` in the consumer's graph, created on first need."""
        key = (self.owner[consumer], use.key)
        if key in self.outputs:
            return self.outputs[key]
        name = self._unique(f"{use.tensor}_{format_label(use.spec)}")
        output = self.outputs[key] = f"{name}_qdq"
        new = self.added[consumer]
        if use.tensor in self.half:
            source = self._cast(new, source, f"{name}_float", onnx.TensorProto.FLOAT)
            output = f"{name}_qdq_float"
        new.extend(self._qdq_nodes(use, source, name, output, compact))
        if use.tensor in self.half:
            self._cast(new, output, self.outputs[key], onnx.TensorProto.FLOAT16)
        return self.outputs[key]

    @staticmethod
    def _cast(new: list[onnx.NodeProto], source: str, output: str, to: int) -> str:
        new.append(onnx.helper.make_node("Cast", [source], [output], name=f"{output}_cast", to=to))
        return output

    def _qdq_nodes(self, use: Use, source: str, name: str, output: str, compact: bool) -> list[onnx.NodeProto]:
        """The Q/DQ nodes of one (tensor, format); their initializers are appended to the graph."""
        scale, zero_point = self.qparams.get((use.tensor, use.spec), (None, None))
        qdq = make_qdq(source, output, use.spec, name, scale, zero_point)
        if compact and has_compact_form(use):
            codes = _stored_codes(self.initializers[use.tensor], use.spec, scale, zero_point, f"{name}_stored")
            self.graph.initializer.append(codes)
            dequantize = qdq.nodes[-1]
            dequantize.input[0] = codes.name
            if dequantize.domain:  # an int32 bias: DequantizeLinear reads int32 codes natively
                dequantize.domain, dequantize.op_type = "", "DequantizeLinear"
            qdq.nodes = [dequantize]
        self.graph.initializer.extend(qdq.initializers)
        return qdq.nodes

    def _unique(self, base: str) -> str:
        """A name prefix no initializer or earlier QDQ uses."""
        used = set(self.initializers) | {output[: -len("_qdq")] for output in self.outputs.values()}
        name, k = base, 1
        while name in used:
            k += 1
            name = f"{base}_{k}"
        return name


def has_compact_form(use: Use) -> bool:
    """Whether compact storage can keep this weight as codes read by a standard DequantizeLinear
    (INT, FP8, int32 biases); block formats and BF16/FP16 stay float (checks says so)."""
    return uses_standard_ops(use.spec) or use.choice == "int32"


def _stored_codes(tensor: onnx.TensorProto, spec: FormatSpec, scale: np.ndarray, zero_point: np.ndarray, name: str) -> onnx.TensorProto:
    """The codes QuantizeLinear would produce for a weight, as an initializer of the code type, read
    from the stored values (a view), not from a copy of them."""
    codes = codes_array(numpy_helper.to_array(tensor), spec, np.asarray(scale), np.asarray(zero_point), numpy_dtype(spec.dtype))
    return numpy_helper.from_array(codes, name)
