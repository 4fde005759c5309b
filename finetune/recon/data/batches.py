"""A unit's training batches: rows drawn without replacement, reproducibly from the seed and the
unit index, with QDrop's (Wei et al., 2022) mixing of the main input per element from the quantized
and the float inputs (the mixing inside a block is recon.methods.qdrop's). A data-parallel process
draws the global batch and the bytes one process draws and keeps those of its own rows, so N
processes train on the one-process mixture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from finetune.config import FastFinetune

from .cache import CachedValue, SpilledArray
from .rows import UnitInputs
from .shards import Rows

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Draw:
    """How a run draws its training batches: rows per batch, the seed, QDrop's share of the main
    input taken from the quantized model (1: no mixing), and the pieces a step's batch is cut into
    (rows of calibration batch c go to piece c modulo `pieces`: see shards)."""

    batch_size: int
    seed: int
    drop_ratio: float
    pieces: int = 1

    @classmethod
    def of(cls, config: FastFinetune) -> Draw:
        """The fast_finetune section's draw."""
        return cls(config.batch_size, config.seed, config.drop_ratio, config.pieces)


@dataclass(frozen=True)
class Piece:
    """One piece of a step's batch as this process holds it: the rows from the calibration batches
    numbered `share` modulo the run's pieces, `slot` its place in the step's sum (the same in every
    process), `rows` its slice of this process's rows of the batch. A step's gradient is computed
    piece by piece and the pieces are added in slot order, so its float sums do not depend on how
    the pieces are spread over processes (see shards)."""

    slot: int
    share: int
    rows: slice


class Batches:
    """Random training batches of a unit, reproducible from the seed and the unit index: rows
    drawn without replacement, the input mixed per element from the quantized (probability
    drop_ratio, in steps of 1/256) and float inputs, QDrop-style.

    Rows come from the chunks shaped like the first beyond the leading axis: a value laid out
    sequence-first, (tokens, batch, ...), has a smaller second axis in a last, partial batch, and
    its rows cannot join the others (they still count in the loss before and after); `left_out`
    counts them. Over several processes every one draws the same global batch and the same mixing
    bytes, and keeps the rows it holds (see shards).

    On an accelerator the unit's rows are copied to it once, when they fit `device_budget` bytes,
    and each batch is gathered there; the mixing bytes come from a generator on the device (see
    KeepMasks), so a step copies only the batch's row numbers to the device and nothing back."""

    def __init__(self, inputs: UnitInputs, float_inputs: CachedValue, targets: CachedValue, draw: Draw, k: int,
                 rows: Rows, device: torch.device = CPU, device_budget: int = 0) -> None:
        self.inputs, self.float_inputs, self.targets = inputs, float_inputs, targets
        self.rows = rows
        self.left_out = rows.total - rows.held_out - len(rows.trainable)
        self.size = min(draw.batch_size, len(rows.trainable))
        self.device = device
        self.generator = np.random.default_rng([draw.seed, k])
        self.masks = KeepMasks(qdrop_threshold(draw.drop_ratio), device, self.generator, [draw.seed, k])
        self.mixing = self.masks.threshold < 256
        self.staged = _stage(self._values(), device, device_budget)
        self.shares = draw.pieces
        # Each piece lies in one process when the processes divide the pieces (calibration batch c is
        # process c % world's); otherwise each process's part of a piece is a slot of its own.
        self.slots = self.shares if self.shares % rows.world == 0 else self.shares * rows.world
        self.steps = 0  # batches drawn so far
        self.pieces: list[Piece] = []  # this process's pieces of the last batch
        self.piece: Piece | None = None  # the piece being trained on (see methods.qdrop)
        self.fixed = [None if gathered else value.tensor(0, device) for value, gathered in zip(inputs.values, inputs.gathered)]

    def next(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The next (inputs, target) batch on the device: the rows of the global batch this process
        holds, the main input mixed, then the side inputs."""
        picked = np.sort(self.rows.trainable[self.generator.permutation(len(self.rows.trainable))[: self.size]])
        shares = self.rows.batch[picked] % self.shares
        order = np.argsort(shares, kind="stable")  # piece by piece, each piece's rows ascending
        picked, shares = picked[order], shares[order]
        local = self.rows.local[picked]
        held = local >= 0
        self._cut(shares[held])
        values = self._gather(local[held])
        rowed = len(self.inputs.rowed)
        (x, *sides), float_x, target = values[:rowed], values[rowed:-1], values[-1]
        if self.mixing:
            keep = self.masks.draw((self.size, *x.shape[1:]))
            if not held.all():
                keep = keep[torch.from_numpy(np.flatnonzero(held)).to(keep.device, non_blocking=True)]
            x = mixed(keep, x, float_x[0])
        return self._assemble([x, *sides]), target

    def _cut(self, shares: np.ndarray) -> None:
        """The step's pieces this process holds (none where it holds no row), from the piece of each
        of its rows of the batch (ascending)."""
        self.steps += 1
        whole = self.slots == self.shares
        numbers, starts = np.unique(shares, return_index=True)
        ends = [*starts[1:], len(shares)]
        self.pieces = [Piece(int(share) if whole else int(share) * self.rows.world + self.rows.rank, int(share), slice(int(a), int(b)))
                       for share, a, b in zip(numbers, starts, ends)]

    def inputs_of(self, inputs: tuple[torch.Tensor, ...], piece: Piece) -> tuple[torch.Tensor, ...]:
        """A piece's rows of the batch's inputs (the inputs a batch takes whole as they are)."""
        return tuple(x[piece.rows] if fixed is None else x for x, fixed in zip(inputs, self.fixed))

    def _assemble(self, rowed: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The unit's inputs in its order: the given rows of those a batch takes rows of, the others as they are."""
        taken = iter(rowed)
        return tuple(next(taken) if fixed is None else fixed for fixed in self.fixed)

    def _gather(self, rows: np.ndarray) -> list[torch.Tensor]:
        """The given local rows, in their order, of the inputs, the float inputs (when mixing) and the
        targets, on the device (the cache reads rows ascending; a batch's pieces put them in another order)."""
        if self.staged is not None:
            index = torch.from_numpy(rows).to(self.device, non_blocking=True)
            return [value.index_select(0, index) for value in self.staged]
        ascending = np.argsort(rows, kind="stable")
        values = [value.gather(rows[ascending]) for value in self._values()]
        if np.any(ascending != np.arange(len(rows))):
            back = torch.from_numpy(np.argsort(ascending))
            values = [value.index_select(0, back) for value in values]
        if self.device.type == "cpu":
            return values
        return [value.pin_memory().to(self.device, non_blocking=True) for value in values]

    def _values(self) -> list[CachedValue]:
        """The cached values a batch reads: the inputs taken by rows, the float inputs when mixing, the targets."""
        return [*self.inputs.rowed, *([self.float_inputs] if self.mixing else []), self.targets]


def _stage(values: list[CachedValue], device: torch.device, budget: int) -> list[torch.Tensor] | None:
    """Each value's chunks as one tensor on an accelerator, when they share their shape beyond the
    leading axis and fit `budget` bytes together; None otherwise (batches are then gathered on the host)."""
    chunks = [chunk for value in values for chunk in value.chunks]
    if device.type == "cpu" or not all(isinstance(chunk, np.ndarray | SpilledArray) for chunk in chunks):
        return None
    uniform = all(chunk.shape[1:] == value.chunks[0].shape[1:] for value in values for chunk in value.chunks)
    if not uniform or sum(chunk.nbytes for chunk in chunks) > budget:
        return None
    return [torch.cat([value.tensor(c, device) for c in range(len(value.chunks))]) for value in values]


class KeepMasks:
    """QDrop's choice per element (keep the quantized value where a random byte is below
    `threshold`): on the CPU drawn by numpy from `generator` (shared with the batch rows' draws),
    elsewhere by a torch generator on the device, seeded from `entropy`, so no mask crosses from the
    host. A GPU run therefore mixes with other bytes than a CPU run of the same seed; on one kind
    of device, a rerun draws the same. The meta device (where the tests run a GPU step's code without
    a GPU: see tests/test_gpu_path.py) has no generator of its own and draws no values anyway."""

    def __init__(self, threshold: int, device: torch.device, generator: np.random.Generator, entropy: list[int]) -> None:
        self.threshold, self.device, self.numpy = threshold, device, generator
        self.torch: torch.Generator | None = None
        if device.type not in ("cpu", "meta"):
            self.torch = torch.Generator(device)
            self.torch.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1)))

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A boolean mask of `shape` on the device: True where the quantized value is kept."""
        if self.device.type == "cpu":
            return torch.from_numpy(keep_quantized(self.numpy, self.threshold, shape))
        return torch.empty(shape, dtype=torch.uint8, device=self.device).random_(generator=self.torch) < self.threshold


# Integer types as wide as each float type, to select between floats by their bits.
SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def mixed(keep: torch.Tensor, quantized: torch.Tensor, float_value: torch.Tensor) -> torch.Tensor:
    """torch.where(keep, quantized, float_value), bit for bit in value and gradient. On the CPU it
    selects by bit operations: torch.where branches on each element, and QDrop's masks are coin
    flips, so it mispredicts half of them (1.7 ms against 0.8 ms for a 16x3x48x192 batch, one
    thread, where QDrop's mixing was a tenth of a step)."""
    if keep.device.type != "cpu" or quantized.dtype not in SAME_WIDTH_INT or float_value.dtype != quantized.dtype:
        return torch.where(keep, quantized, float_value)
    return _BitSelect.apply(keep, quantized, float_value)


class _BitSelect(torch.autograd.Function):
    """Select floats by a mask through their bits: f ^ ((q ^ f) & m), m all ones where kept; the
    gradients are the incoming one's bits and-ed with m and with ~m (where's gradients: +0 elsewhere)."""

    @staticmethod
    def forward(ctx: Any, keep: torch.Tensor, quantized: torch.Tensor, float_value: torch.Tensor) -> torch.Tensor:
        integer = SAME_WIDTH_INT[quantized.dtype]
        ones = keep.to(integer).neg_()  # -1: every bit set
        f = float_value.view(integer)
        selected = (quantized.view(integer) ^ f).bitwise_and_(ones).bitwise_xor_(f).view(quantized.dtype)
        ctx.save_for_backward(ones)
        return selected

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, torch.Tensor | None]:
        (ones,) = ctx.saved_tensors
        bits = grad.view(ones.dtype)
        towards_quantized = (bits & ones).view(grad.dtype) if ctx.needs_input_grad[1] else None
        towards_float = (bits & ones.bitwise_not()).view(grad.dtype) if ctx.needs_input_grad[2] else None
        return None, towards_quantized, towards_float


def qdrop_threshold(drop_ratio: float) -> int:
    """The byte value below which a random byte keeps the quantized value (256: always)."""
    return round(drop_ratio * 256)


def keep_quantized(generator: np.random.Generator, threshold: int, shape: tuple[int, ...]) -> np.ndarray:
    """QDrop's choice per element of `shape`: keep the quantized value where a random byte is below
    `threshold`, else take the float value. Random bytes cost half as much as float draws (9 against
    18 ms for a 16x32x112x112 activation)."""
    count = int(np.prod(shape))
    return np.frombuffer(generator.bytes(count), dtype=np.uint8).reshape(shape) < threshold
