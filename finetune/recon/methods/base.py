"""The method protocol: what a method does to one unit at each moment of its tuning, so the tuner asks
the run's methods instead of comparing algorithm names. A run has one algorithm (AdaRound, AdaQuant
or GPTQ: how the unit's weights change) and the methods that join it (learned scales, learned
equalisation, QDrop inside blocks, bias correction, GPTQ's start), each asked in registry order.

The moments, for every unit a run tunes:

    prepare(module, units, warnings) -> units   once, before any data is read: refuse what cannot be done,
                                                and add to each unit the tensors it learns (Unit.scales)
    skip_reason(unit, module)                   why the unit cannot be tuned (None: it can)
    begin(work)                                 before any weight of the unit moves (bias correction's float means)
    start(work) -> bool                         before the optimisation, in order: True where it moved weights
    part(work, batches, iterations) -> Part     its share of the optimisation (trained tensors, hooks, loss term)
    end(work, loss) -> Loss                     after the optimisation: the unit's loss as the method leaves it
    record() -> dict                            its entries of the unit's report row (UnitResult fields)
    report(module, units) -> dict               its entries of the run's report"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from lightning.fabric import Fabric

from finetune.config import FastFinetune, default_lr, format_family
from finetune.formats import FormatSpec
from finetune.lift import LiftedModule
from finetune.notices import Warnings

from ..data.batches import Batches
from ..data.losses import Loss
from ..data.rows import UnitData
from ..units import Unit


@dataclass
class UnitWork:
    """One unit's tuning as its methods see it: the unit (number `index` of the run's `units`), the
    lifted model holding its weights, its data rows first, the run's Fabric, the held-out calibration
    batches (numbered over every process) and this process's chunks of them, the run's warnings, the
    float model's values of weights and biases stored as codes (`starts`), `measure` (the unit's
    losses as its tensors are now) and its loss before tuning; `moved` tells whether its weights moved
    since that loss was measured, `optimising` whether an optimisation runs."""

    index: int
    unit: Unit
    units: list[Unit]
    module: LiftedModule
    data: UnitData
    fabric: Fabric
    held_out: frozenset[int]
    held: frozenset[int]
    warnings: Warnings
    starts: dict[str, torch.Tensor]
    measure: Callable[[], Loss]
    before: Loss
    optimising: bool
    moved: bool = False


class Part:
    """A method's share of one unit's optimisation (this base adds nothing). `groups` are the
    optimizer's parameter groups it trains (a group without "lr" takes the unit's rate); entered
    before the first step and exited after the last (exiting writes what it learned into the model);
    `penalty` is its term of the loss at a step; `evaluating` is how held-out evaluations see the
    unit; `harden` runs after the exit (the unit ends as it will be exported)."""

    groups: list[dict[str, Any]]

    def __init__(self) -> None:
        self.groups = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        """Nothing installed."""

    def penalty(self, step: int) -> torch.Tensor | None:
        """Its term of the loss at `step` (None: none)."""
        return None

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """The state held-out evaluations measure the unit in (as it is)."""
        return contextlib.nullcontext()

    def harden(self) -> None:
        """Write the unit's final tensors (nothing to do)."""


class Method:
    """One way a unit's tensors change (this base changes nothing): the moments of the module's
    docstring, each a no-op unless a method overrides it."""

    def __init__(self, config: FastFinetune, algorithm: Algorithm | None = None) -> None:
        self.config = config
        self.algorithm = algorithm  # the run's (None for an algorithm itself)

    @classmethod
    def applies(cls, config: FastFinetune, algorithm: Algorithm) -> bool:
        """Whether a run with `config`, whose algorithm is `algorithm`, uses the method."""
        return True

    def prepare(self, module: LiftedModule, units: list[Unit], warnings: Warnings) -> list[Unit]:
        """The units, checked and with what they learn; an error where the method cannot run at all."""
        return units

    def skip_reason(self, unit: Unit, module: LiftedModule) -> str | None:
        """Why the unit cannot be tuned (None: it can)."""
        return None

    def begin(self, work: UnitWork) -> None:
        """Before any weight of the unit moves."""

    def start(self, work: UnitWork) -> bool:
        """Before the optimisation; True where the method moved the unit's weights."""
        return False

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> Part | None:
        """Its share of an optimisation of `iterations` steps over `batches` (None: none)."""
        return None

    def end(self, work: UnitWork, loss: Loss) -> Loss:
        """After the optimisation (`loss`: the unit's now): the loss the method leaves it at."""
        return loss

    def record(self) -> dict[str, Any]:
        """Its entries of the unit's report row (UnitResult fields), for the unit just tuned."""
        return {}

    def report(self, module: LiftedModule, units: list[Unit]) -> dict[str, Any]:
        """Its entries of the run's report."""
        return {}


class Algorithm(Method):
    """How a unit's weights change: AdaRound, AdaQuant or GPTQ (fast_finetune.algorithm names it).
    `optimises`: it runs the optimisation loop; `rounds`: it needs a unit's weights quantized;
    `corrects_bias`: bias correction's `auto` turns on with it (measured: docs/fine-tuning.md);
    `trains_unquantized`: a weight left float counts towards the unit's default rate; `gptq_start`:
    which of GPTQ's weights it starts from with gptq_init (see methods.gptq)."""

    name: ClassVar[str]
    optimises: ClassVar[bool] = True
    rounds: ClassVar[bool] = False
    corrects_bias: ClassVar[bool] = True
    trains_unquantized: ClassVar[bool] = True
    gptq_start: ClassVar[str] = "quantized"  # GPTQ's weights it starts from (gptq_init): quantized or compensated

    def optimising(self) -> bool:
        """Whether its units run the optimisation loop (so backward passes), with the run's iterations."""
        return self.optimises and self.config.iterations > 0

    def default_lr(self, specs: list[FormatSpec | None]) -> float:
        """The lowest default rate (DEFAULT_LR) of the formats of the unit's weights it trains (None:
        a weight left float; a block's layers may differ)."""
        trained = [spec for spec in specs if spec is not None or self.trains_unquantized]
        return min(default_lr(self.name, format_family(spec)) for spec in trained)

    def skip_reason(self, unit: Unit, module: LiftedModule) -> str | None:
        """A rounding algorithm has nothing to do in a unit without a quantized weight."""
        if self.rounds and all(layer.weight_quantizer is None for layer in unit.layers):
            return "no weight of it is quantized (nothing to round)"
        return None

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> AlgorithmPart:
        """The algorithm's share of the optimisation."""
        raise NotImplementedError(f"{self.name} does not optimise")


class AlgorithmPart(Part):
    """The algorithm's share of a unit's optimisation, which also owns the schedule: `schedule` is the
    learning-rate schedule from the first step (None: constant), `stop_at` where a unit told to stop
    after `step` steps with `tail` steps to finish its schedule ends, and `tail_schedule` the rate over
    those steps (None: unchanged)."""

    def schedule(self, optimizer: torch.optim.Optimizer, iterations: int) -> Any:
        """The learning-rate schedule of the whole optimisation (None: a constant rate)."""
        return None

    def stop_at(self, step: int, tail: int, iterations: int) -> int:
        """The step a unit told to stop after `step` steps ends at."""
        return min(iterations, step + tail)

    def tail_schedule(self, optimizer: torch.optim.Optimizer, steps: int) -> Any:
        """The learning-rate schedule of the `steps` after an early stop (None: unchanged)."""
        return None
