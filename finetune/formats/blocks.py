"""Blocking along one axis without transposes: [P, n, Q] -> padded [P, n_blocks, block, Q]."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    """How a tensor was cut into blocks along `axis`, so the cut can be undone exactly."""

    shape: torch.Size
    length: int
    padded: int

    def restore(self, blocks: torch.Tensor) -> torch.Tensor:
        """Undo `to_blocks`: drop the zero padding and return the original shape."""
        p, _, _, q = blocks.shape
        flat = blocks.reshape(p, self.padded, q)
        if self.padded != self.length:
            flat = flat[:, : self.length, :]
        return flat.reshape(self.shape)


def block_axis(x: torch.Tensor, axis: int) -> int:
    """The axis that is blocked: a rank-1 tensor ignores `axis`; negative axes count from the end."""
    if x.dim() <= 1:
        return 0
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {x.dim()}")
    return axis % x.dim()


def to_blocks(x: torch.Tensor, axis: int, block_size: int) -> tuple[torch.Tensor, BlockLayout]:
    """View x as [P, n_blocks, block_size, Q] along `axis`, zero-padding the axis to whole blocks."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    a = block_axis(x, axis)
    shape = x.shape
    n = shape[a] if x.dim() else 1
    p, q = math.prod(shape[:a]), math.prod(shape[a + 1 :])
    flat = x.reshape(p, n, q)
    padded = -(-n // block_size) * block_size
    if padded != n:
        flat = F.pad(flat, (0, 0, 0, padded - n))
    return flat.reshape(p, padded // block_size, block_size, q), BlockLayout(shape, n, padded)


def broadcast_param(param: torch.Tensor, x: torch.Tensor, axis: int | None, block_size: int | None) -> torch.Tensor:
    """Shape a scale or zero point like QuantizeLinear does: scalar (per tensor), 1-D along `axis`
    (per channel) or x's shape with ceil(n / block_size) along `axis` (blocked)."""
    param = torch.as_tensor(param, device=x.device)
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
