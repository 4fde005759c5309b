"""AdaQuant (Hubara et al., 2021) as the run's algorithm: the unit's weights (and, with
adaquant.update_bias, its biases) trained directly through their quantizers by the unit's loss, the
learning rate decaying along a cosine so the weights settle across the quantizer's steps (on the
digits transformer at MX4 that recovered 93 % of the quantization loss, against 40 % at a constant
rate); an early stop ends the decay over its tail (CosineTail)."""

from __future__ import annotations

import math
from typing import Any, Self

import torch

from ..data.batches import Batches
from .base import Algorithm, AlgorithmPart, UnitWork


class AdaQuant(Algorithm):
    """AdaQuant: weights (and biases with update_bias) trained directly."""

    name = "adaquant"
    corrects_bias = False  # after AdaQuant, which moves the weights freely, the correction measured worse

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> WeightPart:
        return WeightPart(work, self.config.adaquant.update_bias)


class WeightPart(AlgorithmPart):
    """AdaQuant's share of a unit's optimisation: its weights trained (biases too with `update_bias`),
    the rest of its parameters frozen meanwhile."""

    def __init__(self, work: UnitWork, update_bias: bool) -> None:
        super().__init__()
        module, unit = work.module, work.unit
        weights = [module.get_parameter(layer.weight) for layer in unit.layers]
        biases = [module.get_parameter(layer.bias) for layer in unit.layers if layer.bias]
        trainable = weights + (biases if update_bias else [])
        self.groups = [{"params": trainable}]
        self.frozen = [p for p in weights + biases if all(p is not t for t in trainable)]

    def __enter__(self) -> Self:
        for parameter in self.frozen:
            parameter.requires_grad_(False)
        return self

    def __exit__(self, *_: object) -> None:
        for parameter in self.frozen:
            parameter.requires_grad_(True)

    def schedule(self, optimizer: torch.optim.Optimizer, iterations: int) -> Any:
        """A cosine decay over the whole optimisation."""
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, iterations)

    def tail_schedule(self, optimizer: torch.optim.Optimizer, steps: int) -> Any:
        """The rest of the decay, over the tail after an early stop."""
        return CosineTail(optimizer, steps)


class CosineTail:
    """AdaQuant's learning rate after an early stop: a half cosine from the rate reached down to
    zero over the tail's `steps`, as the full schedule would have ended."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        self.optimizer, self.steps, self.done = optimizer, steps, 0
        self.start = [group["lr"] for group in optimizer.param_groups]

    def step(self) -> None:
        """Set the rate of the next step."""
        self.done += 1
        for group, lr in zip(self.optimizer.param_groups, self.start):
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * self.done / self.steps))
