"""Each process's share of a data-parallel run: which calibration batches it holds, the training
rows of a unit over all processes, and the sums every process must agree on.

Each process holds the calibration batches c with c % world == rank and computes both streams
over them alone. Every process draws the same global batch of row numbers from the same seeded
generator and trains on the rows it holds; its loss is its rows' squared error over the global
batch's element count, and summing the gradients over processes gives the gradient the global
batch gives in one process. Losses before and after tuning are sums over all processes, so each
process makes the same keep-or-revert decision, and the weights stay identical everywhere.

Every sum that crosses processes is made in pieces that do not depend on their number. A step's
batch is cut into `gradient_pieces` pieces (the rows of calibration batch c in piece c modulo that
number), each piece's gradient is computed alone and the pieces are added in order in float64
(sum_in_order); a loss is summed per cached batch, in batch order. When the processes divide the
pieces, each piece lies in one process, and one process adds the same pieces in the same order:
N processes give its bytes on any CPU, whatever order its kernels sum a piece in."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric

from .cache import CachedValue


def sum_across(fabric: Fabric, values: Sequence[float]) -> list[float]:
    """Each value summed over every process (float64, so the order of processes barely matters)."""
    if fabric.world_size == 1:
        return list(values)
    total = fabric.all_reduce(torch.tensor(values, dtype=torch.float64), reduce_op="sum")
    return [float(v) for v in total]


def sum_in_order(fabric: Fabric, pieces: Sequence[tuple[int, torch.Tensor]], count: int, width: int,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The float64 sum of `count` vectors of `width` values, slot by slot in slot order, where each slot
    is held by one process (`pieces`: this process's, as (slot, vector) of `dtype`). Over several
    processes the slots travel in one all-reduce in which each is one process's vector plus zeros
    (exact), then every process adds them in order as one process adds its own, so the total is the
    one-process bytes whatever the number of processes (a -0 turned +0 there changes no sum from +0)."""
    if fabric.world_size > 1:
        slots = torch.zeros(count, width, dtype=dtype, device=fabric.device)
        for slot, vector in pieces:
            slots[slot] = vector
        pieces = list(enumerate(fabric.all_reduce(slots, reduce_op="sum")))
    total = torch.zeros(width, dtype=torch.float64, device=fabric.device)
    for _, vector in sorted(pieces, key=lambda piece: piece[0]):
        total += vector.double()
    return total


def sum_over_batches(fabric: Fabric, rows: dict[int, torch.Tensor], chunks: int, width: int) -> list[float]:
    """Column sums of float64 rows of `width` values given per cached chunk of this process (`rows`
    by chunk, of its `chunks`; chunk i is calibration batch rank + world * i), over every process,
    added in calibration batch order (see sum_in_order): the same bytes on any number of processes."""
    rank, world = fabric.global_rank, fabric.world_size
    count = _batch_count(fabric, chunks)
    return sum_in_order(fabric, [(rank + world * i, row) for i, row in rows.items()], count, width).tolist()


@dataclass(frozen=True)
class Rows:
    """A unit's rows over all processes: `trainable` lists, ascending, the global numbers of the
    rows training batches draw from (those of the batches not held out whose values share the first
    such batch's shape beyond the leading axis); `local` maps a global row number to its row in this
    process's cache (-1: another process holds it) and `batch` to its calibration batch; `total`
    counts every row, `held_out` those of the held-out batches; `rank` is this process's of `world`."""

    trainable: np.ndarray
    local: np.ndarray
    batch: np.ndarray
    total: int
    held_out: int = 0
    rank: int = 0
    world: int = 1

    @classmethod
    def of(cls, fabric: Fabric, inputs: CachedValue, targets: CachedValue, sides: Sequence[CachedValue] = (),
           held_out: frozenset[int] = frozenset()) -> Rows:
        """The rows of a unit's cached inputs, targets and side inputs viewed rows first (this process's
        share of them), the rows of the `held_out` batches (numbered over every process) not trainable."""
        rank, world = fabric.global_rank, fabric.world_size
        return cls.from_table(_gather_chunks(fabric, chunk_table(inputs, targets, rank, world, sides)), rank, world, held_out)

    @classmethod
    def from_table(cls, table: list[tuple[int, int, int]], rank: int, world: int, held_out: frozenset[int] = frozenset()) -> Rows:
        """The rows described by every process's chunk_table, in batch order, as process `rank` sees them."""
        offsets = np.concatenate([[0], np.cumsum([rows for _, rows, _ in table])]).astype(np.int64)
        first = next(key for c, _, key in table if c not in held_out)
        trainable = np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k, (c, _, key) in enumerate(table)
                                    if key == first and c not in held_out])
        local = np.full(int(offsets[-1]), -1, dtype=np.int64)
        start = 0
        for c, rows, _ in table:
            if c % world == rank:
                local[offsets[c]: offsets[c + 1]] = np.arange(start, start + rows)
                start += rows
        batch = np.repeat(np.array([c for c, _, _ in table], dtype=np.int64), [rows for _, rows, _ in table])
        return cls(trainable, local, batch, int(offsets[-1]), sum(rows for c, rows, _ in table if c in held_out), rank, world)


def chunk_table(inputs: CachedValue, targets: CachedValue, rank: int, world: int,
                sides: Sequence[CachedValue] = ()) -> list[tuple[int, int, int]]:
    """(calibration batch index, rows, shape key) of each batch process `rank` of `world` holds."""
    return [(rank + world * i, len(inputs.chunks[i]), _shape_key(inputs.chunks[i], targets.chunks[i], *(s.chunks[i] for s in sides)))
            for i in range(len(inputs.chunks))]


def _shape_key(*chunks: Any) -> int:
    """A number standing for the chunks' shapes beyond the leading axis (equal shapes, equal numbers)."""
    text = repr([tuple(np.shape(chunk)[1:]) for chunk in chunks]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "little")


def _gather_chunks(fabric: Fabric, mine: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Every process's (batch index, rows, shape key), in batch order."""
    if fabric.world_size == 1:
        return mine
    most = -(-_batch_count(fabric, len(mine)) // fabric.world_size)
    padded = torch.full((most, 3), -1, dtype=torch.int64)
    if mine:
        padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    every = fabric.all_gather(padded).reshape(-1, 3).tolist()
    return sorted(tuple(row) for row in every if row[0] >= 0)


def _batch_count(fabric: Fabric, held: int) -> int:
    """The number of calibration batches over all processes."""
    return int(sum_across(fabric, [held])[0])
