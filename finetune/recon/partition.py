"""Cut a lifted module with torch.fx into an alternating chain of gap segments (the ops between
units) and unit segments, so the quantized activations can be pushed through each segment once:
cost linear in depth. Constant subgraphs (weights behind their quantizers) are copied into each
segment that reads them; every other value crosses segments as an input or output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from finetune.lift import LiftedModule

from .units import Unit, constant_nodes


@dataclass(frozen=True)
class Segment:
    """A GraphModule over part of the lifted graph (sharing its modules and parameters), with the
    fx names of the values it reads and returns (always a tuple)."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


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
    readers = _readers(steps, constant)
    last_use = {name: max(uses) for name, uses in readers.items()}
    segments = [segment(module, members[s], _outputs(members[s], readers, s), constant) for s in range(len(members))]
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


def cut_before(module: LiftedModule, wanted: list[list[fx.Node]]) -> tuple[tuple[Segment, ...], dict[str, int]]:
    """Segments of `module` in order: segment k computes the nodes wanted[k] (and what they depend
    on) that no earlier segment computed, and returns what later segments read. Also the last
    segment reading each value. Ops nothing wanted depends on are dropped."""
    constant = constant_nodes(module.graph)
    steps: dict[fx.Node, int] = {}
    for k, nodes in enumerate(wanted):
        for node in needed(nodes, constant):
            steps.setdefault(node, k)
    members: list[list[fx.Node]] = [[] for _ in wanted]
    for node in module.graph.nodes:
        if node in steps:
            members[steps[node]].append(node)
    readers = _readers(steps, constant)
    segments = tuple(segment(module, members[k], _outputs(members[k], readers, k), constant) for k in range(len(wanted)))
    return segments, {name: max(uses) for name, uses in readers.items()}


def needed(nodes: list[fx.Node], constant: set[fx.Node]) -> set[fx.Node]:
    """The given nodes and the non-constant nodes they depend on (graph inputs excluded)."""
    needed: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in needed or node in constant or node.op == "placeholder":
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return needed


def _assign_steps(graph: fx.Graph, units: list[Unit], constant: set[fx.Node], needed: set[fx.Node]) -> dict[fx.Node, int]:
    """Unit k's nodes go to step 2k+1; any other needed node to the first gap step after every
    step it reads from (graph inputs count as step -1)."""
    in_unit = {name: 2 * k + 1 for k, unit in enumerate(units) for name in unit.nodes}
    steps: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node not in needed:
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


def _readers(steps: dict[fx.Node, int], constant: set[fx.Node]) -> dict[str, list[int]]:
    """For each value read across steps, the steps that read it."""
    readers: dict[str, list[int]] = {}
    for node, step in steps.items():
        for source in node.all_input_nodes:
            if source not in constant and steps.get(source, -1) != step:
                readers.setdefault(source.name, []).append(step)
    return readers


def _outputs(members: list[fx.Node], readers: dict[str, list[int]], step: int) -> list[fx.Node]:
    """The members some later step reads."""
    return [n for n in members if any(s > step for s in readers.get(n.name, ()))]


def segment(module: LiftedModule, members: list[fx.Node], outputs: list[fx.Node], constant: set[fx.Node],
            leading: Sequence[fx.Node] = ()) -> Segment:
    """A GraphModule computing `outputs` from the values `members` read from outside (the `leading`
    ones first, in their order)."""
    graph = fx.Graph()
    inside = set(members)
    read = dict.fromkeys(i for n in members for i in n.all_input_nodes if i not in constant and i not in inside)
    external = {**dict.fromkeys(n for n in leading if n in read), **read}
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in external}

    def value(node: fx.Node) -> fx.Node:
        """The new graph's node for an original one, copying constants on first use."""
        if node not in env:
            env[node] = graph.node_copy(node, value)
        return env[node]

    for node in members:
        env[node] = graph.node_copy(node, value)
    graph.output(tuple(env[n] for n in outputs))
    return Segment(fx.GraphModule(module, graph), tuple(n.name for n in external), tuple(n.name for n in outputs))
