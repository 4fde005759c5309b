"""How GPTQ sees a layer: its weight as a matrix [groups, outputs, columns] and back, and its inputs as
rows of that matrix's columns, summed into the Hessian of each group. Conv weights are [groups, O/g,
I/g*kh*kw] with their unfolded inputs per group; Gemm and MatMul weights are laid out as their
modules apply them (transB, a weight on either side of a MatMul). ConvTranspose, LSTM and GRU have
no layout (GPTQ leaves them as they are, with a warning)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from finetune.lift.padding import torch_pad, window_extents
from finetune.onnx.layers import weight_axes

from ..data.rows import UnitInputs
from ..units import Layer

# Elements of unfolded Conv inputs made at once while summing a Hessian (16 MiB of float32).
PATCH_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Layout:
    """How GPTQ sees a layer: its weight as [groups, outputs, columns] (a view: GPTQ writes its weights
    through it), and its inputs (the positional arguments of one call of its module) as rows
    [groups, n, columns], in pieces."""

    to_matrix: Callable[[torch.Tensor], torch.Tensor]
    rows: Callable[[tuple[torch.Tensor, ...]], Iterator[torch.Tensor]]


def layout_of(layer: Layer, op: nn.Module, shape: torch.Size) -> Layout | str:
    """The layer's Layout, or why GPTQ cannot treat it."""
    if layer.op_type == "Conv":
        return _conv_layout(op, shape)
    if layer.op_type == "Gemm":
        return _gemm_layout(op.trans_a, op.trans_b, shape)
    if layer.op_type == "MatMul" and len(shape) == 2:
        return _matmul_layout(layer.weight_index, shape)
    return f"GPTQ treats Conv, Gemm and 2-D MatMul weights, not this {layer.op_type}'s {tuple(shape)}"


def _conv_layout(op: nn.Module, shape: torch.Size) -> Layout:
    """Conv [O, I/g, *k]: groups of [O/g, I/g * prod(k)], rows the unfolded input patches of each group."""
    groups = op.groups
    kernel = list(shape[2:])
    rank = len(kernel)
    strides, dilations = op.strides or [1] * rank, op.dilations or [1] * rank

    def rows(args: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
        x = args[0]
        pads = op.padding.resolve(x.shape[2:], window_extents(kernel, dilations), strides)
        x = F.pad(x, torch_pad(pads))
        per_sample = x.shape[1] * math.prod(kernel) * math.prod(x.shape[2:])
        step = max(1, PATCH_ELEMENTS // max(1, per_sample))
        for piece in x.split(step):
            yield _patches(piece, kernel, strides, dilations, groups)

    return Layout(lambda t: t.reshape(groups, shape[0] // groups, -1), rows)


def _patches(x: torch.Tensor, kernel: list[int], strides: list[int], dilations: list[int], groups: int) -> torch.Tensor:
    """The padded input x [N, C, *spatial] as rows [groups, N * positions, C/g * prod(kernel)],
    each row the window one output position sees, ordered as the weight's (channel, *kernel)."""
    rank = len(kernel)
    for axis, (k, s, d) in enumerate(zip(kernel, strides, dilations)):
        x = x.unfold(2 + axis, (k - 1) * d + 1, s)[..., ::d]  # window axis appended last
    channels = x.shape[1]
    spatial = list(range(2, 2 + rank))
    x = x.permute(0, *spatial, 1, *range(2 + rank, 2 + 2 * rank))  # [N, *positions, C, *kernel]
    x = x.reshape(-1, groups, channels // groups * math.prod(kernel))
    return x.transpose(0, 1)


def _gemm_layout(trans_a: bool, trans_b: bool, shape: torch.Size) -> Layout:
    """Gemm: B [K, N] (transB: [N, K]) as [1, N, K]; rows are A's rows (transA: its columns)."""
    def rows(args: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
        yield (args[0].T if trans_a else args[0])[None]

    return _outputs_first(weight_axes("Gemm", 1, trans_b), rows)


def _matmul_layout(weight_index: int, shape: torch.Size) -> Layout:
    """MatMul x @ W (W [K, N] as [1, N, K], rows x's last axis) or W @ x (W [M, K] as it is, rows
    x's second-to-last axis)."""
    columns = shape[0] if weight_index == 1 else shape[1]

    def rows(args: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
        x = args[0] if weight_index == 1 else args[1].transpose(-1, -2)
        yield x.reshape(-1, columns)[None]

    return _outputs_first(weight_axes("MatMul", weight_index), rows)


def _outputs_first(axes: tuple[int, int], rows: Callable[[tuple[torch.Tensor, ...]], Iterator[torch.Tensor]]) -> Layout:
    """The layout of a 2-D weight whose (output, input) channel axes are `axes`: outputs first, as
    [1, outputs, inputs]."""
    if axes[0] % 2 == 0:
        return Layout(lambda t: t[None], rows)
    return Layout(lambda t: t.T[None], rows)


class _Collected(Exception):
    """Raised by the hook that has what it needs, to end the forward pass there."""


def input_hessian(op: nn.Module, layout: Layout, train: nn.Module, inputs: UnitInputs, fabric: Fabric,
                  held: frozenset[int] = frozenset()) -> torch.Tensor:
    """X Xᵀ / n (float64, [groups, columns, columns]) over the inputs `op` receives when `train`
    runs on every cached batch of `inputs` but those in `held` (summed over the processes of a
    data-parallel run); each pass ends at `op`."""
    total: list[torch.Tensor] = []
    count = 0
    measured = [chunk for chunk in range(len(inputs.main.chunks)) if chunk not in held]

    def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        nonlocal count
        for rows in layout.rows(args):
            rows = rows.detach().to(torch.float64)
            product = rows.transpose(1, 2) @ rows
            if total:
                total[0] += product
            else:
                total.append(product)
            count += rows.shape[1]
        raise _Collected

    handle = op.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for chunk in measured or [0]:  # none: one pass for the shapes, counted as nothing
                try:
                    train(*inputs.chunk(chunk, fabric.device))
                except _Collected:
                    pass
    finally:
        handle.remove()
    if not total:
        raise ValueError(f"GPTQ: the unit's forward pass never reached {type(op).__name__} (its inputs cannot be measured)")
    if not measured:  # every chunk of this process is held out
        total[0].zero_()
        count = 0
    if fabric.world_size > 1:
        total[0] = fabric.all_reduce(total[0], reduce_op="sum")
        count = int(fabric.all_reduce(torch.tensor(float(count), dtype=torch.float64), reduce_op="sum"))
    return total[0].div_(max(count, 1))  # in place: a width-4096 layer's Hessian is 128 MiB
