"""Each unit's optimisation, run by Lightning Fabric: device placement, seeding and backward, a
revert of any unit whose loss got worse, and the moments of the run told to Fabric's callbacks
(early stopping, logs and the progress bar among them: see callbacks).

Fabric rather than a Trainer per unit: on the digits units a Trainer step cost 2.8-5.5 ms
against 1.6-1.9 ms for Fabric and 1.5 ms for a bare loop (2 CPU cores; see the issue 5 report)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import fx, nn

from finetune.config import FastFinetune
from finetune.lift import LiftedModule

from .adaround import REG_WEIGHT, Annealing, SoftRounding
from .bias import BiasCorrector, corrects_bias
from .cache import CachedValue
from .gptq import quantize_unit
from .heldout import local_chunks
from .optimizers import CosineTail, HostAdam
from .parallel import Rows, sum_across, sum_gradients
from .prescale import LearnedPrescales
from .qdrop import Batches, dropped_quantization
from .rates import RateSearch, search_rate, unit_lr
from .report import Warnings
from .scales import LearnedScales
from .sides import UnitData, UnitInputs, unit_data
from .units import Unit, parameters_of, tuned_tensor
from .watch import BestPoint, Loss, evaluate, evaluation_interval, held_out_loss

logger = logging.getLogger(__name__)

# Steps whose losses an accelerator keeps before the host reads them in one synchronisation; the
# step callbacks then hear them one by one, so a callback that stops a unit stops it at the end of
# such a group there. On the CPU, where reading a loss costs no synchronisation, every step is read.
READ_EVERY = 10

Roundings = list[tuple[SoftRounding, torch.Tensor]]  # AdaRound's soft rounding of each quantized weight, and the weight


@dataclass
class UnitResult:
    """What happened to one unit (a row of the report)."""

    name: str
    op_type: str
    loss_before: float
    loss_after: float
    status: str  # kept | reverted | reverted: <reason> | skipped: <reason>
    iterations: int
    seconds: float
    rejected_loss: float | None = None  # the tuned loss (held-out, where batches are) of a unit reverted for getting worse
    held_out_before: float | None = None  # the loss on the held-out batches (None: none held out)
    held_out_after: float | None = None
    best_iteration: int | None = None  # the step of the held-out evaluation the kept unit ended at (None: none held out)
    lr: float | None = None  # the learning rate it was tuned with (None: GPTQ, or not tuned)
    bias_correction: dict[str, Any] | None = None  # layers corrected or not (why), and each correction's losses (see bias)
    equalization: list[dict[str, Any]] | None = None  # learn_equalization: each layer pair's learned scales (see prescale)


class Tuner:
    """Tunes the units one after another with one Fabric holding the callbacks; a run is the `with`
    block around the tune calls (on_run_start on entry, on_run_end on exit). A resumed run restores
    the units an earlier run finished instead of tuning them."""

    def __init__(self, config: FastFinetune, fabric: Fabric, units: list[Unit], callbacks: Sequence[Any],
                 held_out: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.units = units
        self.held_out = held_out  # calibration batches (numbered over every process) kept out of training
        self.results: list[UnitResult] = []
        self.warnings = Warnings()  # what the tuning undid or left out, unit by unit
        self.resumed_units = 0  # the first units, finished by an earlier run
        self.should_stop = False  # a callback sets it to end the unit's optimisation after the current step
        self.stop_tail = 0  # ... or after this many more steps, which finish its schedule (see finish_schedule)
        self.evaluation_every = 0  # steps between the unit's held-out evaluations (0: none held out; see watch)
        self.rate_search: RateSearch | None = None  # what lr: auto tried, once it has (see rates)
        self._factor = 1.0  # on the default rates: what lr: auto chose, or is trying
        self._listening = True  # whether callbacks hear steps and evaluations (not during lr: auto's tries)
        self.fabric = fabric  # holds the callbacks; over several processes, their process group
        self.corrects_bias = corrects_bias(config)
        self._bias_record: dict[str, Any] | None = None  # the bias correction of the unit being tuned (see bias)
        self._equalization_record: list[dict[str, Any]] | None = None  # its learned equalization (see prescale)
        self._step_hooks = [hook for hook in (getattr(c, "on_step_end", None) for c in callbacks) if callable(hook)]

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
            return self._tune(k, module, data, starts)
        finally:
            data.release()

    def _tune(self, k: int, module: LiftedModule, data: UnitData, starts: dict[str, torch.Tensor] | None) -> UnitResult:
        """tune, on the unit's values viewed rows first."""
        begin = time.perf_counter()
        unit = self.units[k]
        train, inputs, float_inputs, targets = data.train, data.inputs, data.float_inputs, data.targets
        self.should_stop, self.stop_tail = False, 0
        self.fabric.call("on_unit_start", tuner=self, index=k, unit=unit)
        original = {name: tuned_tensor(module, name).detach().clone() for name in parameters_of(unit)}
        held = local_chunks(self.held_out, len(targets.chunks), self.fabric.global_rank, self.fabric.world_size)
        before = evaluate(train, inputs, targets, self.fabric, held)
        if not before.finite:
            raise ValueError(f"unit {k + 1}/{len(self.units)} {unit.name}: its reconstruction loss before tuning is "
                             f"{before.training}, so its weights, its quantized inputs or its float targets hold NaN or Inf; "
                             "check the model's weights and the calibration data")
        self._bias_record = self._equalization_record = None
        skip = data.problem or self._skip_reason(unit)
        if skip:
            self.warnings.add(unit.name, f"not tuned: {skip}")
            return self._finish(k, module, before, before, f"skipped: {skip}", 0, begin)
        starts = starts or {}
        started = [layer.weight for layer in unit.layers if layer.weight in starts]  # float biases are bias correction's
        for name in started:
            tuned_tensor(module, name).data.copy_(starts[name])
        corrector = self._corrector(unit, module, data, held, starts)
        gptq = self.config.algorithm == "gptq" or self.config.gptq_init
        if gptq:
            quantize_unit(unit, module, train, inputs, self.fabric, self.config, self.warnings, held)

        def measure() -> Loss:
            return evaluate(train, inputs, targets, self.fabric, held)

        if corrector is not None:
            corrector.correct("start", measure, None if started or gptq else before)
        optimising = self.config.algorithm != "gptq" and self.config.iterations > 0
        if self.config.lr == "auto" and self.rate_search is None and optimising:
            self.rate_search = self._search_rate(k, module, data, before.power, held)
        iterations, best = self._optimise(
            k, unit, module, train, inputs, float_inputs, targets, before.power, held) if optimising else (0, None)
        after = corrector.correct("final", measure) if corrector is not None and optimising else measure()
        if not after.finite or after.judged > before.judged:
            for name, value in original.items():
                tuned_tensor(module, name).data.copy_(value)
            if not after.finite:
                status = f"reverted: the tuned loss is {after.training}"
                self.warnings.add(unit.name, f"{status}; the weights before tuning are kept (a lower lr may help)")
                return self._finish(k, module, before, before, status, iterations, begin)
            return self._finish(k, module, before, before, "reverted", iterations, begin, after.judged)
        return self._finish(k, module, before, after, "kept", iterations, begin, best=best)

    def _corrector(self, unit: Unit, module: LiftedModule, data: UnitData, held: frozenset[int],
                   starts: dict[str, torch.Tensor]) -> BiasCorrector | None:
        """The unit's bias correction (its float means taken now, before any weight moves, with the float
        biases behind int32 codes from `starts`), None when off. The layers it leaves out are in the unit's
        report; asked for explicitly (true), each is a warning too (`auto` corrects where a bias is)."""
        if not self.corrects_bias:
            return None
        floats = {layer.bias: starts[layer.bias] for layer in unit.layers if layer.bias in starts}
        corrector = BiasCorrector(unit, module, data.train, data.inputs, data.float_inputs, self.fabric, held, floats)
        for layer in corrector.skipped if self.config.bias_correction is True else ():
            self.warnings.add(layer["layer"], f"bias not corrected: {layer['reason']}")
        self._bias_record = corrector.record
        return corrector

    def _skip_reason(self, unit: Unit) -> str | None:
        """Why AdaRound or GPTQ cannot tune a unit (no weight quantizer), else None (always None when
        only bias correction runs: iterations 0)."""
        if self.config.iterations == 0 and self.config.algorithm == "adaround":
            return None
        if self.config.algorithm in ("adaround", "gptq") and all(layer.weight_quantizer is None for layer in unit.layers):
            return "no weight of it is quantized (nothing to round)"
        return None

    def _optimise(self, k: int, unit: Unit, module: LiftedModule, train: nn.Module, inputs: UnitInputs,
                  float_inputs: CachedValue, targets: CachedValue, power: float, held: frozenset[int]) -> tuple[int, int | None]:
        """The optimisation loop; returns the iterations run and, where batches are held out (this
        process's chunks of them: `held`), the step of the held-out evaluation the unit ended at (see
        watch). AdaQuant's learning rate decays along a cosine, so the weights settle across the
        quantizer's steps (on the digits transformer at MX4 that recovered 93 % of the quantization
        loss, against 40 % at a constant rate)."""
        config = self.config
        roundings, trainable, frozen = self._trainables(unit, module)
        scales = LearnedScales(unit, module, config, self.units, self.warnings)  # learn_scales: the scales beside the weights
        prescales = LearnedPrescales(unit, module, config)  # learn_equalization: per-channel scales between layer pairs
        parallel = self.fabric.world_size > 1  # gradients are summed by hand: see parallel
        model = train if parallel else self.fabric.setup_module(train)
        adam = HostAdam if self.fabric.device.type == "cpu" else torch.optim.Adam
        optimizer = self.fabric.setup_optimizers(adam([{"params": trainable}, *scales.groups, *prescales.groups], lr=self.lr(k, module)))
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.iterations) if not roundings else None
        device = self.fabric.device
        rows = Rows.of(self.fabric, inputs.main, targets, inputs.rowed[1:], self.held_out)
        batches = Batches(inputs, float_inputs, targets, config, k, rows, device, config.device_cache_bytes)
        if batches.left_out:
            self.warnings.add(unit.name, f"{batches.left_out} of the {inputs.main.rows} rows of its inputs (slices along their "
                              "leading axis) are left out of its training batches: they come from calibration batches whose "
                              "values differ in shape from the first batch's beyond that axis (a value laid out sequence-first, "
                              "(tokens, batch, ...), in a last partial batch); they still count in its loss before and after "
                              "(calibration batches of one size train on every row)")
        try:
            with contextlib.ExitStack() as installed:
                installed.enter_context(scales)
                installed.enter_context(prescales)
                for rounding, _ in roundings:
                    installed.enter_context(rounding)
                if unit.op_type == "block" and not installed.enter_context(
                        dropped_quantization(train, config, k, device, batches, self.fabric)):
                    self.warnings.add(unit.name, "its rows could not be located in some activation (does it mix the rows "
                                      "of a batch?), so each process draws its own QDrop bytes inside it: the processes "
                                      "do not train on the one-process mixture")
                read_every = steps_per_read(device)
                annealing = Annealing(config.iterations) if roundings else None
                learned = [p for group in (*scales.groups, *prescales.groups) for p in group["params"]]  # restored with the weights
                watch = self._watch(train, inputs, targets, held, rows, roundings, [*trainable, *learned])
                losses: list[torch.Tensor] = []
                step, end, stopping = 0, config.iterations, False
                while step < end:
                    losses.append(self._step(model, optimizer, batches.next(), power, roundings, annealing, step, batches.size))
                    step += 1
                    if schedule is not None:
                        schedule.step()
                    if len(losses) == read_every or step == end:
                        self._hear_steps(k, step - len(losses), losses)
                        losses = []
                    if watch is not None and watch.due(step):
                        loss = watch.evaluate(step)
                        if self._listening:
                            self.fabric.call("on_held_out", tuner=self, index=k, step=step, loss=loss)
                    if self.should_stop and not stopping:
                        stopping, end = True, self._stop(k, unit, step, annealing)
                        schedule = CosineTail(optimizer, end - step) if schedule is not None else None
                best = watch.settle(step) if watch is not None else None
            for rounding, weight in roundings:
                weight.data.copy_(rounding.hardened(weight))
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)
        self._equalization_record = prescales.ratios or None
        return step, best

    def _watch(self, train: nn.Module, inputs: UnitInputs, targets: CachedValue, held: frozenset[int], rows: Rows,
               roundings: Roundings, trainable: list[torch.Tensor]) -> BestPoint | None:
        """The unit's held-out evaluations (AdaRound's with its roundings hard, as the unit will end),
        or None where no batch is held out."""
        self.evaluation_every = evaluation_interval(rows.held_out, self.config.batch_size) if self.held_out else 0
        if not self.evaluation_every:
            return None

        def measure() -> float:
            with contextlib.ExitStack() as hard:
                for rounding, _ in roundings:
                    hard.enter_context(rounding.hard())
                return held_out_loss(train, inputs, targets, self.fabric, held)

        return BestPoint(measure, trainable, self.evaluation_every)

    def lr(self, k: int, module: LiftedModule) -> float:
        """Unit k's learning rate (see rates), with the factor lr: auto chose."""
        return unit_lr(self.config, self.units[k], module, self._factor)

    def _search_rate(self, k: int, module: LiftedModule, data: UnitData, power: float, held: frozenset[int]) -> RateSearch:
        """lr: auto on unit k: tune it briefly at each factor from the weights it starts from, with
        nothing told to the callbacks and no warning kept, and put those weights back after each."""
        unit, config, warnings = self.units[k], self.config, self.warnings
        start = {name: tuned_tensor(module, name).detach().clone() for name in parameters_of(unit)}

        def attempt(factor: float, steps: int) -> float:
            self._factor, self.config = factor, dataclasses.replace(config, iterations=steps)
            self.warnings, self._listening = Warnings(), False
            self.should_stop, self.stop_tail = False, 0
            try:
                self._optimise(k, unit, module, data.train, data.inputs, data.float_inputs, data.targets, power, held)
                return evaluate(data.train, data.inputs, data.targets, self.fabric, held).judged
            finally:
                self.config, self.warnings, self._listening = config, warnings, True
                for name, value in start.items():
                    tuned_tensor(module, name).data.copy_(value)

        search = search_rate(unit.name, config.iterations, attempt)
        self._factor, self.should_stop, self.stop_tail = search.factor, False, 0
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

    def _stop(self, k: int, unit: Unit, step: int, annealing: Annealing | None) -> int:
        """The step at which a unit told to stop after `step` steps ends, with its schedule's rest
        squeezed into the steps up to there."""
        if annealing is not None and self.stop_tail:
            end = annealing.finish_from(step, self.stop_tail)
        else:
            end = min(self.config.iterations, step + self.stop_tail)
        logger.info("unit %d/%d %s: told to stop after %d iterations%s", k + 1, len(self.units), unit.name, step,
                    f"; its schedule ends at iteration {end}" if end > step else "")
        return end

    def _trainables(self, unit: Unit, module: LiftedModule) -> tuple[Roundings, list[torch.Tensor], list[torch.Tensor]]:
        """(AdaRound's soft roundings with their weights, the tensors to train, the unit's parameters frozen meanwhile):
        AdaRound trains V of each quantized weight only; AdaQuant the weights, and the biases with
        update_bias."""
        weights = [module.get_parameter(layer.weight) for layer in unit.layers]
        biases = [module.get_parameter(layer.bias) for layer in unit.layers if layer.bias]
        roundings = []
        if self.config.algorithm == "adaround":
            roundings = [(SoftRounding(module.get_submodule(layer.weight_quantizer), weight).to(weight.device), weight)
                         for layer, weight in zip(unit.layers, weights) if layer.weight_quantizer]
            trainable = [rounding.v for rounding, _ in roundings]
        else:
            trainable = weights + (biases if self.config.update_bias else [])
        frozen = [p for p in weights + biases if all(p is not t for t in trainable)]
        for parameter in frozen:
            parameter.requires_grad_(False)
        return roundings, trainable, frozen

    def _hear_steps(self, k: int, first: int, losses: list[torch.Tensor]) -> None:
        """Read the losses of steps first, first + 1, ... (summed over processes: each holds its rows'
        share) in one synchronisation, and tell the step callbacks each in turn."""
        for offset, loss in enumerate(sum_across(self.fabric, torch.stack(losses).double().tolist())):
            for hook in self._step_hooks if self._listening else ():
                hook(tuner=self, index=k, step=first + offset, loss=loss)

    def _step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor],
              power: float, roundings: Roundings, annealing: Annealing | None, step: int, batch_size: int) -> torch.Tensor:
        """One Adam step on MSE relative to the target power (plus AdaRound's regulariser, averaged
        over every rounded weight element of the unit). Over several processes each holds some rows
        of the batch of `batch_size`: its share of the loss is its rows' squared error over the whole
        batch's element count, and the gradients are summed over processes before the step."""
        x, target = batch
        optimizer.zero_grad(set_to_none=True)
        world = self.fabric.world_size
        if world == 1:
            mse = F.mse_loss(model(*x)[0], target)
        else:
            mse = (model(*x)[0] - target).square().sum() / (batch_size * math.prod(target.shape[1:]))
        objective = mse / power
        exponent = annealing.exponent(step) if annealing is not None else None
        if exponent is not None:
            elements = sum(r.v.numel() for r, _ in roundings)
            regularizer = sum(r.regularizer(exponent) * (r.v.numel() / elements) for r, _ in roundings)
            objective = objective + REG_WEIGHT * regularizer / world  # summed over the processes: once in all
        self.fabric.backward(objective, model=model if world == 1 else None)
        if world > 1:
            sum_gradients(self.fabric, [p for group in optimizer.param_groups for p in group["params"]])
        optimizer.step()
        return mse.detach()

    def _finish(self, k: int, module: LiftedModule, before: Loss, after: Loss, status: str, iterations: int,
                begin: float, tried: float | None = None, best: int | None = None) -> UnitResult:
        """The unit's result, logged and told to the callbacks with the model that holds its weights."""
        unit = self.units[k]
        seconds = time.perf_counter() - begin
        worse = f" (tuned {tried:.4g} was worse)" if tried is not None else ""
        held = f", held out {before.held_out:.4g} -> {after.held_out:.4g}" if before.held_out is not None else ""
        held += f" (best at iteration {best})" if best is not None else ""
        logger.info("unit %d/%d %s: loss %.4g -> %.4g%s, %s%s, %d iterations, %.2f s",
                    k + 1, len(self.units), unit.name, before.training, after.training, held, status, worse, iterations, seconds)
        result = UnitResult(unit.name, unit.op_type, before.training, after.training, status, iterations, seconds, tried,
                            before.held_out, after.held_out, best, self.lr(k, module) if iterations else None,
                            self._bias_record, self._equalization_record)
        self.results.append(result)
        self.fabric.call("on_unit_end", tuner=self, index=k, unit=unit, result=result, module=module)
        return result


def steps_per_read(device: torch.device) -> int:
    """Steps between the host's readings of the losses on `device` (see READ_EVERY)."""
    return 1 if device.type == "cpu" else READ_EVERY
