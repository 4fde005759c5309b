"""Pooling converters: MaxPool / AveragePool of any spatial rank with auto_pad and asymmetric pads
resolved per call, and GlobalMaxPool, which onnx2torch lacks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..padding import SpatialPadding, is_symmetric, torch_pad, window_extents
from ..registry import register
from .common import converted, node_mapping, require_unused_outputs

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


class Pool(nn.Module):
    """ONNX MaxPool / AveragePool with pads resolved per call; asymmetric pads are applied
    explicitly (-inf for max; for average, the divisor counts only real elements unless
    count_include_pad)."""

    def __init__(
        self,
        kind: str,
        kernel: list[int],
        strides: list[int],
        dilations: list[int],
        padding: SpatialPadding,
        ceil_mode: bool,
        count_include_pad: bool,
    ):
        super().__init__()
        self.kind, self.kernel, self.strides, self.dilations = kind, kernel, strides, dilations
        self.padding, self.ceil_mode, self.count_include_pad = padding, ceil_mode, count_include_pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extents = window_extents(self.kernel, self.dilations)
        pads = self.padding.resolve(x.shape[2:], extents, self.strides)
        if is_symmetric(pads) and all(begin <= e // 2 for (begin, _), e in zip(pads, extents)):
            return self._pool(x, [begin for begin, _ in pads], self.count_include_pad)
        if self.kind == "max":
            return self._pool(F.pad(x, torch_pad(pads), value=float("-inf")), 0, False)
        averaged = self._pool(F.pad(x, torch_pad(pads)), 0, True)
        if self.count_include_pad:
            return averaged
        return averaged / self._pool(F.pad(torch.ones_like(x[:1, :1]), torch_pad(pads)), 0, True)

    def _pool(self, x: torch.Tensor, padding: list[int] | int, count_include_pad: bool) -> torch.Tensor:
        """torch's pooling of this node's kind with the given symmetric padding."""
        if self.kind == "max":
            return _MAX_POOL[len(self.kernel)](x, self.kernel, self.strides, padding, self.dilations, self.ceil_mode)
        return _AVG_POOL[len(self.kernel)](x, self.kernel, self.strides, padding, self.ceil_mode, count_include_pad)


@register("MaxPool", (8, 10, 11, 12, 22))
@register("AveragePool", (7, 10, 11, 19, 22))
def _pool(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """MaxPool / AveragePool of any spatial rank, auto_pad and asymmetric pads included."""
    a = node.attributes
    kernel = list(a["kernel_shape"])
    rank = len(kernel)
    dilations = list(a.get("dilations", [1] * rank))
    kind = "max" if node.operation_type == "MaxPool" else "average"
    if a.get("storage_order", 0) != 0:
        raise NotImplementedError("storage_order=1 (column-major indices)")
    if kind == "average" and any(d != 1 for d in dilations):
        raise NotImplementedError("dilated AveragePool (torch has no dilated average pooling)")
    require_unused_outputs(node, graph)
    module = Pool(
        kind, kernel, list(a.get("strides", [1] * rank)), dilations,
        SpatialPadding.from_attributes(a), bool(a.get("ceil_mode", 0)), bool(a.get("count_include_pad", 0)),
    )
    return converted(module, node_mapping(node))


class GlobalMaxPool(nn.Module):
    """Maximum over every spatial axis, kept as size-1 axes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.amax(x, dim=tuple(range(2, x.dim())), keepdim=True)


@register("GlobalMaxPool", (1, 22))
def _global_max_pool(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """GlobalMaxPool, which onnx2torch lacks."""
    return converted(GlobalMaxPool(), node_mapping(node))
