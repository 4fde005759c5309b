"""A unit's losses: over every cached sample before and after its optimisation (evaluate), and on
the held-out batches during it (issue 33): where calibration batches are held
out of training, the unit's loss on them is measured every few steps, early stopping counts those
measurements (callbacks.EarlyStopping), and the unit ends with its trainable tensors (AdaQuant's
weights, AdaRound's rounding variables) as they were at the lowest one, kept in memory: a unit
never ends worse on the held-out rows than its best measured point. The training loss always
falls; on rows the unit did not train on it need not (see heldout)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from lightning.fabric import Fabric
from torch import nn

from finetune.config import STEP_GROUP

from .cache import CachedValue
from .rows import UnitInputs
from .shards import sum_over_batches

# A held-out evaluation's cost per row over a training step's cost per row of its batch (forward,
# backward and Adam), rounded up from the digits CNN on a shared 2-core CPU (MX4 AdaQuant 0.25,
# W4A8 AdaRound 0.19: 32 held-out rows cost 0.50 and 0.39 of a 16-row step; evaluating every 10
# steps took 5.0 % and 3.9 % of the tuning time).
EVAL_COST = 0.3
OVERHEAD = 0.1  # the share of a unit's tuning time its held-out evaluations may take
SUM_SLICE = 1 << 20  # elements per float64 partial sum of a unit's error (error_sums)


def evaluation_interval(held_rows: int, batch_size: int) -> int:
    """Steps between held-out evaluations: enough that they cost about OVERHEAD of the steps
    (EVAL_COST * held_rows per evaluation against batch_size per step), in multiples of STEP_GROUP (each
    evaluation reads the host, as a group of steps' losses does).
    Row counts, not timings, decide it, so every process and every rerun evaluates at the same steps."""
    steps = math.ceil(EVAL_COST * held_rows / (OVERHEAD * batch_size))
    return STEP_GROUP * max(1, math.ceil(steps / STEP_GROUP))


def error_sums(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """float64 [sum of (output - target)^2, sum of target^2, element count], the difference taken in
    float32 or wider (a half-precision unit's not rounded to half), summed a slice of SUM_SLICE elements at
    a time so the float64 copies stay small where an output is large (an LM head's logits: 131 MB a batch
    of 8 x 128 tokens at 32,000 words, four float64 copies of it before). The slices depend on neither
    chunking nor processes."""
    output, target = output.reshape(-1), target.reshape(-1)
    wide = torch.promote_types(torch.promote_types(output.dtype, target.dtype), torch.float32)
    sums = torch.zeros(2, dtype=torch.float64, device=target.device)
    for start in range(0, target.numel(), SUM_SLICE):
        piece = target[start:start + SUM_SLICE].to(wide)
        difference = output[start:start + SUM_SLICE].to(wide) - piece
        sums += torch.stack([difference.double().square().sum(), piece.double().square().sum()])
    return torch.cat([sums, torch.tensor([float(target.numel())], dtype=torch.float64, device=target.device)])


def held_out_loss(train: nn.Module, inputs: UnitInputs, targets: CachedValue, fabric: Fabric, held: frozenset[int]) -> float:
    """The unit's MSE on the held-out chunks of every process: the float64 sums of evaluate, added
    in its order, so for the same weights it is the held-out loss evaluate reports, bit for bit."""
    rows: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for chunk in sorted(held):
            output = train(*inputs.chunk(chunk, fabric.device))[0]
            target = targets.tensor(chunk, fabric.device)
            rows[chunk] = error_sums(output, target)[::2]
    total, count = sum_over_batches(fabric, rows, len(targets.chunks), 2)
    return total / count if count else math.inf


@dataclass(frozen=True)
class Loss:
    """A unit's MSE against its float targets on its training batches and on the held-out ones
    (None: none held out), and the targets' mean square over all."""

    training: float
    held_out: float | None
    power: float

    @property
    def judged(self) -> float:
        """The loss a unit is kept or reverted on: the held-out one where batches are held out."""
        return self.training if self.held_out is None else self.held_out

    @property
    def finite(self) -> bool:
        """Whether every loss is finite."""
        return math.isfinite(self.training) and (self.held_out is None or math.isfinite(self.held_out))


def evaluate(train: nn.Module, inputs: UnitInputs, targets: CachedValue, fabric: Fabric, held: frozenset[int] = frozenset()) -> Loss:
    """The unit's losses over every cached sample of every process, the chunks in `held` (this
    process's held-out chunks) apart: float64 sums per chunk, added in calibration batch order (see
    shards.sum_over_batches), so the result depends neither on chunking nor on the number of
    processes; read by the host once."""
    rows: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for chunk in range(len(targets.chunks)):
            output = train(*inputs.chunk(chunk, fabric.device))[0]
            target = targets.tensor(chunk, fabric.device)
            sums = error_sums(output, target)
            rows[chunk] = torch.cat([sums, torch.zeros_like(sums)] if chunk not in held else [torch.zeros_like(sums), sums])
    error, power, count, held_error, held_power, held_count = sum_over_batches(fabric, rows, len(targets.chunks), 6)
    return Loss(error / max(count, 1), held_error / held_count if held_count else None,
                max((power + held_power) / max(count + held_count, 1), 1e-30))


def kept_or_reverted(before: Loss, after: Loss) -> tuple[str, Loss]:
    """A tuned unit's status and the loss it ends with: reverted to `before` where its tuned loss is not
    finite, or where its judged loss (held-out, where batches are held out) rose; kept otherwise (an
    equal loss keeps the tuned weights)."""
    if not after.finite:
        return f"reverted: the tuned loss is {after.training}", before
    if after.judged > before.judged:
        return "reverted", before
    return "kept", after


class BestPoint:
    """The held-out loss of a unit every `every` steps (`measure` returns it for the tensors as they
    are now) and a copy of its trainable `tensors` at the lowest so far; `settle` ends the unit there.
    Ties keep the earlier point."""

    def __init__(self, measure: Callable[[], float], tensors: Sequence[torch.Tensor], every: int) -> None:
        self.measure, self.tensors, self.every = measure, list(tensors), every
        self.best, self.best_step, self.last_step = math.inf, -1, -1
        self.saved: list[torch.Tensor] = []

    def due(self, step: int) -> bool:
        """Whether the held-out loss is measured after `step` steps."""
        return step % self.every == 0

    def evaluate(self, step: int) -> float:
        """Measure the held-out loss after `step` steps; keep the tensors when it is the lowest yet."""
        loss = self.measure()
        self.last_step = step
        if loss < self.best:
            self.best, self.best_step = loss, step
            self.saved = [tensor.detach().clone() for tensor in self.tensors]
        return loss

    def settle(self, step: int) -> int | None:
        """End the unit after `step` steps at its best held-out point (the end point measured too);
        returns that point's step (None: no measured loss was finite, and the tensors stay)."""
        if self.last_step != step:
            self.evaluate(step)
        if not self.saved:
            return None
        if self.best_step != step:
            with torch.no_grad():
                for tensor, saved in zip(self.tensors, self.saved):
                    tensor.copy_(saved)
        return self.best_step
