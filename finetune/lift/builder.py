"""Build a torch.fx GraphModule from a normalised ONNX graph with onnx2torch's converters and ours.

Module names are the ONNX node names with `.` replaced by `/`. Initializers live in one container
module: the weights and biases fine-tuning may change as parameters (each mapped back to its
initializer in `finetune_params`), everything else as buffers. The bodies of If/Loop/Scan nodes
are built the same way as GraphModules of their own inside the control module (ops/control.py);
an initializer read in several graphs is one parameter, registered in each of their containers."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import getitem
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx2torch.node_converters.shape import OnnxShape
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from torch import fx, nn

from finetune.formats.blocks import SLICE_ELEMENTS
from finetune.host_memory import HEAP_SLACK, release_freed_host_memory
from finetune.onnx.contrib import split_skip_norms
from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.dtypes import to_torch
from finetune.onnx.graphs import node_reads
from finetune.onnx.io import load_model
from finetune.onnx.normalize import normalize_model

from . import ops  # noqa: F401  (registers the converters)
from .fake_quant import FakeQuantize
from .host_shapes import HostOp, HostShape, host_shapes
from .ops.control import Body, constant_condition, contained_bodies, control_module, is_control
from .params import Dequantize, FolderGraph, ParamSource, shared_or_made, tensor_array, trainable_initializers
from .qdq import QOPERATOR_OPS, QUANTIZE_TO_DEQUANTIZE, is_folded_quantize
from .registry import find_converter

logger = logging.getLogger(__name__)

INITIALIZERS = "initializers"  # the container module of parameters and buffers made from initializers
ONNX_NODE = "onnx_node"  # fx node meta: (ONNX node name, its output names) of the node a call_module computes


class LiftError(NotImplementedError):
    """An ONNX node that cannot be lifted; the message names the node, its op type and opset."""


class LiftedModule(fx.GraphModule):
    """The lifted GraphModule; `finetune_params` maps each trainable parameter's qualified name to
    its ParamSource, `initializer_values` each float tensor made from an initializer (not from codes)
    to the initializer's name (what the lift of a related model may reuse); both survive
    copy.deepcopy (which a plain GraphModule attribute does not)."""

    finetune_params: dict[str, ParamSource]
    initializer_values: dict[str, torch.Tensor]

    def __deepcopy__(self, memo: dict[int, Any]) -> LiftedModule:
        copied = super().__deepcopy__(memo)
        copied.finetune_params = copy.deepcopy(self.finetune_params, memo)
        copied.initializer_values = copy.deepcopy(self.initializer_values, memo)
        return copied


def lift_model(model: str | Path | onnx.ModelProto, owned: bool = False,
               reuse: Mapping[str, torch.Tensor] | None = None, folder: Path | None = None) -> LiftedModule:
    """A torch GraphModule computing what onnxruntime computes for the model (inputs in graph
    order; one output as a tensor, several as a tuple), with fake-quant modules for its QDQ
    patterns and `finetune_params` mapping each trainable parameter to its ParamSource. The model
    is normalised in one copy of its own, or with `owned` (a proto the caller hands over and drops
    afterwards, the only way its memory is freed) in place: no copy. An initializer whose value is
    bit for bit that of the tensor `reuse` holds under its name reads that tensor's storage instead
    of a copy of its own, and so does one of codes that the tensor quantizes to exactly
    (Dequantize.stands_for): the parameter holds the float values, which its quantizer turns into
    the codes' values (tuning lifts the QDQ model into its float reference's weights). A proto
    loaded without its external data reads each tensor's values from `folder` as it is made, so
    its weights are never held twice (onnx.io.loaded_tensor)."""
    normalized = normalized_for_lift(model if owned else load_model(model))
    shared = _Shared.of(normalized, reuse or {}, folder)
    module = _Builder(normalized.graph, shared).build()
    module.finetune_params = _merged_sources(module)
    module.initializer_values = {name: value for name, (value, transform) in shared.made.items() if transform is None}
    _freeze_unmapped_parameters(module)
    return module


def normalized_for_lift(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model normalised in place, its fused skip norms split into the Adds and norm they fuse (so
    residual blocks are found in a decoder onnxruntime-genai built)."""
    normalized, _ = normalize_model(model, in_place=True)
    split_skip_norms(normalized)
    return normalized


@dataclass
class _Shared:
    """What the builders of a model's graph and of its bodies share: the opsets, the self-contained
    copy of every control node's body, the initializers that become parameters, and the tensors
    already made from initializers (so a weight several graphs read is one parameter)."""

    opsets: dict[str, int]
    bodies: dict[tuple[str, str], onnx.GraphProto]
    trainable: set[str]
    reuse: Mapping[str, torch.Tensor]
    folder: Path | None  # where external values not loaded are read from
    made: dict[str, tuple[torch.Tensor, Dequantize | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto, reuse: Mapping[str, torch.Tensor], folder: Path | None) -> _Shared:
        """The shared state of a normalised model, reading the equal tensors of `reuse` and the values
        not loaded from `folder` (see lift_model)."""
        opsets = {("" if o.domain in DEFAULT_DOMAINS else o.domain): o.version for o in model.opset_import}
        bodies = dict(contained_bodies(model.graph, {t.name: t for t in model.graph.initializer}, {}))
        trainable = trainable_initializers(model.graph).union(*(trainable_initializers(b) for b in bodies.values()))
        return cls(opsets, bodies, trainable, reuse, folder)


class _Builder:
    """One pass over the topologically sorted nodes of one graph, emitting fx nodes."""

    def __init__(self, graph: onnx.GraphProto, shared: _Shared):
        self.proto, self.shared = graph, shared
        self.graph = FolderGraph(graph, shared.folder)
        self.opsets = shared.opsets
        self.graph_outputs = {o.name for o in graph.output}
        self.consumers: dict[str, list[OnnxNode]] = defaultdict(list)
        for node in self.graph.nodes.values():
            for name in node_reads(node.proto):  # a body's outer reads count as its control node's
                self.consumers[name].append(node)
        self.fx_graph = fx.Graph()
        self.root = nn.Module()
        self.store = nn.Module()
        self.root.add_module(INITIALIZERS, self.store)
        self.values: dict[str, fx.Node] = {}
        self.untaken: dict[str, tuple[fx.Node, int]] = {}  # outputs of multi-output nodes, made on first use
        self.initializers: dict[str, tuple[str, Dequantize | None]] = {}  # attribute name → (initializer, transform)
        self.dequantized: set[str] = set()  # initializers whose codes were dequantized for their one reader
        self.host = host_shapes(graph)  # shape arithmetic that stays on the CPU wherever the model goes

    def build(self) -> LiftedModule:
        """Placeholders, every node that is not a folded quantize, outputs; then the graph's own
        parameter map. A model in QOperator format is refused first, naming its first such node."""
        qoperator = next((node for node in self.graph.nodes.values() if node.operation_type in QOPERATOR_OPS), None)
        if qoperator is not None:
            raise LiftError(f"cannot lift node {qoperator.name!r} ({qoperator.domain or 'ai.onnx'}::{qoperator.operation_type}): "
                            "a QOperator-format op computes in integers inside the op, with no float op to tune; quantize "
                            "the float model in QDQ format (QuantizeLinear/DequantizeLinear around float ops: "
                            "quantize_static(quant_format=QuantFormat.QDQ), or finetune quantize)")
        for name in self.graph.input_values:
            self.values[name] = self.fx_graph.placeholder(_identifier(name))
        for node in self.graph.nodes.values():
            if not is_folded_quantize(node, self.consumers[node.output_values[0]], self.graph_outputs):
                self._add(node)
        outputs = [self._value(name, None) for name in self.graph.output_values]
        self.fx_graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        module = LiftedModule(self.root, self.fx_graph)
        module.finetune_params = self._param_sources(module)
        return module

    def _add(self, node: OnnxNode) -> None:
        """Convert one node and call its module on the fx values of its inputs."""
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        opset = self.opsets.get(domain)
        where = f"node {node.name!r} ({domain or 'ai.onnx'}::{node.operation_type}, opset {opset})"
        if opset is None:
            raise LiftError(f"cannot lift {where}: the model does not import domain {domain!r}")
        try:
            module, args, kwargs, outputs = self._converted(node, domain, opset)
            name = self._module_name(node.name)
            self.root.add_module(name, module)
        except LiftError:
            raise
        except Exception as error:
            raise LiftError(f"cannot lift {where}: {error}") from error
        call = self.fx_graph.call_module(name, tuple(args), kwargs)
        call.meta[ONNX_NODE] = (node.name, tuple(outputs))
        if len(outputs) == 1:
            self.values[outputs[0]] = call
        else:
            self.untaken.update({output: (call, i) for i, output in enumerate(outputs) if output})

    def _converted(self, node: OnnxNode, domain: str, opset: int) -> tuple[nn.Module, list[Any], dict[str, Any], tuple[str, ...]]:
        """The node's module, its fx arguments (positional, by name) and the ONNX names of its outputs."""
        if is_control(node.proto):
            is_if = node.operation_type == "If"
            condition = constant_condition(self.proto, node.input_values[0], self._tensors(), opset) if is_if else None
            module, inputs = control_module(node.proto, lambda attribute: self._body(node, attribute), condition)
            return module, [self._value(value, None) for value in inputs], {}, node.output_values
        module, mapping = find_converter(domain, node.operation_type, opset)(node, self.graph)
        if node.name in self.host.nodes:
            module, args, kwargs = self._host_op(module, mapping.inputs)
        else:
            args = [self._value(value, _codes_transform(module, node, value, self.graph)) for value in mapping.inputs]
            args, kwargs = _split_optional(args, module)
        return module, args, kwargs, mapping.outputs

    def _body(self, node: OnnxNode, attribute: str) -> Body:
        """The lifted body of a control node's graph attribute, with the outer values it takes."""
        contained = self.shared.bodies[(node.name, attribute)]
        own = len(next(a.g for a in node.proto.attribute if a.name == attribute).input)
        return Body(_Builder(contained, self.shared).build(), tuple(v.name for v in contained.input[own:]))

    def _tensors(self) -> dict[str, onnx.TensorProto]:
        """The graph's initializers (its body's outer ones included) by name."""
        return {t.name: t for t in self.proto.initializer}

    def _host_op(self, module: nn.Module, inputs: tuple[str, ...]) -> tuple[nn.Module, list[Any], dict[str, Any]]:
        """A host region's op (see host_shapes): Shape returning a CPU tensor, any other holding its
        constant inputs itself; the graph passes the rest, omitted ones as None."""
        if isinstance(module, OnnxShape):
            return HostShape.of(module), [self._value(value, None) for value in inputs], {}
        constants = {i: to_torch(tensor_array(self.graph.initializers[value].proto, self.shared.folder))
                     for i, value in enumerate(inputs) if value in self.host.constants}
        return HostOp(module, constants), [self._value(v, None) for i, v in enumerate(inputs) if i not in constants], {}

    def _value(self, name: str, transform: Dequantize | None) -> fx.Node | None:
        """The fx node of an ONNX value (None for an omitted optional input)."""
        if not name:
            return None
        if name in self.untaken:
            call, index = self.untaken.pop(name)
            self.values[name] = self.fx_graph.call_function(getitem, (call, index))
        if name in self.values:
            if transform is not None or name in self.dequantized:
                raise LiftError(f"quantized initializer {name!r} has several consumers; only one DequantizeLinear may read it")
            return self.values[name]
        if name in self.graph.initializers:
            return self._initializer(name, transform)
        raise LiftError(f"value {name!r} is neither a graph input, an initializer nor a node output")

    def _initializer(self, name: str, transform: Dequantize | None) -> fx.Node:
        """A parameter (weights and biases) or buffer holding an initializer's value, dequantized
        when a lone DequantizeLinear reads integer or float8 codes; the same tensor wherever
        another graph of the model made it already."""
        value = self._made(name, transform)
        attribute = self._attribute_name(name)
        if isinstance(value, nn.Parameter):
            self.store.register_parameter(attribute, value)
        else:
            self.store.register_buffer(attribute, value)
        self.initializers[attribute] = (name, transform)
        if transform is not None:
            self.dequantized.add(name)
        self.values[name] = self.fx_graph.get_attr(f"{INITIALIZERS}.{attribute}")
        return self.values[name]

    def _made(self, name: str, transform: Dequantize | None) -> torch.Tensor:
        """The tensor of an initializer, made once per model."""
        if name in self.shared.made:
            value, previous = self.shared.made[name]
            if transform is not None or previous is not None:
                raise LiftError(f"quantized initializer {name!r} has several consumers; only one DequantizeLinear may read it")
            return value
        array = tensor_array(self.graph.initializers[name].proto, self.shared.folder)
        existing = self.shared.reuse.get(name)
        if transform is not None and existing is not None and transform.stands_for(existing, array):
            value = existing.detach()  # the float weight these codes quantize it to, not a dequantized copy
        else:
            value = transform.apply(array) if transform is not None else shared_or_made(existing, array)
        if transform is not None and array.size >= SLICE_ELEMENTS:  # its slices' temporaries, kept by glibc
            release_freed_host_memory(at_least=HEAP_SLACK)
        if name in self.shared.trainable and value.is_floating_point():
            value = nn.Parameter(value)
        self.shared.made[name] = (value, transform)
        return value

    def _param_sources(self, module: fx.GraphModule) -> dict[str, ParamSource]:
        """Each parameter's initializer and transform, with the quantizer and layers that read it."""
        sources = {}
        parameters = dict(self.store.named_parameters(recurse=False))
        for node in module.graph.nodes:
            attribute = node.target.split(".", 1)[1] if node.op == "get_attr" else None
            if attribute not in parameters:
                continue
            initializer, transform = self.initializers[attribute]
            quantizer, consumers = _readers(module, node)
            if quantizer is not None:
                module.get_submodule(quantizer).on_parameter = True
            sources[node.target] = ParamSource(initializer, quantizer, consumers, transform)
        return sources

    def _module_name(self, node_name: str) -> str:
        """The node name with `.` replaced by `/`, made unique among the root's attributes."""
        return _free_name(self.root, node_name.replace(".", "/"))

    def _attribute_name(self, initializer: str) -> str:
        """The initializer name with `.` replaced by `/`, made unique in the container."""
        return _free_name(self.store, initializer.replace(".", "/"))


def _merged_sources(root: LiftedModule) -> dict[str, ParamSource]:
    """The parameter map of the whole model, bodies included, by qualified name: a parameter that
    several graphs read (one initializer) is listed once, under its first name, with every
    graph's modules reading it as consumers."""
    local = {_joined(path, name): _prefixed(source, path) for path, owner in root.named_modules()
             if isinstance(owner, LiftedModule) for name, source in owner.finetune_params.items()}
    merged: dict[str, ParamSource] = {}
    first: dict[int, str] = {}
    for name, parameter in root.named_parameters(remove_duplicate=False):
        if name not in local:
            continue
        key = first.setdefault(id(parameter), name)
        if key == name:
            merged[name] = local[name]
        else:
            earlier = merged[key]
            merged[key] = dataclasses.replace(earlier, quantizer=earlier.quantizer or local[name].quantizer,
                                              consumers=earlier.consumers + local[name].consumers)
    return merged


def _joined(path: str, name: str) -> str:
    """A qualified name inside the module at `path` ("" is the root)."""
    return f"{path}.{name}" if path else name


def _prefixed(source: ParamSource, path: str) -> ParamSource:
    """A body's parameter source with its module names qualified from the root."""
    quantizer = None if source.quantizer is None else _joined(path, source.quantizer)
    return dataclasses.replace(source, quantizer=quantizer, consumers=tuple(_joined(path, c) for c in source.consumers))


def _free_name(owner: nn.Module, base: str) -> str:
    """`base`, or `base_1`, `base_2`, ... if `owner` already has that attribute (or method)."""
    name, suffix = base, 0
    while hasattr(owner, name):
        suffix += 1
        name = f"{base}_{suffix}"
    return name


def _codes_transform(module: nn.Module, node: OnnxNode, value: str, graph: OnnxGraph) -> Dequantize | None:
    """The dequantization of an initializer that a lone (Extended)DequantizeLinear reads as codes."""
    lone_dequantize = (
        isinstance(module, FakeQuantize)
        and node.operation_type in QUANTIZE_TO_DEQUANTIZE.values()
        and value == node.input_values[0]
        and value in graph.initializers
    )
    if not lone_dequantize:
        return None
    return Dequantize(graph.initializers[value].proto.data_type, module.spec, module.scale.clone(), module.zero_point.clone())


def _readers(module: fx.GraphModule, node: fx.Node) -> tuple[str | None, tuple[str, ...]]:
    """The fake-quant module reading a parameter's node (if any) and the modules using its value."""
    users = [u for u in node.users if u.op == "call_module"]
    quantizer = next((u for u in users if isinstance(module.get_submodule(u.target), FakeQuantize)), None)
    if quantizer is not None:
        users = [u for u in quantizer.users if u.op == "call_module"]
    return (None if quantizer is None else quantizer.target), tuple(dict.fromkeys(u.target for u in users))


def _split_optional(args: list[fx.Node | None], module: nn.Module) -> tuple[list[Any], dict[str, Any]]:
    """Positional arguments up to the first omitted input, the rest by the forward's parameter names."""
    if None not in args:
        return args, {}
    first = args.index(None)
    names = list(inspect.signature(module.forward).parameters)[first : len(args)]
    return args[:first], {n: a for n, a in zip(names, args[first:]) if a is not None}


def _freeze_unmapped_parameters(module: fx.GraphModule) -> None:
    """Turn parameters created inside onnx2torch modules (affine norms, PRelu slopes) into
    buffers, so every trainable parameter is one that export writes back."""
    frozen = []
    for owner_name, owner in module.named_modules():
        if owner_name.rsplit(".", 1)[-1] == INITIALIZERS:  # the model's container, or a body's
            continue
        for name, parameter in list(owner._parameters.items()):
            del owner._parameters[name]
            owner.register_buffer(name, None if parameter is None else parameter.detach())
            frozen.append(f"{owner_name}.{name}")
    if frozen:
        logger.info("kept %d parameter(s) of converted modules fixed (not exported): %s", len(frozen), frozen)


def _identifier(name: str) -> str:
    """A Python identifier for a graph input (fx makes it unique)."""
    cleaned = re.sub(r"\W", "_", name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"input_{cleaned}"
