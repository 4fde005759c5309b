"""Reconstruction units of a lifted module, in graph order. A layer unit is one weight layer (Conv,
ConvTranspose, Gemm, MatMul with a constant weight, and the bias Add after such a MatMul; LSTM and
GRU with their input and recurrent weights) with the quantized input it reads, followed by its
activation and optionally its output quantizer.
A block unit is a run of such layers between two points where a single value is live (BRECQ's
blocks: a residual block, a transformer layer), reconstructed together at the block's output."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.kinds import is_activation, is_add, is_shape, layer_kind
from finetune.onnx.domains import BIAS_INPUT, RECURRENT_OPS

from .report import Warnings
from .sides import SideInput, measured_outputs, recurrent_sides

RECURRENT_WEIGHTS = (1, 2)  # W and R of an LSTM or GRU, tuned as two layers sharing the bias B


@dataclass(frozen=True)
class Layer:
    """One weight layer: its module (the ONNX node's name), which argument is its activation and
    which its weight, and the trainable parameters behind its weight (with the weight's quantizer
    module) and bias. A recurrent layer is two: its input weight W with the bias, and R."""

    name: str
    op_type: str
    input_index: int
    weight: str
    weight_quantizer: str | None
    bias: str | None
    weight_index: int = 1


@dataclass(frozen=True)
class Unit:
    """One reconstruction unit. Names are fx node names (`input`, `nodes`, `outputs`) and module
    names (`target_module`: the last float op, whose outputs are the float targets). The float
    counterpart of `input` is argument `source_argument` of module `source`, or its output when
    that is None ("" is the whole model). A layer unit's input is its input quantizer's output, so
    QDrop mixes quantized and float values; a block's is the value live where the block starts.
    A unit whose last node returns several values the model reads (an LSTM's Y and final states,
    an If's probability and state) is measured on all of them (see sides.join_rows)."""

    name: str
    op_type: str  # the layer's, or "block"
    layers: tuple[Layer, ...]
    input: str
    source: str
    source_argument: int | None
    nodes: tuple[str, ...]
    outputs: tuple[str, ...]
    target_module: str
    side_inputs: tuple[SideInput, ...] = ()  # computed values it reads besides `input` (see sides)
    target_outputs: tuple[int, ...] = ()  # which outputs of `target_module` are the float targets, when it returns several
    input_axis: int = 0  # the axis of the input holding a training row (a recurrent layer's batch)
    output_axes: tuple[int | None, ...] = (0,)  # the same for each output; None: found from the values when tuning
    scales: tuple[str, ...] = ()  # quantizer buffers (scale, zero point) learned with the weights (see scales)


def parameters_of(unit: Unit) -> list[str]:
    """The names of the tensors tuning `unit` may change: its layers' weights and biases, and the
    quantizer scales and zero points it learns (buffers: read them with tuned_tensor)."""
    return [name for layer in unit.layers for name in (layer.weight, layer.bias) if name] + list(unit.scales)


def tuned_tensor(module: LiftedModule, name: str) -> torch.Tensor:
    """The parameter or quantizer buffer of that name (one of parameters_of)."""
    return module.get_parameter(name) if name in module.finetune_params else module.get_buffer(name)


def find_units(
    module: LiftedModule, op_types: tuple[str, ...], include_output_quant: bool = False, unit: str = "layer",
    warnings: Warnings | None = None,
) -> list[Unit]:
    """The layer or block units of `module` in graph order. Layers that cannot be tuned (a weight
    other layers share, or one computed by other ops) are left out, and layers that cannot join a
    block stay layer units: each is a warning, added to `warnings` when given."""
    warnings = Warnings() if warnings is None else warnings
    if unit not in ("layer", "block"):
        raise ValueError(f"unit must be layer or block, got {unit!r}")
    if unit == "block" and include_output_quant:
        raise ValueError("include_output_quant applies to layer units only: a block ends where one value is live, and the "
                         "quantizers reading it belong to the next block")
    constant = constant_nodes(module.graph)
    layers = []
    for node in module.graph.nodes:
        found = _layer_unit(module, node, constant, op_types, include_output_quant, warnings)
        if found is not None:
            layers.append(found)
    from .bodies import with_bodies  # bodies builds on this module's units, so it is imported here

    units = layers if unit == "layer" else _blocks(module, layers, constant, warnings)
    return with_bodies(module, units, constant, op_types, include_output_quant, warnings)  # the layers of If/Loop/Scan bodies


def constant_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value does not depend on a graph input: initializers and what is computed from
    them alone (weights behind their quantizers)."""
    constant: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or (node.op in ("call_module", "call_function", "call_method") and inputs and all(i in constant for i in inputs)):
            constant.add(node)
    return constant


def _layer_unit(
    module: LiftedModule, node: fx.Node, constant: set[fx.Node], op_types: tuple[str, ...], include_output_quant: bool,
    warnings: Warnings,
) -> Unit | None:
    """The unit of a weight layer node, or None when the node is not one (or shares its weight)."""
    if node.op != "call_module" or node in constant:
        return None
    op_type = layer_kind(module.get_submodule(node.target))
    if op_type is None or op_type not in op_types:
        return None
    sides = _recurrent_sides(node, module.get_submodule(node.target), constant, warnings) if op_type in RECURRENT_OPS else []
    if sides is None:
        return None
    last = BIAS_INPUT[op_type] + 1 if op_type in RECURRENT_OPS else len(node.args)  # the later ones are side inputs
    activations = [i for i, arg in enumerate(node.args[:last]) if isinstance(arg, fx.Node) and arg not in constant]
    weight_indices = _weight_indices(op_type, activations)
    if len(activations) != 1 or weight_indices is None:
        return None
    weights = [_layer_weight(module, node, index, constant, warnings) for index in weight_indices]
    if None in weights:
        return None
    if op_type == "MatMul":
        bias_add, bias = _bias_add(module, node, constant)
    else:
        bias_index = BIAS_INPUT[op_type]
        bias_add, bias = None, parameter_behind(module, node.args[bias_index] if len(node.args) > bias_index else None, constant)
    tail, outputs, last_float, items = _unit_end(module, bias_add or node, include_output_quant)
    layers = tuple(
        Layer(node.target, op_type, activations[0], weight, module.finetune_params[weight].quantizer, bias if k == 0 else None, index)
        for k, (index, weight) in enumerate(zip(weight_indices, weights))
    )
    return Unit(
        name=node.target, op_type=op_type, layers=layers, input=node.args[activations[0]].name, source=node.target,
        source_argument=activations[0], nodes=tuple(n.name for n in dict.fromkeys([node, bias_add or node, *tail])),
        outputs=tuple(n.name for n in outputs), target_module=last_float.target, side_inputs=tuple(sides), target_outputs=items,
        **_row_axes(module.get_submodule(node.target), items, op_type),
    )


def _unit_end(module: LiftedModule, layer: fx.Node,
              include_output_quant: bool) -> tuple[list[fx.Node], list[fx.Node], fx.Node, tuple[int, ...]]:
    """(the nodes after the layer node that join its unit, the unit's outputs, the last float op,
    which outputs of that op are the targets). A layer with several outputs (an LSTM's Y and final
    states) takes in the getitems reading them and is measured on each the model reads."""
    items, outputs, indices = measured_outputs(layer)
    if items:
        return items, outputs, layer, indices
    tail = _output_tail(module, layer, include_output_quant)
    last_float = next((n for n in reversed(tail) if not isinstance(module.get_submodule(n.target), FakeQuantize)), layer)
    return tail, [tail[-1] if tail else layer], last_float, ()


def _row_axes(layer: nn.Module, items: tuple[int, ...], op_type: str) -> dict[str, Any]:
    """The axes of a layer's input and of its outputs (numbered `items` where it returns several)
    where its training rows lie: the first of each, but for a recurrent layer, whose rows are whole
    sequences (time steps are not independent rows): X [T, B, I], Y [T, D, B, H] or a final
    state [D, B, H]; everything batch-first with layout 1."""
    if op_type not in RECURRENT_OPS or layer.layout:
        return {"input_axis": 0, "output_axes": (0,) * max(len(items), 1)}
    return {"input_axis": 1, "output_axes": tuple(2 if layer.returns[item] == 0 else 1 for item in items or (0,))}


def _weight_indices(op_type: str, activations: list[int]) -> tuple[int, ...] | None:
    """Which arguments hold the weights: the second of Conv/ConvTranspose/Gemm and the second and
    third of LSTM/GRU (whose activation must be the first), the constant operand of MatMul."""
    if op_type == "MatMul":
        index = {(0,): 1, (1,): 0}.get(tuple(activations))
        return None if index is None else (index,)
    if activations != [0]:
        return None
    return RECURRENT_WEIGHTS if op_type in RECURRENT_OPS else (1,)


def _recurrent_sides(node: fx.Node, layer: nn.Module, constant: set[fx.Node], warnings: Warnings) -> list[SideInput] | None:
    """The side inputs of an LSTM or GRU (computed sequence lengths or initial states, each with its
    batch axis), or None, with a warning, where it reads a computed value without a batch (peepholes)."""
    sides, unbatched = recurrent_sides(node, BIAS_INPUT[layer_kind(layer)] + 1, layer.layout, constant)
    if unbatched:
        warnings.add(node.target, f"not tuned: besides its input it reads computed values without a batch axis "
                     f"({', '.join(unbatched)}), and a training batch cannot take its rows of them")
        return None
    return sides


def _layer_weight(module: LiftedModule, node: fx.Node, index: int, constant: set[fx.Node], warnings: Warnings) -> str | None:
    """The parameter behind the layer's weight argument `index`, or None (with a warning where it
    is computed or shared)."""
    weight = parameter_behind(module, node.args[index], constant)
    if weight is None:
        if node.args[index] in constant:
            warnings.add(node.target, "not tuned: ops other than quantize/dequantize compute its weight from the initializer "
                         "(a Transpose after a DequantizeLinear, say), so no initializer holds the weight to train")
        return None
    if len(module.finetune_params[weight].consumers) > 1:
        warnings.add(node.target, f"not tuned: its weight is shared with {module.finetune_params[weight].consumers}")
        return None
    return weight


def parameter_behind(module: LiftedModule, node: fx.Node | None, constant: set[fx.Node]) -> str | None:
    """The trainable parameter a constant argument is computed from (through its quantizer)."""
    if node is None or node not in constant:
        return None
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr" and current.target in module.finetune_params:
            return current.target
        stack.extend(current.all_input_nodes)
    return None


def _bias_add(module: LiftedModule, matmul: fx.Node, constant: set[fx.Node]) -> tuple[fx.Node | None, str | None]:
    """(the Add, its bias parameter) when the MatMul's sole reader adds a constant vector that
    only it reads (a Linear layer's bias, as exporters write it), else (None, None)."""
    users = list(matmul.users)
    if len(users) != 1 or users[0].op != "call_module" or len(users[0].args) != 2:
        return None, None
    add = users[0]
    if not is_add(module.get_submodule(add.target)):
        return None, None
    other = add.args[0] if add.args[1] is matmul else add.args[1]
    bias = parameter_behind(module, other if isinstance(other, fx.Node) else None, constant)
    if bias is None or len(module.finetune_params[bias].consumers) > 1 or module.get_parameter(bias).dim() != 1:
        return None, None
    return add, bias


def _output_tail(module: LiftedModule, layer: fx.Node, include_output_quant: bool) -> list[fx.Node]:
    """The layer's activation (so the loss ignores what the activation discards, as AdaRound's
    paper does) and, when asked, then its output quantizer; each taken only when it is the sole
    reader of the value before it."""
    tail: list[fx.Node] = []
    current = layer
    for accepts in (is_activation, _is_fake_quantize)[: 2 if include_output_quant else 1]:
        users = list(current.users)
        if len(users) == 1 and users[0].op == "call_module" and accepts(module.get_submodule(users[0].target)):
            current = users[0]
            tail.append(current)
    return tail


def _is_fake_quantize(module: nn.Module) -> bool:
    """Whether the module is a quantizer (an output quantizer ends a layer's tail)."""
    return isinstance(module, FakeQuantize)


# --- blocks ---------------------------------------------------------------------------------------


# The most layers one block holds. Blocks of real models have 1-5 (EfficientNet-Lite0's MBConv with
# squeeze-excite, PP-OCR's classifier) or 11 (two SVTR mixing layers in PP-OCRv4's recogniser); the
# span from the first tap of a feature pyramid to the neck that reads it (54 of the 64 layers of
# PP-OCRv4's detector) is no block: its layers are tuned one by one.
MAX_BLOCK_LAYERS = 16


def scope(layer: str) -> str:
    """The block a layer belongs to by its name: the exporter's module path without the layer's own
    module and op (/_blocks.3/_expand_conv/Conv -> /_blocks.3, /encoder/layers.0/linear1/MatMul ->
    /encoder/layers.0); "" for a top-level layer."""
    return "/".join(layer.split("/")[:-2])


def _blocks(module: LiftedModule, layers: list[Unit], constant: set[fx.Node], warnings: Warnings) -> list[Unit]:
    """Consecutive layers of one scope, widened to the single-value cut points around them (and
    merged with neighbours they overlap), as block units. The ops between two blocks join the
    first, so its loss is measured on what the next block reads; the last block runs to the last
    cut point. Layers with no cut point around them, or whose block would read more than its
    entry value (the batch size taken from the input's shape, say), stay layer units: a warning
    for each such layer."""
    shapes = _shape_values(module, constant)
    order = [n for n in module.graph.nodes if n not in constant and n not in shapes and n.op != "output"]
    position = {n: i for i, n in enumerate(order)}
    cuts = _cut_points(module, order, position)
    spans: list[tuple[int | None, int | None, list[Unit]]] = []  # (None, None, layers) where no cut surrounds them
    for group in _scope_runs(layers):
        first = min(position[n] for n in order if n.name in (group[0].input, *group[0].nodes))
        last = max(position[n] for n in order if n.name in group[-1].nodes)
        start, end = max((c for c in cuts if c < first), default=None), min((c for c in cuts if c >= last), default=None)
        if start is None or end is None:
            _stay_single(group, "no single value is live around its block", warnings)
            start = end = None
        elif spans and spans[-1][1] is not None and start < spans[-1][1]:
            start, _, merged = spans.pop()
            group = merged + group
        spans.append((start, end, group))
    graph_order = [n for n in module.graph.nodes if n not in constant]
    units: list[Unit] = []
    for k, (start, end, group) in enumerate(spans):
        following = spans[k + 1][0] if k + 1 < len(spans) else cuts[-1]
        if start is None:
            units.extend(group)
            continue
        if len(group) > MAX_BLOCK_LAYERS:
            _stay_single(group, f"no single value is live across the {len(group)} layers around it (a feature pyramid, "
                         f"or a shortcut over many layers, keeps several), and a block holds at most {MAX_BLOCK_LAYERS}",
                         warnings)
            units.extend(group)
            continue
        entry, exit_ = order[start], order[end if following is None else following]
        members = [n for n in graph_order[graph_order.index(entry) + 1 : graph_order.index(exit_) + 1] if n.op != "placeholder"]
        outside = {i.name for n in members for i in n.all_input_nodes if i not in constant} - {n.name for n in [entry, *members]}
        if outside:
            _stay_single(group, f"a block of {len(group)} layer(s) here would also read {sorted(outside)}", warnings)
            units.extend(group)
        elif any(layer.input_axis or layer.output_axes != (0,) or layer.side_inputs for layer in group):
            _stay_single(group, "a block here would hold a recurrent layer, whose training rows are whole sequences", warnings)
            units.extend(group)
        else:
            units.append(_block_unit(module, entry, members, group))
    return _named_apart(units)


def _named_apart(units: list[Unit]) -> list[Unit]:
    """The units, each block whose scope name another unit shares (paddle2onnx's p2o prefix is every
    layer's) renamed after its layers, so names (and the cache keys made of them) are unique."""
    counts = Counter(unit.name for unit in units)
    return [replace(unit, name="+".join(layer.name for layer in unit.layers)) if counts[unit.name] > 1 and unit.op_type == "block"
            else unit for unit in units]


def _stay_single(group: list[Unit], why: str, warnings: Warnings) -> None:
    """Warn that each layer of `group` is tuned on its own, not in a block, and why."""
    for layer in group:
        warnings.add(layer.name, f"stays a layer unit (unit: block asked for blocks): {why}")


def _shape_values(module: LiftedModule, constant: set[fx.Node]) -> set[fx.Node]:
    """Nodes computed from tensor shapes alone (Shape and what follows only from it and constants)."""
    shapes: set[fx.Node] = set()
    for node in module.graph.nodes:
        inputs = [i for i in node.all_input_nodes if i not in constant]
        shape_op = node.op == "call_module" and is_shape(module.get_submodule(node.target))
        if shape_op or (inputs and node.op != "output" and all(i in shapes for i in inputs)):
            shapes.add(node)
    return shapes


def _scope_runs(layers: list[Unit]) -> list[list[Unit]]:
    """Runs of consecutive layers with the same scope; top-level layers (scope "") stand alone, as
    a plain sequential network has no blocks, and so does every layer when all share one scope: an
    exporter's prefix (paddle2onnx's p2o/Conv/12) names no module, and read as a scope it made
    PP-OCR's detector and recogniser one block each."""
    scopes = [scope(layer.name) for layer in layers]
    if len(set(scopes)) == 1:
        scopes = [""] * len(layers)
    runs: list[list[Unit]] = []
    for k, layer in enumerate(layers):
        if runs and scopes[k] and scopes[k - 1] == scopes[k]:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _cut_points(module: LiftedModule, order: list[fx.Node], position: dict[fx.Node, int]) -> list[int]:
    """Positions in `order` after which the node there is the only live value and can be found in
    the float model too (a graph input or a float op's output, not a quantizer's)."""
    last_reader = {}
    for node in order:
        readers = [position[u] if u in position else len(order) for u in node.users if u in position or u.op == "output"]
        if readers:
            last_reader[node] = max(readers)
    ends = [0] * (len(order) + 1)
    for end in last_reader.values():
        ends[end] += 1
    cuts, live = [], 0
    for i, node in enumerate(order):
        live += (node in last_reader) - ends[i]
        findable = node.op == "placeholder" or (node.op == "call_module" and not isinstance(module.get_submodule(node.target), FakeQuantize))
        if live == 1 and node in last_reader and findable:
            cuts.append(i)
    return cuts


def _block_unit(module: LiftedModule, entry: fx.Node, members: list[fx.Node], group: list[Unit]) -> Unit:
    """The block unit computing `members` (the last one its output) from `entry`."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    source, argument = ("", placeholders.index(entry)) if entry.op == "placeholder" else (entry.target, None)
    return Unit(
        name=scope(group[0].name) or "+".join(u.name for u in group), op_type="block",
        layers=tuple(layer for u in group for layer in u.layers), input=entry.name, source=source, source_argument=argument,
        nodes=tuple(n.name for n in members), outputs=(members[-1].name,), target_module=members[-1].target,
    )
