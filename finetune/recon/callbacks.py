"""The Tuner's callbacks: the moments of a run they hear about, and the built-in ones (early
stopping, the CSV/TensorBoard metric log, the progress bar). Lightning Fabric holds them all
(Fabric(callbacks=...)); a user's own callbacks, passed to finetune_model, join the built-in ones.

Every hook is optional; the Tuner calls them by name, in this order:

    on_run_start(tuner, units)                       before the first unit
    on_unit_start(tuner, index, unit)                before a unit's loss is first measured
    on_step_end(tuner, index, step, loss)            after each optimizer step of a unit (loss: its batch's MSE)
    on_unit_end(tuner, index, unit, result, module)  once the unit is kept, reverted or skipped: `result` is its
                                                     report row, `module` the lifted model holding the weights it kept
    on_run_end(tuner, results)                       after the last unit, also when the run fails

Fabric's `call` passes a hook only the keyword arguments it names. on_step_end runs on every step
and is called directly with all four keywords instead, as Fabric calls its own per-step
on_after_optimizer_step: `call` inspects the hook's signature each time (20-60 us, 1-3 % of a step
on small units). A callback ends a unit's optimisation by setting `tuner.should_stop`, as
Lightning's EarlyStopping sets `trainer.should_stop`."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from tqdm.auto import tqdm

from finetune.config import FastFinetune

from .loop import Tuner, UnitResult
from .units import Unit

LOG_EVERY = 10  # steps between logged rows and progress-bar loss updates


def builtin_callbacks(config: FastFinetune, log_dir: Path | None) -> list[Any]:
    """The progress bar, the metric log when there is a directory for it, and early stopping when
    the config enables it."""
    callbacks: list[Any] = [ProgressBar()]
    if log_dir is not None:
        callbacks.append(MetricLog(log_dir))
    stop = config.early_stop
    if stop.enabled:
        callbacks.append(EarlyStopping(stop.patience, stop.min_delta, stop.warmup))
    return callbacks


class EarlyStopping:
    """Ends a unit's optimisation after `patience` steps without an improvement of the loss by at
    least `min_delta`, counting only from step `warmup` on."""

    def __init__(self, patience: int, min_delta: float, warmup: int) -> None:
        self.patience, self.min_delta, self.warmup = patience, min_delta, warmup
        self.best, self.wait = math.inf, 0

    def on_unit_start(self) -> None:
        """Forget the previous unit's best loss."""
        self.best, self.wait = math.inf, 0

    def on_step_end(self, tuner: Tuner, index: int, step: int, loss: float) -> None:
        """Stop the tuner once `patience` steps in a row did not improve on the best loss."""
        if step < self.warmup:
            return
        if loss < self.best - self.min_delta:
            self.best, self.wait = loss, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            tuner.should_stop = True


class MetricLog:
    """Every LOG_EVERY-th step's loss and each unit's losses before and after, as CSV in `log_dir`
    (and as TensorBoard events when it is installed), at the count of steps run so far."""

    def __init__(self, log_dir: Path) -> None:
        self.loggers: list[Logger] = [CSVLogger(log_dir, name="", version="")]
        if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
            self.loggers.append(TensorBoardLogger(log_dir, name="tensorboard", version=""))
        self.steps = 0

    def on_step_end(self, tuner: Tuner, index: int, step: int, loss: float) -> None:
        """Count the step; log its loss every LOG_EVERY steps of a unit."""
        self.steps += 1
        if step % LOG_EVERY == 0:
            self._log({"unit": index, "loss": loss})

    def on_unit_end(self, index: int, result: UnitResult) -> None:
        """Log the unit's loss before and after."""
        self._log({"unit": index, "loss_before": result.loss_before, "loss_after": result.loss_after})

    def on_run_end(self) -> None:
        """Flush the logs."""
        for run_logger in self.loggers:
            run_logger.finalize("success")

    def _log(self, metrics: dict[str, float]) -> None:
        for run_logger in self.loggers:
            run_logger.log_metrics(metrics, step=self.steps)


class ProgressBar:
    """One bar over the iterations of all units, naming the unit and showing every LOG_EVERY-th
    step's loss; a unit that stops early or is skipped advances it by its unused iterations."""

    bar: tqdm  # opened when the run starts

    def on_run_start(self, tuner: Tuner, units: list[Unit]) -> None:
        """Open the bar."""
        self.bar = tqdm(total=len(units) * tuner.config.iterations, unit="it", dynamic_ncols=True, mininterval=0.5)

    def on_unit_start(self, tuner: Tuner, index: int, unit: Unit) -> None:
        """Name the unit."""
        self.bar.set_description(f"unit {index + 1}/{len(tuner.units)} {unit.name}")

    def on_step_end(self, tuner: Tuner, index: int, step: int, loss: float) -> None:
        """Advance by the step; show its loss every LOG_EVERY steps."""
        self.bar.update(1)
        if step % LOG_EVERY == 0:
            self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

    def on_unit_end(self, tuner: Tuner, result: UnitResult) -> None:
        """Advance past the iterations the unit did not run."""
        self.bar.update(tuner.config.iterations - result.iterations)

    def on_run_end(self) -> None:
        """Close the bar."""
        self.bar.close()
