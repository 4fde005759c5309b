"""GPTQ's solver (Frantar et al., 2022): a weight matrix's quantized values chosen column by column,
each column rounded on the format's grid and its rounding error spread over the columns not yet
rounded through the upper Cholesky factor of the inverse Hessian H = X Xᵀ / n of the layer's inputs
(the paper's factor 2 cancels), in blocks of `block_size` columns whose updates reach later columns
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
dead in calibration keeps its weights where it is alive)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from finetune.formats.grids import FixedGrid

# Rows solved at once, in elements (64 MiB of float32): rows are independent problems under one factor,
# so the working copies are a slice's, not the weight's (an LM head of 32,000 x 2,048 is 256 MiB a copy).
ROW_SLICE_ELEMENTS = 1 << 24


def gptq_into(target: torch.Tensor, hessian: torch.Tensor | list[torch.Tensor], grid: FixedGrid | Callable[[], FixedGrid],
              compensated: bool, perc_damp: float = 0.01, block_size: int = 128, act_order: bool = False) -> None:
    """GPTQ's quantized (or, with `compensated`, compensated) weights written over `target` [groups, rows,
    columns] (a view of a layer's weight, any float dtype), a slice of rows at a time: no full-size copy.
    `hessian` is [groups, columns, columns] (any float dtype; factored in float64), each group on its
    own; given as [H], H is consumed (the list emptied, a float64 H damped and factored in its own
    memory: one 128 MiB copy less at width 4096). The compensated weights are each column's values
    when its turn came (after the errors of earlier columns reached it): rounding them to nearest on
    `grid` gives the quantized ones. `perc_damp` of the mean diagonal is added to the diagonal;
    `act_order` rounds the columns of largest curvature first (then in that order within each group).
    `grid` may be a function making it, called once the Hessian is factored (a grid holds tensors shaped
    like the weight, which then never sit beside the float64 matrices)."""
    with torch.no_grad():
        for rows, q, c in _solved_rows(target.detach(), hessian, grid, perc_damp, block_size, act_order):
            target[:, rows] = (c if compensated else q).to(target.dtype)


def _solved_rows(weight: torch.Tensor, hessian: torch.Tensor | list[torch.Tensor], grid: FixedGrid | Callable[[], FixedGrid],
                 perc_damp: float, block_size: int, act_order: bool) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """GPTQ's (rows, quantized, compensated) for slices of about ROW_SLICE_ELEMENTS, in order; each slice
    is read (copied) before it is yielded, so a caller may overwrite those rows of `weight`."""
    upper, order = _factor(hessian, perc_damp, act_order)
    grid = grid() if callable(grid) else grid
    inverse = None if order is None else torch.argsort(order, dim=1)

    def permuted(t: torch.Tensor, by: torch.Tensor | None) -> torch.Tensor:
        return t if by is None else t.gather(2, by[:, None, :].expand_as(t))

    groups, rows, columns = weight.shape
    step = max(1, ROW_SLICE_ELEMENTS // max(1, groups * columns))
    for start in range(0, rows, step):
        part = slice(start, min(start + step, rows))
        sliced = FixedGrid(grid.round_fn, tuple(p[:, part] for p in grid.params)).laid_out(lambda t: permuted(t, order))
        quantized, compensated = _columns(permuted(weight[:, part].float(), order), upper, sliced, block_size)
        yield part, permuted(quantized, inverse), permuted(compensated, inverse)


def _factor(hessian: torch.Tensor | list[torch.Tensor], perc_damp: float,
            act_order: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """inverse_cholesky's factor (as float32) of the damped Hessian (float64) with its columns in the order
    they are rounded, and that order (None: the natural one, which needs no permuted copies). At most two
    float64 matrices are alive at once (each step's input is let go as its result is made)."""
    held = [hessian.pop().detach().to(torch.float64) if isinstance(hessian, list) else hessian.detach().to(torch.float64, copy=True)]
    diagonal = held[0].diagonal(dim1=1, dim2=2)
    diagonal.masked_fill_(diagonal == 0, 1.0)  # dead inputs: rounded to nearest, nothing passed on
    diagonal += perc_damp * diagonal.mean(dim=1, keepdim=True)
    order = torch.argsort(diagonal, dim=1, descending=True, stable=True) if act_order else None
    del diagonal  # a view: it would keep the damped matrix alive
    if order is not None:
        held[0] = held[0].gather(1, order[:, :, None].expand_as(held[0]))
        held[0] = held[0].gather(2, order[:, None, :].expand_as(held[0]))
    return inverse_cholesky(held).to(torch.float32), order


def inverse_cholesky(held: list[torch.Tensor]) -> torch.Tensor:
    """The upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU), batched, in H's dtype, for `held` = [H], which it
    empties (so H is let go once factored: a width-4096 layer's float64 matrices are 128 MiB each): row i
    of U, over its diagonal, spreads column i's error over the later columns (the OBS update with the rows
    and columns of the earlier ones already eliminated)."""
    factor, info = torch.linalg.cholesky_ex(held.pop())
    if bool((info > 0).any()):
        raise ValueError("the damped Hessian of the layer's inputs is not positive definite (raise perc_damp)")
    factor = torch.cholesky_inverse(factor)  # H⁻¹; the lower factor of H is let go here
    factor, info = torch.linalg.cholesky_ex(factor, upper=True)
    if bool((info > 0).any()):
        raise ValueError("the inverse Hessian of the layer's inputs is not positive definite (raise perc_damp)")
    return factor


def _columns(w: torch.Tensor, upper: torch.Tensor, grid: FixedGrid, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's loop over the columns of w [groups, rows, columns] in order, with `upper` the factor of
    inverse_cholesky; a block's errors reach the columns after it in one product. A column's errors
    reach only the columns after it, so the working copy of w ends as the compensated weights."""
    compensated = w.clone()
    quantized = torch.empty_like(w)
    columns = w.shape[2]
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block, factor = compensated[:, :, start:end], upper[:, start:end, start:end]
        errors = torch.empty_like(block)
        for i in range(end - start):
            column = block[:, :, i:i + 1]
            rounded = grid.round(column, slice(start + i, start + i + 1))
            quantized[:, :, start + i:start + i + 1] = rounded
            error = (column - rounded) / factor[:, i:i + 1, i:i + 1]
            block[:, :, i + 1:] -= error @ factor[:, i:i + 1, i + 1:]
            errors[:, :, i:i + 1] = error
        compensated[:, :, end:] -= errors @ upper[:, start:end, end:]
    return quantized, compensated
