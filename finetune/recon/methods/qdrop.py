"""QDrop (Wei et al., 2022) inside a block while it trains: each activation quantizer passes its float
value for some elements, seeded by the unit index, so reruns repeat (the mixing of the block's input
is the batches' own: recon.data.batches). Each piece of a step (see recon.data.shards) draws its
bytes from a generator seeded by the unit, the step and the piece's number, so
a piece draws the same bytes in whichever process trains it: N processes train on the one-process
mixture, whatever layout the block gives its rows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Self

import numpy as np
import torch

from finetune.lift import FakeQuantize
from finetune.lift.graph import constant_nodes

from ..data.batches import CPU, Batches, Draw, KeepMasks, mixed, qdrop_threshold
from ..data.rows import RowsFirst
from .base import Method, Part, UnitWork


class BlockQDrop(Method):
    """QDrop inside every block unit while it trains (layer units have no activation quantizer inside)."""

    def part(self, work: UnitWork, batches: Batches, iterations: int) -> Part | None:
        return _Dropping(work, Draw.of(self.config), batches) if work.unit.op_type == "block" else None


class _Dropping(Part):
    """dropped_quantization installed while the block trains."""

    def __init__(self, work: UnitWork, draw: Draw, batches: Batches) -> None:
        super().__init__()
        self.work, self.draw, self.batches = work, draw, batches
        self.installed = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self.installed.enter_context(dropped_quantization(self.work.data.train, self.draw, self.work.index,
                                                          self.work.fabric.device, self.batches))
        return self

    def __exit__(self, *_: object) -> None:
        self.installed.close()


@contextlib.contextmanager
def dropped_quantization(train: torch.nn.Module, draw: Draw, k: int, device: torch.device = CPU,
                         batches: Batches | None = None) -> Iterator[None]:
    """QDrop inside a block while it trains: each activation quantizer keeps its quantized value
    per element with probability drop_ratio (in steps of 1/256) and passes the float value
    otherwise (seeded by the unit index, so reruns repeat); forwards without gradients (the
    held-out evaluations between steps) see the quantized values and draw nothing. Weight quantizers, which read
    constants, are left alone. On an accelerator the bytes come from a generator there (see
    KeepMasks). Training on `batches`, each piece of a step draws its own bytes (see PieceMasks)."""
    graph_module = train.train_module if isinstance(train, RowsFirst) else train
    constant = constant_nodes(graph_module.graph)
    quantizers = [graph_module.get_submodule(n.target) for n in graph_module.graph.nodes
                  if n.op == "call_module" and n not in constant and isinstance(graph_module.get_submodule(n.target), FakeQuantize)]
    if draw.drop_ratio >= 1 or not quantizers:
        yield
        return
    masks = PieceMasks(qdrop_threshold(draw.drop_ratio), device, [draw.seed, k, 1], batches)

    def mix(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], quantized: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # a held-out evaluation (recon.data.losses): plain quantized values, no draw
            return quantized
        return mixed(masks.draw(tuple(quantized.shape)), quantized, args[0])

    hooks = [quantizer.register_forward_hook(mix) for quantizer in quantizers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class PieceMasks:
    """In-block QDrop masks, drawn for each piece a step trains on (Batches.piece) from a generator
    seeded by `entropy` (the run's seed and the unit), the step and the piece's number, so
    a piece's bytes depend neither on the process that trains it nor on the other pieces of its step;
    without `batches` (a block run outside an optimisation), from one generator seeded by `entropy`."""

    def __init__(self, threshold: int, device: torch.device, entropy: list[int], batches: Batches | None) -> None:
        self.threshold, self.device, self.entropy, self.batches = threshold, device, entropy, batches
        self.piece: tuple[int, int] | None = None  # the (step, piece number) the masks are drawn for
        self.masks = self._masks(entropy)

    def _masks(self, entropy: list[int]) -> KeepMasks:
        """A fresh generator's masks, seeded by `entropy`."""
        return KeepMasks(self.threshold, self.device, np.random.default_rng(entropy), entropy)

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The keep mask of the next quantizer call, for an activation of `shape`."""
        if self.batches is not None and self.batches.piece is not None:
            piece = (self.batches.steps, self.batches.piece.share)
            if piece != self.piece:
                self.piece, self.masks = piece, self._masks([*self.entropy, *piece])
        return self.masks.draw(shape)
