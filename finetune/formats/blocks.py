"""Blocking along one axis without transposes: [P, n, Q] -> padded [P, n_blocks, block, Q]."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .bits import (
    EXPONENT_FIELD_INF_NAN,
    MANTISSA_BITS,
    MIN_NORMAL_EXPONENT,
    ROUNDING_MODES,
    assumes_ordinary,
    checks_rare_cases,
    exponent_field,
    needs,
)

BlockFn = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def check_block_attributes(block_size: int, rounding_mode: int) -> None:
    """The attribute checks every block format shares: a positive block size, a known rounding mode."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if rounding_mode not in ROUNDING_MODES:
        raise ValueError(f"rounding_mode must be one of {ROUNDING_MODES}, got {rounding_mode!r}")

# Elements per chunk on CPU: small enough that a many-pass computation's temporaries stay in
# cache (measured 4x faster than whole-tensor passes on a 64x256x56x56 tensor), large enough that
# the Python loop over chunks costs nothing.
CPU_CHUNK_ELEMENTS = 1 << 20


# Elements per slice where an element-wise quantizer, its codes or a dequantization run on a large
# tensor: temporaries of a slice, not of the tensor (a 32,000 x 2,048 head's int4 codes took 1.8 GiB
# whole), and few enough slices that the loop over them costs nothing.
SLICE_ELEMENTS = 1 << 22


def quantizer_slices(shape: Sequence[int], axis: int | None, params: Sequence[Any]) -> list[tuple[tuple[slice, ...], list[Any]]]:
    """(index, params cut to it) covering an array of `shape` in slices of about SLICE_ELEMENTS along
    its longest dimension other than the quantizer's `axis`; a blocked scale or zero point (a tensor
    of the array's rank) is cut with it, per-tensor and per-channel ones apply to every slice as they
    are. An element of a quantizer with given parameters depends on its own value and its parameters
    only, so slices compute the whole array's bits. One whole index where the array is small or has
    no such dimension."""
    rank = len(shape)
    quantized = None if axis is None or rank == 0 else axis % rank
    others = [d for d in range(rank) if d != quantized and shape[d] > 1]
    if math.prod(shape) <= SLICE_ELEMENTS or not others:
        return [((slice(None),) * rank, list(params))]
    dim = max(others, key=lambda d: shape[d])
    step = max(1, shape[dim] * SLICE_ELEMENTS // math.prod(shape))
    slices = []
    for start in range(0, shape[dim], step):
        index = (slice(None),) * dim + (slice(start, min(start + step, shape[dim])),)
        cut = [p[index] if isinstance(p, torch.Tensor) and p.dim() == rank and p.shape[dim] == shape[dim] else p for p in params]
        slices.append((index, cut))
    return slices


def in_slices(
    values: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor, axis: int | None, *params: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """values(x, *params), a quantizer's (values, mask or None), computed a slice of quantizer_slices
    at a time on CPU: the same bits with a slice's temporaries. Whole on accelerators, where slices
    only add launches, and while torch.compile traces, whose fused kernel keeps no temporaries."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return values(x, *params)
    slices = quantizer_slices(x.shape, axis, params)
    if len(slices) == 1:
        return values(x, *params)
    y = mask = None
    for index, cut in slices:
        y_part, mask_part = values(x[index], *cut)
        if y is None:
            y = torch.empty_like(x, dtype=y_part.dtype)
            mask = None if mask_part is None else torch.empty_like(x, dtype=torch.bool)
        y[index] = y_part
        if mask is not None:
            mask[index] = mask_part
    return y, mask


def block_axis(x: torch.Tensor, axis: int) -> int:
    """The axis that is blocked: a rank-1 tensor ignores `axis`; negative axes count from the end."""
    if x.dim() <= 1:
        return 0
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {x.dim()}")
    return axis % x.dim()


def map_blocks(x: torch.Tensor, axis: int, block_size: int, fn: BlockFn) -> tuple[torch.Tensor, ...]:
    """Apply fn to x viewed as blocks [p, n_blocks, block_size, q] along `axis` (no transposes;
    the axis is zero-padded to whole blocks) and return fn's outputs in x's shape, padding dropped.
    On CPU the work goes chunk by chunk; a block never straddles two chunks. A channels-last
    tensor is blocked in its memory order, so it is not copied and fn's outputs stay channels last;
    the blocks, and so the values, are the same."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    a = block_axis(x, axis)
    order = _memory_order(x)
    if order is not None:
        inverse = [order.index(d) for d in range(x.dim())]
        outputs = _map_contiguous(x.permute(order), order.index(a), block_size, fn)
        return tuple(out.permute(inverse) for out in outputs)
    return _map_contiguous(x, a, block_size, fn)


def _memory_order(x: torch.Tensor) -> list[int] | None:
    """[0, 2, 3, 1] for a channels-last tensor (as convolutions in that layout produce): x.permute
    of it is contiguous. None otherwise: any other layout is copied to a contiguous one,
    as before, so the results downstream, whose float sums follow the layout, stay as they were."""
    if x.dim() != 4 or x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    return [0, 2, 3, 1]


def _map_contiguous(x: torch.Tensor, a: int, block_size: int, fn: BlockFn) -> tuple[torch.Tensor, ...]:
    """map_blocks along axis a (already checked), x viewed as [p, n, q] (a copy unless x is contiguous)."""
    n = x.shape[a] if x.dim() else 1
    p, q = math.prod(x.shape[:a]), math.prod(x.shape[a + 1 :])
    flat = x.reshape(p, n, q)
    chunks = list(_chunks(p, n, q, x.device))
    if len(chunks) == 1:  # the whole tensor at once: fn's outputs are reshaped (padding dropped), not copied into place
        return tuple(out.contiguous().reshape(x.shape) for out in _blocked(flat, n, block_size, fn))
    outputs: list[torch.Tensor] = []
    for rows, cols in chunks:
        results = _blocked(flat[rows, :, cols], n, block_size, fn)
        if not outputs:
            outputs = [torch.empty((p, n, q), dtype=r.dtype, device=x.device) for r in results]
        for out, result in zip(outputs, results):
            out[rows, :, cols] = result
    return tuple(out.reshape(x.shape) for out in outputs)


def _blocked(part: torch.Tensor, n: int, block_size: int, fn: BlockFn) -> tuple[torch.Tensor, ...]:
    """fn's outputs for a [p, n, q] part viewed as whole blocks (zero-padded), as [p, n, q] again."""
    padded = -(-n // block_size) * block_size
    if padded != n:
        part = F.pad(part, (0, 0, 0, padded - n))
    blocks = part.reshape(part.shape[0], padded // block_size, block_size, part.shape[2])
    return tuple(unblocked(r.reshape(blocks.shape), n) for r in fn(blocks))


def unblocked(r: torch.Tensor, n: int) -> torch.Tensor:
    """Blocks [p, n_blocks, block, q] as [p, n, q], the padding dropped: a view, or while
    torch.compile traces, the whole blocks joined to the last one's first elements. (Inductor in
    torch 2.14 miscompiles a slice of the merged block axes read into a contiguous tensor when q
    is 1: elements past the first block are never written.)"""
    p, blocks, size, q = r.shape
    if blocks * size == n or not torch.compiler.is_compiling():
        return r.reshape(p, blocks * size, q)[:, :n, :]
    whole = r[:, : blocks - 1].reshape(p, (blocks - 1) * size, q)
    return torch.cat([whole, r[:, blocks - 1, : n - (blocks - 1) * size, :]], dim=1)


def _chunks(p: int, n: int, q: int, device: torch.device) -> Iterator[tuple[slice, slice]]:
    """Slices of the outer (p) or inner (q) dimension, whichever is longer, of about
    CPU_CHUNK_ELEMENTS each on CPU; one chunk on accelerators, where chunking only adds launches,
    and while torch.compile traces, whose fused kernel keeps no temporaries to fit in cache."""
    budget = CPU_CHUNK_ELEMENTS if device.type == "cpu" and not torch.compiler.is_compiling() else p * n * q
    whole = slice(None)
    if p >= q:
        step = max(1, budget // max(1, n * q))
        yield from ((slice(i, i + step), whole) for i in range(0, max(p, 1), step))
    else:
        step = max(1, budget // max(1, n * p))
        yield from ((whole, slice(j, j + step)) for j in range(0, q, step))


def broadcast_param(
    param: torch.Tensor | float, x: torch.Tensor, axis: int | None, block_size: int | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Shape a scale or zero point like QuantizeLinear does: scalar (per tensor), 1-D along `axis`
    (per channel) or x's shape with ceil(n / block_size) along `axis` (blocked), as `dtype` on x's
    device. A Python number is filled in there: made on the host and copied, it would make the host
    wait for the device."""
    if isinstance(param, (int, float)):
        param = torch.full((), param, dtype=dtype, device=x.device)
    else:
        param = torch.as_tensor(param, dtype=dtype, device=x.device)
    if param.dim() == 0 or (param.numel() == 1 and axis is None):
        return param.reshape(())
    if axis is None:
        raise ValueError(f"a scale/zero point of shape {tuple(param.shape)} needs an axis")
    a = axis % x.dim()
    if block_size:
        expected = list(x.shape)
        expected[a] = -(-x.shape[a] // block_size)
        if list(param.shape) != expected:
            raise ValueError(f"blocked scale/zero point must have shape {expected}, got {tuple(param.shape)}")
        return param.repeat_interleave(block_size, dim=a).narrow(a, 0, x.shape[a])
    if param.dim() != 1 or param.numel() != x.shape[a]:
        raise ValueError(
            f"per-channel scale/zero point must be 1-D of length {x.shape[a]} (axis {axis}), got {tuple(param.shape)}"
        )
    return param.reshape([-1] + [1] * (x.dim() - a - 1))


def max_exponent_field(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """Largest biased exponent field over `dim` (255 where NaN/Inf), read off the largest magnitude."""
    return exponent_field(blocks.abs().amax(dim=dim, keepdim=True))


def shared_exponent_field(blocks: torch.Tensor, dim: int, lowest: int, highest: int) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(largest exponent field over the finite elements along `dim`, the finite mask, whether the
    blocks are ordinary). Ordinary (see ordinary_fields, with the caller's range): zero blocks read
    `lowest` and no mask is needed. Otherwise the mask is None when a check rules NaN/Inf out (on
    CPU). Where rare cases are assumed (accelerators), neither check's work is done; where ordinary
    blocks are assumed (bits.assume_ordinary), the blocks are taken as ordinary unchecked."""
    if assumes_ordinary() or checks_rare_cases(blocks.device):
        magnitudes = blocks.abs().amax(dim=dim, keepdim=True)
        fields = ordinary_fields(magnitudes, lowest, highest)
        if fields is not None:
            return fields, None, True
        field = exponent_field(magnitudes)
        if not needs(field == EXPONENT_FIELD_INF_NAN):
            return field, None, False
    finite = torch.isfinite(blocks)
    return max_exponent_field(torch.where(finite, blocks, 0.0), dim), finite, False


def normal_scale_fields(offset: int) -> tuple[int, int]:
    """The exponent fields f (NaN/Inf's excluded) whose scale 2**(f - offset) and its inverse are
    both normal float32: the range a caller of ordinary_fields passes for scales of that form."""
    return offset + MIN_NORMAL_EXPONENT, min(EXPONENT_FIELD_INF_NAN - 1, offset - MIN_NORMAL_EXPONENT)


def ordinary_fields(magnitudes: torch.Tensor, lowest: int, highest: int) -> torch.Tensor | None:
    """The exponent fields of `magnitudes` (float32 maxima of blocks or sub-blocks, >= 0), zeros
    raised to `lowest`, when every nonzero magnitude's field lies in [lowest, highest]: the caller
    picks the range in which its scales need no rare-case fix, and an all-zero block gives zeros at
    any scale. None otherwise, and always where rare cases are assumed (accelerators): the caller
    then takes its general path. One reduction and one host read replace the per-case checks.
    Within bits.assume_ordinary, the fields unchecked."""
    bits = magnitudes.view(torch.int32)
    if assumes_ordinary():
        return (bits >> MANTISSA_BITS).clamp_(min=lowest)
    if not checks_rare_cases(magnitudes.device) or not magnitudes.numel():
        return None
    least, most = torch.stack(torch.aminmax(bits.masked_fill(bits == 0, lowest << MANTISSA_BITS))).tolist()
    if least < lowest << MANTISSA_BITS or most >= (highest + 1) << MANTISSA_BITS:
        return None
    return (bits >> MANTISSA_BITS).clamp_(min=lowest)
