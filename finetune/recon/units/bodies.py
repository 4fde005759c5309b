"""Units of the weight layers inside If/Loop/Scan bodies. A control-flow module whose bodies hold
layers is tuned as one block-like unit at its output: a branch's layers run only on the batches
that take the branch, so their inputs cannot be captured a layer at a time the way the main
graph's are. The unit reaches back from the node to the nearest value all its inputs come from
(the value its condition is computed from, say), and layer units of the main graph inside that
span join it; where there is none (a model input for the data, another for the sample rate or
the trip count), the node alone is the unit, with side inputs (units.sides). A unit trains on
batches of cached rows, so a condition computed from the data sees a training batch as a whole:
with such a condition, give batches of the size the model runs at (batch_size 1 for a model run
one row at a time)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx, nn

from finetune.lift import LiftedModule
from finetune.lift.graph import constant_nodes
from finetune.lift.ops.control import If, Loop
from finetune.notices import Warnings

from .layers import layer_units
from .sides import SideInput, measured_outputs
from .unit import Layer, Unit

CONTROL_ARGUMENTS = {If: 1, Loop: 2}  # the leading arguments that steer the node: If's condition, Loop's trip count and condition


def with_bodies(module: LiftedModule, layers: list[Unit], constant: set[fx.Node], op_types: tuple[str, ...],
                include_output_quant: bool, warnings: Warnings) -> list[Unit]:
    """The main graph's layer units (in graph order) with a unit for each control-flow node whose
    bodies hold layers, in graph order; layer units inside such a unit's span join it."""
    units = list(layers)
    position = {n.name: i for i, n in enumerate(module.graph.nodes)}
    for node in module.graph.nodes:
        unit = _body_unit(module, node, constant, op_types, include_output_quant, warnings)
        if unit is None:
            continue
        inside = [u for u in units if set(u.nodes) & set(unit.nodes)]
        nodes = sorted({*unit.nodes, *(n for u in inside for n in u.nodes)}, key=position.__getitem__)
        layers = (*(layer for u in inside for layer in u.layers), *unit.layers)
        unit = dataclasses.replace(unit, layers=layers, nodes=tuple(nodes))
        kept = [u for u in units if u not in inside]
        at = next((i for i, u in enumerate(kept) if position[u.nodes[0]] > position[node.name]), len(kept))
        units = [*kept[:at], unit, *kept[at:]]
    return units


def _body_unit(module: LiftedModule, node: fx.Node, constant: set[fx.Node], op_types: tuple[str, ...],
               include_output_quant: bool, warnings: Warnings) -> Unit | None:
    """The unit of a control-flow node whose bodies hold layers, else None (with a warning where
    such a node cannot be tuned)."""
    if node.op != "call_module" or node in constant:
        return None
    layers = [layer for path, body in _bodies(module.get_submodule(node.target), node.target)
              for layer in _body_layers(module, path, body, op_types, include_output_quant, warnings)]
    if not layers:
        return None
    items, outputs, indices = measured_outputs(node)  # several outputs, taken apart by getitem: each is measured
    entry, members = _entry(module, node, constant)
    if entry is None:
        return _unit_with_sides(module, node, layers, constant, warnings)
    reader = next((m for m in members if m.op == "call_module" and entry in m.args), None)
    if reader is None:
        warnings.add(node.target, "not tuned: no op of it reads the value all its inputs come from as an argument")
        return None
    return Unit(
        name=node.target, op_type="block", layers=tuple(layers), input=entry.name, source=reader.target,
        source_argument=reader.args.index(entry), nodes=tuple(m.name for m in [*members, *items]), **_outputs(outputs, indices),
        target_module=node.target,
    )


def _unit_with_sides(module: LiftedModule, node: fx.Node, layers: list[Layer], constant: set[fx.Node],
                     warnings: Warnings) -> Unit | None:
    """The unit of a control-flow node whose inputs come from several values (model inputs, a
    condition computed from another): its main input is the first computed value it reads after its
    control inputs (an If's condition, a Loop's trip count and condition), the others side inputs."""
    control = CONTROL_ARGUMENTS.get(type(module.get_submodule(node.target)), 0)
    computed = list(dict.fromkeys(a for a in node.args if isinstance(a, fx.Node) and a not in constant))
    main = next((a for i, a in enumerate(node.args) if i >= control and a in computed), None)
    if main is None or node.kwargs:
        warnings.add(node.target, "not tuned: it reads no computed value besides its control inputs, so it has no "
                     "input whose rows to train on")
        return None
    items, outputs, indices = measured_outputs(node)
    return Unit(
        name=node.target, op_type="block", layers=tuple(layers), input=main.name, source=node.target,
        source_argument=node.args.index(main), nodes=tuple(n.name for n in [node, *items]), **_outputs(outputs, indices),
        target_module=node.target, side_inputs=tuple(SideInput(a.name) for a in computed if a is not main),
    )


def _outputs(outputs: list[fx.Node], indices: tuple[int, ...]) -> dict[str, Any]:
    """A control-flow unit's outputs, which of its node's they are, and where their rows lie: the
    first along its leading axis, as a unit's output is; the others' found from the values."""
    return {"outputs": tuple(n.name for n in outputs), "target_outputs": indices,
            "output_axes": (0, *(None for _ in outputs[1:]))}


def _bodies(module: nn.Module, path: str) -> list[tuple[str, LiftedModule]]:
    """The lifted bodies a module calls, by qualified name: an If's branches, a Loop's or Scan's
    body, or the module itself where it is the taken branch of an If with a constant condition."""
    if isinstance(module, LiftedModule):
        return [(path, module)]
    return [(f"{path}.{name}", child) for name, child in module.named_children() if isinstance(child, LiftedModule)]


def _body_layers(module: LiftedModule, path: str, body: LiftedModule, op_types: tuple[str, ...], include_output_quant: bool,
                 warnings: Warnings) -> list[Layer]:
    """The layers of a body (and of the bodies inside it), named from the root; a layer whose
    weight another graph of the model reads too is left out with a warning."""
    layers = []
    units = with_bodies(body, layer_units(body, op_types, include_output_quant, warnings), constant_nodes(body.graph),
                        op_types, include_output_quant, warnings)
    for unit in units:
        for layer in unit.layers:
            qualified = _qualified(layer, path)
            source = module.finetune_params.get(qualified.weight)
            if source is None or len(source.consumers) > 1:
                warnings.add(qualified.name, "not tuned: its weight is read by another graph of the model too")
                continue
            layers.append(qualified if qualified.bias in module.finetune_params else dataclasses.replace(qualified, bias=None))
    return layers


def _qualified(layer: Layer, path: str) -> Layer:
    """A body's layer with its module and parameter names qualified by the body's path."""
    def qualify(name: str | None) -> str | None:
        return None if name is None else f"{path}.{name}"
    return dataclasses.replace(layer, name=qualify(layer.name), weight=qualify(layer.weight),
                               weight_quantizer=qualify(layer.weight_quantizer), bias=qualify(layer.bias))


def _entry(module: LiftedModule, node: fx.Node, constant: set[fx.Node]) -> tuple[fx.Node | None, list[fx.Node]]:
    """The latest value that everything the node computes from passes through (the node's one
    input, or the value its condition and its other inputs are computed from), and the nodes from
    there to the node, in graph order; (None, []) when there is none (another model input is read
    on the way: then the unit has side inputs)."""
    ancestors = _ancestors(node, constant)
    order = [n for n in module.graph.nodes if n in ancestors]
    for entry in reversed(order[:-1]):
        members = ancestors - _ancestors(entry, constant)
        outside = {i for m in members for i in m.all_input_nodes if i not in constant and i not in members}
        if outside == {entry} and all(m.op != "placeholder" for m in members):
            return entry, [n for n in order if n in members]
    return None, []


def _ancestors(node: fx.Node, constant: set[fx.Node]) -> set[fx.Node]:
    """The node and every non-constant node it depends on, graph inputs included."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in found and current not in constant:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found
