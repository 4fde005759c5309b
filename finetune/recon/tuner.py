"""The tuner: each unit in turn measured, handed to the run's methods (see methods.base for the
moments they are asked at), optimised (see optimisation) and kept only where its loss went down, the
moments of the run told to the callbacks Fabric holds (early stopping, logs and the progress bar
among them: see callbacks).

Fabric rather than a Trainer per unit: on the digits units a Trainer step cost 2.8-5.5 ms
against 1.6-1.9 ms for Fabric and 1.5 ms for a bare loop (2 CPU cores; see the issue 5 report)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Self

import torch
from lightning.fabric import Fabric
from torch import fx

from finetune.config import FastFinetune
from finetune.lift import LiftedModule
from finetune.notices import Warnings

from .data.batches import Draw
from .data.cache import ActivationCache, CachedValue, SavedWeights
from .data.heldout import local_chunks
from .data.losses import Loss, evaluate, kept_or_reverted
from .data.rows import UnitData, unit_data
from .methods import Method, UnitWork, run_methods
from .optimisation import Optimisation, Schedule
from .rates import RateSearch, search_rate, unit_lr
from .results import UnitResult
from .units import Unit, parameters_of, tuned_tensor

logger = logging.getLogger(__name__)


class Tuner:
    """Tunes the units one after another with one Fabric holding the callbacks; a run is the `with`
    block around the tune calls (on_run_start on entry, on_run_end on exit). A resumed run restores
    the units an earlier run finished instead of tuning them."""

    def __init__(self, config: FastFinetune, fabric: Fabric, units: list[Unit], callbacks: Sequence[Any],
                 held_out: frozenset[int] = frozenset(), methods: list[Method] | None = None,
                 cache: ActivationCache | None = None) -> None:
        self.config = config
        self.cache = cache  # where a unit's weights before tuning are kept (SavedWeights); None: clones
        self.units = units
        self.held_out = held_out  # calibration batches (numbered over every process) kept out of training
        self.methods = methods if methods is not None else run_methods(config)  # the algorithm first
        self.results: list[UnitResult] = []
        self.warnings = Warnings()  # what the tuning undid or left out, unit by unit
        self.resumed_units = 0  # the first units, finished by an earlier run
        self.should_stop = False  # a callback sets it to end the unit's optimisation after the current step
        self.stop_tail = 0  # ... or after this many more steps, which finish its schedule (see finish_schedule)
        self.evaluation_every = 0  # steps between the unit's held-out evaluations (0: none held out; see data.losses)
        self.rate_search: RateSearch | None = None  # what lr: auto tried, once it has (see rates)
        self._factor = 1.0  # on the default rates: what lr: auto chose
        self.fabric = fabric  # holds the callbacks; over several processes, their process group
        self._step_hooks = [c.on_step_end for c in callbacks if callable(getattr(c, "on_step_end", None))]  # api checked them

    def __enter__(self) -> Self:
        self.fabric.call("on_run_start", tuner=self, units=self.units)
        return self

    def __exit__(self, *_: object) -> None:
        self.fabric.call("on_run_end", tuner=self, results=self.results)

    def resume(self, results: list[UnitResult], warnings: list[dict[str, str]], rate_search: RateSearch | None = None) -> None:
        """Continue a run whose first len(results) units an earlier run finished: their results and
        warnings become this run's, and the factor its lr: auto search chose (call before the `with`
        block, so callbacks see them at its start)."""
        self.results = list(results)
        self.resumed_units = len(results)
        self.warnings.extend(warnings)
        if rate_search is not None:
            self.rate_search, self._factor = rate_search, rate_search.factor

    def restore(self, k: int, module: LiftedModule, weights: dict[str, torch.Tensor]) -> None:
        """Put back the weights an earlier run kept for finished unit k, at the point where tuning it
        would have left them, so the streams that follow see what they saw then."""
        for name in parameters_of(self.units[k]):
            tuned_tensor(module, name).data.copy_(weights[name])
        result = self.results[k]
        logger.info("unit %d/%d %s: restored from the checkpoint (loss %.4g -> %.4g, %s)",
                    k + 1, len(self.units), result.name, result.loss_before, result.loss_after, result.status)

    def tune(self, k: int, module: LiftedModule, train: fx.GraphModule, inputs: CachedValue, float_inputs: CachedValue,
             targets: Sequence[CachedValue], starts: dict[str, torch.Tensor] | None = None,
             sides: Sequence[CachedValue] = ()) -> UnitResult:
        """Optimise unit k's weights (from `starts`, by parameter name, where given) to reproduce its
        float targets (one per output) from its quantized inputs and side inputs (`sides`, in the
        unit's order); keep them only if the loss over all cached samples went down and is finite. A
        loss that is not finite before tuning is an error: the unit's weights or values hold NaN or Inf."""
        unit = self.units[k]
        data = unit_data(train, unit.input_axis, unit.output_axes, inputs, float_inputs, targets,
                         list(zip(unit.side_inputs, sides)), self.fabric)
        try:
            return self._tune(k, module, data, starts or {})
        finally:
            data.release()

    def _tune(self, k: int, module: LiftedModule, data: UnitData, starts: dict[str, torch.Tensor]) -> UnitResult:
        """tune, on the unit's values viewed rows first."""
        begin = time.perf_counter()
        unit = self.units[k]
        self.should_stop, self.stop_tail = False, 0
        self.fabric.call("on_unit_start", tuner=self, index=k, unit=unit)
        with SavedWeights({name: tuned_tensor(module, name) for name in parameters_of(unit)}, self.cache) as original:
            work = self._work(k, module, data, starts)
            skip = data.problem or next((why for m in self.methods if (why := m.skip_reason(unit, module)) is not None), None)
            if skip:
                self.warnings.add(unit.name, f"not tuned: {skip}")
                return self._finish(k, module, work.before, work.before, f"skipped: {skip}", 0, begin, {})
            self._start(work)
            if self.config.lr == "auto" and self.rate_search is None and work.optimising:
                self.rate_search = self._search_rate(work)
            iterations, best = self._optimisation(work, self).run(Schedule(self.config.iterations, self.lr(k, module))) \
                if work.optimising else (0, None)
            after = work.measure()
            for method in self.methods:
                after = method.end(work, after)
            records = {key: value for method in self.methods for key, value in method.record().items()}
            status, kept = kept_or_reverted(work.before, after)
            if status != "kept":
                original.restore({name: tuned_tensor(module, name) for name in parameters_of(unit)})
            if not after.finite:
                self.warnings.add(unit.name, f"{status}; the weights before tuning are kept (a lower lr may help)")
            rejected = after.judged if status == "reverted" else None
            return self._finish(k, module, work.before, kept, status, iterations, begin, records, rejected,
                                best if status == "kept" else None)

    def _work(self, k: int, module: LiftedModule, data: UnitData, starts: dict[str, torch.Tensor]) -> UnitWork:
        """Unit k's work, with its loss before tuning; a loss that is not finite is an error."""
        unit, fabric = self.units[k], self.fabric
        held = local_chunks(self.held_out, len(data.targets.chunks), fabric.global_rank, fabric.world_size)

        def measure() -> Loss:
            return evaluate(data.train, data.inputs, data.targets, fabric, held)

        before = measure()
        if not before.finite:
            raise ValueError(f"unit {k + 1}/{len(self.units)} {unit.name}: its reconstruction loss before tuning is "
                             f"{before.training}, so its weights, its quantized inputs or its float targets hold NaN or Inf; "
                             "check the model's weights and the calibration data")
        optimising = self.methods[0].optimising()  # type: ignore[attr-defined]  (the first is the algorithm)
        return UnitWork(k, unit, self.units, module, data, fabric, self.held_out, held, self.warnings, starts, measure, before,
                        optimising)

    def _start(self, work: UnitWork) -> None:
        """The unit's weights from the float model's values where it stores codes (its float biases are
        bias correction's), then every method's begin, then their starts in order."""
        started = [layer.weight for layer in work.unit.layers if layer.weight in work.starts]
        for name in started:
            tuned_tensor(work.module, name).data.copy_(work.starts[name])
        work.moved = bool(started)
        for method in self.methods:
            method.begin(work)
        for method in self.methods:
            work.moved = method.start(work) or work.moved

    def _optimisation(self, work: UnitWork, listener: Tuner | None) -> Optimisation:
        """An optimisation of the unit by the run's methods, heard by `listener` (None: quiet)."""
        return Optimisation(work, self.methods, Draw.of(self.config), self.config.device_cache_bytes, listener)

    def lr(self, k: int, module: LiftedModule, factor: float | None = None) -> float:
        """Unit k's learning rate (see rates), with the factor lr: auto chose (or `factor`)."""
        return unit_lr(self.config.lr, self.methods[0], self.units[k], module, self._factor if factor is None else factor)

    def _search_rate(self, work: UnitWork) -> RateSearch:
        """lr: auto on the unit: tune it briefly at each factor from the weights it starts from, quietly
        (no callback hears it, its warnings are dropped), and put those weights back after each."""
        unit, module = work.unit, work.module
        start = {name: tuned_tensor(module, name).detach().clone() for name in parameters_of(unit)}

        def attempt(factor: float, steps: int) -> float:
            trial = dataclasses.replace(work, warnings=Warnings())
            try:
                self._optimisation(trial, None).run(Schedule(steps, self.lr(work.index, module, factor)))
                return trial.measure().judged
            finally:
                for name, value in start.items():
                    tuned_tensor(module, name).data.copy_(value)

        search = search_rate(unit.name, self.config.iterations, attempt)
        self._factor = search.factor
        logger.info("lr auto: factor %g on the default rates (losses on unit %s after %d steps: %s)", search.factor,
                    unit.name, search.steps, search.losses)
        return search

    def finish_schedule(self, tail: int) -> None:
        """End the unit's optimisation after `tail` more steps (the budget's end if sooner) that run
        what its schedule had left: AdaQuant's learning-rate decay, which settles the weights, or
        AdaRound's annealing, which decides the roundings (its own steps: Annealing.finish_from).
        Early stopping ends units this way: stopping at once would keep weights still moving at a
        high rate, or undecided roundings."""
        self.should_stop, self.stop_tail = True, tail

    def hear_steps(self, index: int, first: int, losses: list[torch.Tensor]) -> None:
        """Read the losses of steps first, first + 1, ... (each already summed over processes: see
        Optimisation._step) in one synchronisation, and tell the step callbacks each in turn."""
        for offset, loss in enumerate(torch.stack(losses).tolist()):
            for hook in self._step_hooks:
                hook(tuner=self, index=index, step=first + offset, loss=loss)

    def hear_held_out(self, index: int, step: int, loss: float) -> None:
        """Tell the callbacks a held-out evaluation's loss."""
        self.fabric.call("on_held_out", tuner=self, index=index, step=step, loss=loss)

    def _finish(self, k: int, module: LiftedModule, before: Loss, after: Loss, status: str, iterations: int, begin: float,
                records: dict[str, Any], tried: float | None = None, best: int | None = None) -> UnitResult:
        """The unit's result, logged and told to the callbacks with the model that holds its weights."""
        unit = self.units[k]
        seconds = time.perf_counter() - begin
        worse = f" (tuned {tried:.4g} was worse)" if tried is not None else ""
        held = f", held out {before.held_out:.4g} -> {after.held_out:.4g}" if before.held_out is not None else ""
        held += f" (best at iteration {best})" if best is not None else ""
        logger.info("unit %d/%d %s: loss %.4g -> %.4g%s, %s%s, %d iterations, %.2f s",
                    k + 1, len(self.units), unit.name, before.training, after.training, held, status, worse, iterations, seconds)
        result = UnitResult(unit.name, unit.op_type, before.training, after.training, status, iterations, seconds, tried,
                            before.held_out, after.held_out, best, self.lr(k, module) if iterations else None, **records)
        self.results.append(result)
        self.fabric.call("on_unit_end", tuner=self, index=k, unit=unit, result=result, module=module)
        return result
