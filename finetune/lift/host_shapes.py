"""Shape arithmetic kept on the host. A graph that computes a Reshape's target from `Shape` (a
transformer's batch and head sizes) would, on a GPU, copy each shape to the device and read each
target back: a synchronisation per op, 18 per training step of the digits transformer. Where a
`Shape` output only flows through integer arithmetic into the shape inputs of Reshape, Slice, Pad
and Expand, that whole region runs on the CPU: its Shape returns a CPU tensor and each of its ops
holds the constants it reads as CPU tensors of its own (plain attributes, which moving the model
leaves where they are): integer ones even where device ops read them too (exporters share a Slice's
0 and 1), float ones only where the region alone reads them (a float initializer may be a weight
tuning trains). On the CPU nothing changes; a region that reaches anything else stays on the device,
as before."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import onnx
import torch
from onnx2torch.node_converters.shape import OnnxShape
from torch import nn

# Integer (and shape-derived float) arithmetic that runs on a region's CPU tensors as it would on the device.
HOST_OPS = frozenset({"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Reshape", "Mul", "Add", "Sub", "Div",
                      "Mod", "Cast", "Floor", "Ceil", "Neg", "Abs", "Min", "Max", "Identity", "ReduceProd"})
# The inputs of the ops that read a tensor's values on the host anyway (our converters call tolist()).
HOST_READS = {"Reshape": {1}, "Slice": {1, 2, 3, 4}, "Pad": {1, 2, 3}, "Expand": {1}}
INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


@dataclass(frozen=True)
class HostShapes:
    """The nodes whose outputs live on the host (by node name) and the initializers they alone read."""

    nodes: frozenset[str]
    constants: frozenset[str]


def host_shapes(graph: onnx.GraphProto) -> HostShapes:
    """The host regions of a graph: grown from each Shape through HOST_OPS, then shrunk until every
    reader of a region value is a region node or a HOST_READS input, no graph output comes from it,
    and every initializer a region node reads is read by region nodes alone."""
    view = _GraphView(graph)
    region = view.grow(set(view.nodes))
    while True:
        constants = {name for name in view.initializers if view.readers[name] and (
            name in view.integers and any(reader.name in region for reader, _ in view.readers[name])
            or all(reader.name in region for reader, _ in view.readers[name]))}
        kept = view.grow({name for name in region if view.safe(view.nodes[name], region, constants)})
        if kept == region:
            return HostShapes(frozenset(region), frozenset(constants))
        region = kept


class _GraphView:
    """Who produces and who reads each value of an ONNX graph."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.nodes = {node.name: node for node in graph.node}
        self.order = [node.name for node in graph.node]  # topological
        self.producer = {output: node.name for node in graph.node for output in node.output}
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in graph.node:
            for position, name in enumerate(node.input):
                self.readers[name].append((node, position))
        self.initializers = {i.name for i in graph.initializer}
        self.integers = {i.name for i in graph.initializer if i.data_type in INTEGER_TYPES}  # never a trained weight
        self.outputs = {o.name for o in graph.output}

    def grow(self, allowed: set[str]) -> set[str]:
        """The allowed nodes that are a Shape, or of HOST_OPS with every input from the region so far
        or an initializer (constant arithmetic that folding left joins the region it feeds)."""
        region: set[str] = set()
        for name in self.order:
            node = self.nodes[name]
            if name in allowed and (node.op_type == "Shape" or (node.op_type in HOST_OPS and self._fed(node, region))):
                region.add(name)
        return region

    def _fed(self, node: onnx.NodeProto, region: set[str]) -> bool:
        """Whether each input of the node comes from the region or is an initializer."""
        return any(node.input) and all(
            not value or self.producer.get(value) in region or value in self.initializers for value in node.input)

    def safe(self, node: onnx.NodeProto, region: set[str], constants: set[str]) -> bool:
        """Whether a region node may run on the host: the initializers it reads are host constants,
        and its outputs reach only region nodes or host-read inputs, never a graph output."""
        if any(value in self.initializers and value not in constants for value in node.input):
            return False
        return all(output not in self.outputs and all(
            reader.name in region or position in HOST_READS.get(reader.op_type, ())
            for reader, position in self.readers[output]) for output in node.output)


class HostShape(OnnxShape):
    """ONNX Shape whose result is a CPU tensor, for a host region (see host_shapes)."""

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        return torch.tensor(input_tensor.shape[self._start: self._end], dtype=torch.int64)

    @classmethod
    def of(cls, shape: OnnxShape) -> HostShape:
        """The host form of onnx2torch's Shape module."""
        return cls(shape._start, shape._end)


class HostOp(nn.Module):
    """An op of a host region with its constant inputs fixed as CPU tensors (plain attributes, not
    buffers, so moving the model leaves them on the CPU); the graph passes the other inputs."""

    def __init__(self, op: nn.Module, constants: dict[int, torch.Tensor]):
        super().__init__()
        self.op = op
        self.constants = sorted(constants.items())  # (input position, value)

    def forward(self, *args: torch.Tensor | None) -> torch.Tensor:
        inputs = list(args)
        for position, value in self.constants:
            inputs.insert(position, value)
        return self.op(*inputs)
