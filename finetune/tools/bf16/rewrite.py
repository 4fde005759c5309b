"""The graph walk every bfloat16 format shares: a format (`Format`) says how weights are stored and
which form of a float tensor each use needs; `Rewriter` walks the graph once and inserts the
format's conversion nodes (built with `Chain`) right after each producer, once per tensor and form."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from finetune.formats import BF16
from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.fold import infer_types, tensor_types
from finetune.onnx.io import check_model
from finetune.onnx.normalize import default_opset
from finetune.onnx.qdq import make_qdq

from ..optimize import NameSource
from .numerics import Source
from .schemas import Schemas

# Forms of one float tensor: as stored in the original type, rounded to bfloat16 values but in
# the original type, or of type bfloat16.
SOURCE, ROUNDED, BFLOAT16 = "source", "rounded", "bf16"

# Ops whose output magnitude never exceeds the largest magnitude of their (already saturated)
# inputs, or is at most 1: their outputs need no Clip before a cast to bfloat16.
BOUNDED_OPS = frozenset({
    "Relu", "MaxPool", "GlobalMaxPool", "ReduceMax", "ReduceMin", "Max", "Min", "Abs", "Neg", "Reshape",
    "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather", "GatherElements", "GatherND", "Concat",
    "Split", "Identity", "Dropout", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "Sigmoid", "Tanh",
    "Softmax", "Erf", "Sin", "Cos", "HardSigmoid", "Sign",
})


@dataclasses.dataclass
class Tensor:
    """A float tensor of the source type: its native form, whether it is a (converted) weight and
    whether its values are already within the saturation bound."""

    name: str
    form: str
    weight: np.ndarray | None = None
    bounded: bool = False


class Format:
    """One conversion format: how weights are stored, which form each use needs, and the nodes
    that turn one form of a tensor into another. The traversal in `apply` is shared."""

    weight_form = SOURCE

    def __init__(self, source: Source) -> None:
        self.source = source

    def weight(self, array: np.ndarray) -> np.ndarray:
        """The weight as stored in the converted model (saturated to the bound)."""
        return np.clip(array, -self.source.bound, self.source.bound).astype(self.source.dtype)

    def need(self, bf16_position: bool) -> str | None:
        """The form a node input needs (None: whatever the tensor is)."""
        return ROUNDED if bf16_position else None

    def output_need(self) -> str | None:
        """The form a graph output needs."""
        return ROUNDED

    def output_form(self, schemas: Schemas, node: onnx.NodeProto, index: int, bf16_params: set[str], retyped: bool) -> str:
        """The form of a node's output."""
        return SOURCE

    def retype(self, schemas: Schemas, node: onnx.NodeProto) -> bool:
        """Switch attributes that name the source type to bfloat16; whether any was switched."""
        return False

    def convert(self, rewriter: Rewriter, tensor: Tensor, src: str, dst: str, form: str) -> list[onnx.NodeProto]:
        """Nodes (or initializers added to the rewriter) making `dst`, the `form` of the tensor, from `src`."""
        raise NotImplementedError

    def finish(self, model: onnx.ModelProto) -> None:
        """Last touches to the converted model."""

    def apply(self, model: onnx.ModelProto) -> None:
        """Convert the model in place."""
        Rewriter(model, self).run()
        self.finish(model)
        infer_types(model)
        model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(list(model.opset_import), True))
        check_model(model)


class Rewriter:
    """Walks the graph once: stores weights in their converted form, gives each node input the
    form its format needs (creating conversions right after the producer, once per tensor and
    form), and reroutes graph outputs so they carry the form the format wants."""

    def __init__(self, model: onnx.ModelProto, fmt: Format) -> None:
        self.graph, self.fmt = model.graph, fmt
        self.schemas = Schemas(default_opset(model))
        self.types = {name: t.elem_type for name, t in tensor_types(model).items()}
        self.names = NameSource(model)
        self.tensors: dict[str, Tensor] = {}
        self.versions: dict[tuple[str, str], str] = {}
        self.producer: dict[str, int] = {}
        self.after: dict[int | None, list[onnx.NodeProto]] = defaultdict(list)
        self.constants: dict[tuple[str, float], str] = {}

    def is_source(self, name: str) -> bool:
        """Whether a value is a float tensor of the source type."""
        return bool(name) and self.types.get(name) == self.fmt.source.elem_type

    def run(self) -> None:
        """Rewrite the graph in place."""
        self._weights()
        for info in self.graph.input:
            if self.is_source(info.name):
                self._register(Tensor(info.name, SOURCE), None)
        outputs = {o.name for o in self.graph.output}
        for index, node in enumerate(self.graph.node):
            bf16_params = self._inputs(node)
            retyped = self.fmt.retype(self.schemas, node)
            for j, name in enumerate(node.output):
                if self.is_source(name):
                    bounded = node.op_type in BOUNDED_OPS and node.domain in DEFAULT_DOMAINS
                    form = self.fmt.output_form(self.schemas, node, j, bf16_params, retyped)
                    self._register(Tensor(name, form, bounded=bounded), index)
                    if name in outputs:
                        self._reroute_output(node, j)
        nodes = list(self.after[None])
        for index, node in enumerate(self.graph.node):
            nodes += [node, *self.after[index]]
        del self.graph.node[:]
        self.graph.node.extend(nodes)

    def _weights(self) -> None:
        """Store every source-type initializer in the format's weight form."""
        for position, tensor in enumerate(self.graph.initializer):
            if not self.is_source(tensor.name):
                continue
            original = numpy_helper.to_array(tensor)
            self.graph.initializer[position].CopyFrom(numpy_helper.from_array(self.fmt.weight(original), tensor.name))
            self._register(Tensor(tensor.name, self.fmt.weight_form, original, bounded=True), None)

    def _register(self, tensor: Tensor, producer: int | None) -> None:
        self.tensors[tensor.name] = tensor
        self.versions[(tensor.name, tensor.form)] = tensor.name
        if producer is not None:
            self.producer[tensor.name] = producer

    def _inputs(self, node: onnx.NodeProto) -> set[str]:
        """Point each source-type input at the form it needs; the type parameters fed bfloat16."""
        bf16_params = set()
        for i, name in enumerate(node.input):
            if name not in self.tensors:
                continue
            tensor = self.tensors[name]
            form = self.fmt.need(self.schemas.allows_bf16(node, i)) or tensor.form
            node.input[i] = self.version(tensor, form)
            if form == BFLOAT16:
                bf16_params.add(self.schemas.type_str(node, i, True))
        return bf16_params

    def version(self, tensor: Tensor, form: str) -> str:
        """The name of the tensor in `form`, converting (once) from its native form."""
        key = (tensor.name, form)
        if key not in self.versions:
            src = self.versions[(tensor.name, tensor.form)]
            dst = self.names.take(f"{tensor.name}_{form}")
            self.after[self.producer.get(tensor.name)].extend(self.fmt.convert(self, tensor, src, dst, form))
            self.versions[key] = dst
        return self.versions[key]

    def _reroute_output(self, node: onnx.NodeProto, index: int) -> None:
        """Let the producer write a fresh name and make the graph output a converted version of it."""
        name = node.output[index]
        tensor = self.tensors[name]
        wanted = self.fmt.output_need()
        if wanted is None or wanted == tensor.form:
            return
        raw = self.names.take(f"{name}_{tensor.form}")
        node.output[index] = raw
        self.versions[(name, tensor.form)] = raw
        self.after[self.producer[name]].extend(self.fmt.convert(self, tensor, raw, name, wanted))
        self.versions[(name, wanted)] = name

    def constant(self, value: float, elem_type: int) -> str:
        """A scalar initializer of the given type, shared by every node that needs it."""
        key = (TensorProto.DataType.Name(elem_type), value)
        if key not in self.constants:
            name = self.names.take(f"bf16_saturation_{'max' if value > 0 else 'min'}_{key[0].lower()}")
            dtype = helper.tensor_dtype_to_np_dtype(elem_type)
            self.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype), name))
            self.constants[key] = name
        return self.constants[key]


class Chain:
    """A chain of conversion nodes from one tensor, each reading the previous output."""

    def __init__(self, rewriter: Rewriter, src: str) -> None:
        self.rewriter, self.current, self.nodes = rewriter, src, []
        self.stem = src

    def _add(self, op_type: str, extra_inputs: list[str], what: str, **attributes: int) -> None:
        out = self.rewriter.names.take(f"{self.stem}_{what}")
        name = self.rewriter.names.take(f"{self.stem}_{what}_{op_type.lower()}")
        self.nodes.append(helper.make_node(op_type, [self.current, *extra_inputs], [out], name=name, **attributes))
        self.current = out

    def saturate(self, bound: float, elem_type: int) -> None:
        """Clip to ±bound, in element type `elem_type`."""
        lo, hi = self.rewriter.constant(-bound, elem_type), self.rewriter.constant(bound, elem_type)
        self._add("Clip", [lo, hi], "saturated")

    def cast(self, to: int) -> None:
        """Cast to element type `to`."""
        self._add("Cast", [], TensorProto.DataType.Name(to).lower(), to=to)

    def qdq(self) -> None:
        """bfloat16 quantize-dequantize in the com.finetune domain (float32 output)."""
        out = self.rewriter.names.take(f"{self.stem}_bf16qdq")
        qdq = make_qdq(self.current, out, BF16, self.rewriter.names.take(f"{self.stem}_bf16"))
        self.rewriter.graph.initializer.extend(qdq.initializers)
        self.nodes.extend(qdq.nodes)
        self.current = out

    def ending_in(self, dst: str) -> list[onnx.NodeProto]:
        """The nodes, the last one writing `dst`."""
        self.nodes[-1].output[0] = dst
        return self.nodes
