"""ONNX spatial padding (explicit begin/end pads or auto_pad) resolved against the input shape at
run time, so dynamic sizes and asymmetric pads work for Conv and pooling alike."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")


@dataclass(frozen=True)
class SpatialPadding:
    """The padding rule of a Conv or pooling node."""

    auto_pad: str
    pads: tuple[int, ...]

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, Any]) -> SpatialPadding:
        """Read `auto_pad` and `pads` (begins, then ends; none means zeros) from a node's attributes."""
        auto_pad = attributes.get("auto_pad", "NOTSET")
        if auto_pad not in AUTO_PADS:
            raise NotImplementedError(f"auto_pad={auto_pad!r}")
        return cls(auto_pad, tuple(attributes.get("pads", ())))

    def resolve(self, sizes: Sequence[int], extents: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
        """(begin, end) pads per spatial axis for inputs of `sizes`, windows of `extents`
        ((kernel - 1) * dilation + 1) and `strides`."""
        rank = len(sizes)
        if self.auto_pad == "NOTSET" and self.pads:
            return list(zip(self.pads[:rank], self.pads[rank:]))
        if self.auto_pad in ("NOTSET", "VALID"):
            return [(0, 0)] * rank
        totals = [max((math.ceil(n / s) - 1) * s + e - n, 0) for n, e, s in zip(sizes, extents, strides)]
        small_first = self.auto_pad == "SAME_UPPER"
        return [(t // 2, t - t // 2) if small_first else (t - t // 2, t // 2) for t in totals]


def is_symmetric(pads: Sequence[tuple[int, int]]) -> bool:
    """Whether every axis pads its begin and end equally."""
    return all(begin == end for begin, end in pads)


def torch_pad(pads: Sequence[tuple[int, int]]) -> list[int]:
    """The `F.pad` argument: last axis first, (begin, end) each."""
    return [p for begin_end in reversed(pads) for p in begin_end]


def window_extents(kernel: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """The span of each window: (kernel - 1) * dilation + 1."""
    return [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
