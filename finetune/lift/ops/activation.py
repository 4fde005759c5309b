"""Element-wise converters onnx2torch lacks at the versions exporters write: Gelu-20 (exact or
tanh-approximated), and Dropout as the identity it is at inference (a Dropout in training mode is refused)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..registry import register
from .common import converted, node_mapping, require_unused_outputs

TRAINING_MODE = 2  # Dropout-12 and later: the optional boolean input that turns dropping on


@register("Dropout", (1, 6, 7, 10, 12, 13, 22))
def _dropout(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Dropout is the identity at inference, which is what onnxruntime runs and what we tune; one
    whose training_mode is true, or computed (so it may be true), drops values and is refused."""
    require_unused_outputs(node, graph)
    mode = node.input_values[TRAINING_MODE] if len(node.input_values) > TRAINING_MODE else ""
    if mode and mode not in graph.initializers:
        raise NotImplementedError(f"training_mode {mode!r} is computed, not a constant: a Dropout that may drop values "
                                  "is not lifted (export the model in inference mode)")
    if mode and graph.initializers[mode].to_torch().any():
        raise NotImplementedError("training_mode is true: a Dropout that drops values is not lifted (export the model "
                                  "in inference mode)")
    return converted(nn.Identity(), node_mapping(node, node.input_values[:1]))


class Gelu(nn.Module):
    """GELU, exact (erf) or with the tanh approximation."""

    def __init__(self, approximate: str):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


@register("Gelu", (20,))
def _gelu(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Gelu-20, exact or tanh-approximated."""
    return converted(Gelu(node.attributes.get("approximate", "none")), node_mapping(node))
