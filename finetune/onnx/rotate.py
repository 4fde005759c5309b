"""QuaRot-style rotation (Ashkboos et al., "QuaRot", 2024; its R1) of a float graph's residual stream,
folded into the weights: every value of the stream x becomes x Q for one orthogonal Q (a randomised
Hadamard matrix, finetune.onnx.hadamard), so an outlier channel is spread over all channels before
the layers reading the stream quantize their inputs, while the graph computes the same function.

The stream starts at the largest token table read by a Gather (table := table Q) and is followed
through the graph: residual Adds (both operands in the stream; a constant operand is rotated too),
products by a scalar or by a per-row value (an RMS norm's 1 / sqrt(mean(x^2) + eps), found by
walking up to a reduction over the last axis with keepdims), layers writing into it (W := W Q, the
bias too) and layers reading it (W := Q^T W). A norm's gain g (a Mul by a constant vector) does not
commute with Q: it is folded into the layers reading the norm (W := diag(g) W) and set to ones, so a
SmoothQuant or AWQ rescaling after the rotation still folds into it. The squares of the stream may
only be reduced over the last axis (the norm's mean, which Q leaves as it is). Anything else that
reads the stream (a LayerNormalization's mean, a model output, a subgraph) stops the rewrite with a
one-line error that names the value and the node, before any weight changes. RMS norm ops
(RMSNormalization, onnxruntime's SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization, as
onnxruntime-genai's builder writes them) are followed as the norm and gain they compute."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .contrib import SKIP_SUM, rms_gain_input
from .domains import DEFAULT_DOMAINS
from .graphs import node_reads
from .hadamard import online_factors, rotation_matrix
from .rotate_heads import plan_heads
from .rotate_online import insert_online
from .rotate_steps import (
    COLUMNS,
    HEADS,
    LEFT,
    ONES,
    ONLINE,
    RIGHT,
    ROWS,
    SHAPE_ONLY,
    STREAM,
    RotationError,
    Steps,
    apply_rotation,
    node_axes,
)
from .smooth import input_axis

_REDUCTIONS = ("ReduceMean", "ReduceSum")  # of the stream's squares over the last axis: Q keeps them
_NORMS = ("ReduceL2", "ReduceSumSquare")  # of the stream itself over the last axis: Q keeps them too
_PER_ROW_STEPS = ("Sqrt", "Reciprocal", "Neg", "Cast", "Add", "Sub", "Mul", "Div", "Pow")
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


@dataclass
class Plan:
    """What rotating one stream does: `steps` per (node name, input index) of a constant, in order
    (RIGHT, LEFT, or ROWS / COLUMNS and a gain's name), the norms' gains set to ones."""

    width: int
    table: str  # the Gather that starts the stream
    stream: set[str] = field(default_factory=set)
    steps: Steps = field(default_factory=lambda: defaultdict(list))
    gains: dict[tuple[str, int], str] = field(default_factory=dict)  # a norm's Mul input -> its gain (set to ones)
    reading: list[str] = field(default_factory=list)  # the layers reading the stream (their weights: Q^T W)
    writing: list[str] = field(default_factory=list)  # the layers writing into it (W Q)
    online: dict[str, int] = field(default_factory=dict)  # a layer whose input is rotated online -> its input width
    inserted: list[str] = field(default_factory=list)  # the MatMuls of the online rotations (float: never quantized)
    heads: list[tuple[str, str]] = field(default_factory=list)  # (value, output) projections rotated per head
    head_width: int = 0  # the order of the heads' rotation R (0: none)


class _Walk:
    """Follows one stream from its table's Gather, filling a Plan or raising RotationError."""

    def __init__(self, graph: onnx.GraphProto, table: onnx.NodeProto, width: int) -> None:
        self.graph, self.plan = graph, Plan(width, table.name)
        self.tensors = {t.name: t for t in graph.initializer}
        self.producers = {output: node for node in graph.node for output in node.output}
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in graph.node:
            for index, name in enumerate(node.input):
                if name and not (node.op_type in SHAPE_ONLY and node.domain in DEFAULT_DOMAINS):
                    self.readers[name].append((node, index))
            for name in node_reads(node)[len(node.input):]:  # a subgraph's reads of the stream cannot be rotated
                self.readers[name].append((node, -1))
        self.outputs = {o.name for o in graph.output}
        self.pending: list[str] = []

    def run(self, start: str) -> Plan:
        self.mark(start)
        while self.pending:
            value = self.pending.pop()
            if value in self.outputs:
                raise RotationError(f"rotation: {value} (the residual stream) is a model output, which would come out rotated")
            self.produce(value)
            for node, index in self.readers[value]:
                self.consume(value, node, index)
        return self.plan

    def mark(self, value: str) -> None:
        if value not in self.plan.stream:
            self.plan.stream.add(value)
            self.pending.append(value)

    def fail(self, value: str, node: onnx.NodeProto, why: str) -> RotationError:
        return RotationError(f"rotation: {value} (the residual stream) meets {node.name or '(unnamed)'} ({node.op_type}), "
                             f"{why}; remove `rotation` from the config")

    def constant(self, name: str) -> onnx.TensorProto | None:
        tensor = self.tensors.get(name)
        return tensor if tensor is not None and tensor.data_type in _FLOATS else None

    def size(self, name: str) -> int | None:
        tensor = self.constant(name)
        return None if tensor is None else int(np.prod(tensor.dims, dtype=np.int64))

    def last_is_width(self, name: str) -> bool:
        tensor = self.constant(name)
        return tensor is not None and len(tensor.dims) >= 1 and tensor.dims[-1] == self.plan.width and \
            int(np.prod(tensor.dims)) == self.plan.width

    def produce(self, value: str) -> None:
        """Make `value`'s producer compute it rotated (or check that it does, from rotated inputs)."""
        node = self.producers.get(value)
        if node is None:
            raise RotationError(f"rotation: {value} (the residual stream) is a model input, which comes in unrotated")
        if rms_gain_input(node) is not None:
            self.rms_norm(value, node)
            return
        if node.domain not in DEFAULT_DOMAINS:
            raise self.fail(value, node, "a custom op")
        kind = node.op_type
        if kind == "Gather" and self.is_table(node):
            self.plan.steps[(node.name, 0)].append(RIGHT)
        elif kind in ("MatMul", "Gemm"):
            self.layer(value, node, reads=False)
        elif kind in ("Add", "Sub"):
            self.both_in_stream(value, node)
        elif kind in ("Mul", "Div"):
            self.scaled(value, node)
        elif kind == "Cast" and next((a.i for a in node.attribute if a.name == "to"), 0) in _FLOATS:
            self.mark(node.input[0])
        else:
            raise self.fail(value, node, "which cannot compute it rotated")

    def rms_norm(self, value: str, node: onnx.NodeProto) -> None:
        """An RMS norm op (RMSNormalization, onnxruntime's SimplifiedLayerNormalization and its skip form,
        which adds the stream's two operands and a bias first): rotated inputs give its residual sum
        rotated (a bias of the stream's width rotated too) and its normed output rotated once its gain
        is folded into the layers reading it; its other outputs (inverse roots) may not be read."""
        gain = rms_gain_input(node)
        if any(self.readers[name] or name in self.outputs for k, name in enumerate(node.output) if name and k not in (0, SKIP_SUM)):
            raise self.fail(value, node, "whose inverse root is read (a rotation keeps it, but it is not followed)")
        if value == node.output[0]:
            self.fold_gain(value, node, gain)
        for name in node.input[:gain]:  # the stream: input (and skip)
            self.mark(name)
        if gain == 2 and len(node.input) > 3 and node.input[3]:  # the skip form's bias, added to the stream
            if not self.last_is_width(node.input[3]):
                raise self.fail(value, node, "whose bias is not one constant per channel")
            self.plan.steps[(node.name, 3)].append(RIGHT)

    def is_table(self, node: onnx.NodeProto) -> bool:
        """A Gather of rows (axis 0) of a constant float [vocabulary, width] table."""
        table = self.constant(node.input[0])
        return table is not None and len(table.dims) == 2 and table.dims[1] == self.plan.width and \
            not any(a.name == "axis" and a.i for a in node.attribute)

    def layer(self, value: str, node: onnx.NodeProto, reads: bool) -> None:
        """A MatMul / Gemm reading the stream (Q^T W) or writing into it (W Q, and its bias b Q); the
        stream's axis of the weight decides the side (a Gemm's transposed weight swaps them)."""
        weight = self.constant(node.input[1])
        if weight is None or len(weight.dims) != 2 or any(a.name == "transA" and a.i for a in node.attribute):
            raise self.fail(value, node, "whose weight is not a constant 2-D float matrix")
        axis = input_axis(node) if reads else 1 - input_axis(node)  # the weight's axis of the stream's channels
        if weight.dims[axis] != self.plan.width:
            raise self.fail(value, node, f"whose {'input' if reads else 'output'} is not {self.plan.width} wide")
        self.plan.steps[(node.name, 1)].append(LEFT if axis == 0 else RIGHT)
        (self.plan.reading if reads else self.plan.writing).append(node.name)
        if not reads and len(node.input) > 2 and node.input[2]:
            if not self.last_is_width(node.input[2]):
                raise self.fail(value, node, "whose bias is not one constant per output channel")
            self.plan.steps[(node.name, 2)].append(RIGHT)

    def both_in_stream(self, value: str, node: onnx.NodeProto) -> None:
        """x + y (or x - y) is rotated where both are: a computed operand joins the stream, a
        constant one (a bias of the stream's width) is rotated."""
        for index, name in enumerate(node.input):
            if name in self.tensors:
                if not self.last_is_width(name):
                    raise self.fail(value, node, f"whose constant {name} is not one value per channel (a scalar "
                                    "added to every channel does not commute with a rotation)")
                self.plan.steps[(node.name, index)].append(RIGHT)
            else:
                self.mark(name)

    def scaled(self, value: str, node: onnx.NodeProto) -> None:
        """x * c, x * r, x / c, x / r (c a scalar constant, r a value per row) are rotated where x is;
        x * g (g a constant per channel: a norm's gain) where g is folded into every reader."""
        first, second = node.input[0], node.input[1]
        if node.op_type == "Div" or first in self.plan.stream:
            rotated, other = first, second
        elif second in self.plan.stream or first in self.tensors or self.per_row(first):
            rotated, other = second, first
        else:
            rotated, other = first, second
        if other in self.plan.stream:
            raise self.fail(value, node, "which multiplies or divides two values of the stream")
        self.mark(rotated)
        if self.size(other) == 1 or (other not in self.tensors and self.per_row(other)):
            return
        if node.op_type == "Mul" and self.last_is_width(other):
            self.fold_gain(value, node, list(node.input).index(other))
            return
        raise self.fail(value, node, f"which scales its channels by {other}, neither a scalar, a value per row nor a "
                        "norm's gain that layers alone read")

    def fold_gain(self, value: str, node: onnx.NodeProto, index: int) -> None:
        """The norm's gain g into every layer reading g * x (their weights' rows times g); g set to ones."""
        readers = self.readers[value]
        layers = [(reader, k) for reader, k in readers if reader.op_type in ("MatMul", "Gemm") and k == 0
                  and reader.domain in DEFAULT_DOMAINS]
        if not readers or len(layers) != len(readers):
            raise self.fail(value, node, "a norm's gain read by something other than layers, which cannot absorb it")
        self.plan.gains[(node.name, index)] = node.input[index]
        for layer, _ in layers:
            self.plan.steps[(layer.name, 1)].append(f"{ROWS if input_axis(layer) == 0 else COLUMNS}{node.input[index]}")

    def consume(self, value: str, node: onnx.NodeProto, index: int) -> None:
        """Check one reader of a stream value, planning its weight's rotation or following its output."""
        gain = rms_gain_input(node) if index >= 0 else None
        if gain is not None and index < gain:  # the stream into an RMS norm op: its outputs follow (rms_norm)
            self.mark(node.output[0])
            if len(node.output) > SKIP_SUM and node.output[SKIP_SUM]:
                self.mark(node.output[SKIP_SUM])
            return
        if index < 0 or node.domain not in DEFAULT_DOMAINS:
            raise self.fail(value, node, "a subgraph or custom op that reads it")
        kind = node.op_type
        if kind in ("MatMul", "Gemm") and index == 0:
            self.layer(value, node, reads=True)
        elif kind == "Mul" and node.input[0] == node.input[1]:
            self.squares_reduced(value, node)
        elif kind in ("Add", "Sub", "Mul", "Div", "Cast"):
            self.mark(node.output[0])
        elif kind == "Pow" and index == 0 and self.is_two(node.input[1]):
            self.squares_reduced(value, node)
        elif kind in _NORMS and self.over_last_axis(node):
            return
        else:
            raise self.fail(value, node, "which does not commute with a rotation of its last axis")

    def is_two(self, name: str) -> bool:
        """Whether `name` is a constant holding the one value 2 (x ** 2)."""
        values = numpy_helper.to_array(self.tensors[name]).reshape(-1) if name in self.tensors else None
        return values is not None and values.size == 1 and float(values[0]) == 2.0

    def squares_reduced(self, value: str, node: onnx.NodeProto) -> None:
        """x^2 only reduced over the last axis (an RMS norm's mean square), which a rotation keeps."""
        for reader, _ in self.readers[node.output[0]]:
            if reader.op_type not in _REDUCTIONS or not self.over_last_axis(reader):
                raise self.fail(value, reader, "which reads the stream's squares other than as a sum over the last axis")

    def over_last_axis(self, node: onnx.NodeProto) -> bool:
        """A reduction over the last axis alone (axes [-1]), keeping its dimension."""
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        return node.domain in DEFAULT_DOMAINS and keepdims == 1 and node_axes(node, self.tensors) == [-1]

    def per_row(self, name: str) -> bool:
        """Whether `name` is one value per row: elementwise steps with scalar constants from a
        reduction over the last axis with keepdims (an RMS norm's 1 / sqrt(mean(x^2) + eps))."""
        while True:
            node = self.producers.get(name)
            if node is None or node.domain not in DEFAULT_DOMAINS:
                return False
            if node.op_type in (*_REDUCTIONS, *_NORMS):
                return self.over_last_axis(node)
            computed = [i for i in node.input if i and i not in self.tensors]
            constants = [i for i in node.input if i in self.tensors]
            if node.op_type not in _PER_ROW_STEPS or len(computed) != 1 or any(self.size(c) != 1 for c in constants):
                return False
            name = computed[0]


def plan_rotation(graph: onnx.GraphProto) -> Plan:
    """The rotation of the stream that starts at the largest token table a Gather reads (a constant
    float [vocabulary, width] table, axis 0); the first table whose stream can be rotated wins."""
    tensors = {t.name: t for t in graph.initializer}
    tables = [node for node in graph.node if node.op_type == "Gather" and node.domain in DEFAULT_DOMAINS
              and node.input[0] in tensors and len(tensors[node.input[0]].dims) == 2
              and tensors[node.input[0]].data_type in _FLOATS and not any(a.name == "axis" and a.i for a in node.attribute)]
    if not tables:
        raise RotationError("rotation: no token table (a Gather of a constant float [vocabulary, width] table) starts a "
                            "residual stream in this graph; remove `rotation` from the config")
    tables.sort(key=lambda node: -int(np.prod(tensors[node.input[0]].dims)))
    first_error = None
    for table in tables:
        try:
            return _Walk(graph, table, int(tensors[table.input[0]].dims[1])).run(table.output[0])
        except RotationError as error:
            first_error = first_error or error
    raise first_error


def plan_online(graph: onnx.GraphProto, plan: Plan) -> None:
    """Add an online rotation of the input of every MatMul writing into the stream from outside it
    (attention's output projection, the MLP's down projection: QuaRot's online Hadamard): the input x
    becomes x H (nodes inserted by finetune.onnx.rotate_online) and the weight H^T W / n. A width
    without a Hadamard matrix here is a RotationError."""
    nodes = {node.name: node for node in graph.node}
    tensors = {t.name: t for t in graph.initializer}
    for name in plan.writing:
        node = nodes[name]
        if node.op_type != "MatMul" or node.input[0] in plan.stream:
            continue
        width = int(tensors[node.input[1]].dims[0])
        if online_factors(width) is None:
            raise RotationError(f"rotation: no Hadamard matrix of order {width} is built here for the online rotation of "
                                f"{node.input[0]}, the input of {name}; set rotation.online to false")
        plan.steps[(name, 1)].append(f"{ONLINE}{width}")
        plan.online[name] = width


def rotate_graph(graph: onnx.GraphProto, kind: str, seed: int, folder: Path | None = None, online: bool = False,
                 heads: bool = False) -> Plan:
    """Rotate the graph's residual stream (see the module's docstring) in place, reading values still
    in a data file from `folder` (see apply_rotation); with `heads` each attention head's values too
    (finetune.onnx.rotate_heads: before the online rotations, whose products come after R^T on the
    output projections' rows), and with `online` the inputs of the layers writing into the stream
    from outside (plan_online); the plan says what was done."""
    plan = plan_rotation(graph)
    matrices = {STREAM: rotation_matrix(plan.width, kind, seed)}
    if heads:
        plan.heads, plan.head_width = plan_heads(graph, plan.steps)
        matrices[HEADS] = rotation_matrix(plan.head_width, kind, seed)
    if online:
        plan_online(graph, plan)
    apply_rotation(graph, [*plan.steps.items(), *((key, [ONES]) for key in plan.gains)], matrices, folder)
    if online:
        plan.inserted = insert_online(graph, plan.online)
    return plan
