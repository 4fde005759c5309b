"""QDrop (Wei et al., 2022) for the unit optimisation: training inputs mixed per element from the
quantized and the float inputs, and inside a block each activation quantizer passing its float
value for some elements; both seeded by the unit index, so reruns repeat. A data-parallel process
draws the bytes one process draws for the whole batch and keeps those of its own rows, so N
processes train on the one-process mixture."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric

from finetune.config import FastFinetune
from finetune.lift import FakeQuantize

from .cache import CachedValue, SpilledArray
from .parallel import Rows, sum_across
from .sides import RowsFirst, UnitInputs
from .units import constant_nodes

CPU = torch.device("cpu")


class Batches:
    """Random training batches of a unit, reproducible from the seed and the unit index: rows
    drawn without replacement, the input mixed per element from the quantized (probability
    drop_ratio, in steps of 1/256) and float inputs, QDrop-style.

    Rows come from the chunks shaped like the first beyond the leading axis: a value laid out
    sequence-first, (tokens, batch, ...), has a smaller second axis in a last, partial batch, and
    its rows cannot join the others (they still count in the loss before and after); `left_out`
    counts them. Over several processes every one draws the same global batch and the same mixing
    bytes, and keeps the rows it holds (see parallel).

    On an accelerator the unit's rows are copied to it once, when they fit `device_budget` bytes,
    and each batch is gathered there; the mixing bytes come from a generator on the device (see
    KeepMasks), so a step copies only the batch's row numbers to the device and nothing back."""

    def __init__(self, inputs: UnitInputs, float_inputs: CachedValue, targets: CachedValue, config: FastFinetune, k: int,
                 rows: Rows, device: torch.device = CPU, device_budget: int = 0) -> None:
        self.inputs, self.float_inputs, self.targets = inputs, float_inputs, targets
        self.rows = rows
        self.left_out = rows.total - rows.held_out - len(rows.trainable)
        self.size = min(config.batch_size, len(rows.trainable))
        self.device = device
        self.generator = np.random.default_rng([config.seed, k])
        self.masks = KeepMasks(qdrop_threshold(config.drop_ratio), device, self.generator, [config.seed, k])
        self.mixing = self.masks.threshold < 256
        self.staged = _stage(self._values(), device, device_budget)
        self.held = np.arange(0)  # positions in the last global batch of the rows this process holds
        self.fixed = [None if gathered else value.tensor(0, device) for value, gathered in zip(inputs.values, inputs.gathered)]

    def next(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The next (inputs, target) batch on the device: the rows of the global batch this process
        holds, the main input mixed, then the side inputs."""
        picked = np.sort(self.rows.trainable[self.generator.permutation(len(self.rows.trainable))[: self.size]])
        local = self.rows.local[picked]
        held = local >= 0
        self.held = np.flatnonzero(held)
        values = self._gather(local[held])
        rowed = len(self.inputs.rowed)
        (x, *sides), float_x, target = values[:rowed], values[rowed:-1], values[-1]
        if self.mixing:
            keep = self.masks.draw((self.size, *x.shape[1:]))
            if not held.all():
                keep = keep[torch.from_numpy(np.flatnonzero(held)).to(keep.device, non_blocking=True)]
            x = mixed(keep, x, float_x[0])
        return self._assemble([x, *sides]), target

    def sample(self, count: int) -> tuple[torch.Tensor, ...]:
        """The unit's inputs over `count` rows on the device for probing its layout: this process's
        first trainable rows, zeros where it holds fewer."""
        local = self.rows.local[self.rows.trainable]
        rowed = self._gather(local[local >= 0][:count])[: len(self.inputs.rowed)]
        return self._assemble([torch.cat([x, x.new_zeros((count - len(x), *x.shape[1:]))]) for x in rowed])

    def _assemble(self, rowed: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The unit's inputs in its order: the given rows of those a batch takes rows of, the others as they are."""
        taken = iter(rowed)
        return tuple(next(taken) if fixed is None else fixed for fixed in self.fixed)

    def _gather(self, rows: np.ndarray) -> list[torch.Tensor]:
        """The given local rows of the inputs, the float inputs (when mixing) and the targets, on the device."""
        if self.staged is not None:
            index = torch.from_numpy(rows).to(self.device, non_blocking=True)
            return [value.index_select(0, index) for value in self.staged]
        if self.device.type == "cpu":
            return [value.gather(rows) for value in self._values()]
        return [value.gather(rows).pin_memory().to(self.device, non_blocking=True) for value in self._values()]

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
    of device, a rerun draws the same."""

    def __init__(self, threshold: int, device: torch.device, generator: np.random.Generator, entropy: list[int]) -> None:
        self.threshold, self.device, self.numpy = threshold, device, generator
        self.torch: torch.Generator | None = None
        if device.type != "cpu":
            self.torch = torch.Generator(device)
            self.torch.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1)))

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A boolean mask of `shape` on the device: True where the quantized value is kept."""
        if self.torch is None:
            return torch.from_numpy(keep_quantized(self.numpy, self.threshold, shape))
        return torch.empty(shape, dtype=torch.uint8, device=self.device).random_(generator=self.torch) < self.threshold


@contextlib.contextmanager
def dropped_quantization(train: torch.nn.Module, config: FastFinetune, k: int, device: torch.device = CPU,
                         batches: Batches | None = None, fabric: Fabric | None = None) -> Iterator[bool]:
    """QDrop inside a block while it trains: each activation quantizer keeps its quantized value
    per element with probability drop_ratio (in steps of 1/256) and passes the float value
    otherwise (seeded by the unit index, so reruns repeat); forwards without gradients (the
    held-out evaluations between steps) see the quantized values and draw nothing. Weight quantizers, which read
    constants, are left alone. On an accelerator the bytes come from a generator there (see
    KeepMasks). In a data-parallel run (`fabric` of several processes, training on `batches`) each
    process draws the whole batch's bytes and keeps its rows' (see BatchMasks); it yields False
    where it cannot locate the rows in some activation and each process then draws its own bytes."""
    graph_module = train.train_module if isinstance(train, RowsFirst) else train
    constant = constant_nodes(graph_module.graph)
    quantizers = [graph_module.get_submodule(n.target) for n in graph_module.graph.nodes
                  if n.op == "call_module" and n not in constant and isinstance(graph_module.get_submodule(n.target), FakeQuantize)]
    if config.drop_ratio >= 1 or not quantizers:
        yield True
        return
    parallel = fabric is not None and fabric.world_size > 1 and batches is not None
    axes = row_axes(train, quantizers, batches.sample(1), batches.sample(2), fabric) if parallel else None
    rank = fabric.global_rank if parallel and axes is None else 0
    entropy = [config.seed, k, 1, *([rank] if rank else [])]
    masks = BatchMasks(KeepMasks(qdrop_threshold(config.drop_ratio), device, np.random.default_rng(entropy), entropy),
                       batches, axes)

    def mix(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], quantized: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # a held-out evaluation (recon.watch): plain quantized values, no draw
            return quantized
        return mixed(masks.draw(tuple(quantized.shape)), quantized, args[0])

    hooks = [quantizer.register_forward_hook(mix) for quantizer in quantizers]
    try:
        yield not parallel or axes is not None
    finally:
        for hook in hooks:
            hook.remove()


@dataclass(frozen=True)
class RowAxis:
    """Where a batch's rows lie in an activation: along `axis`, laid out as (outer, rows, inner)
    flattened, so `inner` consecutive entries per row, repeated `outer` times (a value reshaped
    from (rows, tokens, d) to (rows * tokens, d) has inner = tokens; from (tokens, rows, d), outer = tokens)."""

    axis: int
    outer: int
    inner: int

    def whole(self, shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
        """The shape of this activation over a batch of `rows` rows."""
        return (*shape[: self.axis], self.outer * rows * self.inner, *shape[self.axis + 1:])

    def index(self, positions: np.ndarray, rows: int) -> np.ndarray:
        """The entries along the axis, in order, of the rows at these positions of a batch of `rows`."""
        outer = np.arange(self.outer)[:, None, None] * rows * self.inner
        inner = positions[None, :, None] * self.inner + np.arange(self.inner)[None, None, :]
        return (outer + inner).reshape(-1)


class BatchMasks:
    """In-block QDrop masks of one process: for the batch it trains on (`batches` None, or `axes`
    None) or, in a data-parallel run, the global batch's masks drawn as one process draws them, cut
    to the rows this process holds in each activation (`axes`: the row axis of each quantizer call
    of a forward, in call order; None for an activation whose shape does not follow the rows)."""

    def __init__(self, masks: KeepMasks, batches: Batches | None, axes: list[RowAxis | None] | None) -> None:
        self.masks, self.batches, self.axes, self.calls = masks, batches, axes, 0

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The keep mask of the next quantizer call, for an activation of `shape`."""
        if not self.axes or self.batches is None:
            return self.masks.draw(shape)
        axis = self.axes[self.calls % len(self.axes)]
        self.calls += 1
        if axis is None:
            return self.masks.draw(shape)
        keep = self.masks.draw(axis.whole(shape, self.batches.size))
        index = torch.from_numpy(axis.index(self.batches.held, self.batches.size)).to(keep.device, non_blocking=True)
        return keep.index_select(axis.axis, index)


class _NoRowAxis(Exception):
    """An activation in which a batch's rows cannot be located."""


def row_axes(train: torch.nn.Module, quantizers: list[torch.nn.Module], first: tuple[torch.Tensor, ...],
             both: tuple[torch.Tensor, ...], fabric: Fabric) -> list[RowAxis | None] | None:
    """The row axis of each activation quantizer call of one forward, found by running `train` on
    the inputs of one row (`first`) and of two starting with it (`both`): the one axis that doubles,
    with the first row's entries first. None, in every process alike, where some process finds no
    such axis (e.g. a unit that mixes rows)."""
    one, two = _quantizer_inputs(train, quantizers, first), _quantizer_inputs(train, quantizers, both)
    try:
        if len(one) != len(two):
            raise _NoRowAxis
        axes = [_row_axis(a, b) for a, b in zip(one, two)]
    except _NoRowAxis:
        axes = None
    return None if sum_across(fabric, [axes is None])[0] else axes


def _quantizer_inputs(train: torch.nn.Module, quantizers: list[torch.nn.Module], x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """What the quantizers receive, call by call, in one forward of the inputs `x`."""
    seen: list[torch.Tensor] = []
    hooks = [q.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach())) for q in quantizers]
    try:
        with torch.no_grad():
            train(*x)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _row_axis(one: torch.Tensor, two: torch.Tensor) -> RowAxis | None:
    """The row axis of an activation seen over one row and over two rows starting with it (None:
    its shape does not follow the rows): the one axis that doubles, split as the first row's
    entries are found in it."""
    if one.dim() != two.dim():
        raise _NoRowAxis
    differ = [d for d in range(one.dim()) if one.shape[d] != two.shape[d]]
    if len(differ) > 1:
        raise _NoRowAxis
    if not differ:
        return None
    axis, size = differ[0], one.shape[differ[0]]
    if two.shape[axis] != 2 * size:
        raise _NoRowAxis
    for outer in (n for n in range(1, size + 1) if size % n == 0):
        first = two.unflatten(axis, (outer, 2, size // outer)).select(axis + 1, 0)
        if torch.allclose(first, one.unflatten(axis, (outer, size // outer)), rtol=1e-4, atol=1e-6):
            return RowAxis(axis, outer, size // outer)
    raise _NoRowAxis


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
