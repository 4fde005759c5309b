"""The constants' side of a rotation (finetune.onnx.rotate and .rotate_heads plan it): the steps a
planned constant goes through, by name, and the rewrite that applies them in place, each product in
float64 a piece at a time and stored in the constant's own type; and what both planners read of a
node alike (its axes)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graphs import node_reads, unique_name
from .hadamard import online_factors
from .io import loaded_tensor

RIGHT, LEFT = "right", "left"  # a constant times Q along its last axis; Q^T times it along its first
HEADS_RIGHT, HEADS_LEFT = "heads right", "heads left"  # the same by R, one attention head's width at a time
ONLINE = "online:"  # + a width: a weight whose input is rotated online by a Hadamard matrix of that order
ROWS, COLUMNS = "rows:", "columns:"  # + a gain's name: a weight's rows (or a transposed weight's columns) times the gain
ONES = "ones"  # a norm's gain, once folded into the layers reading the norm
STREAM, HEADS = "stream", "heads"  # the matrices: Q of the residual stream's width, R of one head's
_PRODUCTS = {RIGHT: (STREAM, False), LEFT: (STREAM, True), HEADS_RIGHT: (HEADS, False), HEADS_LEFT: (HEADS, True)}
SHAPE_ONLY = ("Shape", "Size")  # readers of a value's shape alone, which no rotation changes
PIECE_ELEMENTS = 1 << 22  # the most elements of a constant rotated at once in float64 (32 MiB)

Steps = dict[tuple[str, int], list[str]]  # (node name, input index) of a constant -> its steps, in order


class RotationError(ValueError):
    """The graph cannot be rotated exactly: one line naming the value and node."""


def apply_rotation(graph: onnx.GraphProto, steps: Iterable[tuple[tuple[str, int], list[str]]],
                   matrices: dict[str, np.ndarray], folder: Path | None = None) -> None:
    """Rewrite the planned constants in place (each step's products in float64, a piece of at most
    PIECE_ELEMENTS at a time, stored in the constant's own type: an LM head of 128 k x 4096 never
    stands whole in float64); a constant that other readers share is copied first, so only the
    planned reads change. Constants whose values are still in a data file in `folder` are read from
    it, so a tensor's old bytes never stay in the graph's memory beside its new ones."""
    nodes = {node.name: node for node in graph.node}
    tensors = {t.name: t for t in graph.initializer}
    reads: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node_reads(node):
            reads[name] += 1
    outputs = {o.name for o in graph.output}
    for (name, index), planned in steps:
        node = nodes[name]
        tensor = tensors[node.input[index]]
        array = numpy_helper.to_array(loaded_tensor(tensor, folder))
        for step in planned:
            array = _step(array, step, matrices, lambda gain: numpy_helper.to_array(loaded_tensor(tensors[gain], folder)))
        if reads[tensor.name] > 1 or tensor.name in outputs:
            copy = unique_name(f"{tensor.name}_rotated", set(tensors))
            reads[tensor.name] -= 1
            tensors[copy] = tensor = graph.initializer.add()
            tensor.name = node.input[index] = copy
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))


def _step(array: np.ndarray, step: str, matrices: dict[str, np.ndarray], gain_of: Callable[[str], np.ndarray]) -> np.ndarray:
    """One planned step on a constant, a new array of its type: times a matrix along its last axis,
    the matrix's transpose times it along its first (a block of the matrix's order at a time: the
    stream's whole width, or one head's), its rows (or columns) times a gain (read before any gain is
    set to ones), or ones."""
    if step == ONES:
        return np.ones_like(array)
    if step.startswith(ONLINE):  # the input rotated online by H (unnormalised): W := H^T W / n
        return _left(array, _online_left(int(step[len(ONLINE):])))
    if step in _PRODUCTS:
        matrix, transposed = _PRODUCTS[step]
        return _left(array, matrices[matrix].T) if transposed else _right(array, matrices[matrix])
    result = np.empty_like(array)
    gain = gain_of(step.split(":", 1)[1]).astype(array.dtype).reshape(-1)  # one product: rounded once
    np.multiply(array, gain[:, None] if step.startswith(ROWS) else gain[None, :], out=result)
    return result


def _right(array: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Each run of the matrix's order along the array's last axis times the matrix (float64 products
    by pieces of rows), in the array's type."""
    result = np.empty_like(array)
    rows, out = array.reshape(-1, matrix.shape[0]), result.reshape(-1, matrix.shape[0])
    step_rows = max(1, PIECE_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step_rows):
        out[start:start + step_rows] = rows[start:start + step_rows].astype(np.float64) @ matrix
    return result


def _left(array: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """The matrix times each run of its order along the array's first axis (float64 products by
    pieces of columns), in the array's type."""
    result = np.empty_like(array)
    step_columns = max(1, PIECE_ELEMENTS // array.shape[0])
    for start in range(0, array.shape[1], step_columns):
        piece = array[:, start:start + step_columns].astype(np.float64)
        result[:, start:start + step_columns] = (matrix @ piece.reshape(-1, matrix.shape[0], piece.shape[1])).reshape(piece.shape)
    return result


@functools.lru_cache(maxsize=4)
def _online_left(n: int) -> np.ndarray:
    """H^T / n for the Hadamard matrix H of order n that an online rotation applies."""
    return np.kron(*online_factors(n)).T.astype(np.float64) / n


def node_axes(node: onnx.NodeProto, tensors: dict[str, onnx.TensorProto]) -> list[int] | None:
    """A reduction's, Unsqueeze's or Squeeze's axes: its attribute (older opsets) or its constant second
    input (newer ones); None where neither gives them."""
    axes = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axes"), None)
    if axes is None and len(node.input) > 1 and node.input[1] in tensors:
        axes = numpy_helper.to_array(tensors[node.input[1]]).reshape(-1).tolist()
    return None if axes is None else list(axes)
