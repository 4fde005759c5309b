"""Working along one axis of a tensor of unknown shape: block formats view it as zero-padded
blocks that share an exponent, and linear ops broadcast per-axis parameters along it.

Two views of the same blocks keep onnxruntime's element-wise kernels fast. Its broadcasting loops
over the innermost dimension, so an operand whose last dimension is 1, or a broadcast over a few
elements, costs one call per element (50x a plain Add). The view along the last axis therefore
keeps every tensor flat, reduces through a [-1, k] reshape, and spreads a block's value over its
elements with a MatMul by a row of ones (one product per element: exact); the other view keeps
[P, nb, *inner, Q], whose innermost dimension Q is the length after the axis.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
from onnx import numpy_helper

from finetune.formats import BFPSpec, MXSpec

from .arithmetic import FLT_MAX, Body, exponent_power

_INT64_MAX = np.iinfo(np.int64).max

SpecT = TypeVar("SpecT", BFPSpec, MXSpec)


def axis_index(b: Body, rank: str, axis: int) -> str:
    """The axis as an index into x's shape, 0 for rank-1 x (AMD Quark ignores axis there); an
    out-of-range axis stays out of range, so the reshapes that follow fail instead of guessing."""
    index = b.const([axis], np.int64) if axis >= 0 else b.op("Add", rank, b.const([axis], np.int64))
    return b.op("Where", b.op("Equal", rank, b.const([1], np.int64)), b.const([0], np.int64), index)


@dataclasses.dataclass(frozen=True)
class BlockDims:
    """x's shape and the one-element int64 sizes that view it as blocks along the axis: the
    products of the dimensions before and after it, its length and the zeros that pad it."""

    shape: str
    before: str
    length: str
    after: str
    padding: str


def block_dims(b: Body, x: str, axis: int, block: int) -> BlockDims:
    """The sizes of x's blocks along `axis` (rank-0 x viewed as rank 1; rank-1 and one-element
    inputs use axis 0, as AMD Quark ignores axis there), every one from x's shape at run time."""
    zero, one = b.const([0], np.int64), b.const([1], np.int64)
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
    return BlockDims(shape, before_size, length, after_size, padding)


class BlockView(ABC):
    """x in zero-padded blocks of `inner` (a block, or sub-blocks within a block) at levels:
    0 the elements, and level k+1 the maxima of level k over the innermost remaining group."""

    def __init__(self, b: Body, x: str, dims: BlockDims, inner: list[int]) -> None:
        self.b, self.dims, self.inner = b, dims, inner
        self.padded_length = b.op("Add", dims.length, dims.padding)
        self.blocks = self._view(x)

    @abstractmethod
    def _view(self, x: str) -> str:
        """The element-level view of x."""

    @abstractmethod
    def reduce_max(self, t: str, level: int) -> str:
        """The maxima at `level + 1` of t at `level`."""

    @abstractmethod
    def spread(self, t: str, level: int, to: int = 0) -> str:
        """t at `level` as an operand of tensors at level `to` (each element its group's value)."""

    @abstractmethod
    def undo(self, y: str) -> str:
        """y at level 0 back in x's shape (rank 0 included), without the padding."""

    def _rows(self, x: str, after: list[str]) -> str:
        """x as [before, padded length, *after]: the axis padded with zeros at its end."""
        b, dims = self.b, self.dims
        zero = b.const([0], np.int64)
        rows = b.reshape(x, b.op("Concat", dims.before, dims.length, *after, axis=0))
        pads = [zero, zero, *[zero] * len(after), zero, dims.padding, *[zero] * len(after)]
        return b.op("Pad", rows, b.op("Concat", *pads, axis=0))

    def _unrows(self, rows: str, after: list[str]) -> str:
        """The inverse of _rows for y of the same element count."""
        b, dims = self.b, self.dims
        zero, one = b.const([0], np.int64), b.const([1], np.int64)
        rows = b.reshape(rows, b.op("Concat", dims.before, self.padded_length, *after, axis=0))
        return b.reshape(b.op("Slice", rows, zero, dims.length, one), dims.shape)


class AxisView(BlockView):
    """Blocks as [P, nb, *inner, Q]; a level's maxima keep their dimensions (size 1), so they
    broadcast against the elements as they are."""

    def _view(self, x: str) -> str:
        """x as [P, nb, *inner, Q]."""
        b = self.b
        padded = self._rows(x, [self.dims.after])
        count = b.op("Div", self.padded_length, b.const([math.prod(self.inner)], np.int64))
        shape = b.op("Concat", self.dims.before, count, b.const(self.inner, np.int64), self.dims.after, axis=0)
        return b.reshape(padded, shape)

    def reduce_max(self, t: str, level: int) -> str:
        """ReduceMax over the innermost dimension of `inner` not yet reduced."""
        return self.b.reduce_max(t, [1 + len(self.inner) - level])

    def spread(self, t: str, level: int, to: int = 0) -> str:
        """t itself: element-wise ops broadcast it along its size-1 dimensions."""
        return t

    def undo(self, y: str) -> str:
        """Back to x's shape."""
        return self._unrows(y, [self.dims.after])


class LastAxisView(BlockView):
    """Blocks along x's last axis (Q = 1): every level is a flat vector, so no operand ends in a
    dimension of 1."""

    def _view(self, x: str) -> str:
        """x flat, the blocks one after another."""
        return self.b.reshape(self._rows(x, []), self.b.const([-1], np.int64))

    def reduce_max(self, t: str, level: int) -> str:
        """ReduceMax of t viewed as [-1, group] over the group."""
        b = self.b
        groups = b.op("Reshape", t, b.const([-1, self.inner[-1 - level]], np.int64))
        return b.op("Reshape", b.reduce_max(groups, [1]), b.const([-1], np.int64))

    def spread(self, t: str, level: int, to: int = 0) -> str:
        """[-1, 1] times a row of ones as long as the groups between the levels, flattened."""
        b = self.b
        ones = b.const(np.ones((1, math.prod(self.inner[len(self.inner) - level:len(self.inner) - to]))))
        spread = b.op("MatMul", b.op("Reshape", t, b.const([-1, 1], np.int64)), ones)
        return b.op("Reshape", spread, b.const([-1], np.int64))

    def undo(self, y: str) -> str:
        """Back to x's shape."""
        return self._unrows(y, [])


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

    @property
    @abstractmethod
    def inner(self) -> list[int]:
        """The dimensions of one block: [block_size], or sub-blocks [count, size]."""

    def prepare(self, b: Body, x: str) -> str:
        """Rounding applied to float32 x before the format; none unless the format asks for it."""
        return x

    @abstractmethod
    def quantize(self, b: Body, view: BlockView, ordinary: bool) -> str:
        """y at level 0 of `view`, following FORMATS.md; `ordinary` promises what needs_general_body
        checks (more than one element, all finite and below 2^64 in magnitude), so the rare-case
        handling is left out."""

    def finish_ordinary(self, b: Body, y: str) -> str:
        """The ordinary body's last step, on y in x's shape: + 0, which turns -0 into +0 as the
        general body's last Where does (onnxruntime's Where of three same-shape tensors does), and
        which writes the If's output itself rather than through a copy."""
        return b.op("Add", y, b.const(0.0))

    def build(self, b: Body, x: str, ordinary: bool = False) -> str:
        """y for float32 x. The general body views the blocks along the axis; the ordinary one asks
        at run time whether the axis is x's last (nothing after it) and takes the flat view there."""
        dims = block_dims(b, x, self.spec.axis, math.prod(self.inner))
        if not ordinary:
            view = AxisView(b, x, dims, self.inner)
            return view.undo(self.quantize(b, view, False))
        last, other = Body(b.opset, b.prefix + "l"), Body(b.opset, b.prefix + "a")
        last_view, other_view = LastAxisView(last, x, dims, self.inner), AxisView(other, x, dims, self.inner)
        last_y = self.finish_ordinary(last, last_view.undo(self.quantize(last, last_view, True)))
        other_y = self.finish_ordinary(other, other_view.undo(self.quantize(other, other_view, True)))
        return b.choose(b.op("Equal", dims.after, b.const([1], np.int64)),
                        last.branch(last_y, "last_axis"), other.branch(other_y, "other_axis"))

    def shared_quantize(self, b: Body, view: BlockView, scale_of: Callable[[str], str],
                        quantize: Callable[[str, str], str], ordinary: bool) -> str:
        """Each block replaced by quantize(values, scale) with scale = scale_of(2^(E-127)) for E the
        exponent field of its largest finite magnitude; NaN and Inf pass through (outside E, and
        kept by the last Where). `quantize` is element-wise given the scale, so whatever it makes of
        a NaN or Inf stays at that element, which the last Where replaces."""
        blocks = view.blocks
        magnitude = b.op("Abs", blocks)
        if ordinary:
            shared = exponent_power(b, view.reduce_max(magnitude, 0), bounded=True)
            return quantize(blocks, view.spread(scale_of(shared), 1))
        finite = b.op("LessOrEqual", magnitude, b.const(FLT_MAX))
        shared = exponent_power(b, view.reduce_max(b.op("Where", finite, magnitude, b.const(0.0)), 0))
        return b.op("Where", finite, quantize(blocks, view.spread(scale_of(shared), 1)), blocks)


def needs_general_body(b: Body, x: str) -> str:
    """Whether x takes the general body rather than the ordinary one: it has one element (returned
    as it is) or a NaN, an Inf or a magnitude of 2^64 or more. One sum of squares finds the last
    three (it is NaN or overflows to Inf); a sum of large finite values that overflows too only
    sends x to the general body, which gives the same values."""
    squares = b.op("ReduceSumSquare", x, keepdims=0)
    rare = b.op("Not", b.op("LessOrEqual", squares, b.const(FLT_MAX)))
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
