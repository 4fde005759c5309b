"""Each unit's learning rate: the config's, or the default of the algorithm and the unit's weight
format family (config.DEFAULT_LR, one table measured per family), times the factor `lr: auto`
chose by a short seeded search on the first tuned unit. The issue 33 measurements: AdaQuant's one
rate for every format overshot at 4 bits (a digits CNN at MX4 tuned better at 1e-4 than at 1e-3)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from finetune.lift import LiftedModule

from .methods import Algorithm
from .units import Unit

AUTO_FACTORS = (1.0, 0.1, 0.3, 3.0)  # tried on the table's rate by lr: auto; ties keep the earlier (the table's own first)
AUTO_STEPS = 100  # steps of each try (fewer when the run's iterations are fewer)


def unit_lr(lr: float | str | None, algorithm: Algorithm, unit: Unit, module: LiftedModule, factor: float = 1.0) -> float:
    """The learning rate of `unit`: the config's number (`lr`), or `factor` times the algorithm's
    default for its layers' weight formats (the layers of a block may differ)."""
    if isinstance(lr, float):
        return lr
    specs = [module.get_submodule(layer.weight_quantizer).spec if layer.weight_quantizer else None for layer in unit.layers]
    return factor * algorithm.default_lr(specs)


@dataclass(frozen=True)
class RateSearch:
    """What lr: auto tried on `unit`: each factor's loss after `steps` steps (held-out where batches
    are held out), and the factor chosen, which every unit's default rate is multiplied by."""

    unit: str
    steps: int
    losses: dict[str, float]
    factor: float


def search_rate(unit: str, iterations: int, attempt: Callable[[float, int], float]) -> RateSearch:
    """Try every AUTO_FACTORS factor for min(iterations, AUTO_STEPS) steps (`attempt` tunes the unit
    from the same start with the same seeded batches and returns its loss) and choose the lowest
    finite loss; each process reads the same summed losses, so all choose alike."""
    steps = min(iterations, AUTO_STEPS)
    losses = {factor: attempt(factor, steps) for factor in AUTO_FACTORS}
    chosen = min(AUTO_FACTORS, key=lambda factor: losses[factor] if math.isfinite(losses[factor]) else math.inf)
    return RateSearch(unit, steps, {f"{factor:g}": loss for factor, loss in losses.items()}, chosen)
