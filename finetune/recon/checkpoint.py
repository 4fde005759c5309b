"""The checkpoint a killed run resumes from: the finished units' weights, report rows and warnings,
with the fingerprint of what the run started from, written after every unit."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pickle
import shutil
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

PROGRESS = "progress.pt"  # the checkpoint folder's record of the finished units
CHECKPOINT_KEYS = {"fingerprint", "results", "warnings"}  # what the progress file holds


class Checkpoint(Callback):
    """The run's progress after every unit, in a folder beside its output that a killed run resumes
    from: one file per finished unit (`unit-<index>.pt`, the weights it left), then `progress.pt` (their
    report rows and warnings, and the fingerprint of what the run started from), each written
    atomically with torch.save (which streams one tensor at a time). A unit's file is written before
    the progress that counts it, so a kill between the two loses nothing counted, and each weight is
    written once: rewriting one file of every finished weight after each unit wrote 45 GB over the
    2.5 GB benchmark's 37 units. Read back with Fabric's load, tensors and plain values only.

    No random state is saved: each unit draws from numpy generators seeded by (seed, unit index)
    (recon.data.batches, recon.methods.qdrop), and nothing else in a run draws random numbers (no lifted op does: Dropout is
    the identity), so a resumed unit draws what it would have drawn."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fingerprint: dict[str, Any] = {}  # what the run started from: set once its inputs are cached
        self._replace = False  # an earlier run's checkpoint is there, to be replaced at the first unit's end
        self._fabric: Any = None  # the run's Fabric, whose load reads the files (set by start)

    def start(self, tuner: Tuner, resume: bool) -> None:
        """With `resume`, hand `tuner` the finished units of the checkpoint (their weights: unit_weights);
        a checkpoint of another run is refused, and without one the run starts at the first unit. Without
        `resume`, an earlier run's checkpoint is replaced at the first unit's end (a warning)."""
        self._fabric = tuner.fabric
        if not self.path.exists():
            if resume:
                logger.warning("no checkpoint at %s to resume from: starting from the first unit", self.path)
            return
        if not resume:
            logger.warning("%s holds an earlier run's checkpoint: this run starts afresh and replaces it (resume to "
                           "continue that run instead)", self.path)
            self._replace = True
            return
        state = self._load()
        _check_same_run(self.path, state["fingerprint"], self.fingerprint)
        search = state.get("rate_search")
        tuner.resume([UnitResult(**row) for row in state["results"]], state["warnings"], search and RateSearch(**search))
        logger.info("resuming from %s: %d of %d units finished earlier and are restored, not tuned again",
                    self.path, tuner.resumed_units, len(tuner.units))

    def unit_weights(self, index: int) -> dict[str, torch.Tensor]:
        """The weights finished unit `index` left (read when it is restored: one unit's at a time)."""
        return self._read(self._unit_file(index))

    def _load(self) -> dict[str, Any]:
        """The checkpoint's progress; a folder that is not one of our checkpoints is an error naming it."""
        if not self.path.is_dir():
            raise ValueError(f"{self.path} is not a fine-tuning checkpoint (a checkpoint is a folder): delete it to "
                             "start afresh")
        state = self._read(self.path / PROGRESS)
        if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
            raise ValueError(f"{self.path} is not a fine-tuning checkpoint: delete it to start afresh")
        return state

    def _read(self, source: Path) -> Any:
        """One of the checkpoint's files; a missing or damaged one is an error naming the checkpoint."""
        try:
            return self._fabric.load(source, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, FileNotFoundError) as error:
            raise ValueError(f"cannot read the checkpoint {self.path} ({type(error).__name__} in {source.name}): it is "
                             "damaged or not a fine-tuning checkpoint; delete it to start afresh") from error

    def _unit_file(self, index: int) -> Path:
        return self.path / f"unit-{index:05d}.pt"

    def on_unit_end(self, tuner: TuningRun, index: int, module: LiftedModule) -> None:
        """Save unit `index`'s weights as the model holds them now, then the results up to it."""
        if self._replace:
            self.remove()
            self._replace = False
        self.path.mkdir(parents=True, exist_ok=True)
        weights = {name: tuned_tensor(module, name).detach().cpu() for name in parameters_of(tuner.units[index])}
        write_atomic(self._unit_file(index), lambda tmp: torch.save(weights, tmp))
        state = {"fingerprint": self.fingerprint, "results": [dataclasses.asdict(r) for r in tuner.results],
                 "warnings": list(tuner.warnings),  # CHECKPOINT_KEYS
                 "rate_search": dataclasses.asdict(tuner.rate_search) if tuner.rate_search else None}  # lr: auto's choice
        write_atomic(self.path / PROGRESS, lambda tmp: torch.save(state, tmp))

    def on_run_end(self, tuner: TuningRun, results: list[UnitResult]) -> None:
        """After a run that stopped short, say where its finished units are kept."""
        if len(results) < len(tuner.units) and (self.path / PROGRESS).is_file():
            logger.warning("the run stopped after %d of %d units; they are kept in %s: run again with --resume "
                           "(resume=True) to continue from there", len(results), len(tuner.units), self.path)

    def remove(self) -> None:
        """Delete the checkpoint (a folder, or a file an earlier version wrote), if there is one."""
        if self.path.is_dir():
            shutil.rmtree(self.path)
        else:
            self.path.unlink(missing_ok=True)


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
