"""The processes of a run through Lightning Fabric: the Fabric on one device, or on `devices`
processes launched by a DDP strategy (each holding a share of the calibration batches: see
recon.data.shards), and the launch that brings their results back."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric import Fabric

from finetune.config import FastFinetune

J = TypeVar("J")


def make_fabric(config: FastFinetune, device: torch.device, callbacks: Sequence[Any]) -> Fabric:
    """The Fabric that runs the units: on `device` alone, or on config.devices devices of its kind
    (cuda:0..N-1, or N CPU processes with gloo) on each of config.nodes machines, through config.strategy."""
    placement: dict[str, Any] = {"devices": config.devices, "num_nodes": config.nodes, "strategy": config.strategy}
    if config.processes == 1:
        placement = {"devices": 1 if device.type == "cpu" else [device.index or 0]}
    return Fabric(accelerator="cpu" if device.type == "cpu" else "cuda", precision="32-true", callbacks=list(callbacks),
                  **placement)


def launch(fabric: Fabric, work: Callable[[Fabric, J], Any], job: J) -> list[Any]:
    """Run work(fabric, job) in every process Fabric's launcher starts and return, by rank, the
    results that reach this process: every process's where the launcher spawned them from here, its
    own where the launcher runs the command again in each (ddp). `job` must be a plain class, not a
    dataclass: the launcher rebuilds dataclass arguments field by field, which frozen ones (a config)
    refuse. Results come back through files: a launcher hands them back through a pipe that it reads
    only after every process ended, and one over the pipe's 64 KiB would block its sender forever."""
    with tempfile.TemporaryDirectory(prefix="finetune-launch-") as folder:
        fabric.launch(_saving, work, job, Path(folder))
        files = sorted(Path(folder).glob("rank*.pt"), key=lambda path: int(path.stem[4:]))
        return [torch.load(path, weights_only=False) for path in files]


def _saving(fabric: Fabric, work: Callable[[Fabric, J], Any], job: J, folder: Path) -> None:
    """One process: its work's result into `folder`, under its rank."""
    torch.save(work(fabric, job), folder / f"rank{fabric.global_rank}.pt")
