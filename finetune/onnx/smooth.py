"""SmoothQuant (Xiao et al., "SmoothQuant", 2022) as a rewrite of a float graph, given the
activations' per-channel maxima (finetune.quantize.smooth collects them); smooth_graph takes any
per-channel scales, so AWQ's searched ones (finetune.quantize.awq) are written the same way.

Each activation X that MatMul / Gemm / Conv layers read, with constant weights, gets one scale per
input channel j, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (W_j: the j-th input channel of every
weight reading X; layers sharing X share s). The weights' input channels are multiplied by s and X
divided by s, so the function is unchanged while an outlier channel of X moves part of its range
into the weights, where per-channel or block scales absorb it. X / s is computed by the producer
where that is exact (1/s folded into a LayerNormalization's scale and bias, an RMS norm's gain (the
ONNX op, onnxruntime's SimplifiedLayerNormalization and the normed output of its skip form), a Mul's or Add's
constant, or the output channels of a MatMul / Gemm / Conv, through Relu and MaxPool, which commute
with positive scales, and through one operand of a product a * b, as SwiGLU's up projection), and
only when every reader of X is smoothed (a Shape or Size reads no element); otherwise by a `Mul`
inserted before the layers. Only the main graph is rewritten: a value a subgraph reads is never folded."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .contrib import rms_gain_input
from .domains import DEFAULT_DOMAINS
from .graphs import node_reads, unique_name
from .layers import LAYER_OPS, weight_axes

SCALE_RANGE = (1e-4, 1e4)  # s is clamped here: a near-empty channel must not blow a weight up to overflow
LAST, CHANNEL = LAYER_OPS["MatMul"].channel_axis, LAYER_OPS["Conv"].channel_axis  # where MatMul / Gemm and Conv inputs hold channels
NO_WEIGHT = "its second operand is computed: no constant weight takes the scale"
_COMMUTING = {"Relu": (LAST, CHANNEL), "MaxPool": (CHANNEL,)}  # ops that pass a positive per-channel scale through
_SHAPE_ONLY = ("Shape", "Size")  # readers of a value's shape, which a scale leaves as it is


@dataclass
class Group:
    """The smoothed layers reading one activation `value`, whose `channels` lie on `axis` (LAST or
    CHANNEL); `rank` of the value where a Conv tells it (None otherwise)."""

    value: str
    layers: list[onnx.NodeProto]
    axis: int
    channels: int
    rank: int | None = None


@dataclass
class Outcome:
    """What happened to one layer: `action` is folded, mul or skipped; `detail` says where or why."""

    node: str
    action: str
    detail: str


@dataclass
class _Constants:
    """The float initializers being rewritten, read and written as float64 arrays; one that other
    nodes also read is copied first (under a new name), so only the node being rewritten changes."""

    graph: onnx.GraphProto
    readers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # value -> reading nodes' names
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = {t.name: t for t in self.graph.initializer}
        self.shape_readers = {node.name for node in self.graph.node
                              if node.op_type in _SHAPE_ONLY and node.domain in DEFAULT_DOMAINS}
        for node in self.graph.node:
            for name in node_reads(node):  # a subgraph's reads of outer values count as its node's
                self.readers[name].append(node.name)

    def value_readers(self, value: str) -> list[str]:
        """The nodes that read a value's elements (not only its shape)."""
        return [name for name in self.readers[value] if name not in self.shape_readers]

    def private(self, node: onnx.NodeProto, index: int) -> str:
        """The name of node.input[index], an initializer only this node now reads."""
        name = node.input[index]
        if len(self.readers[name]) > 1 or name in {o.name for o in self.graph.output}:
            copy = unique_name(f"{name}_smoothed", set(self.tensors))
            self.tensors[copy] = numpy_helper.from_array(numpy_helper.to_array(self.tensors[name]), copy)
            self.graph.initializer.append(self.tensors[copy])
            self.readers[name].remove(node.name)
            self.readers[copy] = [node.name]
            node.input[index] = name = copy
        return name

    def scale(self, node: onnx.NodeProto, index: int, factor: np.ndarray) -> None:
        """Multiply node.input[index] by `factor` (broadcast)."""
        name = self.private(node, index)
        current = self.arrays.get(name, numpy_helper.to_array(self.tensors[name]).astype(np.float64))
        self.arrays[name] = current * factor

    def store(self) -> None:
        """Write the rewritten arrays back as float32 initializers."""
        for name, array in self.arrays.items():
            self.tensors[name].CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))


def find_groups(graph: onnx.GraphProto, candidates: set[str]) -> tuple[list[Group], list[Outcome]]:
    """The groups of the main graph's candidate nodes (by name) that can be smoothed, and the
    candidates that cannot, with the reason."""
    initializers = {t.name: t for t in graph.initializer}
    by_value: dict[str, list[tuple[onnx.NodeProto, int, int, int]]] = defaultdict(list)
    skipped = []
    for node in graph.node:
        if node.name not in candidates:
            continue
        layout = _layout(node, initializers)
        if isinstance(layout, str):
            skipped.append(Outcome(node.name, "skipped", layout))
        else:
            by_value[node.input[0]].append((node, *layout))
    groups = []
    for value, members in by_value.items():
        axes, channels = {m[1] for m in members}, {m[2] for m in members}
        if len(axes) > 1 or len(channels) > 1:
            why = f"the layers reading {value} disagree on where or how many its channels are"
            skipped += [Outcome(m[0].name, "skipped", why) for m in members]
            continue
        rank = next((m[3] for m in members if m[1] == CHANNEL), None)
        groups.append(Group(value, [m[0] for m in members], axes.pop(), channels.pop(), rank))
    return groups, skipped


def _layout(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> tuple[int, int, int] | str:
    """(channel axis, input channels, weight rank) of a layer that can be smoothed, or why not."""
    if node.domain not in DEFAULT_DOMAINS or node.op_type not in ("MatMul", "Gemm", "Conv"):
        return f"{node.op_type} is not a MatMul, Gemm or Conv"
    if node.input[0] in initializers:
        return "its input is a constant"
    weight = initializers.get(node.input[1]) if len(node.input) > 1 else None
    if weight is None:
        return NO_WEIGHT
    if weight.data_type != onnx.TensorProto.FLOAT:
        return "its weight is not float32"
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    dims = list(weight.dims)
    if node.op_type == "Conv":
        return CHANNEL, dims[1] * attributes.get("group", 1), len(dims)
    if len(dims) != 2:
        return "its weight is not 2-D"
    if attributes.get("transA", 0):
        return "Gemm with transA reads its input transposed"
    return LAST, dims[1] if attributes.get("transB", 0) else dims[0], 2


def weight_maxima(weight: np.ndarray, node: onnx.NodeProto) -> np.ndarray:
    """max |W_j| over each input channel j of a layer's weight."""
    if node.op_type == "Conv":
        return np.abs(_by_input_channel(weight, node)).max(axis=(1, 3)).reshape(-1)
    return np.abs(weight).max(axis=1 if input_axis(node) == 0 else 0)


def input_axis(node: onnx.NodeProto) -> int:
    """The input-channel axis of a MatMul's or Gemm's 2-D weight (onnx.layers.weight_axes)."""
    return weight_axes(node.op_type, 1, any(a.name == "transB" and a.i for a in node.attribute))[1] % 2


def _group_count(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _by_input_channel(weight: np.ndarray, node: onnx.NodeProto) -> np.ndarray:
    """A Conv weight (out, in / g, ...) as (g, out / g, in / g, kernel): input channel
    k * (in / g) + j is [k, :, j, :]."""
    groups = _group_count(node)
    return weight.reshape(groups, weight.shape[0] // groups, weight.shape[1], -1)


def smoothing_scales(activation_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """s = max|X|^alpha / max|W|^(1 - alpha) per channel, 1 where either maximum is 0 (or not
    finite), clamped to SCALE_RANGE."""
    usable = (activation_max > 0) & (weight_max > 0) & np.isfinite(activation_max) & np.isfinite(weight_max)
    x, w = np.where(usable, activation_max, 1.0), np.where(usable, weight_max, 1.0)
    scales = np.where(usable, x.astype(np.float64) ** alpha / w.astype(np.float64) ** (1 - alpha), 1.0)
    return np.clip(scales, *SCALE_RANGE)


def smooth_graph(graph: onnx.GraphProto, groups: list[Group], scales: dict[str, np.ndarray], fold: bool) -> list[Outcome]:
    """Scale every group's weights' input channels by its `scales` (by the group's value; one per
    channel, positive) and divide its input by them (in place); say what happened to each layer."""
    constants = _Constants(graph)
    outcomes: list[Outcome] = []
    muls: list[tuple[Group, np.ndarray]] = []
    for group in groups:
        s = scales[group.value]
        for layer in group.layers:
            constants.scale(layer, 1, weight_factor(layer, s, tuple(constants.tensors[layer.input[1]].dims)))
        steps, why = _fold_chain(graph, group, constants) if fold else (None, "fold: false")
        if steps is None:
            muls.append((group, 1.0 / s))
            outcomes += [Outcome(layer.name, "mul", f"Mul inserted before it: {why}") for layer in group.layers]
            continue
        for node, indices in steps:
            for index in indices:
                constants.scale(node, index, _output_factor(node, index, group, 1.0 / s))
        where = f"folded into {steps[-1][0].name} ({steps[-1][0].op_type})"
        outcomes += [Outcome(layer.name, "folded", where) for layer in group.layers]
    constants.store()
    _insert_muls(graph, muls)  # last: rebuilding the node list replaces the node objects the groups hold
    return outcomes


def weight_factor(layer: onnx.NodeProto, scales: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`scales` shaped to multiply a layer's weight (of `shape`) along its input channels; a grouped
    Conv's output channel o reads input channels of its group only."""
    if layer.op_type != "Conv":
        return scales[:, None] if input_axis(layer) == 0 else scales[None, :]
    out, per_group = shape[:2]
    group_of = np.arange(out) // (out // _group_count(layer))
    channel = group_of[:, None] * per_group + np.arange(per_group)[None, :]
    return scales[channel].reshape(out, per_group, *[1] * (len(shape) - 2))


def _fold_chain(graph: onnx.GraphProto, group: Group,
                constants: _Constants) -> tuple[list[tuple[onnx.NodeProto, list[int]]] | None, str]:
    """The nodes (with the inputs to scale by 1/s) that compute X / s when X's producer absorbs
    1/s: through Relu / MaxPool, Add of a constant and one operand of a Mul of two computed values,
    to a LayerNormalization, a Mul by a constant or a MatMul / Gemm / Conv with constant weights.
    None, and why, where that is not exact. Readers of X's shape only do not stand in the way."""
    producers = {output: node for node in graph.node for output in node.output}
    names = {layer.name for layer in group.layers}
    others = [name for name in constants.value_readers(group.value) if name not in names]
    if others:
        return None, f"{group.value} is also read by {others[0]}, which is not smoothed"
    return _chain_from(group.value, group, constants, producers)


def _chain_from(current: str, group: Group, constants: _Constants,
                producers: dict[str, onnx.NodeProto]) -> tuple[list[tuple[onnx.NodeProto, list[int]]] | None, str]:
    """_fold_chain's steps from the value `current` up (X itself, or a value only the chain reads)."""
    outputs = {o.name for o in constants.graph.output}
    steps: list[tuple[onnx.NodeProto, list[int]]] = []
    while True:
        if current in outputs:
            return None, f"{current} is a graph output"
        if current != group.value and len(constants.value_readers(current)) != 1:
            return None, f"{current} is read by other nodes too"
        producer = producers.get(current)
        if producer is None or (producer.domain not in DEFAULT_DOMAINS and rms_gain_input(producer) is None):
            return None, f"{current} is a graph input" if producer is None else f"{producer.name} is a custom op"
        if rms_gain_input(producer) is not None and current != producer.output[0]:
            return None, f"its producer {producer.name} ({producer.op_type}) writes it unnormalised"
        if group.axis in _COMMUTING.get(producer.op_type, ()):
            current = producer.input[0]
            continue
        if producer.op_type == "Mul" and not any(name in constants.tensors for name in producer.input):
            return _through_product(producer, group, constants, producers, steps)
        indices = _absorbing_inputs(producer, group, constants.tensors)
        if indices is None:
            return None, f"its producer {producer.name} ({producer.op_type}) cannot absorb the scale"
        steps.append((producer, indices))
        if producer.op_type != "Add":
            return steps, ""
        current = next(name for k, name in enumerate(producer.input) if k not in indices)


def _through_product(product: onnx.NodeProto, group: Group, constants: _Constants, producers: dict[str, onnx.NodeProto],
                     steps: list[tuple[onnx.NodeProto, list[int]]]) -> tuple[list[tuple[onnx.NodeProto, list[int]]] | None, str]:
    """a * b / s = a * (b / s): the steps so far and those of the first operand whose chain ends in
    a layer or a LayerNormalization, which have the channels (a Mul by a constant could broadcast a
    narrower operand): SwiGLU's up projection, read by silu(gate) * up. Else None, and why."""
    for operand in reversed(product.input) if len(set(product.input)) == 2 else ():  # silu(gate) * up: the second first
        chain, _ = _chain_from(operand, group, constants, producers)
        if chain is not None and (chain[-1][0].op_type in ("MatMul", "Gemm", "Conv", "LayerNormalization")
                                  or rms_gain_input(chain[-1][0]) is not None):
            return steps + chain, ""
    return None, f"its producer {product.name} (Mul) has no operand that can absorb the scale"


def _absorbing_inputs(node: onnx.NodeProto, group: Group, tensors: dict[str, onnx.TensorProto]) -> list[int] | None:
    """The inputs of `node` that, scaled by 1/s, make it compute its output / s (an Add also needs
    its other input divided), or None."""
    floats = [k for k, name in enumerate(node.input) if name in tensors and tensors[name].data_type == onnx.TensorProto.FLOAT]
    if node.op_type in ("Add", "Mul"):
        return floats if len(floats) == 1 and len(node.input) == 2 else None
    if node.op_type == "LayerNormalization":
        if group.axis != LAST or any(list(tensors[node.input[k]].dims) != [group.channels] for k in floats):
            return None
        return floats if 1 in floats and floats == [k for k in (1, 2) if k < len(node.input) and node.input[k]] else None
    gain = rms_gain_input(node)
    if gain is not None:
        return [gain] if group.axis == LAST and gain in floats and list(tensors[node.input[gain]].dims) == [group.channels] else None
    layout = _layout(node, tensors) if node.op_type in ("MatMul", "Gemm", "Conv") else "not a layer"
    if isinstance(layout, str) or layout[0] != group.axis:  # a Conv writes channels on axis 1, MatMul and Gemm last
        return None
    weight = tensors[node.input[1]]
    out = weight.dims[0] if node.op_type == "Conv" or input_axis(node) == 1 else weight.dims[1]
    bias = [2] if len(node.input) > 2 and node.input[2] else []
    if out != group.channels or any(k not in floats for k in bias):
        return None
    return [1, *bias]


def _output_factor(node: onnx.NodeProto, index: int, group: Group, inverse: np.ndarray) -> np.ndarray:
    """1/s shaped to multiply input `index` of a producer along the channels of its output."""
    if node.op_type in ("Add", "Mul"):
        return inverse if group.axis == LAST else inverse.reshape(-1, *[1] * (group.rank - 2))
    if node.op_type == "Conv" and index == 1:
        return inverse.reshape(-1, 1, *[1] * (group.rank - 2))
    if node.op_type in ("MatMul", "Gemm") and index == 1:
        return inverse[:, None] if input_axis(node) == 1 else inverse[None, :]
    return inverse  # a bias, or LayerNormalization's scale and bias: 1-D over the channels


def _insert_muls(graph: onnx.GraphProto, muls: list[tuple[Group, np.ndarray]]) -> None:
    """A Mul by 1/s (a new initializer) between each group's X and its layers, placed before the
    group's first layer."""
    taken = {t.name for t in graph.initializer} | {n for node in graph.node for n in (*node.input, *node.output)}
    taken |= {node.name for node in graph.node} | {v.name for v in graph.input}
    nodes = list(graph.node)
    before: dict[int, list[onnx.NodeProto]] = defaultdict(list)
    for group, inverse in muls:
        shape = (-1,) if group.axis == LAST else (-1, *[1] * (group.rank - 2))
        factor = unique_name(f"{group.value}_smooth_inverse", taken)
        graph.initializer.append(numpy_helper.from_array(inverse.reshape(shape).astype(np.float32), factor))
        output = unique_name(f"{group.value}_smoothed", taken)
        name = unique_name(f"{group.value}/SmoothQuant", taken)
        before[min(nodes.index(layer) for layer in group.layers)].append(
            helper.make_node("Mul", [group.value, factor], [output], name=name))
        for layer in group.layers:
            layer.input[0] = output
    if muls:
        rebuilt = [new for k, node in enumerate(nodes) for new in (*before.get(k, ()), node)]
        del graph.node[:]
        graph.node.extend(rebuilt)

