"""Working along one axis of a tensor of unknown shape: block formats view it as zero-padded
blocks that share an exponent, and linear ops broadcast per-axis parameters along it."""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
from onnx import numpy_helper

from finetune.formats import BFPSpec, MXSpec

from .arithmetic import FLT_MAX, Body, exponent_power, pow2

_INT64_MAX = np.iinfo(np.int64).max

SpecT = TypeVar("SpecT", BFPSpec, MXSpec)


def axis_index(b: Body, rank: str, axis: int) -> str:
    """The axis as an index into x's shape, 0 for rank-1 x (AMD Quark ignores axis there); an
    out-of-range axis stays out of range, so the reshapes that follow fail instead of guessing."""
    index = b.const([axis], np.int64) if axis >= 0 else b.op("Add", rank, b.const([axis], np.int64))
    return b.op("Where", b.op("Equal", rank, b.const([1], np.int64)), b.const([0], np.int64), index)


def to_blocks(b: Body, x: str, axis: int, inner: list[int]) -> tuple[str, Callable[[str], str]]:
    """View x as [P, nb, *inner, Q] blocks along `axis` (rank-0 x as rank 1; rank-1 and one-element
    inputs use axis 0, as AMD Quark ignores axis there), zero-padding the axis to a multiple of the
    block; returns the blocks and the function that undoes the view. P and Q are the products of the
    dimensions before and after the axis, so nothing transposes. Every shape comes from x at run time."""
    block = math.prod(inner)
    one, zero = b.const([1], np.int64), b.const([0], np.int64)
    shape = b.op("Shape", x)
    viewed = _at_least_rank_1(b, shape)
    single = b.op("Equal", b.op("Size", x), b.const(1, np.int64))
    at = b.op("Where", single, zero, axis_index(b, b.op("Shape", viewed), axis))
    after = b.op("Add", at, one)
    before_size = b.op("ReduceProd", b.op("Slice", viewed, zero, at), keepdims=1)
    length = b.op("Slice", viewed, at, after)
    after_size = b.op("ReduceProd", b.op("Slice", viewed, after, b.const([_INT64_MAX], np.int64)), keepdims=1)
    size = b.const([block], np.int64)
    padding = b.op("Mod", b.op("Sub", size, b.op("Mod", length, size)), size)
    flat = b.reshape(x, b.op("Concat", before_size, length, after_size, axis=0))
    padded = b.op("Pad", flat, b.op("Concat", zero, zero, zero, zero, padding, zero, axis=0))
    padded_length = b.op("Add", length, padding)
    count = b.op("Div", padded_length, size)
    blocks = b.reshape(padded, b.op("Concat", before_size, count, b.const(inner, np.int64), after_size, axis=0))

    def undo(y: str) -> str:
        """Back to x's shape (rank 0 included), dropping the padding."""
        rows = b.reshape(y, b.op("Concat", before_size, padded_length, after_size, axis=0))
        return b.reshape(b.op("Slice", rows, zero, length, one), shape)

    return blocks, undo


def _at_least_rank_1(b: Body, shape: str) -> str:
    """x's shape with a leading 1 where x is rank 0 (a scalar is blocked as a one-element vector)."""
    missing = b.op("Max", b.op("Sub", b.const([1], np.int64), b.op("Shape", shape)), b.const([0], np.int64))
    return b.op("Concat", _ones(b, missing), shape, axis=0)


def _ones(b: Body, count: str) -> str:
    """An int64 vector of `count` ones (count a one-element int64 tensor), for padding shapes."""
    return b.op("ConstantOfShape", count, value=numpy_helper.from_array(np.array([1], np.int64)))


@dataclasses.dataclass(frozen=True)
class BlockBody(ABC, Generic[SpecT]):
    """The function body of a block format, specialised to the node's attributes `spec`."""

    spec: SpecT

    @property
    @abstractmethod
    def overload(self) -> str:
        """A readable name that identifies the attribute set."""

    def prepare(self, b: Body, x: str) -> str:
        """Rounding applied to float32 x before the format; none unless the format asks for it."""
        return x

    @abstractmethod
    def build(self, b: Body, x: str, ordinary: bool = False) -> str:
        """y for float32 x, following FORMATS.md; `ordinary` promises what needs_general_body checks
        (more than one element, all finite and below 2^64 in magnitude), so the rare-case handling is
        left out. The ordinary to_bfp and MX bodies end in + 0, which turns -0 into +0 as the general
        body's last Where does (onnxruntime's Where of three same-shape tensors does; broadcast ones
        keep -0, as to_bfp_prime's does)."""

    def quantize_blocks(self, b: Body, x: str, quantize: Callable[[str, str], str], ordinary: bool = False) -> str:
        """x in blocks of `block_size` along `axis`, each replaced by quantize(values, 2^(E-127)) for E
        the exponent field of its largest finite magnitude; NaN and Inf pass through (outside E, and
        kept by the last Where). `quantize` is element-wise given the scale, so whatever it makes of
        a NaN or Inf stays at that element, which the last Where replaces."""
        blocks, undo = to_blocks(b, x, self.spec.axis, [self.spec.block_size])
        magnitude = b.op("Abs", blocks)
        if ordinary:
            shared = exponent_power(b, b.reduce_max(magnitude, [2]), bounded=True)
            return undo(b.op("Add", quantize(blocks, shared), b.const(0.0)))
        finite = b.op("LessOrEqual", magnitude, b.const(FLT_MAX))
        shared = exponent_power(b, b.reduce_max(b.op("Where", finite, magnitude, b.const(0.0)), [2]))
        return undo(b.op("Where", finite, quantize(blocks, shared), blocks))


def needs_general_body(b: Body, x: str) -> str:
    """Whether x takes the general body rather than the ordinary one: it has one element (returned
    as it is) or a NaN, an Inf or a magnitude of 2^64 or more. One sum finds the last three:
    floor(|x| 2^-64) is 0 for every other element, and a sum of terms >= 0 is 0 only when all are."""
    beyond = b.op("ReduceSum", b.op("Floor", b.op("Mul", b.op("Abs", x), b.const(pow2(-64)))), keepdims=0)
    rare = b.op("Not", b.op("LessOrEqual", beyond, b.const(0.0)))
    return b.op("Or", rare, b.op("Equal", b.op("Size", x), b.const(1, np.int64)))


def broadcast_along(b: Body, parameter: str, x: str, axis: int) -> str:
    """A 1-D per-axis parameter reshaped to [C, 1, ...] to broadcast against x along `axis`; a
    scalar stays a scalar (so a rank-0 x keeps its rank)."""
    rank = b.op("Shape", b.op("Shape", x))
    at = axis_index(b, rank, axis)
    trailing = b.op("Max", b.op("Sub", b.op("Sub", rank, b.const([1], np.int64)), at), b.const([0], np.int64))
    parameter_shape = b.op("Shape", parameter)
    count = b.op("Mul", trailing, b.op("Size", parameter_shape))
    return b.op("Reshape", parameter, b.op("Concat", parameter_shape, _ones(b, count), axis=0))
