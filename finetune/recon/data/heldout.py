"""The held-out guard: some calibration batches are kept out of training (fast_finetune.validation_share),
units are kept or reverted on their loss there, and after the last unit the model's output error
against the float model on those batches is compared with the untuned model's; tuning that made it
worse is undone. A unit's training loss always falls; on rows it did not train on it need not (the
repository's Quark MX4 digits CNN, 1000 iterations: every unit kept, held-out accuracy 96.44 % -> 94.43 %)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric
from torch import nn

from finetune.config import FastFinetune
from finetune.lift import LiftedModule
from finetune.lift.fake_quant import quantizers_disabled
from finetune.notices import Warnings

from ..units import Unit, parameters_of, tuned_tensor
from .cache import ActivationCache, CachedValue
from .losses import error_sums
from .shards import sum_across, sum_over_batches


def held_out_batches(batches: int, share: float, seed: int) -> frozenset[int]:
    """The calibration batches (numbered over every process) held out of training: the share of
    them rounded down, drawn with the run's seed, so every process and every rerun holds out the same."""
    count = math.floor(share * batches + 1e-9)
    if not count:
        return frozenset()
    rng = np.random.default_rng([seed, 7])
    return frozenset(int(b) for b in rng.choice(batches, size=count, replace=False))


def local_chunks(held_out: frozenset[int], chunks: int, rank: int, world: int) -> frozenset[int]:
    """Which of this process's cached chunks are held-out batches (chunk i is batch rank + world * i)."""
    return frozenset(i for i in range(chunks) if rank + world * i in held_out)


class ModelGuard:
    """The model's output error against the float model on the held-out chunks, measured once before
    any unit is tuned (with the float outputs kept) and once after the last; `check` writes the
    untuned weights back when the tuned model is further from float there. The error is the mean over
    the model's floating-point outputs of each one's squared error relative to its mean square."""

    def __init__(self, module: LiftedModule, reference: LiftedModule, inputs: Sequence[CachedValue], chunks: frozenset[int],
                 weights: Sequence[str], fabric: Fabric, batches: int) -> None:
        self.module, self.inputs, self.chunks, self.fabric, self.batches = module, list(inputs), sorted(chunks), fabric, batches
        self.chunk_count = len(self.inputs[0].chunks)  # this process's cached chunks, held out or not
        self.untuned = {name: _Kept(inputs[0].cache, name, tuned_tensor(module, name)) for name in dict.fromkeys(weights)}
        for value in self.inputs:
            value.holders += 1  # read after the streams are done with them: see release
        with quantizers_disabled(reference) if reference is module else contextlib.nullcontext():
            self.targets = [self._outputs(reference, chunk) for chunk in self.chunks]
            self.outputs = len(self.targets[0]) if self.targets else len(self._outputs(reference, 0))
        self.before = self._error()

    def check(self, warnings: Warnings) -> dict[str, Any]:
        """Compare the tuned model with the untuned one on the held-out chunks; where tuning made it
        worse, put the untuned weights back, with a warning (every process alike: the errors are
        summed over them). Returns the report's "held_out" entry."""
        after = self._error()
        restored = after > self.before
        if restored:
            for name, value in self.untuned.items():
                tuned_tensor(self.module, name).data.copy_(value.tensor(self.fabric.device))
            warnings.add("held-out batches", f"tuning made the model's output error against the float model on the "
                         f"{self.batches} calibration batches held out of training worse ({self.before:.4g} -> {after:.4g}): "
                         "the untuned weights are written back (more calibration data, fewer iterations or a lower lr "
                         "may help)", "model")
        return {"batches": self.batches, "output_error_untuned": self.before, "output_error_tuned": after,
                "restored_untuned_weights": restored}

    def release(self, cache: ActivationCache) -> None:
        """Let the cache free the model inputs and the untuned weights the guard kept."""
        for value in [*self.inputs, *(kept.value for kept in self.untuned.values())]:
            cache.release(value.name)

    def _outputs(self, module: nn.Module, chunk: int) -> list[torch.Tensor]:
        """The module's floating-point outputs on one cached chunk."""
        with torch.no_grad():
            result = module(*(value.tensor(chunk, self.fabric.device) for value in self.inputs))
        results = result if isinstance(result, tuple | list) else (result,)
        return [r for r in results if isinstance(r, torch.Tensor) and r.is_floating_point()]

    def _error(self) -> float:
        """The module's error on the held-out chunks of every process: float64 sums per chunk, added
        in calibration batch order (shards.sum_over_batches), so any number of processes decides alike."""
        rows = {}
        for chunk, targets in zip(self.chunks, self.targets):
            rows[chunk] = torch.cat([error_sums(output, target)[:2] for output, target in zip(self._outputs(self.module, chunk), targets)])
        totals = np.array(sum_over_batches(self.fabric, rows, self.chunk_count, 2 * self.outputs)).reshape(-1, 2)
        return float(np.mean([error / power if power > 0 else error for error, power in totals])) if len(totals) else 0.0


class _Kept:
    """A copy of an untuned weight in the run's activation cache, as its bytes: in memory within the
    cache's budget, spilled past it (a model's weights may be gigabytes, and the copy is read back
    only where tuning made the model worse)."""

    def __init__(self, cache: ActivationCache, name: str, tensor: torch.Tensor) -> None:
        self.dtype, self.shape = tensor.dtype, tensor.shape
        self.value = cache.value(f"untuned weight {name}")
        self.value.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone())

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The weight as it was, on `device`."""
        return self.value.tensor(0, device).view(self.dtype).reshape(self.shape)


def hold_out(module: LiftedModule, reference: LiftedModule, units: list[Unit], inputs: list[CachedValue],
              config: FastFinetune, fabric: Fabric, warnings: Warnings) -> tuple[frozenset[int], ModelGuard | None]:
    """The calibration batches held out of training and the guard measuring the untuned model on them
    (which keeps the model inputs cached until released), or none where validation_share holds none out
    (a warning where it asked for some but the data has too few batches)."""
    batches = int(sum_across(fabric, [len(inputs[0].chunks)])[0])
    held_out = held_out_batches(batches, config.validation_share, config.seed)
    if not held_out:
        if config.validation_share > 0:
            warnings.add("fast_finetune.validation_share", f"{config.validation_share} of the {batches} calibration batch(es) "
                         "is less than one, so none is held out: units are kept on their training loss and the tuned model "
                         "is not checked on data it did not train on (give more batches, of fewer samples each)", "config")
        return held_out, None
    chunks = local_chunks(held_out, len(inputs[0].chunks), fabric.global_rank, fabric.world_size)
    weights = [name for unit in units for name in parameters_of(unit)]
    return held_out, ModelGuard(module, reference, inputs, chunks, weights, fabric, len(held_out))
