"""The Tuner's callbacks: the moments of a run they hear about, and the built-in ones (early
stopping, the CSV/TensorBoard metric log, the progress bar, the checkpoint a killed run resumes
from). Lightning Fabric holds them all (Fabric(callbacks=...)); a user's own callbacks, passed to
finetune_model, join the built-in ones.

Every hook is optional; the Tuner calls them by name, in this order:

    on_run_start(tuner, units)                       before the first unit
    on_unit_start(tuner, index, unit)                before a unit's loss is first measured
    on_step_end(tuner, index, step, loss)            after each optimizer step of a unit (loss: its batch's MSE)
    on_held_out(tuner, index, step, loss)            where batches are held out, after every tuner.evaluation_every-th
                                                     step: the unit's MSE on them (see watch)
    on_unit_end(tuner, index, unit, result, module)  once the unit is kept, reverted or skipped: `result` is its
                                                     report row, `module` the lifted model holding the weights it kept
    on_run_end(tuner, results)                       after the last unit, also when the run fails

Fabric's `call` passes a hook only the keyword arguments it names. on_step_end runs on every step
and is called directly with all four keywords instead, as Fabric calls its own per-step
on_after_optimizer_step: `call` inspects the hook's signature each time (20-60 us, 1-3 % of a step
on small units). A callback ends a unit's optimisation at once by setting `tuner.should_stop`, as
Lightning's EarlyStopping sets `trainer.should_stop`, or after a tail that finishes the unit's
schedule with `tuner.finish_schedule(steps)`. Units a resumed run restores from its
checkpoint are not told again: the run's callbacks heard them in the run that tuned them."""

from __future__ import annotations

import collections
import csv
import dataclasses
import hashlib
import importlib.util
import logging
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from tqdm.auto import tqdm

from finetune.config import FastFinetune, to_dict
from finetune.files import write_atomic
from finetune.lift import LiftedModule

from .cache import CachedValue
from .loop import Tuner, UnitResult
from .rates import RateSearch
from .units import Unit, parameters_of, tuned_tensor

logger = logging.getLogger(__name__)

LOG_EVERY = 10  # steps between logged rows and progress-bar loss updates
LOSS_WINDOW = 10  # steps whose mean loss early stopping watches (one batch's loss is noisy)
CHECKPOINT_KEYS = {"fingerprint", "results", "warnings", "weights"}  # what a checkpoint holds


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
    """Ends a unit's optimisation once its loss has not improved on its best by at least `min_delta`
    for `patience` steps, counting only from step `warmup` on; the unit's schedule then runs its
    rest in `patience` more steps (Tuner.finish_schedule). Where batches are held out the loss is
    the unit's on them, measured every tuner.evaluation_every steps, and patience counts those
    evaluations: ceil(patience / evaluation_every) of them without improvement. Otherwise it is the
    mean training loss of the last `window` steps: each step's loss is one batch's, and batches
    differ, so a single lucky batch would set a best that later steps rarely beat."""

    def __init__(self, patience: int, min_delta: float, warmup: int, window: int = LOSS_WINDOW) -> None:
        self.patience, self.min_delta, self.warmup, self.window = patience, min_delta, warmup, window
        self.on_unit_start()

    def on_unit_start(self) -> None:
        """Forget the previous unit's losses."""
        self.best, self.wait, self.recent = math.inf, 0, collections.deque(maxlen=self.window)

    def on_step_end(self, tuner: Tuner, index: int, step: int, loss: float) -> None:
        """Without held-out batches: stop the tuner once `patience` steps in a row did not improve on
        the best windowed training loss."""
        if tuner.evaluation_every:
            return
        self.recent.append(loss)
        if step < self.warmup or len(self.recent) < self.window:
            return
        self._judge(tuner, math.fsum(self.recent) / self.window, self.patience)

    def on_held_out(self, tuner: Tuner, step: int, loss: float) -> None:
        """Stop the tuner once the held-out evaluations of `patience` steps did not improve on the best."""
        if step >= self.warmup:
            self._judge(tuner, loss, math.ceil(self.patience / tuner.evaluation_every))

    def _judge(self, tuner: Tuner, loss: float, patience: int) -> None:
        """Count one more loss without improvement, or start the count afresh; stop at `patience`."""
        if loss < self.best - self.min_delta:
            self.best, self.wait = loss, 0
            return
        self.wait += 1
        if self.wait == patience:
            tuner.finish_schedule(self.patience)


class MetricLog:
    """Every LOG_EVERY-th step's loss and each unit's losses before and after, as CSV in `log_dir`
    (and as TensorBoard events when it is installed), at the count of steps run so far. A resumed
    run's CSV keeps the rows of the units restored from the checkpoint (Lightning's CSV logger
    starts its file anew); TensorBoard keeps every event file anyway."""

    def __init__(self, log_dir: Path) -> None:
        self.csv = CSVLogger(log_dir, name="", version="")
        self.loggers: list[Logger] = [self.csv]
        if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
            self.loggers.append(TensorBoardLogger(log_dir, name="tensorboard", version=""))
        self.steps = 0

    def on_run_start(self, tuner: Tuner) -> None:
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

    def on_step_end(self, tuner: Tuner, index: int, step: int, loss: float) -> None:
        """Count the step; log its loss every LOG_EVERY steps of a unit."""
        self.steps += 1
        if step % LOG_EVERY == 0:
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


class ProgressBar:
    """One bar over the iterations of all units, naming the unit and showing every LOG_EVERY-th
    step's loss; a unit that stops early or is skipped advances it by its unused iterations, and
    units restored from a checkpoint count as done."""

    bar: tqdm  # opened when the run starts

    def on_run_start(self, tuner: Tuner, units: list[Unit]) -> None:
        """Open the bar."""
        iterations = tuner.config.iterations
        self.bar = tqdm(total=len(units) * iterations, initial=tuner.resumed_units * iterations, unit="it",
                        dynamic_ncols=True, mininterval=0.5, disable=not tuner.fabric.is_global_zero)

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


class Checkpoint:
    """The run's progress after every unit, in one file beside its output that a killed run resumes
    from: the weights of the finished units, their report rows and warnings, and the fingerprint of
    what the run started from. Written whole (Fabric's save into a temporary file renamed over the
    last checkpoint) and read back with Fabric's load, tensors and plain values only.

    No random state is saved: each unit draws from numpy generators seeded by (seed, unit index)
    (recon.qdrop), and nothing else in a run draws random numbers (no lifted op does: Dropout is
    the identity), so a resumed unit draws what it would have drawn."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fingerprint: dict[str, Any] = {}  # what the run started from: set once its inputs are cached

    def start(self, tuner: Tuner, resume: bool) -> dict[str, torch.Tensor]:
        """With `resume`, hand `tuner` the finished units of the checkpoint and return their weights;
        a checkpoint of another run is refused, and without one the run starts at the first unit.
        Without `resume`, an earlier run's checkpoint is replaced at the first unit's end (a warning)."""
        if not self.path.is_file():
            if resume:
                logger.warning("no checkpoint at %s to resume from: starting from the first unit", self.path)
            return {}
        if not resume:
            logger.warning("%s holds an earlier run's checkpoint: this run starts afresh and replaces it (resume to "
                           "continue that run instead)", self.path)
            return {}
        state = self._load(tuner)
        _check_same_run(self.path, state["fingerprint"], self.fingerprint)
        search = state.get("rate_search")
        tuner.resume([UnitResult(**row) for row in state["results"]], state["warnings"], search and RateSearch(**search))
        logger.info("resuming from %s: %d of %d units finished earlier and are restored, not tuned again",
                    self.path, tuner.resumed_units, len(tuner.units))
        return state["weights"]

    def _load(self, tuner: Tuner) -> dict[str, Any]:
        """The checkpoint's state; a file that is not one of our checkpoints is an error naming it."""
        try:
            state = tuner.fabric.load(self.path, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
            raise ValueError(f"cannot read the checkpoint {self.path} ({type(error).__name__}): it is damaged or not a "
                             "fine-tuning checkpoint; delete it to start afresh") from error
        if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
            raise ValueError(f"{self.path} is not a fine-tuning checkpoint: delete it to start afresh")
        return state

    def on_unit_end(self, tuner: Tuner, index: int, module: LiftedModule) -> None:
        """Save the weights of units 0..index as the model holds them now, with their results."""
        weights = {name: tuned_tensor(module, name).detach().cpu()
                   for unit in tuner.units[: index + 1] for name in parameters_of(unit)}
        state = {"fingerprint": self.fingerprint, "results": [dataclasses.asdict(r) for r in tuner.results],
                 "warnings": list(tuner.warnings), "weights": weights,  # CHECKPOINT_KEYS
                 "rate_search": dataclasses.asdict(tuner.rate_search) if tuner.rate_search else None}  # lr: auto's choice
        write_atomic(self.path, lambda tmp: tuner.fabric.save(tmp, state))

    def on_run_end(self, tuner: Tuner, results: list[UnitResult]) -> None:
        """After a run that stopped short, say where its finished units are kept."""
        if len(results) < len(tuner.units) and self.path.is_file():
            logger.warning("the run stopped after %d of %d units; they are kept in %s: run again with --resume "
                           "(resume=True) to continue from there", len(results), len(tuner.units), self.path)


def run_fingerprint(sources: dict[str, str | None], config: FastFinetune, inputs: list[CachedValue]) -> dict[str, Any]:
    """What a run's result depends on, so a checkpoint resumes only its own run: the digests of the
    models (`sources`), the settings, the calibration inputs, torch's version and thread count
    (float sums, and so the last bits, follow the thread count). cache_budget_bytes is left out:
    spilling to disk changes no bit, and lowering it is how a run killed for memory resumes."""
    settings = {key: value for key, value in to_dict(config).items() if key != "cache_budget_bytes"}
    data = hashlib.sha256()
    for value in inputs:
        for chunk in value.chunks:
            data.update(f"{chunk.dtype}{chunk.shape}".encode())
            data.update(np.asarray(chunk).tobytes())
    return {**sources, "config": settings, "samples": inputs[0].rows, "data": data.hexdigest()[:16],
            "torch": str(torch.__version__), "threads": torch.get_num_threads()}


def digest(data: bytes) -> str:
    """A short digest of some bytes (a model's), for a fingerprint."""
    return hashlib.sha256(data).hexdigest()[:16]


def _check_same_run(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a checkpoint whose fingerprint differs from this run's, naming what differs."""
    saved_items, current_items = _flat(saved), _flat(current)
    differences = [f"{key} {saved_items.get(key)!r} there, {current_items.get(key)!r} now"
                   for key in sorted(saved_items.keys() | current_items.keys()) if saved_items.get(key) != current_items.get(key)]
    if differences:
        raise ValueError(f"the checkpoint {path} is another run's ({'; '.join(differences)}): resume with that run's model, "
                         "data and settings, or run without --resume (resume=False) to start afresh")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
