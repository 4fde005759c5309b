"""Normalisation converters that keep inference semantics: BatchNormalization with its running
statistics as inputs, and LayerNormalization with broadcast scale and bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..registry import register
from .common import converted, node_mapping, require_unused_outputs


class BatchNorm(nn.Module):
    """Inference-mode BatchNormalization of any rank (running statistics, never batch statistics)."""

    def __init__(self, epsilon: float):
        super().__init__()
        self.epsilon = epsilon

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, var: torch.Tensor
    ) -> torch.Tensor:
        return F.batch_norm(x, mean, var, scale, bias, False, 0.0, self.epsilon)


@register("BatchNormalization", (9, 14, 15))
def _batch_norm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """BatchNormalization in inference mode with its statistics as inputs."""
    if node.attributes.get("training_mode", 0):
        raise NotImplementedError("training_mode=1 (batch statistics)")
    require_unused_outputs(node, graph)
    return converted(BatchNorm(node.attributes.get("epsilon", 1e-5)), node_mapping(node))


class LayerNorm(nn.Module):
    """LayerNormalization over the axes from `axis` on, with broadcast scale and bias."""

    def __init__(self, axis: int, epsilon: float):
        super().__init__()
        self.axis, self.epsilon = axis, epsilon

    def forward(self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape[self.axis % x.dim() :]
        if scale.shape == shape and (bias is None or bias.shape == shape):
            return F.layer_norm(x, shape, scale, bias, self.epsilon)
        y = F.layer_norm(x, shape, None, None, self.epsilon) * scale
        return y if bias is None else y + bias


@register("LayerNormalization", (17,))
def _layer_norm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """LayerNormalization with scale and bias as inputs (no shape information needed)."""
    if node.attributes.get("stash_type", 1) != 1:
        raise NotImplementedError("stash_type other than float32")
    require_unused_outputs(node, graph)
    a = node.attributes
    return converted(LayerNorm(a.get("axis", -1), a.get("epsilon", 1e-5)), node_mapping(node))
