"""GPTQ (Frantar et al., 2022): choose a layer's quantized weights column by column, each column
rounded on the format's grid and its rounding error spread over the columns not yet rounded
through the upper Cholesky factor of the inverse Hessian H = X Xᵀ / n of the layer's inputs (the
paper's factor 2 cancels), in blocks of `block_size` columns whose updates reach later columns
at once ("lazy batch" updates).

The grid is frozen before any column is rounded (finetune.formats.grids): INT and float formats
keep the scale and zero point their QDQ node stores, and every BFP/MX/OCP MX block takes the shared
exponent (and sub-block shifts) the format computes from the layer's original float weights. A
block runs along the format's axis, which for a Conv weight [O, I, kh, kw] blocked along I holds
the columns c*kh*kw + j of GPTQ's [O, I*kh*kw] matrix, interleaved with other blocks; since no
grid waits for its block's first column, any column order (natural, or `act_order`'s) rounds every
column on the grid its block had, and the result is exactly representable in the format.

A column whose input is always zero in the calibration data (a dead input) has no curvature: it is
rounded to nearest and passes no error on (rather than zeroed, as the paper does, so a channel
dead in calibration keeps its weights where it is alive). Conv weights are [groups, O/g, I/g*kh*kw]
with their unfolded inputs per group; Gemm and MatMul weights are laid out as their modules apply
them (transB, a weight on either side of a MatMul). ConvTranspose, LSTM and GRU are left as they
are, with a warning."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from finetune.config import FastFinetune
from finetune.formats.grids import FixedGrid, fixed_grid
from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.padding import torch_pad, window_extents

from .report import Warnings
from .sides import UnitInputs
from .units import Layer, Unit

logger = logging.getLogger(__name__)

# Elements of unfolded Conv inputs made at once while summing a Hessian (16 MiB of float32).
PATCH_ELEMENTS = 1 << 22


def gptq(weight: torch.Tensor, hessian: torch.Tensor, grid: FixedGrid, perc_damp: float = 0.01,
         block_size: int = 128, act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weights, compensated weights) of `weight` [groups, rows, columns] (float32) under
    `hessian` [groups, columns, columns] (any float dtype; factored in float64), each group on its
    own. The compensated weights are each column's values when its turn came (after the errors of
    earlier columns reached it): rounding them to nearest on `grid` gives the quantized ones.
    `perc_damp` of the mean diagonal is added to the diagonal; `act_order` rounds the columns of
    largest curvature first (then in that order within each group)."""
    h = hessian.detach().to(torch.float64).clone()
    diagonal = h.diagonal(dim1=1, dim2=2)
    diagonal.masked_fill_(diagonal == 0, 1.0)  # dead inputs: rounded to nearest, nothing passed on
    diagonal += perc_damp * diagonal.mean(dim=1, keepdim=True)
    columns = weight.shape[2]
    if act_order:
        order = torch.argsort(diagonal, dim=1, descending=True, stable=True)
    else:
        order = torch.arange(columns, device=weight.device).expand(weight.shape[0], columns)

    def permuted(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, order[:, None, :].expand_as(t))

    upper = inverse_cholesky(h.gather(1, order[:, :, None].expand_as(h)).gather(2, order[:, None, :].expand_as(h)))
    quantized, compensated = _columns(permuted(weight.detach().float()), upper.to(torch.float32),
                                      grid.laid_out(permuted), block_size)
    inverse = torch.argsort(order, dim=1)
    return quantized.gather(2, inverse[:, None, :].expand_as(quantized)), \
        compensated.gather(2, inverse[:, None, :].expand_as(compensated))


def inverse_cholesky(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU), batched, in H's dtype: row i of U, over its
    diagonal, spreads column i's error over the later columns (the OBS update with the rows and
    columns of the earlier ones already eliminated)."""
    lower, info = torch.linalg.cholesky_ex(hessian)
    if bool((info > 0).any()):
        raise ValueError("the damped Hessian of the layer's inputs is not positive definite (raise perc_damp)")
    upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    if bool((info > 0).any()):
        raise ValueError("the inverse Hessian of the layer's inputs is not positive definite (raise perc_damp)")
    return upper


def _columns(w: torch.Tensor, upper: torch.Tensor, grid: FixedGrid, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's loop over the columns of w [groups, rows, columns] in order, with `upper` the factor of
    inverse_cholesky; a block's errors reach the columns after it in one product."""
    w = w.clone()
    quantized, compensated = torch.empty_like(w), torch.empty_like(w)
    columns = w.shape[2]
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block, factor = w[:, :, start:end], upper[:, start:end, start:end]
        errors = torch.empty_like(block)
        for i in range(end - start):
            column = block[:, :, i:i + 1]
            compensated[:, :, start + i:start + i + 1] = column
            rounded = grid.round(column, slice(start + i, start + i + 1))
            quantized[:, :, start + i:start + i + 1] = rounded
            error = (column - rounded) / factor[:, i:i + 1, i:i + 1]
            block[:, :, i:] -= error @ factor[:, i:i + 1, i:]
            errors[:, :, i:i + 1] = error
        w[:, :, end:] -= errors @ upper[:, start:end, end:]
    return quantized, compensated


# --- layers ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How GPTQ sees a layer: its weight as [groups, outputs, columns] and back, and its inputs (the
    positional arguments of one call of its module) as rows [groups, n, columns], in pieces."""

    to_matrix: Callable[[torch.Tensor], torch.Tensor]
    from_matrix: Callable[[torch.Tensor], torch.Tensor]
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

    return Layout(lambda t: t.reshape(groups, shape[0] // groups, -1), lambda m: m.reshape(shape), rows)


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

    if trans_b:
        return Layout(lambda t: t[None], lambda m: m[0], rows)
    return Layout(lambda t: t.T[None], lambda m: m[0].T, rows)


def _matmul_layout(weight_index: int, shape: torch.Size) -> Layout:
    """MatMul x @ W (W [K, N] as [1, N, K], rows x's last axis) or W @ x (W [M, K] as it is, rows
    x's second-to-last axis)."""
    columns = shape[0] if weight_index == 1 else shape[1]

    def rows(args: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
        x = args[0] if weight_index == 1 else args[1].transpose(-1, -2)
        yield x.reshape(-1, columns)[None]

    if weight_index == 1:
        return Layout(lambda t: t.T[None], lambda m: m[0].T, rows)
    return Layout(lambda t: t[None], lambda m: m[0], rows)


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
    return total[0] / max(count, 1)


def quantize_unit(unit: Unit, module: LiftedModule, train: nn.Module, inputs: UnitInputs, fabric: Fabric,
                  config: FastFinetune, warnings: Warnings, held: frozenset[int] = frozenset()) -> None:
    """Replace the weights of the unit's layers by GPTQ's, layer after layer in graph order, each
    from the inputs it receives from the unit's quantized inputs with the earlier layers already
    replaced; a layer GPTQ cannot treat keeps its weights, with a warning. AdaRound (gptq_init),
    which chooses between the two codes around its starting weights, starts from the compensated
    weights, which round to GPTQ's; everything else takes the quantized weights, on the grid. The
    chunks in `held` (held out of training) are not measured."""
    for layer in unit.layers:
        reason = _quantize_layer(layer, module, train, inputs, fabric, config, held)
        if reason is not None:
            warnings.add(unit.name, f"{layer.name}: not quantized by GPTQ (its weights round to nearest): {reason}")


def _quantize_layer(layer: Layer, module: LiftedModule, train: nn.Module, inputs: UnitInputs, fabric: Fabric,
                    config: FastFinetune, held: frozenset[int]) -> str | None:
    """GPTQ's weights for one layer, written into its parameter; or why not (nothing changed)."""
    quantizer = module.get_submodule(layer.weight_quantizer) if layer.weight_quantizer else None
    if not isinstance(quantizer, FakeQuantize) or not quantizer.enabled:
        return "its weight is not quantized"
    weight = module.get_parameter(layer.weight)
    op = module.get_submodule(layer.name)
    layout = layout_of(layer, op, weight.shape)
    if isinstance(layout, str):
        return layout
    settings = config.gptq
    grid = fixed_grid(weight, quantizer.spec, quantizer.scale, quantizer.zero_point).laid_out(layout.to_matrix)
    hessian = input_hessian(op, layout, train, inputs, fabric, held)
    quantized, compensated = gptq(layout.to_matrix(weight.detach().float()), hessian, grid, settings.perc_damp,
                                  settings.block_size, settings.act_order)
    start = compensated if config.algorithm == "adaround" else quantized
    with torch.no_grad():
        weight.copy_(layout.from_matrix(start).to(weight.dtype))
    logger.debug("GPTQ: %s, %d column(s) in %d group(s)", layer.name, hessian.shape[-1], hessian.shape[0])
    return None
