"""Residual blocks found from a graph's structure, for exports whose node names carry no scopes (the
dynamo exporter's) or whose blocks leave several values live (a decoder's attention mask, rotary
tables and cache): the Adds that join a branch back onto the stream it left form a chain; the spans
between consecutive joins repeat with a period (a decoder block's attention half, then its MLP half),
and each period is one block unit. What a block reads besides the stream (computed without any
layer, as a mask or a position table is, or a model input such as a past key) is a side input."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import fx

from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.kinds import is_add

from .blocks import MAX_BLOCK_LAYERS, shape_values
from .sides import SideInput, batch_axis_by_readers
from .unit import Unit


@dataclass(frozen=True)
class _Span:
    """The ops from one stream value (`entry`, excluded) to the next (`exit`), and the layer units in them."""

    entry: fx.Node
    exit: fx.Node
    nodes: tuple[fx.Node, ...]
    layers: tuple[Unit, ...]  # the units whose layers it holds


def residual_blocks(module: LiftedModule, units: list[Unit], constant: set[fx.Node]) -> list[Unit]:
    """`units` with each run of layer units that makes up whole periods of a residual chain (two
    repetitions at least) replaced by one block unit per period; everything else as it was."""
    graph = module.graph
    spans = _spans(module, units, constant)
    period = _period([tuple((layer.op_type, tuple(module.get_parameter(layer.weight).shape))
                            for unit in span.layers for layer in unit.layers) for span in spans])
    if period is None:
        return units
    weights = {layer.name for u in units for layer in u.layers}
    downstream = _descendants({node for node in graph.nodes if node.op == "call_module" and node.target in weights})
    shapes = shape_values(module, constant)
    groups = [spans[k : k + period] for k in range(0, len(spans), period)]
    claimed = {id(u) for span in spans for u in span.layers}
    kept = [u for u in units if id(u) not in claimed]
    taken = {n.name for span in spans for n in span.nodes}
    if any(taken.intersection(u.nodes) for u in kept) or not all(_blockable(g, shapes, constant, downstream) for g in groups):
        return units  # a unit kept would share ops with a block, or a block reads what a layer computes
    groups = [_with_own_shapes(module, group, shapes, constant) for group in groups]
    module.recompile()
    blocks = [_block(module, group, constant) for group in groups]
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    return sorted([*kept, *blocks], key=lambda u: position[u.nodes[0]])


def _spans(module: LiftedModule, units: list[Unit], constant: set[fx.Node]) -> list[_Span]:
    """The spans of the longest chain of residual joins each of whose spans holds whole units (their
    weight layers inside it), one of them at least a layer that scopes left alone, in stream order;
    [] where there is no such chain of two joins."""
    name_of = {n.target: n.name for n in module.graph.nodes if n.op == "call_module"}
    unit_of = {name_of[layer.name]: u for u in units for layer in u.layers}
    joins = [join for node in module.graph.nodes if (join := _join(module, node, constant)) is not None]
    following = {entry: node for node, entry in joins}
    best: list[_Span] = []
    for node, entry in joins:
        if any(exit_ is entry for exit_, _ in joins):
            continue  # not the chain's start
        chain: list[_Span] = []
        while node is not None:
            nodes = _between(entry, node)
            inside = tuple(dict.fromkeys(unit_of[n.name] for n in nodes if n.name in unit_of))
            if not inside or any(name_of[layer.name] not in {n.name for n in nodes} for u in inside for layer in u.layers):
                break
            chain.append(_Span(entry, node, tuple(nodes), inside))
            node, entry = following.get(node), node
        alone = any(u.op_type != "block" for span in chain for u in span.layers)
        best = chain if alone and len(chain) > len(best) else best
    return best if len(best) >= 2 else []


def _join(module: LiftedModule, node: fx.Node, constant: set[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """(the Add, the stream value it adds a branch back onto) when `node` is an Add of two computed
    values one of which (its float value, behind any quantizer) the other is computed from."""
    if node.op != "call_module" or not is_add(module.get_submodule(node.target)):
        return None
    args = [a for a in node.args if isinstance(a, fx.Node) and a not in constant]
    if len(args) != 2:
        return None
    for skip, branch in (args, args[::-1]):
        stream = _float_value(module, skip)
        if stream in _ancestors(branch):
            return node, stream
    return None


def _float_value(module: LiftedModule, node: fx.Node) -> fx.Node:
    """The value behind a chain of quantizers."""
    while node.op == "call_module" and isinstance(module.get_submodule(node.target), FakeQuantize):
        node = node.args[0]
    return node


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` is computed from."""
    return _reached(node.all_input_nodes, lambda current: current.all_input_nodes)


def _descendants(nodes: set[fx.Node]) -> set[fx.Node]:
    """Every node computed from any of `nodes`, those included."""
    return _reached(nodes, lambda current: current.users)


def _reached(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """The nodes `start` holds and every node reached from them by `step`."""
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(step(current))
    return seen


def _between(entry: fx.Node, exit_: fx.Node) -> list[fx.Node]:
    """The nodes computed from `entry` that `exit_` is computed from, `exit_` included, in graph order."""
    inside = (_ancestors(exit_) | {exit_}) & _descendants({entry})
    return [n for n in entry.graph.nodes if n in inside and n is not entry]


def _with_own_shapes(module: LiftedModule, spans: list[_Span], shapes: set[fx.Node], constant: set[fx.Node]) -> list[_Span]:
    """The spans with the shape arithmetic they read from outside (a Reshape's target built from the
    Shape of a model input, which the dynamo exporter shares between blocks) copied into the first of
    them, so a block recomputes it for the rows it trains on instead of reading the calibration
    batch's sizes; the graph computes the same values."""
    inside = {n for span in spans for n in span.nodes}
    readers = [n for n in module.graph.nodes if n in inside and any(i in shapes and i not in inside for i in n.all_input_nodes)]
    if not readers:
        return spans
    graph = module.graph
    copies: dict[fx.Node, fx.Node] = {}

    def copied(node: fx.Node) -> fx.Node:
        """The block's copy of a shape value (made once, its own inputs first); any other value itself."""
        if node not in shapes or node in constant:
            return node
        if node not in copies:
            copies[node] = graph.node_copy(node, copied)
        return copies[node]

    for reader in readers:  # each copy just before its first reader, after every constant it reads
        with graph.inserting_before(reader):
            for value in [i for i in reader.all_input_nodes if i in shapes and i not in inside]:
                reader.replace_input_with(value, copied(value))
    for node in reversed(list(graph.nodes)):  # the originals no reader is left to
        if node in copies and not node.users:
            graph.erase_node(node)
    first = spans[0]
    order = [n for n in graph.nodes if n in inside or n in copies.values()]
    widened = tuple(n for n in order if n not in inside or n in first.nodes)
    return [_Span(first.entry, first.exit, widened, first.layers), *spans[1:]]


def _period(signatures: list[tuple]) -> int | None:
    """The shortest period of the spans' layer signatures that repeats at least twice over them all."""
    count = len(signatures)
    return next((p for p in range(1, count // 2 + 1)
                 if count % p == 0 and all(signatures[i] == signatures[i % p] for i in range(count))), None)


def _blockable(spans: list[_Span], shapes: set[fx.Node], constant: set[fx.Node], downstream: set[fx.Node]) -> bool:
    """Whether consecutive spans make one block: an entry the float model names too, at most
    MAX_BLOCK_LAYERS layers, and nothing a layer computes read besides the entry (looking through the
    shape arithmetic the block will copy)."""
    nodes = [n for span in spans for n in span.nodes]
    inside, reads = set(nodes) | {spans[0].entry}, set()
    stack = [i for n in nodes for i in n.all_input_nodes]
    while stack:
        value = stack.pop()
        if value in inside or value in constant or value in reads:
            continue
        reads.add(value)
        stack.extend(value.all_input_nodes if value in shapes else [])
    layers = sum(len(unit.layers) for span in spans for unit in span.layers)
    findable = spans[0].entry.op in ("placeholder", "call_module")  # the float model has it by the same name
    return findable and layers <= MAX_BLOCK_LAYERS and not any(value in downstream for value in reads - shapes)


def _block(module: LiftedModule, spans: list[_Span], constant: set[fx.Node]) -> Unit:
    """The block unit of consecutive spans, reading its entry and, as side inputs, the other values
    its ops read (computed without layers: a mask, a position table, a model input such as a past key)."""
    layers = tuple(layer for span in spans for unit in span.layers for layer in unit.layers)
    nodes = [n for span in spans for n in span.nodes]
    inside = set(nodes) | {spans[0].entry}
    sides = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside and i not in constant))
    entry, exit_ = spans[0].entry, spans[-1].exit
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    source, argument = ("", placeholders.index(entry)) if entry.op == "placeholder" else (entry.target, None)
    scope = "/".join(os.path.commonprefix([layer.name.split("/") for layer in layers]))  # /layers/0 of its layers' names
    return Unit(
        name=scope if scope.strip("/") else f"{layers[0].name}..{layers[-1].name}", op_type="block", layers=layers,
        input=entry.name, source=source, source_argument=argument, nodes=tuple(n.name for n in nodes), outputs=(exit_.name,),
        target_module=exit_.target,
        side_inputs=tuple(SideInput(side.name, batch_axis_by_readers(module, side, side.users)) for side in sides),
        source_reader=next(((n.target, n.args.index(entry)) for n in nodes if n.op == "call_module" and entry in n.args), None),
    )
