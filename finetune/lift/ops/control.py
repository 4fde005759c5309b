"""Control flow (If, Loop, Scan) as torch modules whose bodies are lifted graphs of their own.

Each body is built by the same builder from a self-contained copy of its subgraph: the outer
initializers it reads become initializers of the copy (so a weight read inside a branch is a
parameter behind its fake-quant module there, as at the top level) and the other outer values it
reads become extra graph inputs, passed in explicitly after the body's own inputs. The condition
and trip count are read at run time (a Python `if` / `while` inside forward; the fx graph holds one
call_module), except an If whose condition is constant, where only the taken branch is lifted."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from torch import nn

from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.graphs import has_subgraphs, outer_reads

CONTROL_OPS = frozenset({"If", "Loop", "Scan"})
BODY_ATTRIBUTES = {"If": ("then_branch", "else_branch"), "Loop": ("body",), "Scan": ("body",)}


@dataclass(frozen=True)
class Body:
    """A lifted body and the outer (non-initializer) values it takes after its own inputs."""

    module: nn.Module
    outer: tuple[str, ...]


BuildBody = Callable[[str], Body]  # the lifted body of the node's graph attribute of that name


def is_control(node: onnx.NodeProto) -> bool:
    """Whether the node is a default-domain If, Loop or Scan (lifted with its bodies)."""
    return node.domain in DEFAULT_DOMAINS and node.op_type in CONTROL_OPS


def contained_bodies(graph: onnx.GraphProto, visible: Mapping[str, onnx.TensorProto],
                     types: Mapping[str, onnx.ValueInfoProto]) -> Iterator[tuple[tuple[str, str], onnx.GraphProto]]:
    """((node name, attribute), self-contained copy) of every body of the graph's control nodes, at
    any depth: each copy holds the outer initializers it reads as initializers, and takes the other
    outer values it reads as graph inputs after its own."""
    types = {**types, **{v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}}
    for node in graph.node:
        if not is_control(node):
            continue
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                body = _contained(attribute.g, visible, types)
                yield (node.name, attribute.name), body
                yield from contained_bodies(body, {**visible, **{t.name: t for t in body.initializer}}, types)


def _contained(body: onnx.GraphProto, visible: Mapping[str, onnx.TensorProto],
               types: Mapping[str, onnx.ValueInfoProto]) -> onnx.GraphProto:
    """A copy of `body` with the outer initializers it reads as its own and its other outer reads as inputs."""
    copy = onnx.GraphProto()
    copy.CopyFrom(body)
    reads = sorted(outer_reads(body))
    copy.initializer.extend(visible[name] for name in reads if name in visible)
    copy.input.extend(_value_info(name, types) for name in reads if name not in visible)
    return copy


def _value_info(name: str, types: Mapping[str, onnx.ValueInfoProto]) -> onnx.ValueInfoProto:
    """The known value info of an outer value, or a bare one of that name."""
    info = onnx.ValueInfoProto()
    if name in types:
        info.CopyFrom(types[name])
    info.name = name
    return info


def outer_inputs(body: onnx.GraphProto, own: int) -> tuple[str, ...]:
    """The outer values a contained body takes after its `own` inputs."""
    return tuple(v.name for v in body.input[own:])


def control_module(node: onnx.NodeProto, build: BuildBody, condition: np.ndarray | None) -> tuple[nn.Module, list[str]]:
    """The module of a control node and the ONNX names of its arguments, in order (an If with a
    constant `condition` is its taken branch alone)."""
    if node.op_type == "If":
        if condition is not None:
            taken = build("then_branch" if bool(np.asarray(condition).reshape(-1)[0]) else "else_branch")
            return taken.module, list(taken.outer)
        return _if(node.input[0], build("then_branch"), build("else_branch"))
    body = build("body")
    if node.op_type == "Loop":
        if not (node.input[0] if node.input else "") and not (node.input[1] if len(node.input) > 1 else ""):
            raise NotImplementedError("a Loop with neither a trip count nor a condition never ends")
        carried = len(node.input) - 2
        graph = next(a.g for a in node.attribute if a.name == "body")
        return Loop(body.module, carried, _empty_scans(graph, carried)), [*node.input, *body.outer]
    return _scan(node, body), [*node.input, *body.outer]


def _if(condition: str, then_branch: Body, else_branch: Body) -> tuple[nn.Module, list[str]]:
    """An If over both branches, called with the condition and the union of their outer reads."""
    reads = list(dict.fromkeys([*then_branch.outer, *else_branch.outer]))
    module = If(then_branch.module, else_branch.module, [reads.index(n) for n in then_branch.outer],
                [reads.index(n) for n in else_branch.outer])
    return module, [condition, *reads]


def _empty_scans(body: onnx.GraphProto, carried: int) -> list[torch.Tensor]:
    """Each scan output of a Loop that runs no iteration: empty along the new axis, with the
    per-iteration shape the body states (0 where unknown), as onnxruntime returns it."""
    empty = []
    for output in body.output[1 + carried :]:
        tensor_type = output.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor_type.shape.dim]
        empty.append(torch.from_numpy(np.zeros((0, *dims), helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))))
    return empty


def _scan(node: onnx.NodeProto, body: Body) -> nn.Module:
    """A Scan (opset 9+) module from the node's attributes."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.type != onnx.AttributeProto.GRAPH}
    scans = attributes["num_scan_inputs"]
    states = len(node.input) - scans
    outputs = len(node.output) - states
    return Scan(body.module, states, list(attributes.get("scan_input_axes", [0] * scans)),
                list(attributes.get("scan_input_directions", [0] * scans)),
                list(attributes.get("scan_output_axes", [0] * outputs)),
                list(attributes.get("scan_output_directions", [0] * outputs)), len(body.outer))


def _as_tuple(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A body's outputs as a tuple (a lifted graph returns one output bare)."""
    return result if isinstance(result, tuple) else (result,)


def _single(results: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One output bare, several as a tuple, as a lifted graph returns them."""
    return results[0] if len(results) == 1 else tuple(results)


class If(nn.Module):
    """ONNX If: runs the branch the condition picks (read on the host at run time) on the outer
    values that branch reads."""

    def __init__(self, then_branch: nn.Module, else_branch: nn.Module, then_reads: list[int], else_reads: list[int]):
        super().__init__()
        self.then_branch, self.else_branch = then_branch, else_branch
        self.then_reads, self.else_reads = then_reads, else_reads

    def forward(self, condition: torch.Tensor, *outer: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        taken, reads = (self.then_branch, self.then_reads) if bool(condition) else (self.else_branch, self.else_reads)
        return taken(*(outer[i] for i in reads))


class Loop(nn.Module):
    """ONNX Loop: runs the body while the iteration count is below the trip count (if given) and
    the condition holds (if given); loop-carried values are threaded through and the scan outputs of
    every iteration stacked along a new first axis (empty ones, `empty`, after no iteration)."""

    def __init__(self, body: nn.Module, carried: int, empty: list[torch.Tensor]):
        super().__init__()
        self.body, self.carried = body, carried
        self.empty = empty  # a plain attribute: moving the model leaves it on the CPU, forward moves it

    def forward(self, trip_count: torch.Tensor | None, condition: torch.Tensor | None,
                *values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        carried, outer = list(values[: self.carried]), values[self.carried :]
        trips = None if trip_count is None else int(trip_count)
        keep = True if condition is None else bool(condition)
        scans: list[list[torch.Tensor]] = [[] for _ in self.empty]
        iteration = 0
        while keep and (trips is None or iteration < trips):
            flag = torch.tensor(keep) if condition is None else condition.new_tensor(keep)
            results = _as_tuple(self.body(torch.tensor(iteration, dtype=torch.int64), flag, *carried, *outer))
            keep, carried = bool(results[0]), list(results[1 : 1 + self.carried])
            for collected, value in zip(scans, results[1 + self.carried :]):
                collected.append(value)
            iteration += 1
        device = values[0].device if values else None
        stacked = [torch.stack(collected) if collected else empty.to(device) for collected, empty in zip(scans, self.empty)]
        return _single([*carried, *stacked])


class Scan(nn.Module):
    """ONNX Scan (opset 9+): runs the body once per slice of the scan inputs along their axes (in
    their directions), threading the state values, and stacks the per-step scan outputs."""

    def __init__(self, body: nn.Module, states: int, input_axes: list[int], input_reverse: list[int], output_axes: list[int],
                 output_reverse: list[int], outer: int):
        super().__init__()
        self.body, self.states, self.outer = body, states, outer
        self.input_axes, self.input_reverse = input_axes, input_reverse
        self.output_axes, self.output_reverse = output_axes, output_reverse

    def forward(self, *values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        split = len(values) - self.outer
        states, inputs, outer = list(values[: self.states]), values[self.states : split], values[split:]
        axes = [axis % inputs[i].dim() for i, axis in enumerate(self.input_axes)]
        length = inputs[0].shape[axes[0]]
        steps: list[tuple[torch.Tensor, ...]] = []
        for t in range(length):
            slices = [x.select(axis, length - 1 - t if reverse else t)
                      for x, axis, reverse in zip(inputs, axes, self.input_reverse)]
            results = _as_tuple(self.body(*states, *slices, *outer))
            states = list(results[: self.states])
            steps.append(results[self.states :])
        return _single([*states, *(self._stacked([step[k] for step in steps], k) for k in range(len(self.output_axes)))])

    def _stacked(self, values: list[torch.Tensor], k: int) -> torch.Tensor:
        """Scan output k of every step, stacked along its axis in its direction."""
        ordered = values[::-1] if self.output_reverse[k] else values
        return torch.stack(ordered, dim=self.output_axes[k] % (values[0].dim() + 1))


def constant_condition(graph: onnx.GraphProto, name: str, tensors: Mapping[str, onnx.TensorProto],
                       opset: int) -> np.ndarray | None:
    """The value of an If's condition when it is constant: an initializer, or computed by the graph's
    nodes from initializers and the shapes of fully shaped values alone; else None."""
    if name in tensors:
        return numpy_helper.to_array(tensors[name])
    producers = {output: node for node in graph.node for output in node.output}
    shapes = _static_shapes(graph)
    needed: set[str] = set()
    stack = [name]
    while stack:
        value = stack.pop()
        if not value or value in tensors:
            continue
        node = producers.get(value)
        if node is None or node.domain not in DEFAULT_DOMAINS or has_subgraphs(node):
            return None
        needed.add(node.name)
        if node.op_type != "Shape":
            stack.extend(node.input)
        elif node.input[0] not in shapes:
            return None
    return _evaluate([n for n in graph.node if n.name in needed], name, tensors, shapes, opset)


def _static_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """Fully known shapes of the graph's values (inputs, value infos, outputs)."""
    shapes = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        dims = info.type.tensor_type.shape.dim
        if info.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = tuple(d.dim_value for d in dims)
    return shapes


def _evaluate(nodes: list[onnx.NodeProto], name: str, tensors: Mapping[str, onnx.TensorProto],
              shapes: dict[str, tuple[int, ...]], opset: int) -> np.ndarray:
    """`name` computed by `nodes` (in graph order) with onnx's reference evaluator, each Shape of a
    statically shaped value fed a zero tensor of that shape."""
    feeds = {v: np.zeros(shapes[v], np.float32) for n in nodes if n.op_type == "Shape" for v in n.input[:1]}
    used = {v for n in nodes for v in n.input if v in tensors and v not in feeds}
    inner = helper.make_graph(nodes, "condition", [helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, None) for v in feeds],
                              [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)],
                              [tensors[v] for v in sorted(used)])
    model = helper.make_model(inner, opset_imports=[helper.make_opsetid("", opset)])
    return np.asarray(ReferenceEvaluator(model).run(None, feeds)[0])
