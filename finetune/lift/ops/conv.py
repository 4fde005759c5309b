"""Converters for the ops onnx2torch lacks or lifts in a way we cannot use: layers take their
weights as inputs (so a weight can be a parameter behind a fake-quant module), padding follows
auto_pad and asymmetric pads, normalisations keep their inference semantics, and newer op
versions (Cast-19+, Reduce*-18, Pad-18+, Resize-18/19, Split-18, Gelu-20, Conv-22, ...) work."""

from __future__ import annotations

import math
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
from .common import constant_ints, converted, is_constant_or_absent, node_mapping

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


# ---------------------------------------------------------------- convolutions


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


# ---------------------------------------------------------------- Reshape, Pad, Split, Resize


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
