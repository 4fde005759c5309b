"""Block units (BRECQ's blocks: a residual block, a transformer layer): runs of layer units of one
exporter scope, widened to the points around them where a single value is live, and reconstructed
together at the block's output."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from torch import fx

from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.kinds import is_shape
from finetune.notices import Warnings

from .unit import Unit

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


def blocks(module: LiftedModule, layers: list[Unit], constant: set[fx.Node], warnings: Warnings) -> list[Unit]:
    """Consecutive layers of one scope, widened to the single-value cut points around them (and
    merged with neighbours they overlap), as block units. The ops between two blocks join the
    first, so its loss is measured on what the next block reads; the last block runs to the last
    cut point. Layers with no cut point around them, or whose block would read more than its
    entry value (the batch size taken from the input's shape, say), stay layer units: a warning
    for each such layer."""
    shapes = shape_values(module, constant)
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


def shape_values(module: LiftedModule, constant: set[fx.Node]) -> set[fx.Node]:
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
