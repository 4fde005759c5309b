"""Resize converter for the sampling modes torch's interpolate reproduces exactly; any other mode
or attribute raises instead of lifting to a module that drifts from onnxruntime."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from ..registry import register
from .common import converted, node_mapping

# (mode, coordinate_transformation_mode, nearest_mode) → torch interpolate mode and align_corners,
# only for combinations whose sampling positions are the same in both.
_RESIZE_MODES: dict[tuple[str, str, str], tuple[str, bool | None]] = {
    ("nearest", "asymmetric", "floor"): ("nearest", None),
    ("nearest", "half_pixel", "round_prefer_ceil"): ("nearest-exact", None),
    ("linear", "half_pixel", ""): ("linear", False),
    ("linear", "pytorch_half_pixel", ""): ("linear", False),
    ("linear", "align_corners", ""): ("linear", True),
    ("cubic", "half_pixel", ""): ("cubic", False),
    ("cubic", "align_corners", ""): ("cubic", True),
}
_INTERPOLATE_PREFIX = {1: "", 2: "bi", 3: "tri"}


class Resize(nn.Module):
    """Resize over the spatial axes by scales or sizes (batch and channel unchanged)."""

    def __init__(self, mode: str, align_corners: bool | None, axes: tuple[int, ...] | None, single_pixel_zero: bool):
        super().__init__()
        self.mode, self.align_corners, self.axes = mode, align_corners, axes
        self.single_pixel_zero = single_pixel_zero  # pytorch_half_pixel samples 0 for a size-1 output

    def forward(
        self,
        x: torch.Tensor,
        roi: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
        sizes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rank = x.dim() - 2
        mode = self.mode if self.mode.startswith("nearest") else _INTERPOLATE_PREFIX[rank] + self.mode
        if mode == "cubic":
            raise NotImplementedError("cubic Resize of one spatial axis")
        if sizes is not None and sizes.numel():
            size = self._full(sizes, list(x.shape))
            self._check(size[:2] == list(x.shape[:2]), size[2:])
            return F.interpolate(x, size=size[2:], mode=mode, align_corners=self.align_corners)
        factors = self._full(scales, [1.0] * x.dim())
        self._check(factors[:2] == [1.0, 1.0], [math.floor(n * f) for n, f in zip(x.shape[2:], factors[2:])])
        return F.interpolate(x, scale_factor=factors[2:], mode=mode, align_corners=self.align_corners)

    def _full(self, values: torch.Tensor, defaults: list) -> list:
        """Per-axis values for every input axis, the default where `axes` leaves one out."""
        full = list(defaults)
        for axis, v in zip(self.axes or range(len(full)), values.tolist()):
            full[axis % len(full)] = v
        return full

    def _check(self, batch_channel_kept: bool, output_sizes: list[int]) -> None:
        """Raise for what interpolate cannot do: resizing batch/channel, pytorch_half_pixel to size 1."""
        if not batch_channel_kept:
            raise NotImplementedError("Resize of the batch or channel axis")
        if self.single_pixel_zero and 1 in output_sizes:
            raise NotImplementedError("pytorch_half_pixel Resize to a size-1 axis")


@register("Resize", (11, 13, 18, 19))
def _resize(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Resize whose sampling torch reproduces exactly; other modes raise instead of drifting."""
    a = node.attributes
    mode = a.get("mode", "nearest")
    transform = a.get("coordinate_transformation_mode", "half_pixel")
    nearest = a.get("nearest_mode", "round_prefer_floor") if mode == "nearest" else ""
    key = (mode, transform, nearest)
    unsupported = [
        f"{name}={a[name]!r}"
        for name, default in (("antialias", 0), ("exclude_outside", 0), ("keep_aspect_ratio_policy", "stretch"))
        if a.get(name, default) != default
    ]
    if mode == "cubic" and a.get("cubic_coeff_a", -0.75) != -0.75:
        unsupported.append(f"cubic_coeff_a={a['cubic_coeff_a']}")
    if key not in _RESIZE_MODES or unsupported:
        raise NotImplementedError(f"Resize {key} {unsupported or ''} has no exact torch equivalent")
    torch_mode, align_corners = _RESIZE_MODES[key]
    axes = tuple(a["axes"]) if "axes" in a else None
    return converted(Resize(torch_mode, align_corners, axes, transform == "pytorch_half_pixel"), node_mapping(node))
