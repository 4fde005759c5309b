"""Sensitivity forwards that start at their layer: a candidate lowers one layer alone, so all the
graph computes before that layer's slots is the top model's. One forward of the top model per
batch keeps the values each layer's tail (its slots and everything after them) reads; each
candidate then runs only its tail from those values. The same ops on the same values give
outputs bit-identical to full forwards, at the cost of the tails alone, and only one batch's
values are held at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from finetune.lift.graph import Segment, constant_nodes, needed, segment

from .switch import SwitchableModel

logger = logging.getLogger(__name__)

Keys = dict[str, str]  # role -> model key, as SwitchableModel.set takes them


@dataclass(frozen=True)
class Tails:
    """`capture` runs the whole graph and returns every value a tail reads (and the output);
    `tails[node]` maps those values to the output with `node`'s slots as they are set. A node
    the output does not depend on has no tail (lowering it leaves the output as it is)."""

    capture: Segment
    tails: dict[str, Segment]
    placeholders: tuple[str, ...]
    output: str


def cut_tails(switch: SwitchableModel, output_index: int) -> Tails:
    """The capture segment and one tail per searched node of the switchable model."""

    module, graph = switch.module, switch.module.graph
    constant = constant_nodes(graph)
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    output = returned[output_index] if isinstance(returned, (tuple, list)) else returned
    calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
    tails = {}
    for node, slots in switch.slots.items():
        reached = _downstream([calls[slot.name] for slot in slots])
        if output in reached:
            tails[node] = segment(module, [n for n in graph.nodes if n in reached], [output], constant)
    nodes = {n.name: n for n in graph.nodes}
    kept = list(dict.fromkeys([nodes[name] for tail in tails.values() for name in tail.inputs if nodes[name].op != "placeholder"]
                              + [output]))
    members = needed(kept, constant)
    capture = segment(module, [n for n in graph.nodes if n in members], kept, constant)
    placeholders = tuple(n.name for n in graph.nodes if n.op == "placeholder")
    return Tails(capture, tails, placeholders, output.name)


def _downstream(starts: list[fx.Node]) -> set[fx.Node]:
    """The given nodes and every node reading them, directly or not (the graph's output node excluded)."""
    reached: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in reached or node.op == "output":
            continue
        reached.add(node)
        stack.extend(node.users)
    return reached


@torch.inference_mode()
def candidate_outputs(switch: SwitchableModel, tails: Tails, batches: Sequence[tuple[torch.Tensor, ...]],
                      candidates: Sequence[tuple[str, Keys]], top: dict[str, Keys],
                      progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
    """For each candidate (node, its keys), the output over all batches with that node switched to
    its keys and every other node at `top` (as the switch must be set on entry, and is left)."""
    results: list[list[np.ndarray]] = [[] for _ in candidates]
    for done, batch in enumerate(batches):
        values = dict(zip(tails.placeholders, batch, strict=True))
        values.update(zip(tails.capture.outputs, tails.capture.module(*(values[name] for name in tails.capture.inputs))))
        for result, (node, keys) in zip(results, candidates, strict=True):
            tail = tails.tails.get(node)
            if tail is None:
                result.append(values[tails.output].float().cpu().numpy())
                continue
            switch.set(node, keys)
            result.append(tail.module(*(values[name] for name in tail.inputs))[0].float().cpu().numpy())
            switch.set(node, top[node])
        if progress is not None:
            progress(done + 1, len(batches))
    return [np.concatenate(result) for result in results]
