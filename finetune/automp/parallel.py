"""Sensitivity evaluations split over the processes the config's fast_finetune section names
(devices, strategy and device, as tuning uses them), launched through Lightning Fabric like the
tuning (recon.processes). Process r evaluates every candidate on the evaluation batches b with
b % world == r, on its own switchable model lifted from the same QDQ models (lifting is
deterministic), so each batch meets the ops and values it meets in one process; the outputs,
gathered back into batch order, are the one-process ones bit for bit (on the same device)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from finetune.config import FastFinetune

from .resume import Keys, candidate_outputs, cut_tails
from .switch import SwitchSource

if TYPE_CHECKING:
    from lightning.fabric import Fabric

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, ...]
Share = list[list[np.ndarray]]  # per batch a process holds, in order: each candidate's outputs


@dataclass(frozen=True)
class Processes:
    """The processes a sensitivity is split over: the fast_finetune section naming them, and the
    QDQ models each one lifts its own switchable model from."""

    config: FastFinetune
    source: SwitchSource

    @classmethod
    def of(cls, config: FastFinetune | None, source: SwitchSource) -> Processes | None:
        """The processes of a data-parallel fast_finetune section (None: the sensitivity runs here)."""
        return cls(config, source) if config is not None and config.processes > 1 else None

    def candidate_outputs(self, output_index: int, batches: Sequence[Batch], candidates: Sequence[tuple[str, Keys]],
                          top: dict[str, Keys]) -> list[np.ndarray]:
        """resume.candidate_outputs of every candidate over all batches, the batches split over the
        processes, whose shares come back through recon.processes.launch (the processes share this
        machine's disk, the config allowing one machine only)."""
        from finetune.recon.device import resolve_device  # finetune.recon imports lightning (seconds): only here
        from finetune.recon.processes import launch, make_fabric

        if not candidates:
            return []
        fabric = make_fabric(self.config, resolve_device(self.config.device), [])
        logger.info("sensitivity: %d candidates on %d evaluation batches, split over %d processes (%s)", len(candidates),
                    len(batches), self.config.processes, self.config.strategy)
        shares = launch(fabric, _evaluate_share, _Job(self, output_index, batches, candidates, top))
        return _in_batch_order(shares, len(batches))


class _Job:
    """What each process of a split sensitivity needs (a plain class: see recon.processes.launch)."""

    def __init__(self, processes: Processes, output_index: int, batches: Sequence[Batch],
                 candidates: Sequence[tuple[str, Keys]], top: dict[str, Keys]) -> None:
        self.source, self.allow_tf32 = processes.source, processes.config.allow_tf32
        self.output_index, self.batches, self.candidates, self.top = output_index, batches, candidates, top


def _evaluate_share(fabric: Fabric, job: _Job) -> Share:
    """In one process: lift the switchable model onto this process's device, set it to the top,
    and evaluate every candidate on each batch this process holds, one batch at a time, in the
    float32 precision tuning uses."""
    from finetune.recon.device import float32_precision

    switch = job.source.build().to(fabric.device)
    for node, keys in job.top.items():
        switch.set(node, keys)
    tails = cut_tails(switch, job.output_index)
    rank, world = fabric.global_rank, fabric.world_size
    with float32_precision(job.allow_tf32):
        return [candidate_outputs(switch, tails, [tuple(t.to(fabric.device) for t in batch)], job.candidates, job.top)
                for batch in job.batches[rank::world]]


def _in_batch_order(shares: Sequence[Share], batches: int) -> list[np.ndarray]:
    """Each candidate's outputs over all batches in batch order, from every process's share
    (process r holds batches r, r + world, ...), concatenated as one process concatenates them."""
    world = len(shares)
    ordered = [shares[b % world][b // world] for b in range(batches)]
    return [np.concatenate(outputs) for outputs in zip(*ordered, strict=True)]
