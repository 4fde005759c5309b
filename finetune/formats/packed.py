"""Straight-through gradient masks packed to one bit per element, for the compiled block-format
kernels: the forward writes the mask beside the values in the same pass (a 16th of the values'
bytes for a block of 16, against a byte per element as booleans, which inductor also stores slowly
on the CPU), and the backward is one pass over the incoming gradient instead of a second run of
the format. The bits go along the format's block axis, a group of up to 32 per int32 word, so the
packing is a reduction over the axis the format already reduces over, and fuses with it; so does
`all_groups`, the check the kernels without rare-case fixes make of their input."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .blocks import unblocked

MAX_GROUP = 32  # bits in one int32 word


def group_size(block_size: int) -> int:
    """Mask bits per word: a whole block where it fits in 32 bits (the loops then match the format's)."""
    return min(block_size, MAX_GROUP)


def grouped(t: torch.Tensor, a: int, group: int, fill: int) -> torch.Tensor:
    """t (boolean) as int32 [p, ceil(n / group), group, q] along axis `a` (as blocks.block_axis gives
    it; of length n; p and q the products of the axes before and after it), `fill` past its end."""
    shape = t.shape if t.dim() else (1,)
    n, p, q = shape[a], math.prod(shape[:a]), math.prod(shape[a + 1 :])
    words = -(-n // group)
    values = t.reshape(p, n, q).to(torch.int32)
    if words * group != n:
        values = F.pad(values, (0, 0, 0, words * group - n), value=fill)
    return values.reshape(p, words, group, q)


def pack_mask(passes: torch.Tensor, a: int, group: int) -> torch.Tensor:
    """The boolean mask `passes` as int32 words [p, ceil(n / group), q] (see grouped): bit i of a
    word is the mask of its group's i-th element, zero past the axis' end."""
    shifts = torch.arange(group, dtype=torch.int32, device=passes.device).reshape(1, 1, group, 1)
    return (grouped(passes, a, group, 0) << shifts).sum(dim=2, dtype=torch.int32)


def unpack_mask(packed: torch.Tensor, shape: torch.Size, a: int, group: int) -> torch.Tensor:
    """The boolean mask of `shape` that pack_mask packed along axis `a`."""
    n = shape[a] if len(shape) else 1
    shifts = torch.arange(group, dtype=torch.int32, device=packed.device).reshape(1, 1, group, 1)
    bits = (packed.unsqueeze(2) >> shifts) & 1
    return unblocked(bits, n).reshape(shape) != 0


def all_groups(holds: torch.Tensor, a: int, group: int) -> torch.Tensor:
    """Whether the boolean `holds` is true everywhere (0-dim), reduced group by group first, as
    pack_mask reduces, so that inductor computes both in one loop over the input."""
    return grouped(holds, a, group, 1).amin(dim=2).amin() != 0
