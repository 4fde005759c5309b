"""Cast of any opset (Cast-19+ included) and CastLike, which onnx2torch lacks, bfloat16 and float8
targets included, with ONNX's saturation of float8 casts; other targets raise."""

from __future__ import annotations

import torch
from onnx import TensorProto
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from finetune.onnx.dtypes import torch_dtype, type_name

from ..registry import register
from .common import converted, node_mapping

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cast(x: torch.Tensor, dtype: torch.dtype, saturate: bool) -> torch.Tensor:
    """ONNX Cast: float8 targets saturate at their largest finite value when `saturate` (inf too)."""
    if dtype in _FLOAT8 and saturate and x.is_floating_point():
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


class Cast(nn.Module):
    """Cast to a fixed type."""

    def __init__(self, dtype: torch.dtype, saturate: bool):
        super().__init__()
        self.dtype, self.saturate = dtype, saturate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(x, self.dtype, self.saturate)


class CastLike(nn.Module):
    """Cast to the type of a second tensor."""

    def __init__(self, saturate: bool):
        super().__init__()
        self.saturate = saturate

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return cast(x, like.dtype, self.saturate)


def _torch_type(data_type: int) -> torch.dtype:
    """The torch dtype of an ONNX element type; types torch cannot compute with raise."""
    try:
        return torch_dtype(type_name(data_type))
    except NotImplementedError as error:
        raise NotImplementedError(f"cast to {TensorProto.DataType.Name(data_type)}") from error


def _saturate(node: OnnxNode) -> bool:
    """The `saturate` attribute of Cast / CastLike; round modes other than Cast-24's default raise."""
    if node.attributes.get("round_mode", "up") != "up":
        raise NotImplementedError(f"round_mode={node.attributes['round_mode']!r}")
    return bool(node.attributes.get("saturate", 1))


@register("Cast", (6, 9, 13, 19, 21, 23, 24, 25))
def _cast(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Cast of any opset, bfloat16 and float8 targets included."""
    return converted(Cast(_torch_type(node.attributes["to"]), _saturate(node)), node_mapping(node))


@register("CastLike", (15, 19, 21, 23, 24, 25))
def _cast_like(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """CastLike, which onnx2torch lacks."""
    return converted(CastLike(_saturate(node)), node_mapping(node))
