"""The built-in callbacks (the moments they hear: recon.hooks): early stopping, the CSV/TensorBoard
metric log and the progress bar (the checkpoint a killed run resumes from is recon.checkpoint)."""

from __future__ import annotations

import collections
import csv
import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from tqdm.auto import tqdm

from finetune.config import STEP_GROUP, FastFinetune

from .hooks import Callback, TuningRun
from .results import UnitResult
from .units import Unit

logger = logging.getLogger(__name__)



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


class EarlyStopping(Callback):
    """Ends a unit's optimisation once its loss has not improved on its best by at least `min_delta`
    for `patience` steps, counting only from step `warmup` on; the unit's schedule then runs its
    rest in `patience` more steps (TuningRun.finish_schedule). Where batches are held out the loss is
    the unit's on them, measured every tuner.evaluation_every steps, and patience counts those
    evaluations: ceil(patience / evaluation_every) of them without improvement. Otherwise it is the
    mean training loss of the last `window` steps: each step's loss is one batch's, and batches
    differ, so a single lucky batch would set a best that later steps rarely beat."""

    def __init__(self, patience: int, min_delta: float, warmup: int, window: int = STEP_GROUP) -> None:
        self.patience, self.min_delta, self.warmup, self.window = patience, min_delta, warmup, window
        self.on_unit_start()

    def on_unit_start(self) -> None:
        """Forget the previous unit's losses."""
        self.best, self.wait, self.recent = math.inf, 0, collections.deque(maxlen=self.window)

    def on_step_end(self, tuner: TuningRun, index: int, step: int, loss: float) -> None:
        """Without held-out batches: stop the tuner once `patience` steps in a row did not improve on
        the best windowed training loss."""
        if tuner.evaluation_every:
            return
        self.recent.append(loss)
        if step < self.warmup or len(self.recent) < self.window:
            return
        self._judge(tuner, math.fsum(self.recent) / self.window, self.patience)

    def on_held_out(self, tuner: TuningRun, step: int, loss: float) -> None:
        """Stop the tuner once the held-out evaluations of `patience` steps did not improve on the best."""
        if step >= self.warmup:
            self._judge(tuner, loss, math.ceil(self.patience / tuner.evaluation_every))

    def _judge(self, tuner: TuningRun, loss: float, patience: int) -> None:
        """Count one more loss without improvement, or start the count afresh; stop at `patience`."""
        if loss < self.best - self.min_delta:
            self.best, self.wait = loss, 0
            return
        self.wait += 1
        if self.wait == patience:
            tuner.finish_schedule(self.patience)


class MetricLog(Callback):
    """Every STEP_GROUP-th step's loss and each unit's losses before and after, as CSV in `log_dir`
    (and as TensorBoard events when it is installed), at the count of steps run so far. A resumed
    run's CSV keeps the rows of the units restored from the checkpoint (Lightning's CSV logger
    starts its file anew); TensorBoard keeps every event file anyway."""

    def __init__(self, log_dir: Path) -> None:
        self.csv = CSVLogger(log_dir, name="", version="")
        self.loggers: list[Logger] = [self.csv]
        if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
            self.loggers.append(TensorBoardLogger(log_dir, name="tensorboard", version=""))
        self.steps = 0

    def on_run_start(self, tuner: TuningRun) -> None:
        """On a resumed run, carry the restored units' CSV rows over and count their steps."""
        if not tuner.resumed_units:
            return
        self.steps = sum(result.iterations for result in tuner.results)
        path = Path(self.csv.log_dir) / "metrics.csv"
        if not path.is_file():
            return
        with path.open(newline="") as file:
            rows = [row for row in csv.DictReader(file) if int(row["unit"]) < tuner.resumed_units]
        for row in rows:
            metrics = {key: int(value) if key == "unit" else float(value)
                       for key, value in row.items() if value and key != "step"}
            self.csv.log_metrics(metrics, step=int(row["step"]))

    def on_step_end(self, tuner: TuningRun, index: int, step: int, loss: float) -> None:
        """Count the step; log its loss every STEP_GROUP steps of a unit."""
        self.steps += 1
        if step % STEP_GROUP == 0:
            self._log({"unit": index, "loss": loss})

    def on_held_out(self, index: int, loss: float) -> None:
        """Log a held-out evaluation's loss (at the count of steps run so far)."""
        self._log({"unit": index, "held_out": loss})

    def on_unit_end(self, index: int, result: UnitResult) -> None:
        """Log the unit's loss before and after (on the held-out batches too, where some are)."""
        held = {"held_out_before": result.held_out_before, "held_out_after": result.held_out_after}
        self._log({"unit": index, "loss_before": result.loss_before, "loss_after": result.loss_after,
                   **(held if result.held_out_before is not None else {})})

    def on_run_end(self) -> None:
        """Flush the logs."""
        for run_logger in self.loggers:
            run_logger.finalize("success")

    def _log(self, metrics: dict[str, float]) -> None:
        for run_logger in self.loggers:
            run_logger.log_metrics(metrics, step=self.steps)


class ProgressBar(Callback):
    """One bar over the iterations of all units, naming the unit and showing every STEP_GROUP-th
    step's loss; a unit that stops early or is skipped advances it by its unused iterations, and
    units restored from a checkpoint count as done."""

    bar: tqdm  # opened when the run starts

    def on_run_start(self, tuner: TuningRun, units: list[Unit]) -> None:
        """Open the bar."""
        iterations = tuner.config.iterations
        self.bar = tqdm(total=len(units) * iterations, initial=tuner.resumed_units * iterations, unit="it",
                        dynamic_ncols=True, mininterval=0.5, disable=not tuner.fabric.is_global_zero)

    def on_unit_start(self, tuner: TuningRun, index: int, unit: Unit) -> None:
        """Name the unit."""
        self.bar.set_description(f"unit {index + 1}/{len(tuner.units)} {unit.name}")

    def on_step_end(self, tuner: TuningRun, index: int, step: int, loss: float) -> None:
        """Advance by the step; show its loss every STEP_GROUP steps."""
        self.bar.update(1)
        if step % STEP_GROUP == 0:
            self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

    def on_unit_end(self, tuner: TuningRun, result: UnitResult) -> None:
        """Advance past the iterations the unit did not run."""
        self.bar.update(tuner.config.iterations - result.iterations)

    def on_run_end(self) -> None:
        """Close the bar."""
        self.bar.close()
