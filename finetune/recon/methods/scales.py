"""Learned INT scales (LSQ, Esser et al. 2019) beside AdaQuant's weights: of the weights
(`learn_scales: weights`), of the activations (`activations`), or both (`all`).

The scale of each learned INT quantizer (per tensor, channel or block) becomes s = s0 * exp(t) with
a trainable t that starts at 0 (so s starts at s0 exactly and stays positive); a power-of-two scale
becomes s = s0 * 2^round(t), rounded with a straight-through estimator, so every value it takes is
an exact power of two. An asymmetric format's zero point learns an integer offset the same way, kept
in the code range. The quantize-dequantize runs LSQ's form, round(clamp(x / s, qmin - zp, qmax -
zp)) * s, whose values are QuantizeLinear's bit for bit and whose scale gradient is LSQ's: round(x/s)
- x/s inside the range, the clamp bound outside it (the clipping gradient), scaled by 1 / sqrt(elements
per scale * qmax), the elements of one row for an activation. That path is eager: the compiled kernels
carry no scale gradient. An activation quantizer is learned by the unit whose nodes call it (a layer
unit's input quantizer is outside it: with `include_output_quant` the layer before learns it). An
int32 bias whose scale is s_input * s_weight follows either learned scale (re-quantized on the new
grid, saturating at the int32 range); export writes the learned scales, zero points and re-encoded
codes into the QDQ graph (export_scales)."""

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
from finetune.lift.graph import constant_nodes
from finetune.notices import Warnings

from ..data.batches import Batches
from ..units import Layer, Unit
from .base import Algorithm, Method, Part, UnitWork

# What each learn_scales value learns.
LEARNS = {"weights": ("weight",), "activations": ("activation",), "all": ("weight", "activation")}


@dataclass(frozen=True)
class TiedBias:
    """An int32 bias quantizer whose scale is its layer's input quantizer's times its weight
    quantizer's, so it follows either when learned."""

    bias: str
    quantizer: str
    input_quantizer: str
    weight_quantizer: str


@dataclass(frozen=True)
class Learning:
    """What one unit learns: its quantizers (`kinds`: weight or activation, by quantizer name) and
    the int32 biases tied to them."""

    kinds: dict[str, str]
    biases: tuple[TiedBias, ...]

    def buffers(self, module: LiftedModule) -> tuple[str, ...]:
        """The quantizer buffers learning changes (what a revert or a checkpoint must hold)."""
        names = []
        for name in self.kinds:
            names.append(f"{name}.scale")
            if not module.get_submodule(name).spec.symmetric:
                names.append(f"{name}.zero_point")
        return (*names, *(f"{tied.quantizer}.scale" for tied in self.biases))


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
    """The trainable scale (and asymmetric zero point) of one quantizer; `value()` and
    `zero_point()` are what it quantizes with now. `elements` is how many values share a scale
    (None until an activation's first call, `observe`, tells)."""

    def __init__(self, quantizer: FakeQuantize, elements: int | None) -> None:
        super().__init__()
        spec = quantizer.spec
        self.spec = spec
        self.register_buffer("base", quantizer.scale.detach().clone())
        self.register_buffer("base_zero_point", quantizer.zero_point.detach().clone())
        self.t = nn.Parameter(torch.zeros_like(self.base))
        self.zp = nn.Parameter(torch.zeros_like(self.base)) if not spec.symmetric else None
        self.factor, self.observed = 1.0, False
        if elements is not None:
            self.observe(elements)

    def observe(self, elements: int) -> None:
        """LSQ's gradient scale, 1 / sqrt(values per scale * qmax), from the values quantized at once."""
        self.factor = 1.0 / math.sqrt(max(elements / self.base.numel(), 1.0) * max(self.spec.qmax, 1.0))
        self.observed = True

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


def _why_not(quantizer: FakeQuantize) -> str:
    """Why the quantizer's scale cannot be learned ("" where it can)."""
    spec = quantizer.spec
    if not isinstance(spec, IntSpec):
        return f"its format ({type(spec).__name__}) has no scale to learn (INT formats only)"
    if spec.dtype in ("int32", "uint32"):
        return "32-bit codes are not learned (they are not exact in float32)"
    return ""


def unit_learning(module: LiftedModule, unit: Unit, learns: tuple[str, ...], units: list[Unit]) -> tuple[Learning, list[tuple[str, str]]]:
    """What `unit` learns and (where, why not) for what it cannot; `units`: every unit of the run,
    whose layers' int32 biases may be tied to an activation scale this unit learns."""
    kinds, skipped = {}, []
    if "weight" in learns:
        for layer in unit.layers:
            why = _why_not(module.get_submodule(layer.weight_quantizer)) if layer.weight_quantizer else "its weight is not quantized"
            if why:
                skipped.append((layer.name, f"its weight scale stays: {why}"))
            else:
                kinds[layer.weight_quantizer] = "weight"
    if "activation" in learns:
        for name, why in activation_quantizers(module, unit):
            if why:
                skipped.append((name, f"its activation scale stays: {why}"))
            else:
                kinds[name] = "activation"
    if not kinds:
        return Learning({}, ()), skipped
    layers = [layer for each in units for layer in each.layers]
    biases = tuple(tied for layer in layers if (tied := _tied_bias(module, layer)) is not None
                   and (tied.input_quantizer in kinds or tied.weight_quantizer in kinds))
    return Learning(kinds, biases), skipped


def activation_quantizers(module: LiftedModule, unit: Unit) -> list[tuple[str, str]]:
    """The activation quantizers the unit's nodes call (each module is called once, by one node),
    with why each one's scale cannot be learned ("" where it can)."""
    mine, constant = set(unit.nodes), constant_nodes(module.graph)
    found = []
    for node in module.graph.nodes:
        if node.name not in mine or node.op != "call_module" or node in constant:
            continue
        quantizer = module.get_submodule(node.target)
        if isinstance(quantizer, FakeQuantize) and not quantizer.on_parameter:
            found.append((node.target, _why_not(quantizer)))
    return found


def _tied_bias(module: LiftedModule, layer: Layer) -> TiedBias | None:
    """The layer's int32 bias quantizer where its scale is s_input * s_weight, else None."""
    bias_quantizer = module.finetune_params[layer.bias].quantizer if layer.bias else None
    if bias_quantizer is None or layer.weight_quantizer is None:
        return None
    input_quantizer = _input_quantizer(module, layer)  # a walk over the graph: only for a quantized bias
    if input_quantizer is None:
        return None
    weight = module.get_submodule(layer.weight_quantizer)
    bias_scale = module.get_submodule(bias_quantizer).scale
    if not isinstance(weight.spec, IntSpec) or bias_scale is None:
        return None
    derived = module.get_submodule(input_quantizer).scale * weight.scale
    if derived.shape != bias_scale.shape or not torch.equal(derived, bias_scale):
        return None  # a bias on its own grid, not tied to the scales
    return TiedBias(layer.bias, bias_quantizer, input_quantizer, layer.weight_quantizer)


def _input_quantizer(module: LiftedModule, layer: Layer) -> str | None:
    """The INT quantizer module whose output is the layer's activation input, if one is."""
    node = next((n for n in module.graph.nodes if n.op == "call_module" and n.target == layer.name), None)
    arg = node.args[layer.input_index] if node is not None and layer.input_index < len(node.args) else None
    if getattr(arg, "op", None) != "call_module":
        return None
    found = module.get_submodule(arg.target)
    return arg.target if isinstance(found, FakeQuantize) and isinstance(found.spec, IntSpec) else None


def with_learned_scales(module: LiftedModule, units: list[Unit], learn_scales: str,
                        warnings: Warnings) -> tuple[list[Unit], dict[str, Learning]]:
    """The units with the quantizer buffers they learn, and what each learns by unit name; a quantizer
    whose scale cannot be learned is a warning, and a model with none at all an error."""
    learns = LEARNS[learn_scales]
    result, learnings = [], {}
    for unit in units:
        learning, skipped = unit_learning(module, unit, learns, units)
        for where, why in skipped:
            warnings.add(where, f"learn_scales: {why}")
        result.append(replace(unit, scales=learning.buffers(module)))
        learnings[unit.name] = learning
    if not any(unit.scales for unit in result):
        raise ValueError(f"fast_finetune.adaquant.learn_scales: {learn_scales}: no unit has an INT {' or '.join(learns)} "
                         "quantizer, so there is no scale to learn (BFP, MX and float formats have none; a layer unit's "
                         "input quantizer lies outside it: use unit: block or include_output_quant) or set learn_scales: false")
    return result, learnings


class ScaleLearning(Method):
    """learn_scales as a method: the units learn their quantizers' scales beside AdaQuant's weights."""

    @classmethod
    def applies(cls, config: FastFinetune, algorithm: Algorithm) -> bool:
        return bool(config.adaquant.learn_scales)

    def prepare(self, module: LiftedModule, units: list[Unit], warnings: Warnings) -> list[Unit]:
        """The units with the buffers they learn, what each learns (its quantizers and tied int32 biases,
        found once, before the model moves to its device: finding a tied bias compares scale values) and
        those buffers' values before tuning (for the report)."""
        units, self.learnings = with_learned_scales(module, units, self.config.adaquant.learn_scales, warnings)
        self.untuned = scale_snapshot(module, units)
        return units

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> LearnedScales:
        return LearnedScales(work, self.learnings[work.unit.name], self.config.adaquant.scale_lr)

    def report(self, module: LiftedModule, units: list[Unit]) -> dict[str, Any]:
        """Per unit and learned scale: new over old (the report's `learned_scales`)."""
        return {"learned_scales": scale_changes(module, units, self.untuned, self.learnings)}


class LearnedScales(Part):
    """While entered, the unit's learned quantizers (and the int32 bias quantizers tied to them)
    quantize with the learned scales; on exit the learned values are written into their buffers.
    `groups` are the optimizer's parameter groups (none when the unit learns no scale)."""

    def __init__(self, work: UnitWork, learning: Learning, scale_lr: float) -> None:
        super().__init__()
        self.module, self.warnings, self.learning = work.module, work.warnings, learning
        self.scales = {name: LearnedScale(self._quantizer(name), self._elements(name, kind))
                       for name, kind in self.learning.kinds.items()}
        parameters = [p for scale in self.scales.values() for p in scale.parameters()]
        self.groups = [{"params": parameters, "lr": scale_lr}] if parameters else []

    def __enter__(self) -> Self:
        for name, scale in self.scales.items():
            self._quantizer(name).learned = _learned_fn(scale, self.learning.kinds[name] == "activation")
        for tied in self.learning.biases:
            bias = self._quantizer(tied.quantizer)
            bias.learned = _bias_fn(bias, self._current(tied.input_quantizer), self._current(tied.weight_quantizer))
        return self

    def __exit__(self, *_: object) -> None:
        with torch.no_grad():
            for name, scale in self.scales.items():
                quantizer = self._quantizer(name)
                quantizer.learned = None
                quantizer.scale.copy_(scale.value())
                quantizer.zero_point.copy_(scale.zero_point())
            for tied in self.learning.biases:
                self._harden_bias(tied)

    def _quantizer(self, name: str) -> FakeQuantize:
        return self.module.get_submodule(name)

    def _elements(self, name: str, kind: str) -> int | None:
        """Values per quantization of a weight quantizer (its weight's size); None for an activation."""
        if kind == "activation":
            return None
        source = next(value for value, parameter in self.module.finetune_params.items() if parameter.quantizer == name)
        return self.module.get_parameter(source).numel()

    def _current(self, name: str) -> Callable[[], torch.Tensor]:
        """The quantizer's scale now: learned, or its buffer."""
        scale = self.scales.get(name)
        return (lambda: scale.value().detach()) if scale is not None else (lambda: self._quantizer(name).scale)

    def _harden_bias(self, tied: TiedBias) -> None:
        """The bias quantizer's scale becomes s_input * s_weight; a warning where its codes saturate."""
        bias = self._quantizer(tied.quantizer)
        bias.learned = None
        bias.scale.copy_(self._quantizer(tied.input_quantizer).scale * self._quantizer(tied.weight_quantizer).scale)
        value = self.module.get_parameter(tied.bias).detach().double()
        ratio = value / broadcast_param(bias.scale, value, bias.spec.axis, bias.spec.block_size, torch.float64)
        if bool(((ratio < bias.spec.qmin) | (ratio > bias.spec.qmax)).any()):
            self.warnings.add(tied.bias, "learn_scales: the int32 bias re-quantized to s_input * s_weight with the learned "
                              "scale saturates at the int32 range (its codes are clipped)", "tensor")


def _learned_fn(scale: LearnedScale, activation: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A learned quantizer's forward; an activation's first call sets the gradient scale from its row size."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if activation and not scale.observed:
            scale.observe(x[0].numel() if x.dim() > 1 else 1)
        return compute_in_float32(lambda xf: lsq_quantize_dequantize(xf, scale.value(), scale.zero_point(), scale.spec), x)

    return forward


def _bias_fn(bias: FakeQuantize, input_scale: Callable[[], torch.Tensor], weight_scale: Callable[[], torch.Tensor]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The int32 bias quantizer's forward: its grid is s_input * s_weight as learned now (no gradient to either)."""
    return lambda x: int_quantize_dequantize(x, input_scale() * weight_scale(), bias.zero_point, bias.spec)


def scale_snapshot(module: LiftedModule, units: list[Unit]) -> dict[str, torch.Tensor]:
    """The learned buffers' values now (before tuning), for scale_changes."""
    return {name: module.get_buffer(name).detach().clone() for unit in units for name in unit.scales}


def scale_changes(module: LiftedModule, units: list[Unit], before: dict[str, torch.Tensor], learnings: dict[str, Learning]
                  ) -> list[dict[str, Any]]:
    """Per unit and learned scale: new / old over its channels or blocks (min, mean, max), how many
    zero points moved, and whether int32 biases followed (the report's `learned_scales`)."""
    rows = []
    for unit in units:
        learning = learnings[unit.name]
        for name, kind in learning.kinds.items():
            key = f"{name}.scale"
            ratio = (module.get_buffer(key).detach().double() / before[key].double()).cpu()
            zero_key = f"{name}.zero_point"
            moved = int((module.get_buffer(zero_key) != before[zero_key]).sum()) if zero_key in before else 0
            followed = any(name in (tied.input_quantizer, tied.weight_quantizer) for tied in learning.biases)
            rows.append({"unit": unit.name, "quantizer": name, "of": kind, "scales": ratio.numel(),
                         "ratio_min": float(ratio.min()), "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()),
                         "zero_points_moved": moved, "bias_requantized": followed})
    return rows
