"""Converters for ops steered by integer inputs (shape, pads, split sizes, slice bounds) that may be
constant or computed: Reshape with allowzero, Pad with optional axes and every mode, Split-18 with
num_outputs, Slice with constant bounds, Squeeze, Unsqueeze, Gather and Expand with constant axes,
indices and shapes held on the host; Flatten at any rank; and Size."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from onnx2torch.node_converters.slice import OnnxSlice
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..padding import torch_pad
from ..registry import register
from .common import constant_ints, converted, is_constant_or_absent, node_mapping


class Reshape(nn.Module):
    """Reshape to a fixed or computed shape; 0 copies the input's size unless `allowzero`."""

    def __init__(self, shape: tuple[int, ...] | None, allowzero: bool):
        super().__init__()
        self.shape, self.allowzero = shape, allowzero

    def forward(self, x: torch.Tensor, shape: torch.Tensor | None = None) -> torch.Tensor:
        target = self.shape if self.shape is not None else tuple(shape.tolist())
        if not self.allowzero:
            target = tuple(x.shape[i] if size == 0 else size for i, size in enumerate(target))
        return torch.reshape(x, target)


@register("Reshape", (5, 13, 14, 19, 21, 23, 24, 25))
def _reshape(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Reshape honouring allowzero (the dynamo exporter sets it), shape constant or computed."""
    static = is_constant_or_absent(node, graph, 1)
    module = Reshape(constant_ints(node, graph, 1) if static else None, bool(node.attributes.get("allowzero", 0)))
    return converted(module, node_mapping(node, node.input_values[: 1 if static else 2]))


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


class Pad(nn.Module):
    """ONNX Pad with optional axes; pads, value and axes are fixed when constant, else read per call."""

    def __init__(self, mode: str, pads: tuple[int, ...] | None, value: float | None, axes: tuple[int, ...] | None):
        super().__init__()
        self.mode, self.pads, self.value, self.axes = mode, pads, value, axes

    def forward(
        self,
        x: torch.Tensor,
        pads: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        axes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        flat = self.pads if self.pads is not None else tuple(pads.tolist())
        chosen = self.axes if self.axes is not None else tuple(axes.tolist()) if axes is not None else range(x.dim())
        per_axis = [(0, 0)] * x.dim()
        for i, axis in enumerate(chosen):
            per_axis[axis % x.dim()] = (flat[i], flat[i + len(flat) // 2])
        first = next((i for i, p in enumerate(per_axis) if p != (0, 0)), x.dim())
        if self.mode != "constant":
            return F.pad(x, torch_pad(per_axis[first:]), mode=self.mode)
        fill = self.value if self.value is not None else value.item() if value is not None else 0.0
        return F.pad(x, torch_pad(per_axis[first:]), value=fill)


@register("Pad", (11, 13, 18, 19, 21, 23, 24, 25))
def _pad(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Pad with pads, value and axes as constant or computed inputs (axes from Pad-18, wrap from Pad-19)."""
    mode = node.attributes.get("mode", "constant")
    if mode not in _PAD_MODES:
        raise NotImplementedError(f"Pad mode {mode!r}")
    inputs = list(node.input_values) + [""] * (4 - len(node.input_values))
    static = [is_constant_or_absent(node, graph, i) for i in range(4)]
    value = None
    if inputs[2] and static[2]:
        value = float(graph.initializers[inputs[2]].to_torch().reshape(-1)[0])
    module = Pad(
        _PAD_MODES[mode],
        constant_ints(node, graph, 1) if static[1] else None,
        value,
        constant_ints(node, graph, 3) if static[3] else None,
    )
    dynamic = [name if name and not fixed else "" for name, fixed in zip(inputs, static)]
    return converted(module, node_mapping(node, [inputs[0], *dynamic[1:]]))


class Split(nn.Module):
    """Split into given sizes, or `num_outputs` parts with the last one smaller (Split-18)."""

    def __init__(self, axis: int, sizes: tuple[int, ...] | None, parts: int):
        super().__init__()
        self.axis, self.sizes, self.parts = axis, sizes, parts

    def forward(self, x: torch.Tensor, sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        split = self.sizes or (tuple(sizes.tolist()) if sizes is not None else math.ceil(x.shape[self.axis] / self.parts))
        return torch.split(x, split, dim=self.axis)


@register("Split", (18,))
def _split(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Split-18: given sizes, or num_outputs parts with a smaller last one."""
    static = is_constant_or_absent(node, graph, 1)
    parts = node.attributes.get("num_outputs", len(node.output_values))
    module = Split(node.attributes.get("axis", 0), constant_ints(node, graph, 1) if static else None, parts)
    return converted(module, node_mapping(node, node.input_values[: 1 if static else 2], len(node.output_values)))


class Slice(nn.Module):
    """ONNX Slice with constant starts, ends, axes and positive steps, as one indexing of the input:
    Python slices clamp bounds to each axis and count negative ones from its end, as ONNX does for
    positive steps. onnx2torch's Slice reads its bound tensors on the host at every call (on a GPU,
    a synchronisation each)."""

    def __init__(self, starts: tuple[int, ...], ends: tuple[int, ...], axes: tuple[int, ...] | None,
                 steps: tuple[int, ...] | None):
        super().__init__()
        self.bounds = tuple(zip(starts, ends, axes or range(len(starts)), steps or (1,) * len(starts), strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = [slice(None)] * x.dim()
        for start, end, axis, step in self.bounds:
            index[axis % x.dim()] = slice(start, end, step)
        return x[tuple(index)]


@register("Slice", (10, 11, 13))
def _slice(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Slice with constant bounds and positive steps as fixed indexing; computed bounds or negative
    steps (a reversal) through onnx2torch's module, which reads them per call."""
    if all(is_constant_or_absent(node, graph, i) for i in range(1, 5)):
        starts, ends, axes, steps = (constant_ints(node, graph, i) for i in range(1, 5))
        if min(steps or (1,)) > 0:
            return converted(Slice(starts, ends, axes, steps), node_mapping(node, node.input_values[:1]))
    return converted(OnnxSlice(), node_mapping(node))


class Flatten(nn.Module):
    """ONNX Flatten: the axes before `axis` into one, the rest into another, for an input of any rank
    (onnx2torch's fails on one of rank below 2, which the TorchScript exporter writes for a tensor
    indexed by two index tensors, as transformers builds its padding mask)."""

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axis = self.axis % x.dim() if self.axis < 0 else self.axis
        return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


@register("Flatten", (1, 9, 11, 13))
def _flatten(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Flatten at its axis (1 unless given; negative counts from the end)."""
    return converted(Flatten(int(node.attributes.get("axis", 1))), node_mapping(node))


class Size(nn.Module):
    """ONNX Size: the number of elements of the input, as an int64 scalar on its device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(x.numel(), dtype=torch.int64, device=x.device)


@register("Size", (1, 13, 19, 21, 23, 24, 25))
def _size(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Size, which onnx2torch lacks (voice-activity models compare it to pick an LSTM's state)."""
    return converted(Size(), node_mapping(node))


class Squeeze(nn.Module):
    """Squeeze the given axes (fixed when constant, else read per call), or every axis of size 1."""

    def __init__(self, axes: tuple[int, ...] | None):
        super().__init__()
        self.axes = axes

    def forward(self, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
        dims = self.axes if self.axes is not None else tuple(axes.tolist()) if axes is not None else None
        return torch.squeeze(x) if dims is None else torch.squeeze(x, tuple(d % x.dim() for d in dims))


class Unsqueeze(nn.Module):
    """Insert axes of size 1 at the given positions of the output (fixed when constant, else read per
    call), negative ones counted from the output's end, as ONNX defines them."""

    def __init__(self, axes: tuple[int, ...] | None):
        super().__init__()
        self.axes = axes

    def forward(self, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
        dims = self.axes if self.axes is not None else tuple(axes.tolist())
        rank = x.dim() + len(dims)
        for dim in sorted(d % rank for d in dims):
            x = x.unsqueeze(dim)
        return x


@register("Squeeze", (1, 11, 13, 21, 23, 24, 25))
@register("Unsqueeze", (1, 11, 13, 21, 23, 24, 25))
def _squeeze(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Squeeze and Unsqueeze with axes as an attribute (before opset 13) or an input, held as Python
    integers where constant, so the module reads no tensor for them (onnx2torch read Squeeze-13's
    axes from a tensor on the model's device at every call, a GPU synchronisation each, and placed
    several negative Unsqueeze axes wrongly)."""
    static = is_constant_or_absent(node, graph, 1)
    attribute = node.attributes.get("axes")
    axes = tuple(attribute) if attribute is not None else constant_ints(node, graph, 1) if static else None
    module = (Squeeze if node.operation_type == "Squeeze" else Unsqueeze)(axes)
    return converted(module, node_mapping(node, node.input_values[: 1 if static else 2]))


class Gather(nn.Module):
    """ONNX Gather (numpy.take along `axis`, negative indices counted from the end): a constant scalar
    index selects with a Python integer; any other index (a constant array, or computed) is read on the
    device it lives on, never by the host (onnx2torch indexed with it, which reads a 0-d index: a GPU
    synchronisation at every call of a transformer's q/k/v split)."""

    def __init__(self, axis: int, index: int | None):
        super().__init__()
        self.axis, self.index = axis, index

    def forward(self, x: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        if indices is None:
            return x.select(self.axis, self.index)
        axis = self.axis % x.dim()
        flat = indices.reshape(-1).long()
        flat = torch.where(flat < 0, flat + x.shape[axis], flat)
        taken = torch.index_select(x, axis, flat)
        return taken.reshape(*x.shape[:axis], *indices.shape, *x.shape[axis + 1:])


@register("Gather", (1, 11, 13))
def _gather(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Gather with its index a Python integer where it is a constant scalar, else an input."""
    name = node.input_values[1]
    scalar = name in graph.initializers and graph.initializers[name].to_torch().dim() == 0
    index = int(graph.initializers[name].to_torch()) if scalar else None
    module = Gather(node.attributes.get("axis", 0), index)
    return converted(module, node_mapping(node, node.input_values[:1] if scalar else None))


class Expand(nn.Module):
    """ONNX Expand: the input broadcast with a shape (fixed when constant, else read per call; a
    shape computed from `Shape` is on the host: see host_shapes), as a view, without onnx2torch's
    multiplication by a tensor of ones."""

    def __init__(self, shape: tuple[int, ...] | None):
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor, shape: torch.Tensor | None = None) -> torch.Tensor:
        target = self.shape if self.shape is not None else tuple(int(size) for size in shape.tolist())
        return torch.broadcast_to(x, torch.broadcast_shapes(x.shape, target))


@register("Expand", (8, 13))
def _expand(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Expand with its shape a tuple of Python integers where constant, else an input."""
    static = is_constant_or_absent(node, graph, 1)
    module = Expand(constant_ints(node, graph, 1) if static else None)
    return converted(module, node_mapping(node, node.input_values[: 1 if static else 2]))
