"""Learned INT weight scales (LSQ, Esser et al. 2019) beside AdaQuant's weights.

With `learn_scales: weights`, the scale of each tuned INT weight quantizer (per tensor, channel or
block) becomes s = s0 * exp(t) with a trainable t that starts at 0 (so s starts at s0 exactly and
stays positive); a power-of-two scale becomes s = s0 * 2^round(t), rounded with a straight-through
estimator, so every value it takes is an exact power of two. An asymmetric format's zero point
learns an integer offset the same way, kept in the code range. The quantize-dequantize runs LSQ's
form, round(clamp(x / s, qmin - zp, qmax - zp)) * s, whose values are QuantizeLinear's bit for bit
and whose scale gradient is LSQ's: round(x/s) - x/s inside the range, the clamp bound outside it
(the clipping gradient), scaled by 1 / sqrt(elements per scale * qmax). That path is eager: the
compiled kernels carry no scale gradient. An int32 bias whose scale is s_input * s_weight follows
the learned weight scale (re-quantized on the new grid, saturating at the int32 range); export
writes the learned scales, zero points and re-encoded codes into the QDQ graph (export_scales)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Self

import torch
from torch import nn

from finetune.config import FastFinetune
from finetune.formats import IntSpec, int_quantize_dequantize
from finetune.formats.bits import compute_in_float32, pow2, round_half_even
from finetune.formats.blocks import broadcast_param
from finetune.lift import FakeQuantize, LiftedModule

from .report import Warnings
from .units import Layer, Unit


@dataclass(frozen=True)
class Site:
    """One weight whose scale is learned: its quantizer, and the int32 bias quantizer (None: none)
    whose scale is the input quantizer's times the weight's and so follows it."""

    weight: str
    weight_quantizer: str
    bias: str | None = None
    bias_quantizer: str | None = None
    input_quantizer: str | None = None

    def buffers(self, spec: IntSpec) -> tuple[str, ...]:
        """The quantizer buffers learning changes (what a revert or a checkpoint must hold)."""
        names = [f"{self.weight_quantizer}.scale"]
        if not spec.symmetric:
            names.append(f"{self.weight_quantizer}.zero_point")
        if self.bias_quantizer is not None:
            names.append(f"{self.bias_quantizer}.scale")
        return tuple(names)


def lsq_quantize_dequantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """QuantizeLinear-DequantizeLinear of float32 x with LSQ's gradients: the values of
    formats.int_quantize_dequantize bit for bit (codes of at most 16 bits are exact in float32);
    towards x straight through strictly inside the range; towards the scale round(v) - v inside and
    the bound at or beyond it (v = x / s); towards the zero point -s at or beyond the bound."""
    s = broadcast_param(scale, x, spec.axis, spec.block_size, torch.float32)
    zp = broadcast_param(zero_point, x, spec.axis, spec.block_size, torch.float32)
    v = x / s
    low, high = spec.qmin - zp, spec.qmax - zp
    clamped = torch.where(v <= low, low, torch.where(v >= high, high, v))
    return (clamped + (round_half_even(clamped.detach()) - clamped).detach()) * s


class _GradScale(torch.autograd.Function):
    """Identity whose gradient is multiplied by a constant (LSQ's gradient scale)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _Pow2Step(torch.autograd.Function):
    """s0 * 2^round(t), exact (s0 a power of two, the product a power of two in float32's normal
    range), with the gradient of s0 * 2^t towards t (straight through the rounding)."""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        exponent = torch.frexp(base)[1] - 1 + round_half_even(t).to(torch.int32)
        value = pow2(exponent.clamp(-126, 127))
        ctx.save_for_backward(value)
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (value,) = ctx.saved_tensors
        return None, grad * value * math.log(2.0)


class LearnedScale(nn.Module):
    """The trainable scale (and asymmetric zero point) of one weight quantizer; `value()` and
    `zero_point()` are what it quantizes with now."""

    def __init__(self, quantizer: FakeQuantize, weight: torch.Tensor) -> None:
        super().__init__()
        spec = quantizer.spec
        self.spec = spec
        self.register_buffer("base", quantizer.scale.detach().clone())
        self.register_buffer("base_zero_point", quantizer.zero_point.detach().clone())
        self.t = nn.Parameter(torch.zeros_like(self.base))
        self.zp = nn.Parameter(torch.zeros_like(self.base)) if not spec.symmetric else None
        self.factor = 1.0 / math.sqrt(weight.numel() / self.base.numel() * max(spec.qmax, 1.0))

    def value(self) -> torch.Tensor:
        """The scale now: s0 * exp(t), or s0 * 2^round(t) for a power-of-two format."""
        t = _GradScale.apply(self.t, self.factor)
        return _Pow2Step.apply(self.base, t) if self.spec.power_of_two else self.base * torch.exp(t)

    def zero_point(self) -> torch.Tensor:
        """The zero point now: the original plus a learned integer offset, within the code range."""
        if self.zp is None:
            return self.base_zero_point
        offset = _GradScale.apply(self.zp, self.factor)
        offset = offset + (round_half_even(offset.detach()) - offset).detach()
        return torch.clamp(self.base_zero_point + offset, self.spec.qmin, self.spec.qmax)


def learned_sites(module: LiftedModule, unit: Unit) -> tuple[list[Site], list[tuple[str, str]]]:
    """The weights of `unit` whose scales can be learned, and (layer, why not) for the others."""
    sites, skipped = [], []
    for layer in unit.layers:
        site, why = _site(module, layer)
        if site is not None:
            sites.append(site)
        else:
            skipped.append((layer.name, why))
    return sites, skipped


def _site(module: LiftedModule, layer: Layer) -> tuple[Site | None, str]:
    """The layer's Site, or None with the reason its weight scale stays."""
    if layer.weight_quantizer is None:
        return None, "its weight is not quantized"
    quantizer = module.get_submodule(layer.weight_quantizer)
    spec = quantizer.spec
    if not isinstance(spec, IntSpec):
        return None, f"its weight format ({type(spec).__name__}) has no scale to learn (INT formats only)"
    if spec.dtype in ("int32", "uint32"):
        return None, "32-bit weight codes are not learned (their codes are not exact in float32)"
    site = Site(layer.weight, layer.weight_quantizer)
    bias_quantizer = module.finetune_params[layer.bias].quantizer if layer.bias else None
    if bias_quantizer is None:
        return site, ""
    input_quantizer = _input_quantizer(module, layer)
    bias_scale = module.get_submodule(bias_quantizer).scale
    if input_quantizer is None or bias_scale is None:
        return site, ""  # a bias on its own grid, not tied to the weight's scale
    derived = module.get_submodule(input_quantizer).scale * quantizer.scale
    if derived.shape != bias_scale.shape or not torch.equal(derived, bias_scale):
        return site, ""
    return replace(site, bias=layer.bias, bias_quantizer=bias_quantizer, input_quantizer=input_quantizer), ""


def _input_quantizer(module: LiftedModule, layer: Layer) -> str | None:
    """The INT quantizer module whose output is the layer's activation input, if one is."""
    node = next((n for n in module.graph.nodes if n.op == "call_module" and n.target == layer.name), None)
    arg = node.args[layer.input_index] if node is not None and layer.input_index < len(node.args) else None
    if getattr(arg, "op", None) != "call_module":
        return None
    found = module.get_submodule(arg.target)
    return arg.target if isinstance(found, FakeQuantize) and isinstance(found.spec, IntSpec) else None


def with_learned_scales(module: LiftedModule, units: list[Unit], config: FastFinetune, warnings: Warnings) -> list[Unit]:
    """The units with the quantizer buffers they learn (none unless learn_scales); a layer whose
    weight scale cannot be learned is a warning, and a model with none at all an error."""
    if not config.learn_scales:
        return units
    result = []
    for unit in units:
        sites, skipped = learned_sites(module, unit)
        for layer, why in skipped:
            warnings.add(layer, f"learn_scales: its weight scale stays: {why}")
        buffers = [name for site in sites for name in site.buffers(module.get_submodule(site.weight_quantizer).spec)]
        result.append(replace(unit, scales=tuple(buffers)))
    if not any(unit.scales for unit in result):
        raise ValueError("fast_finetune.learn_scales: no tuned weight has an INT format, so there is no scale to learn "
                         "(BFP, MX and float formats have none): set learn_scales: false")
    return result


class LearnedScales:
    """While entered, the unit's weight quantizers (and the int32 bias quantizers tied to them)
    quantize with the learned scales; on exit the learned values are written into their buffers.
    `groups` are the optimizer's parameter groups (none when the unit learns no scale)."""

    def __init__(self, unit: Unit, module: LiftedModule, config: FastFinetune, warnings: Warnings) -> None:
        self.unit, self.module, self.warnings = unit, module, warnings
        self.sites = learned_sites(module, unit)[0] if unit.scales else []
        self.scales = [LearnedScale(module.get_submodule(site.weight_quantizer), module.get_parameter(site.weight))
                       for site in self.sites]
        parameters = [p for scale in self.scales for p in scale.parameters()]
        self.groups = [{"params": parameters, "lr": config.scale_lr}] if parameters else []

    def __enter__(self) -> Self:
        for site, scale in zip(self.sites, self.scales):
            self._quantizer(site.weight_quantizer).learned = _weight_fn(scale)
            if site.bias_quantizer is not None:
                bias = self._quantizer(site.bias_quantizer)
                bias.learned = _bias_fn(bias, self._quantizer(site.input_quantizer), scale)
        return self

    def __exit__(self, *_: object) -> None:
        with torch.no_grad():
            for site, scale in zip(self.sites, self.scales):
                weight = self._quantizer(site.weight_quantizer)
                weight.learned = None
                weight.scale.copy_(scale.value())
                weight.zero_point.copy_(scale.zero_point())
                if site.bias_quantizer is not None:
                    self._harden_bias(site, weight.scale)

    def _quantizer(self, name: str | None) -> FakeQuantize:
        return self.module.get_submodule(name)

    def _harden_bias(self, site: Site, weight_scale: torch.Tensor) -> None:
        """The bias quantizer's scale becomes s_input * s_weight; a warning where its codes saturate."""
        bias = self._quantizer(site.bias_quantizer)
        bias.learned = None
        bias.scale.copy_(self._quantizer(site.input_quantizer).scale * weight_scale)
        value = self.module.get_parameter(site.bias).detach().double()
        ratio = value / broadcast_param(bias.scale, value, bias.spec.axis, bias.spec.block_size, torch.float64)
        if bool(((ratio < bias.spec.qmin) | (ratio > bias.spec.qmax)).any()):
            self.warnings.add(site.bias, "learn_scales: the int32 bias re-quantized to s_input * the learned weight scale "
                              "saturates at the int32 range (its codes are clipped)", "tensor")


def _weight_fn(scale: LearnedScale) -> Callable[[torch.Tensor], torch.Tensor]:
    """The weight quantizer's forward while its scale is learned."""
    return lambda x: compute_in_float32(lambda xf: lsq_quantize_dequantize(xf, scale.value(), scale.zero_point(), scale.spec), x)


def _bias_fn(bias: FakeQuantize, input_quantizer: FakeQuantize, scale: LearnedScale) -> Callable[[torch.Tensor], torch.Tensor]:
    """The int32 bias quantizer's forward: its grid is s_input * the learned weight scale (no gradient to the scale)."""
    return lambda x: int_quantize_dequantize(x, input_quantizer.scale * scale.value().detach(), bias.zero_point, bias.spec)


def scale_snapshot(module: LiftedModule, units: list[Unit]) -> dict[str, torch.Tensor]:
    """The learned buffers' values now (before tuning), for scale_changes."""
    return {name: module.get_buffer(name).detach().clone() for unit in units for name in unit.scales}


def scale_changes(module: LiftedModule, units: list[Unit], before: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per unit and learned weight scale: new / old over its channels or blocks (min, mean, max),
    and how many zero points moved (the report's `learned_scales`)."""
    rows = []
    for unit in units:
        for site in learned_sites(module, unit)[0] if unit.scales else []:
            key = f"{site.weight_quantizer}.scale"
            ratio = (module.get_buffer(key).detach().double() / before[key].double()).cpu()
            zero_key = f"{site.weight_quantizer}.zero_point"
            moved = int((module.get_buffer(zero_key) != before[zero_key]).sum()) if zero_key in before else 0
            rows.append({"unit": unit.name, "weight": site.weight, "scales": ratio.numel(), "ratio_min": float(ratio.min()),
                         "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()), "zero_points_moved": moved,
                         "bias_requantized": site.bias_quantizer is not None})
    return rows
