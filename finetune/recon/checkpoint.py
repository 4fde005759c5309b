"""The checkpoint a killed run resumes from: the finished units' weights, report rows and warnings,
with the fingerprint of what the run started from, written after every unit."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.config import FastFinetune, to_dict
from finetune.files import write_atomic
from finetune.lift import LiftedModule

from .data.cache import CachedValue
from .hooks import Callback, TuningRun
from .rates import RateSearch
from .results import UnitResult
from .tuner import Tuner
from .units import parameters_of, tuned_tensor

logger = logging.getLogger(__name__)

CHECKPOINT_KEYS = {"fingerprint", "results", "warnings", "weights"}  # what a checkpoint holds


class Checkpoint(Callback):
    """The run's progress after every unit, in one file beside its output that a killed run resumes
    from: the weights of the finished units, their report rows and warnings, and the fingerprint of
    what the run started from. Written whole (torch.save, streaming one tensor at a time, into a
    temporary file renamed over the last checkpoint: Fabric's save would first build the whole file in
    memory, a copy of every finished weight) and read back with Fabric's load, tensors and plain values only.

    No random state is saved: each unit draws from numpy generators seeded by (seed, unit index)
    (recon.data.batches, recon.methods.qdrop), and nothing else in a run draws random numbers (no lifted op does: Dropout is
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

    def on_unit_end(self, tuner: TuningRun, index: int, module: LiftedModule) -> None:
        """Save the weights of units 0..index as the model holds them now, with their results."""
        weights = {name: tuned_tensor(module, name).detach().cpu()
                   for unit in tuner.units[: index + 1] for name in parameters_of(unit)}
        state = {"fingerprint": self.fingerprint, "results": [dataclasses.asdict(r) for r in tuner.results],
                 "warnings": list(tuner.warnings), "weights": weights,  # CHECKPOINT_KEYS
                 "rate_search": dataclasses.asdict(tuner.rate_search) if tuner.rate_search else None}  # lr: auto's choice
        write_atomic(self.path, lambda tmp: torch.save(state, tmp))  # streamed: Fabric's save buffers the whole file in memory

    def on_run_end(self, tuner: TuningRun, results: list[UnitResult]) -> None:
        """After a run that stopped short, say where its finished units are kept."""
        if len(results) < len(tuner.units) and self.path.is_file():
            logger.warning("the run stopped after %d of %d units; they are kept in %s: run again with --resume "
                           "(resume=True) to continue from there", len(results), len(tuner.units), self.path)


def run_fingerprint(sources: dict[str, str | None], config: FastFinetune, inputs: list[CachedValue],
                    threads: int | str) -> dict[str, Any]:
    """What a run's result depends on, so a checkpoint resumes only its own run: the digests of the
    models (`sources`), the settings, the calibration inputs, torch's version and the thread counts
    (`threads`: float sums, and so the last bits, follow them; see recon.threads). cache_budget_bytes is left out:
    spilling to disk changes no bit, and lowering it is how a run killed for memory resumes."""
    settings = {key: value for key, value in to_dict(config).items() if key != "cache_budget_bytes"}
    data = hashlib.sha256()
    for value in inputs:
        for chunk in value.chunks:
            data.update(f"{chunk.dtype}{chunk.shape}".encode())
            data.update(np.asarray(chunk).tobytes())
    return {**sources, "config": settings, "samples": inputs[0].rows, "data": data.hexdigest()[:16],
            "torch": str(torch.__version__), "threads": threads}


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
