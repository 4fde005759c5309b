"""AdaRound (Nagel et al., 2020): learn, per weight element, whether to round down or up. The
rounding is floor(w / s) + h(V) with h a rectified sigmoid; a regulariser with an annealed
exponent beta pushes h to 0 or 1, and the result is hardened to integer codes at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Self

import torch
from torch import nn

from finetune.formats import IntSpec, broadcast_param
from finetune.lift import FakeQuantize, LiftedModule
from finetune.notices import Warnings

from ..data.batches import Batches
from ..units import Unit
from .base import Algorithm, AlgorithmPart, UnitWork

ZETA = 1.1
GAMMA = -0.1
BETA_START = 20.0
BETA_END = 2.0
WARMUP_FRACTION = 0.2  # iterations before the regulariser starts
REG_WEIGHT = 0.01  # lambda, against the reconstruction MSE relative to the target's mean square


class SoftRounding(nn.Module):
    """The learnable rounding of one INT-quantized weight; installed as its quantizer's rounding
    hook while training, so the quantizer computes clamp(floor(w/s) + h(V) + zp) as usual."""

    def __init__(self, quantizer: FakeQuantize, weight: torch.Tensor) -> None:
        super().__init__()
        if not isinstance(quantizer.spec, IntSpec):
            raise TypeError(f"AdaRound needs INT weights, not {quantizer.spec}")
        self.quantizer = quantizer
        with torch.no_grad():
            ratio = self._ratio(weight)
            p = ((ratio - torch.floor(ratio)) - GAMMA) / (ZETA - GAMMA)
        self.v = nn.Parameter(torch.log(p / (1 - p)))

    def _scale(self, weight: torch.Tensor) -> torch.Tensor:
        """The quantizer's scale broadcast to the weight's shape."""
        spec = self.quantizer.spec
        return broadcast_param(self.quantizer.scale, weight, spec.axis, spec.block_size)

    def _ratio(self, weight: torch.Tensor) -> torch.Tensor:
        """w / s in float32, as the quantizer computes it."""
        return weight.detach().float() / self._scale(weight)

    def h(self) -> torch.Tensor:
        """The soft rounding offset in [0, 1]."""
        return torch.clamp(torch.sigmoid(self.v) * (ZETA - GAMMA) + GAMMA, 0, 1)

    def rounding(self, ratio: torch.Tensor) -> torch.Tensor:
        """The quantizer's rounding hook: floor(w / s) + h(V) (`ratio` is w / s)."""
        return torch.floor(ratio.detach()) + self.h()

    def regularizer(self, beta: float) -> torch.Tensor:
        """Mean of 1 - |2h - 1|^beta: zero once every h is 0 or 1."""
        return (1 - (2 * self.h() - 1).abs().pow(beta)).mean()

    def hard_rounding(self, ratio: torch.Tensor) -> torch.Tensor:
        """The rounding the hardened weight will have: floor(w / s) + [h >= 0.5]."""
        return torch.floor(ratio.detach()) + (self.h() >= 0.5).float()

    @contextlib.contextmanager
    def hard(self) -> Iterator[None]:
        """Inside the block the quantizer rounds as `hardened` will: what a held-out evaluation
        measures (the unit ends with hard roundings, never soft ones)."""
        self.quantizer.rounding = self.hard_rounding
        try:
            yield
        finally:
            self.quantizer.rounding = self.rounding

    def hardened(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight whose round-half-even codes are floor(w / s) + [h >= 0.5]: codes times scale."""
        with torch.no_grad():
            codes = torch.floor(self._ratio(weight)) + (self.h() >= 0.5).float()
            return (codes * self._scale(weight)).to(weight.dtype)

    def __enter__(self) -> Self:
        self.quantizer.rounding = self.rounding
        return self

    def __exit__(self, *_: object) -> None:
        self.quantizer.rounding = None


class Annealing:
    """The regulariser's exponent over a unit's steps: None during warm-up (the first
    WARMUP_FRACTION of the iterations), then falling linearly from BETA_START to BETA_END at the
    last. An early stop does not cut it short, which would harden roundings the regulariser has not
    yet decided: `finish_from` starts the annealing early instead."""

    def __init__(self, iterations: int) -> None:
        self.start = int(WARMUP_FRACTION * iterations)
        self.end = iterations

    def exponent(self, step: int) -> float | None:
        """The exponent at a step, None during warm-up."""
        if step < self.start:
            return None
        progress = (step - self.start) / max(1, self.end - self.start)
        return BETA_END + (BETA_START - BETA_END) * (1 - progress)

    def finish_from(self, step: int, tail: int) -> int:
        """Where a unit told after `step` steps to stop early now ends. In warm-up the loss measures
        the relaxed roundings, so its plateau is a real signal: the annealing starts at once and
        takes `tail` steps, or the steps a budget whose warm-up ended at `step` would anneal, if
        more (within the budget). The roundings need those steps to settle: on the digits CNN at
        XINT8 (patience 50) its last two layers' losses fell by about 3 % and 24 % with 50-step
        tails, 15 % and 38 % over the schedule's proportions, and 29 % and 45 % in full
        1000-iteration runs. Once annealing, the loss rises by design as the regulariser decides
        the roundings: no signal, the schedule runs to its end."""
        if step >= self.start:
            return self.end
        annealing = max(tail, round(step * (1 - WARMUP_FRACTION) / WARMUP_FRACTION))
        self.start, self.end = step, min(self.end, step + annealing)
        return self.end


class AdaRound(Algorithm):
    """AdaRound as the run's algorithm: each quantized weight's rounding is learned (SoftRounding), its
    regulariser annealed, and the roundings hardened when the unit ends; held-out evaluations see them
    hard, as the unit will end; an early stop starts the annealing early (Annealing.finish_from).
    `iterations: 0` runs bias correction alone."""

    name = "adaround"
    rounds = True
    trains_unquantized = False  # AdaRound reads its rounded weights only
    gptq_start = "compensated"  # it chooses between the two codes around its starting weights

    def prepare(self, module: LiftedModule, units: list[Unit], warnings: Warnings) -> list[Unit]:
        """Every weight it rounds must be INT (checked only where it will round: iterations > 0)."""
        if self.config.iterations:
            check_int_weights(module, units)
        return units

    def skip_reason(self, unit: Unit, module: LiftedModule) -> str | None:
        """Nothing to round in the unit (None where only bias correction runs: iterations 0)."""
        return None if self.config.iterations == 0 else super().skip_reason(unit, module)

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> RoundingPart:
        return RoundingPart(work, iterations)


class RoundingPart(AlgorithmPart):
    """AdaRound's share of a unit's optimisation: the soft roundings' V trained, every weight and
    bias of the unit frozen meanwhile."""

    def __init__(self, work: UnitWork, iterations: int) -> None:
        super().__init__()
        module, unit = work.module, work.unit
        weights = [module.get_parameter(layer.weight) for layer in unit.layers]
        self.roundings = [(SoftRounding(module.get_submodule(layer.weight_quantizer), weight).to(weight.device), weight)
                          for layer, weight in zip(unit.layers, weights) if layer.weight_quantizer]
        self.groups = [{"params": [rounding.v for rounding, _ in self.roundings]}]
        self.frozen = [*weights, *(module.get_parameter(layer.bias) for layer in unit.layers if layer.bias)]
        self.annealing = Annealing(iterations)
        self.elements = sum(rounding.v.numel() for rounding, _ in self.roundings)

    def __enter__(self) -> Self:
        for parameter in self.frozen:
            parameter.requires_grad_(False)
        for rounding, _ in self.roundings:
            rounding.__enter__()
        return self

    def __exit__(self, *_: object) -> None:
        for rounding, _ in self.roundings:
            rounding.__exit__()
        for parameter in self.frozen:
            parameter.requires_grad_(True)

    def penalty(self, step: int) -> torch.Tensor | None:
        """The regulariser at its annealed exponent, averaged over every rounded element (None in warm-up)."""
        exponent = self.annealing.exponent(step)
        if exponent is None:
            return None
        regularizer = sum(r.regularizer(exponent) * (r.v.numel() / self.elements) for r, _ in self.roundings)
        return REG_WEIGHT * regularizer

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Held-out evaluations see the roundings hard, as the unit will end."""
        with contextlib.ExitStack() as hard:
            for rounding, _ in self.roundings:
                hard.enter_context(rounding.hard())
            yield

    def harden(self) -> None:
        """Each weight becomes its hardened codes times the scale."""
        for rounding, weight in self.roundings:
            weight.data.copy_(rounding.hardened(weight))

    def stop_at(self, step: int, tail: int, iterations: int) -> int:
        """Stopped with a tail, the annealing finishes the roundings (Annealing.finish_from)."""
        return self.annealing.finish_from(step, tail) if tail else super().stop_at(step, tail, iterations)


def check_int_weights(module: LiftedModule, units: list[Unit]) -> None:
    """AdaRound learns integer roundings: some weight must be quantized, and every quantized one INT
    (a clear error otherwise)."""
    layers = [layer for unit in units for layer in unit.layers]
    if all(layer.weight_quantizer is None for layer in layers):
        raise ValueError(f"AdaRound has nothing to round: no weight of the {len(layers)} layer(s) it would tune is quantized "
                         "(only their activations are); use algorithm adaquant, or quantize the weights")
    for layer in layers:
        spec = module.get_submodule(layer.weight_quantizer).spec if layer.weight_quantizer else None
        if spec is not None and not isinstance(spec, IntSpec):
            raise ValueError(f"AdaRound needs INT weights, but {layer.name} has {spec}; use algorithm adaquant for this format")
