"""One optimisation of a unit: Adam steps on its loss over seeded batches, with the parts its methods
add (the tensors they train, their hooks and loss terms), held-out evaluations that keep the best
point, and an early stop when a callback asks for one. The tuner runs it once per unit, and `lr:
auto` runs it briefly at each rate it tries, with nobody listening."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from finetune.config import STEP_GROUP

from .data.batches import Batches, Draw
from .data.losses import BestPoint, evaluation_interval, held_out_loss
from .data.shards import Rows, sum_in_order
from .methods import AlgorithmPart, Method, Part, UnitWork
from .optimizers import HostAdam

logger = logging.getLogger(__name__)


def steps_per_read(device: torch.device) -> int:
    """Steps whose losses the host reads in one synchronisation: STEP_GROUP on an accelerator, where
    each read waits for the device (a callback that stops a unit stops it at the end of such a group);
    every step on the CPU, where a read costs nothing."""
    return 1 if device.type == "cpu" else STEP_GROUP


@dataclass(frozen=True)
class Schedule:
    """What one optimisation runs: its steps and the unit's learning rate."""

    iterations: int
    lr: float


class Listener(Protocol):
    """Who hears an optimisation (the tuner, which tells the callbacks) and may stop it."""

    evaluation_every: int  # set by the optimisation: steps between its held-out evaluations (0: none)
    should_stop: bool  # set by a callback: end after the current step ...
    stop_tail: int  # ... or after this many more steps, which finish the schedule

    def hear_steps(self, index: int, first: int, losses: list[torch.Tensor]) -> None:
        """The losses of steps first, first + 1, ..."""

    def hear_held_out(self, index: int, step: int, loss: float) -> None:
        """A held-out evaluation's loss after `step` steps."""


class Optimisation:
    """An optimisation of one unit (`work`) by the run's methods (the algorithm first), drawing its
    batches as `draw` says (on an accelerator, its rows staged there within `device_budget` bytes);
    `listener` None runs it quietly (lr: auto's tries): no callback hears it and none stops it."""

    def __init__(self, work: UnitWork, methods: Sequence[Method], draw: Draw, device_budget: int,
                 listener: Listener | None) -> None:
        self.work, self.methods, self.draw, self.device_budget, self.listener = work, methods, draw, device_budget, listener
        self.fabric = work.fabric

    def run(self, schedule: Schedule) -> tuple[int, int | None]:
        """The steps run and, where batches are held out, the step of the held-out evaluation the unit
        ended at (see BestPoint); the methods' parts are hardened after it."""
        batches = self._batches()
        parts = [part for method in self.methods if (part := method.part(self.work, batches, schedule.iterations)) is not None]
        parallel = self.fabric.world_size > 1  # gradients are summed by hand: see data.shards
        model = self.work.data.train if parallel else self.fabric.setup_module(self.work.data.train)
        adam = HostAdam if self.fabric.device.type == "cpu" else torch.optim.Adam
        optimizer = self.fabric.setup_optimizers(adam([group for part in parts for group in part.groups], lr=schedule.lr))
        with contextlib.ExitStack() as installed:
            for part in parts:
                installed.enter_context(part)
            watch = self._watch(parts, batches.rows)
            step = self._steps(model, optimizer, batches, parts, schedule.iterations, watch)
            best = watch.settle(step) if watch is not None else None
        for part in parts:
            part.harden()
        return step, best

    def _batches(self) -> Batches:
        """The unit's training batches; a warning for rows they leave out."""
        work, data = self.work, self.work.data
        rows = Rows.of(self.fabric, data.inputs.main, data.targets, data.inputs.rowed[1:], work.held_out)
        batches = Batches(data.inputs, data.float_inputs, data.targets, self.draw, work.index, rows, self.fabric.device,
                          self.device_budget)
        if batches.left_out:
            work.warnings.add(work.unit.name, f"{batches.left_out} of the {data.inputs.main.rows} rows of its inputs (slices "
                              "along their leading axis) are left out of its training batches: they come from calibration "
                              "batches whose values differ in shape from the first batch's beyond that axis (a value laid out "
                              "sequence-first, (tokens, batch, ...), in a last partial batch); they still count in its loss "
                              "before and after (calibration batches of one size train on every row)")
        return batches

    def _steps(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, parts: list[Part],
               iterations: int, watch: BestPoint | None) -> int:
        """Run the steps (to the end, or to where an early stop's tail ends); returns how many ran."""
        algorithm: AlgorithmPart = parts[0]  # type: ignore[assignment]  (the algorithm's part comes first)
        rates = algorithm.schedule(optimizer, iterations)
        read_every, listener, index = steps_per_read(self.fabric.device), self.listener, self.work.index
        losses: list[torch.Tensor] = []
        step, end, stopping = 0, iterations, False
        while step < end:
            losses.append(self._step(model, optimizer, batches.next(), parts, step, batches))
            step += 1
            if rates is not None:
                rates.step()
            if listener is not None and (len(losses) == read_every or step == end):
                listener.hear_steps(index, step - len(losses), losses)
                losses = []
            if watch is not None and watch.due(step):
                loss = watch.evaluate(step)
                if listener is not None:
                    listener.hear_held_out(index, step, loss)
            if listener is not None and listener.should_stop and not stopping:
                stopping, end = True, self._stop(algorithm, step, iterations)
                rates = algorithm.tail_schedule(optimizer, end - step)
        return step

    def _step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor],
              parts: list[Part], step: int, batches: Batches) -> torch.Tensor:
        """One Adam step on MSE relative to the target power, plus the parts' terms; returns the step's
        MSE over the whole batch. The MSE's gradient is computed piece by piece (Draw.pieces; each
        piece's squared error over the whole batch's element count), and the pieces of every process
        are added in their order in float64 (shards.sum_in_order), the parts' terms after them, so N
        processes that divide the pieces take one process's step bit for bit."""
        x, target = batch
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        elements = batches.size * math.prod(target.shape[1:])
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in parameters], target.dtype)  # the pieces' type
        pieces = []
        for piece in batches.pieces:
            batches.piece = piece
            error = (model(*batches.inputs_of(x, piece))[0] - target[piece.rows]).square().sum() / elements
            pieces.append((piece.slot, torch.cat([self._gradient(error / self.work.before.power, model, parameters),
                                                  error.detach().reshape(1)]).to(dtype)))
        width = sum(p.numel() for p in parameters) + 1
        total = sum_in_order(self.fabric, pieces, batches.slots, width, dtype=target.dtype)
        penalties = [term for part in parts if (term := part.penalty(step)) is not None]
        if penalties:  # every process computes the same, so it is added once
            total[:-1] += self._gradient(sum(penalties), model, parameters).double()
        offset = 0
        for parameter in parameters:
            parameter.grad = total[offset: offset + parameter.numel()].view_as(parameter).to(parameter.dtype)
            offset += parameter.numel()
        optimizer.step()
        return total[-1]

    def _gradient(self, objective: torch.Tensor, model: torch.nn.Module, parameters: list[torch.Tensor]) -> torch.Tensor:
        """The gradient of `objective` with respect to `parameters`, flattened into one vector."""
        for parameter in parameters:
            parameter.grad = None
        self.fabric.backward(objective, model=model if self.fabric.world_size == 1 else None)
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in parameters])

    def _watch(self, parts: list[Part], rows: Rows) -> BestPoint | None:
        """The unit's held-out evaluations, each seeing the unit as the parts will leave it (AdaRound's
        roundings hard), keeping every trained tensor at the best point; None where no batch is held out."""
        every = evaluation_interval(rows.held_out, self.draw.batch_size) if self.work.held_out else 0
        if self.listener is not None:
            self.listener.evaluation_every = every
        if not every:
            return None
        data, work = self.work.data, self.work

        def measure() -> float:
            with contextlib.ExitStack() as evaluating:
                for part in parts:
                    evaluating.enter_context(part.evaluating())
                return held_out_loss(data.train, data.inputs, data.targets, work.fabric, work.held)

        return BestPoint(measure, [p for part in parts for group in part.groups for p in group["params"]], every)

    def _stop(self, algorithm: AlgorithmPart, step: int, iterations: int) -> int:
        """The step at which a unit told to stop after `step` steps ends, with its schedule's rest
        squeezed into the steps up to there."""
        assert self.listener is not None
        end = algorithm.stop_at(step, self.listener.stop_tail, iterations)
        work = self.work
        logger.info("unit %d/%d %s: told to stop after %d iterations%s", work.index + 1, len(work.units), work.unit.name, step,
                    f"; its schedule ends at iteration {end}" if end > step else "")
        return end

