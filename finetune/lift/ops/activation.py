"""Element-wise converters onnx2torch lacks or gets wrong at the versions exporters write: Gelu-20
(exact or tanh-approximated), Clip with any bound omitted or computed (torch writes `clamp(min=)` with
an empty max), and Dropout as the identity it is at inference (a Dropout in training mode is refused)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.node_converters.clip import OnnxClip
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..registry import register
from .common import converted, is_constant_or_absent, node_mapping, require_unused_outputs

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


def _saturated(x: torch.Tensor) -> torch.Tensor:
    """The value clamped to its float dtype's finite range, as an omitted Clip bound is (ONNX
    defaults it to the type's lowest and max, so onnxruntime turns ±inf into ±max); ints unchanged."""
    if not x.is_floating_point():
        return x
    info = torch.finfo(x.dtype)
    return torch.clamp(x, info.min, info.max)


class OpenReLU(nn.ReLU):
    """Clip with min 0 and no max: a ReLU (so it joins its layer's unit and commutes with positive
    scales as one) whose +inf becomes the dtype's max, as onnxruntime's Clip makes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _saturated(super().forward(x))


class OpenClip(OnnxClip):
    """Clip with constant bounds, one or both omitted: an omitted side is the dtype's finite extreme."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _saturated(x if self.min_val is None and self.max_val is None else super().forward(x))


class Clip(nn.Module):
    """Clip with a computed bound, read per call (an omitted one is the dtype's finite extreme). Not
    an activation for unit finding (kinds.py): it reads values besides the one it clips."""

    def forward(self, x: torch.Tensor, low: torch.Tensor | None = None, high: torch.Tensor | None = None) -> torch.Tensor:
        clipped = torch.clamp(x, _scalar(low), _scalar(high))
        return clipped if low is not None and high is not None else _saturated(clipped)


def _scalar(bound: torch.Tensor | None) -> torch.Tensor | None:
    """A bound as a 0-d tensor: onnxruntime takes shape [1] too and returns the clipped value's
    shape; a bound of several elements raises here, as it does there."""
    return None if bound is None else bound.reshape(())


@register("Clip", (6, 11, 12, 13))
def _clip(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Clip with bounds as attributes (Clip-6) or inputs (Clip-11+), each present, omitted (absent or
    an empty name) or computed. Constant bounds give activations that join their layer's unit
    (ReLU6 and OnnxClip as onnx2torch makes them, and their saturating kin above); a computed one gives Clip."""
    if not all(is_constant_or_absent(node, graph, i) for i in (1, 2)):
        return converted(Clip(), node_mapping(node))
    low, high = (_constant_bound(node, graph, i, name) for i, name in ((1, "min"), (2, "max")))
    return converted(_constant_clip(low, high), node_mapping(node, node.input_values[:1]))


def _constant_bound(node: OnnxNode, graph: OnnxGraph, index: int, attribute: str) -> float | None:
    """A constant bound (Clip-6's attribute, or an initializer input) as a Python number of its type,
    so an integer Clip keeps its dtype; None when omitted."""
    name = node.input_values[index] if index < len(node.input_values) else ""
    if name:
        return graph.initializers[name].to_torch().reshape(()).item()
    return node.attributes.get(attribute)


def _constant_clip(low: float | None, high: float | None) -> nn.Module:
    """The module of a Clip with constant bounds: exact ReLU6 and OnnxClip where both are given,
    saturating kin where one is omitted."""
    if low == 0 and high == 6:
        return nn.ReLU6()
    if low is not None and high is not None:
        return OnnxClip(low, high)
    return OpenReLU() if low == 0 and high is None else OpenClip(low, high)
