"""Learned per-channel pre-scales between two layers of a unit (`learn_equalization`, AdaQuant):
equalisation for block formats, learned rather than computed. Where a layer's output reaches the
next layer's input through ops that commute with a positive per-channel scale (ReLU, LeakyReLU,
max pooling, identity) and activation quantizers, output channel c of the first is divided by
s_c = exp(t_c) (its weight's rows and its bias) and input channel c of the second multiplied by
s_c. In float the unit computes the same function; quantized, the activation between them enters
its shared-exponent blocks with its channels rescaled, and t is trained beside the weights by the
unit's loss. On exit the scales are folded into the float weights and biases, so the graph keeps
its topology and exports plain weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import fx, nn
from torch.utils.hooks import RemovableHandle

from finetune.config import FastFinetune
from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.kinds import is_add, layer_kind
from finetune.onnx.layers import weight_axes

from finetune.notices import Warnings

from ..data.batches import Batches
from ..units import Layer, Unit
from .base import Algorithm, Method, Part, UnitWork

# Ops through which a positive per-channel scale passes unchanged: f(x / s) = f(x) / s.
HOMOGENEOUS = (nn.ReLU, nn.LeakyReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.Identity, nn.Dropout)


@dataclass(frozen=True)
class Pair:
    """A producer layer whose output channels reach a consumer layer's input channels through
    homogeneous ops: the weight axes holding those channels, and where the producer's bias enters
    (module, argument index; None: no bias)."""

    producer: Layer
    consumer: Layer
    out_axis: int
    in_axis: int
    bias_reader: tuple[str, int] | None


def channel_axes(module: LiftedModule, layer: Layer) -> tuple[int, int] | None:
    """(axis of output channels, axis of input channels) of the layer's weight (onnx.layers.weight_axes);
    None where a per-channel scale cannot move through it (grouped Conv, transposed Gemm input, a
    MatMul weight that is not a 2-D second operand, other layers)."""
    layer_module = module.get_submodule(layer.name)
    kind = layer_kind(layer_module)
    rank = module.get_parameter(layer.weight).dim()
    movable = ((kind == "Conv" and layer_module.groups == 1) or (kind == "Gemm" and not layer_module.trans_a)
               or (kind == "MatMul" and rank == 2 and layer.weight_index == 1))
    if not movable:
        return None
    out_axis, in_axis = weight_axes(kind, layer.weight_index, kind == "Gemm" and bool(layer_module.trans_b))
    return out_axis % rank, in_axis % rank


def pairs_of(module: LiftedModule, unit: Unit) -> list[Pair]:
    """The unit's producer-consumer pairs (each producer's output read by its consumer alone)."""
    layer_nodes = {n.target: n for n in module.graph.nodes if n.op == "call_module"}
    consumers = {layer.name: layer for layer in unit.layers}
    pairs = []
    for producer in unit.layers:
        found = _consumer(module, layer_nodes[producer.name], producer, consumers, set(unit.nodes))
        if found is None or producer.weight_quantizer is None or found[0].weight_quantizer is None:
            continue
        consumer, bias_reader = found
        out_axes, in_axes = channel_axes(module, producer), channel_axes(module, consumer)
        if out_axes is None or in_axes is None or (producer.bias is not None and bias_reader is None):
            continue
        channels = module.get_parameter(producer.weight).shape[out_axes[0]]
        if module.get_parameter(consumer.weight).shape[in_axes[1]] == channels:
            pairs.append(Pair(producer, consumer, out_axes[0], in_axes[1], bias_reader))
    return pairs


def _consumer(module: LiftedModule, start: fx.Node, producer: Layer, consumers: dict[str, Layer],
              members: set[str]) -> tuple[Layer, tuple[str, int] | None] | None:
    """The layer of the unit that the producer's output reaches through homogeneous ops and
    activation quantizers alone (every value on the way read once), with where the bias enters."""
    bias_reader = _bias_argument(start, producer)
    current = start
    while len(current.users) == 1:
        (user,) = current.users
        if user.name not in members or user.op != "call_module":
            return None
        target = module.get_submodule(user.target)
        if user.target in consumers and consumers[user.target].input_index < len(user.args) \
                and user.args[consumers[user.target].input_index] is current:
            return consumers[user.target], bias_reader
        if is_add(target) and bias_reader is None and (found := _bias_argument(user, producer)) is not None:
            bias_reader = found
        elif not (isinstance(target, HOMOGENEOUS) or (isinstance(target, FakeQuantize) and not target.on_parameter)):
            return None
        current = user
    return None


def _bias_argument(node: fx.Node, producer: Layer) -> tuple[str, int] | None:
    """(module, argument index) where `node` reads the producer's float bias directly (a bias
    behind a quantizer is not scaled: its grid is tied to other scales)."""
    for index, arg in enumerate(node.args):
        if producer.bias is not None and getattr(arg, "op", None) == "get_attr" and arg.target == producer.bias:
            return node.target, index
    return None


class EqualizationLearning(Method):
    """learn_equalization as a method: the scales between each unit's layer pairs learned beside
    AdaQuant's weights, each unit's ratios in its report row."""

    @classmethod
    def applies(cls, config: FastFinetune, algorithm: Algorithm) -> bool:
        return config.adaquant.learn_equalization

    def prepare(self, module: LiftedModule, units: list[Unit], warnings: Warnings) -> list[Unit]:
        """Refuse the option where no unit holds a pair: it would change nothing."""
        if not any(pairs_of(module, unit) for unit in units):
            raise ValueError("fast_finetune.adaquant.learn_equalization: no unit holds two layers joined only by ReLU, "
                             "LeakyReLU, max pooling or activation quantizers (ReLU6, SiLU, hard-swish and reshapes do not "
                             "commute with a per-channel scale; layer units hold one layer: use unit: block), so there is "
                             "nothing to learn: set learn_equalization: false")
        return units

    def begin(self, work: UnitWork) -> None:
        self.last: LearnedPrescales | None = None

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> LearnedPrescales:
        self.last = LearnedPrescales(work.unit, work.module, self.config.adaquant.scale_lr)
        return self.last

    def record(self) -> dict[str, Any]:
        """Each layer pair's learned scales (the last optimisation's)."""
        return {"equalization": (self.last.ratios or None) if self.last is not None else None}


class LearnedPrescales(Part):
    """While entered, each pair's weights and producer bias are read through its learned scales
    (forward pre-hooks); on exit the scales are folded into them and the hooks removed. `groups`
    are the optimizer's parameter groups (none when the unit has no pair or the option is off)."""

    def __init__(self, unit: Unit, module: LiftedModule, scale_lr: float) -> None:
        super().__init__()
        self.module = module
        self.pairs = pairs_of(module, unit)
        self.logs = [nn.Parameter(torch.zeros(module.get_parameter(p.producer.weight).shape[p.out_axis],
                                              device=module.get_parameter(p.producer.weight).device)) for p in self.pairs]
        self.groups = [{"params": self.logs, "lr": scale_lr}] if self.logs else []
        self.hooks: list[RemovableHandle] = []
        self.ratios: list[dict[str, Any]] = []

    def __enter__(self) -> Self:
        for pair, log in zip(self.pairs, self.logs):
            self._hook(pair.producer.weight_quantizer, 0, _scaled(log, pair.out_axis, -1))
            self._hook(pair.consumer.weight_quantizer, 0, _scaled(log, pair.in_axis, 1))
            if pair.bias_reader is not None:
                self._hook(*pair.bias_reader, _scaled(log, 0, -1))
        return self

    def __exit__(self, *_: object) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        with torch.no_grad():
            for pair, log in zip(self.pairs, self.logs):
                weight = self.module.get_parameter(pair.producer.weight)
                weight.copy_(_scaled(log, pair.out_axis, -1)(weight))
                other = self.module.get_parameter(pair.consumer.weight)
                other.copy_(_scaled(log, pair.in_axis, 1)(other))
                if pair.producer.bias is not None:
                    bias = self.module.get_parameter(pair.producer.bias)
                    bias.copy_(_scaled(log, 0, -1)(bias))
                scale = log.detach().exp()
                self.ratios.append({"producer": pair.producer.name, "consumer": pair.consumer.name, "channels": scale.numel(),
                                    "scale_min": float(scale.min()), "scale_max": float(scale.max())})

    def _hook(self, name: str, index: int, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace argument `index` of module `name` by its transform while entered."""

        def pre_hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (*args[:index], transform(args[index]), *args[index + 1:])

        self.hooks.append(self.module.get_submodule(name).register_forward_pre_hook(pre_hook))


def _scaled(log: torch.Tensor, axis: int, sign: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """t -> x * exp(sign * log) along `axis` of x (x / s for sign -1, x * s for 1)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[axis] = -1
        return x * torch.exp(sign * log).view(shape).to(x.dtype)

    return apply
