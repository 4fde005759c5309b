"""Cut a lifted module with torch.fx into an alternating chain of gap segments (the ops between
units) and unit segments, so the quantized activations can be pushed through each segment once:
cost linear in depth. Constant subgraphs (weights behind their quantizers) are copied into each
segment that reads them; every other value crosses segments as an input or output."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from finetune.lift import LiftedModule
from finetune.lift.graph import Segment, constant_nodes, needed, read_later, segment, step_readers

from .unit import Unit


@dataclass(frozen=True)
class Plan:
    """Gap segment k computes what unit k reads from the previous ones; unit segment k runs unit
    k and returns what later segments read; `train[k]` maps unit k's input to its output alone.
    `last_use[name]` is the index of the last step (2k gap, 2k+1 unit) reading a value."""

    gaps: tuple[Segment, ...]
    units: tuple[Segment, ...]
    train: tuple[fx.GraphModule, ...]
    last_use: dict[str, int]


def cut(module: LiftedModule, units: list[Unit]) -> Plan:
    """The segments of `module` around `units` (in graph order); ops no unit depends on are dropped."""
    graph = module.graph
    nodes = {n.name: n for n in graph.nodes}
    constant = constant_nodes(graph)
    steps = _assign_steps(graph, units, constant, needed([nodes[name] for unit in units for name in unit.nodes], constant))
    members: list[list[fx.Node]] = [[] for _ in range(2 * len(units))]
    for node, step in steps.items():
        members[step].append(node)
    readers = step_readers(steps, constant)
    last_use = {name: max(uses) for name, uses in readers.items()}
    segments = [segment(module, members[s], read_later(members[s], readers, s), constant) for s in range(len(members))]
    train = tuple(_train_module(module, members[2 * k + 1], nodes, u, constant) for k, u in enumerate(units))
    return Plan(tuple(segments[0::2]), tuple(segments[1::2]), train, last_use)


def _train_module(module: LiftedModule, members: list[fx.Node], nodes: dict[str, fx.Node], unit: Unit,
                  constant: set[fx.Node]) -> fx.GraphModule:
    """Unit `unit`'s module from its input, then its side inputs (in the unit's order), to its outputs."""
    reads = [nodes[unit.input], *(nodes[side.name] for side in unit.side_inputs)]
    train = segment(module, members, [nodes[name] for name in unit.outputs], constant, reads)
    if train.inputs != tuple(node.name for node in reads):
        raise ValueError(f"unit {unit.name} reads {list(train.inputs)}, not its input and side inputs {[n.name for n in reads]}")
    return train.module


def _assign_steps(graph: fx.Graph, units: list[Unit], constant: set[fx.Node], wanted: set[fx.Node]) -> dict[fx.Node, int]:
    """Unit k's nodes go to step 2k+1; any other wanted node to the first gap step after every
    step it reads from (graph inputs count as step -1)."""
    in_unit = {name: 2 * k + 1 for k, unit in enumerate(units) for name in unit.nodes}
    steps: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node not in wanted:
            continue
        if node.name in in_unit:
            steps[node] = in_unit[node.name]
            continue
        latest = max((steps.get(i, -1) for i in node.all_input_nodes if i not in constant), default=-1)
        steps[node] = latest + 1 if latest % 2 else latest
    for node, step in steps.items():
        late = [i.name for i in node.all_input_nodes if steps.get(i, -1) > step]
        if late:
            raise ValueError(f"cannot cut the graph: {node.name} reads {late} from a later unit")
    return steps
