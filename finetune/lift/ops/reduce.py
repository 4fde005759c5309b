"""Reduce* converters for the versions that take their axes as an input (ReduceSum-13, every
Reduce*-18), with the axes constant, computed or omitted; and CumSum with ONNX's defaults."""

from __future__ import annotations

from collections.abc import Callable

import torch
from onnx2torch.node_converters.cumsum import OnnxCumSum
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..registry import register
from .common import constant_ints, converted, is_constant_or_absent, node_mapping


def _prod(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    """Product over several axes (torch.prod takes one at a time)."""
    for dim in dims:
        x = torch.prod(x, dim, keepdim=True)
    return x if keepdim else x.squeeze(dims)


_REDUCTIONS: dict[str, Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]] = {
    "ReduceSum": lambda x, d, k: torch.sum(x, d, keepdim=k),
    "ReduceMean": lambda x, d, k: torch.mean(x, d, keepdim=k),
    "ReduceMax": lambda x, d, k: torch.amax(x, d, keepdim=k),
    "ReduceMin": lambda x, d, k: torch.amin(x, d, keepdim=k),
    "ReduceProd": _prod,
    "ReduceL1": lambda x, d, k: torch.sum(x.abs(), d, keepdim=k),
    "ReduceL2": lambda x, d, k: torch.sqrt(torch.sum(x * x, d, keepdim=k)),
    "ReduceLogSum": lambda x, d, k: torch.log(torch.sum(x, d, keepdim=k)),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
    "ReduceSumSquare": lambda x, d, k: torch.sum(x * x, d, keepdim=k),
}


class Reduce(nn.Module):
    """A Reduce* op whose axes come as an input (ReduceSum-13, every Reduce*-18)."""

    def __init__(self, op_type: str, axes: tuple[int, ...] | None, keepdims: bool, noop_with_empty_axes: bool):
        super().__init__()
        self.op_type, self.axes, self.keepdims, self.noop = op_type, axes, keepdims, noop_with_empty_axes

    def forward(self, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
        dims = self.axes if self.axes is not None else tuple(axes.tolist()) if axes is not None else ()
        if not dims and self.noop:  # each element reduced alone, as onnxruntime does: ReduceL2 is sqrt(x * x), not x
            return _REDUCTIONS[self.op_type](x.unsqueeze(0), (0,), False)
        if not dims:
            dims = tuple(range(x.dim()))
        return _REDUCTIONS[self.op_type](x, tuple(sorted(d % x.dim() for d in dims)), self.keepdims)


@register("ReduceSum", (13,))
@register("ReduceMax", (18, 20))
@register("ReduceMin", (18, 20))
@register("ReduceMean", (18,))
@register("ReduceProd", (18,))
@register("ReduceL1", (18,))
@register("ReduceL2", (18,))
@register("ReduceLogSum", (18,))
@register("ReduceLogSumExp", (18,))
@register("ReduceSumSquare", (18,))
def _reduce(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Reductions with axes as an (optional) input, constant or computed."""
    static = is_constant_or_absent(node, graph, 1)
    axes = (constant_ints(node, graph, 1) or ()) if static else None
    a = node.attributes
    module = Reduce(node.operation_type, axes, bool(a.get("keepdims", 1)), bool(a.get("noop_with_empty_axes", 0)))
    return converted(module, node_mapping(node, node.input_values[: 1 if static else 2]))


@register("CumSum", (11, 14))
def _cumsum(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """CumSum with exclusive and reverse off unless set, as ONNX defaults them: onnx2torch defaults
    reverse to on, so the plain cumulative sum TorchScript writes (no attributes) came out reversed."""
    a = node.attributes
    return converted(OnnxCumSum(bool(a.get("exclusive", 0)), bool(a.get("reverse", 0))), node_mapping(node))
