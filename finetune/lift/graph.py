"""Graph utilities of a lifted module (torch.fx): which nodes are constant (initializers and what is
computed from them alone), the trainable parameter behind a constant argument, and segments: a
GraphModule over part of the graph, sharing the module's submodules and parameters, with constants
copied into each segment that reads them. Fine-tuning cuts the graph around its units with them,
mixed-precision search cuts sensitivity tails."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from .builder import LiftedModule


def constant_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value does not depend on a graph input: initializers and what is computed from
    them alone (weights behind their quantizers)."""
    constant: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or (node.op in ("call_module", "call_function", "call_method") and inputs and all(i in constant for i in inputs)):
            constant.add(node)
    return constant


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


@dataclass(frozen=True)
class Segment:
    """A GraphModule over part of the lifted graph (sharing its modules and parameters), with the
    fx names of the values it reads and returns (always a tuple)."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


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
    readers = step_readers(steps, constant)
    segments = tuple(segment(module, members[k], read_later(members[k], readers, k), constant) for k in range(len(wanted)))
    return segments, {name: max(uses) for name, uses in readers.items()}


def needed(nodes: list[fx.Node], constant: set[fx.Node]) -> set[fx.Node]:
    """The given nodes and the non-constant nodes they depend on (graph inputs excluded)."""
    found: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in found or node in constant or node.op == "placeholder":
            continue
        found.add(node)
        stack.extend(node.all_input_nodes)
    return found


def step_readers(steps: dict[fx.Node, int], constant: set[fx.Node]) -> dict[str, list[int]]:
    """For each value read across steps (`steps`: the step each node runs in), the steps that read it."""
    readers: dict[str, list[int]] = {}
    for node, step in steps.items():
        for source in node.all_input_nodes:
            if source not in constant and steps.get(source, -1) != step:
                readers.setdefault(source.name, []).append(step)
    return readers


def read_later(members: list[fx.Node], readers: dict[str, list[int]], step: int) -> list[fx.Node]:
    """The members of step `step` that some later step reads."""
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
