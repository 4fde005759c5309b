"""QDrop (Wei et al., 2022) inside a block while it trains: each activation quantizer passes its float
value for some elements, seeded by the unit index, so reruns repeat (the mixing of the block's input
is the batches' own: recon.data.batches). A data-parallel process draws the bytes one process draws
for the whole batch and keeps those of its own rows, so N processes train on the one-process mixture."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
from lightning.fabric import Fabric

from finetune.lift import FakeQuantize
from finetune.lift.graph import constant_nodes

from ..data.batches import CPU, Batches, Draw, KeepMasks, mixed, qdrop_threshold
from ..data.rows import RowsFirst
from ..data.shards import sum_across
from .base import Method, Part, UnitWork


class BlockQDrop(Method):
    """QDrop inside every block unit while it trains (layer units have no activation quantizer inside)."""

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> Part | None:
        return _Dropping(work, Draw.of(self.config), batches) if work.unit.op_type == "block" else None


class _Dropping(Part):
    """dropped_quantization installed while the block trains; a warning where the processes of a
    data-parallel run cannot draw one process's bytes."""

    def __init__(self, work: UnitWork, draw: Draw, batches: Batches) -> None:
        super().__init__()
        self.work, self.draw, self.batches = work, draw, batches
        self.installed = contextlib.ExitStack()

    def __enter__(self) -> Self:
        work = self.work
        if not self.installed.enter_context(dropped_quantization(work.data.train, self.draw, work.index, work.fabric.device,
                                                                 self.batches, work.fabric)):
            work.warnings.add(work.unit.name, "its rows could not be located in some activation (does it mix the rows of a "
                              "batch?), so each process draws its own QDrop bytes inside it: the processes do not train "
                              "on the one-process mixture")
        return self

    def __exit__(self, *_: object) -> None:
        self.installed.close()


@contextlib.contextmanager
def dropped_quantization(train: torch.nn.Module, draw: Draw, k: int, device: torch.device = CPU,
                         batches: Batches | None = None, fabric: Fabric | None = None) -> Iterator[bool]:
    """QDrop inside a block while it trains: each activation quantizer keeps its quantized value
    per element with probability drop_ratio (in steps of 1/256) and passes the float value
    otherwise (seeded by the unit index, so reruns repeat); forwards without gradients (the
    held-out evaluations between steps) see the quantized values and draw nothing. Weight quantizers, which read
    constants, are left alone. On an accelerator the bytes come from a generator there (see
    KeepMasks). In a data-parallel run (`fabric` of several processes, training on `batches`) each
    process draws the whole batch's bytes and keeps its rows' (see BatchMasks), and so does one process,
    which trains piece by piece as they do; it yields False where it cannot locate the rows in some
    activation of a data-parallel run and each process then draws its own bytes."""
    graph_module = train.train_module if isinstance(train, RowsFirst) else train
    constant = constant_nodes(graph_module.graph)
    quantizers = [graph_module.get_submodule(n.target) for n in graph_module.graph.nodes
                  if n.op == "call_module" and n not in constant and isinstance(graph_module.get_submodule(n.target), FakeQuantize)]
    if draw.drop_ratio >= 1 or not quantizers:
        yield True
        return
    parallel = fabric is not None and fabric.world_size > 1 and batches is not None
    axes = row_axes(train, quantizers, batches.sample(1), batches.sample(2), fabric) \
        if fabric is not None and batches is not None else None
    rank = fabric.global_rank if parallel and axes is None else 0
    entropy = [draw.seed, k, 1, *([rank] if rank else [])]
    masks = BatchMasks(KeepMasks(qdrop_threshold(draw.drop_ratio), device, np.random.default_rng(entropy), entropy),
                       batches, axes)

    def mix(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], quantized: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # a held-out evaluation (recon.data.losses): plain quantized values, no draw
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
    """In-block QDrop masks of one process: for the rows it trains on (`batches` None, or `axes` None)
    or, where the rows are located (`axes`: the row axis of each quantizer call of a forward, in call
    order; None for an activation whose shape does not follow the rows), the whole global batch's
    mask of each call drawn once per step, as one process draws it, and cut to the rows of the
    piece being trained (Batches.piece), so every piece and every process sees the one-process bytes."""

    def __init__(self, masks: KeepMasks, batches: Batches | None, axes: list[RowAxis | None] | None) -> None:
        self.masks, self.batches, self.axes = masks, batches, axes
        self.step, self.calls = -1, 0  # the batch the masks are of, and the quantizer calls made on it
        self.whole: list[torch.Tensor] = []  # the batch's mask of each call

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The keep mask of the next quantizer call, for an activation of `shape`."""
        if not self.axes or self.batches is None:
            return self.masks.draw(shape)
        batches = self.batches
        if self.step != batches.steps:  # a new batch: its masks are drawn afresh, call by call
            self.step, self.calls, self.whole = batches.steps, 0, []
        call = self.calls % len(self.axes)
        self.calls += 1
        axis = self.axes[call]
        if call == len(self.whole):
            self.whole.append(self.masks.draw(shape if axis is None else axis.whole(shape, batches.size)))
        if axis is None:
            return self.whole[call]
        index = axis.index(batches.held[batches.piece.rows], batches.size)
        return self.whole[call].index_select(axis.axis, torch.from_numpy(index).to(self.whole[call].device, non_blocking=True))


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

