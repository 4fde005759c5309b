"""Weight-layer converters: Conv, ConvTranspose and Gemm take their weight and bias as inputs, so
a weight can be a trainable parameter behind a fake-quant module, and Conv / ConvTranspose
padding follows auto_pad and asymmetric pads as onnxruntime does (Conv-22 included)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from onnx2torch.node_converters.gemm import OnnxGemm
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..padding import SpatialPadding, is_symmetric, torch_pad, window_extents
from ..registry import register
from .common import converted, node_mapping

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class Conv(nn.Module):
    """ONNX Conv with weight and bias as inputs; pads resolved per call (auto_pad, asymmetric)."""

    def __init__(self, strides: list[int] | None, dilations: list[int] | None, groups: int, padding: SpatialPadding):
        super().__init__()
        self.strides, self.dilations, self.groups, self.padding = strides, dilations, groups, padding

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rank = weight.dim() - 2
        strides, dilations = self.strides or [1] * rank, self.dilations or [1] * rank
        pads = self.padding.resolve(x.shape[2:], window_extents(weight.shape[2:], dilations), strides)
        if is_symmetric(pads):
            return _CONV[rank](x, weight, bias, strides, [begin for begin, _ in pads], dilations, self.groups)
        return _CONV[rank](F.pad(x, torch_pad(pads)), weight, bias, strides, 0, dilations, self.groups)


class ConvTranspose(nn.Module):
    """ONNX ConvTranspose with weight and bias as inputs: computed unpadded, then cropped by the
    pads (explicit, from output_shape, or auto_pad) as onnxruntime does."""

    def __init__(
        self,
        strides: list[int] | None,
        dilations: list[int] | None,
        groups: int,
        output_padding: list[int] | None,
        output_shape: list[int] | None,
        padding: SpatialPadding,
    ):
        super().__init__()
        self.strides, self.dilations, self.groups = strides, dilations, groups
        self.output_padding, self.output_shape, self.padding = output_padding, output_shape, padding

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rank = weight.dim() - 2
        strides, dilations = self.strides or [1] * rank, self.dilations or [1] * rank
        output_padding = self.output_padding or [0] * rank
        y = _CONV_TRANSPOSE[rank](x, weight, bias, strides, 0, output_padding, self.groups, dilations)
        for axis, (begin, end) in enumerate(self._pads(x.shape[2:], y.shape[2:], strides)):
            y = y.narrow(axis + 2, begin, y.shape[axis + 2] - begin - end)
        return y

    def _pads(self, sizes: Sequence[int], full: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
        """(begin, end) crop per axis; an odd total crops the extra element at the end for
        SAME_UPPER, at the begin otherwise (the ONNX rule, which onnxruntime follows)."""
        rank = len(sizes)
        if self.output_shape is not None:
            targets = self.output_shape[-rank:]
        elif self.padding.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            targets = [n * s for n, s in zip(sizes, strides)]
        else:
            return self.padding.resolve(sizes, [1] * rank, strides)
        totals = [f - t for f, t in zip(full, targets)]
        if any(t < 0 for t in totals):
            raise NotImplementedError(f"output_shape {list(targets)} exceeds the full transposed size {list(full)}")
        upper = self.padding.auto_pad == "SAME_UPPER"
        return [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in totals]


def _optional_ints(node: OnnxNode, name: str) -> list[int] | None:
    """An optional list-of-ints attribute, None when absent (the module picks the default per call)."""
    value = node.attributes.get(name)
    return None if value is None else list(value)


@register("Conv", (1, 11, 22))
def _conv(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Conv with its weight and bias as inputs."""
    a = node.attributes
    padding = SpatialPadding.from_attributes(a)
    module = Conv(_optional_ints(node, "strides"), _optional_ints(node, "dilations"), a.get("group", 1), padding)
    return converted(module, node_mapping(node))


@register("ConvTranspose", (1, 11, 22))
def _conv_transpose(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """ConvTranspose with its weight and bias as inputs."""
    a = node.attributes
    module = ConvTranspose(
        _optional_ints(node, "strides"),
        _optional_ints(node, "dilations"),
        a.get("group", 1),
        _optional_ints(node, "output_padding"),
        _optional_ints(node, "output_shape"),
        SpatialPadding.from_attributes(a),
    )
    return converted(module, node_mapping(node))


@register("Gemm", (9, 11, 13))
def _gemm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Gemm with B and C as inputs (onnx2torch's own module, always in its functional form)."""
    a = node.attributes
    module = OnnxGemm(a.get("alpha", 1.0), a.get("beta", 1.0), bool(a.get("transA", 0)), bool(a.get("transB", 0)))
    return converted(module, node_mapping(node))
