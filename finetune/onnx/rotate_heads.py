"""QuaRot's and SpinQuant's R2: each attention head's values rotated by one orthogonal matrix R of
the head's width, folded into the weights: the value projection's columns (W_v R per head, its bias
too) and the output projection's rows (R^T W_o per head). Attention mixes positions, not channels,
so the heads' outputs come out rotated as the values went in, and the output projection takes the
rotation back: the graph computes the same function, while the values (the attention product's
second input) and the output projection's input are quantized with an outlier channel of a head
spread over the head. One R serves every head, so a key/value head that several query heads share
(grouped-query attention) needs nothing more.

A pair is found from its output projection (a MatMul by a constant 2-D weight) up: steps that keep
the last axis last (Reshape, Transpose, Unsqueeze, Squeeze, Expand, Cast, Identity), the attention
product (a MatMul whose second input is followed), a bias added, up to the value projection (a
MatMul by a constant 2-D weight). Rotating each run of b along the last axis commutes with those
steps where every value's last axis is a known multiple of b (a Reshape then keeps the runs whole,
in memory order), so b, the head width, is the greatest common divisor of those widths, read from
the graph's inferred shapes. A value on the way that anything else reads (a Concat with a key/value
cache, a model output) would be read rotated: one line naming it, before any weight changes."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx

from .domains import DEFAULT_DOMAINS
from .graphs import node_reads
from .rotate_steps import HEADS_LEFT, HEADS_RIGHT, SHAPE_ONLY, RotationError, Steps, node_axes

_KEEP_LAST = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Cast", "Identity")


@dataclass
class _Pair:
    """One value projection and the output projection that reads its heads, the constants rotated
    (node name, input index) by side, and the widths of the last axis on the way."""

    value: str = ""
    output: str = ""
    right: list[tuple[str, int]] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)


class _Heads:
    """The graph's producers, readers, constants and inferred shapes, and the walk up from an output projection."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.tensors = {t.name: t for t in graph.initializer}
        self.producers = {output: node for node in graph.node for output in node.output}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node_reads(node):
                if not (node.op_type in SHAPE_ONLY and node.domain in DEFAULT_DOMAINS):
                    self.readers[name].append(node)
        self.outputs = {o.name for o in graph.output}
        self.shapes = {v.name: v.type.tensor_type.shape for v in (*graph.value_info, *graph.input, *graph.output)
                       if v.type.tensor_type.HasField("shape")}

    def layer(self, node: onnx.NodeProto) -> bool:
        """A MatMul by a constant 2-D weight."""
        weight = self.tensors.get(node.input[1]) if node.op_type == "MatMul" and node.domain in DEFAULT_DOMAINS else None
        return weight is not None and len(weight.dims) == 2

    def dims(self, name: str) -> list[int | None] | None:
        """The value's inferred dimensions (None where unknown), or None without a known rank."""
        shape = self.shapes.get(name)
        return None if shape is None else [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]

    def pair(self, output: onnx.NodeProto) -> _Pair | None:
        """The pair ending at `output`, or None where its input does not come from attention's values."""
        pair, value, attended = _Pair(output=output.name), output.input[0], False
        reader = output
        while True:
            if not self.only_reader(value, reader, attended):
                return None
            last = (self.dims(value) or [None])[-1]
            if not last:
                return self.stop(value, attended, "has no width known from the graph's shapes")
            pair.widths.append(last)
            node = self.producers.get(value)
            if node is None:
                return self.stop(value, attended, "is a model input, which comes in unrotated")
            if self.layer(node):
                if not attended:
                    return None
                pair.value = node.name
                pair.right.append((node.name, 1))
                return pair
            following = self.follow(node, value, pair)
            if following is None:
                return self.stop(value, attended, f"meets {_named(node)}, which does not keep each head's channels on the last axis")
            attended = attended or node.op_type == "MatMul"
            value, reader = following, node

    def follow(self, node: onnx.NodeProto, value: str, pair: _Pair) -> str | None:
        """The input of `node` that carries the heads (its output `value`), or None where it does not keep them."""
        if node.domain not in DEFAULT_DOMAINS:
            return None
        if node.op_type == "MatMul":  # attention's product: the weights (first input) times the values (second)
            rank = len(self.dims(node.input[1]) or [])
            return node.input[1] if rank >= 2 and node.input[1] not in self.tensors else None
        if node.op_type in ("Add", "Sub"):  # a bias of one constant per channel (linear: rotated with the rest)
            constants = [k for k, name in enumerate(node.input) if name in self.tensors]
            last = self.dims(value)[-1]
            if len(constants) != 1:
                return None
            bias = self.tensors[node.input[constants[0]]]
            if not bias.dims or bias.dims[-1] != last or int(np.prod(bias.dims)) != last:
                return None
            pair.right.append((node.name, constants[0]))
            return node.input[1 - constants[0]]
        if node.op_type in _KEEP_LAST and self.keeps_last(node, value):
            return node.input[0]
        return None

    def keeps_last(self, node: onnx.NodeProto, value: str) -> bool:
        """Whether the step leaves its input's last axis as its output's (a Reshape: any, the widths checked by the caller)."""
        before, after = self.dims(node.input[0]), self.dims(value)
        if before is None or after is None or not before[-1:]:
            return False
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(len(before)))[::-1])
            return perm[-1] == len(before) - 1
        if node.op_type in ("Unsqueeze", "Squeeze"):
            axes = node_axes(node, self.tensors)
            rank = len(after if node.op_type == "Unsqueeze" else before)
            return axes is not None and rank - 1 not in [a % rank for a in axes] and before[-1] == after[-1]
        return node.op_type == "Reshape" or before[-1] == after[-1]

    def only_reader(self, value: str, reader: onnx.NodeProto, attended: bool) -> bool:
        """Whether the value on the way is read by the next step alone (its shape aside) and is no model output."""
        if value in self.outputs:
            self.stop(value, attended, "is a model output, which would come out rotated (a key/value cache)")
            return False
        others = [node for node in self.readers[value] if node is not reader]
        if others:
            self.stop(value, attended, f"is also read by {_named(others[0])}, which would read it rotated")
        return not others

    def stop(self, value: str, attended: bool, why: str) -> None:
        """Past attention's product a pair that cannot be rotated is an error; before it, no pair (None:
        the caller's answer)."""
        if attended:
            raise RotationError(f"rotation.heads: {value} (attention's values, rotated per head) {why}; set rotation.heads to false")


def _named(node: onnx.NodeProto) -> str:
    return f"{node.name or '(unnamed)'} ({node.op_type})"


def plan_heads(graph: onnx.GraphProto, steps: Steps) -> tuple[list[tuple[str, str]], int]:
    """Add R2's steps for every pair of value and output projections to `steps`; the pairs (value,
    output projection names) and the head width b. No pair, or widths whose divisor is 1, is a
    RotationError."""
    heads = _Heads(graph)
    pairs = [pair for node in graph.node if heads.layer(node) and (pair := heads.pair(node)) is not None]
    if not pairs:
        raise RotationError("rotation.heads: no attention's values found (a value projection's output, split into heads, "
                            "multiplied by attention's weights and read by an output projection); set rotation.heads to false")
    width = math.gcd(*(w for pair in pairs for w in pair.widths))
    if width < 2:
        raise RotationError(f"rotation.heads: the widths of the values on the way to {pairs[0].output} have no common "
                            "divisor above 1, so no head width; set rotation.heads to false")
    for pair in pairs:
        for key in pair.right:
            steps[key].append(HEADS_RIGHT)
        steps[(pair.output, 1)].append(HEADS_LEFT)
    return [(pair.value, pair.output) for pair in pairs], width
