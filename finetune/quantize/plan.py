"""The quantization plan: which input of which node gets which format (one Use each, with its
role, per-channel and block axes, the producer's format under dual quant and int32 bias
granularity), and the opset the planned quantize-dequantize nodes need."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import onnx

from finetune.config import FormatChoice, QuantConfig
from finetune.formats import FormatSpec, IntSpec
from finetune.notices import Notice, warn
from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.layers import BIAS_INPUT, LAYER_OPS, RECURRENT_OPS, weight_axes
from finetune.onnx.graphs import all_graphs, all_nodes
from finetune.onnx.normalize import default_opset, normalize_model
from finetune.onnx.qdq import STANDARD_QDQ_OPSET, uses_standard_ops

logger = logging.getLogger(__name__)

QUANTIZABLE_ELEMENT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
UNTYPED = "stays float: its element type is unknown (onnx's shape inference could not infer it, as for outputs of custom-domain ops)"
TABLE_OP = "Gather"  # its data input, a constant [rows, width] table read along axis 0, is quantized as a weight
PER_CHANNEL_OPSET = 13
FP8_OPSET = 19


@dataclass(frozen=True)
class Use:
    """One quantized input of one node: which tensor, its role, and the format it gets there."""

    node: str
    index: int
    tensor: str
    role: str  # activation | weight | bias
    choice: FormatChoice | str  # "int32" for a bias whose scale is s_input * s_weight
    spec: FormatSpec
    before: Use | None = None  # dual quant: the producer's format, applied to the tensor first

    @property
    def key(self) -> tuple:
        """Identifies the quantize-dequantize chain this input reads: tensor and formats in order."""
        return (self.tensor, self.spec) if self.before is None else (self.tensor, self.before.spec, self.spec)


def plan(model: onnx.ModelProto, config: QuantConfig, notices: list[Notice]) -> list[Use]:
    """Every quantized input of every selected node (inside If/Loop/Scan bodies too), in graph
    order, with its concrete format; an input the config quantizes but whose element type onnx
    could not infer stays float, and is added to `notices` (WARNING). An LSTM or GRU bias the
    config makes int32 stays float: its sum also holds the unquantized recurrent products."""
    initializers = {t.name: t for graph in all_graphs(model.graph) for t in graph.initializer}
    types, ranks = tensor_types_and_ranks(model)
    producers = {output: node for node in all_nodes(model.graph) for output in node.output}
    uses: list[Use] = []
    untyped, float_tables = [], []
    for node in all_nodes(model.graph):
        if node.domain not in DEFAULT_DOMAINS:
            continue
        formats = config.node_formats(node.name, node.op_type)
        if formats is None:
            continue
        problem = _table_problem(node, initializers, types, ranks)
        if problem:
            float_tables.append(Notice("node", node.name, problem))
            continue
        node_uses = []
        for index, role in _input_roles(node, initializers):
            tensor = node.input[index]
            choice = config.tensor_overrides.get(tensor, getattr(formats, role))
            if choice is None:
                continue
            if types.get(tensor) not in QUANTIZABLE_ELEMENT_TYPES:
                if not types.get(tensor):  # unknown (or UNDEFINED); a known integer or bool input is simply not quantized
                    untyped.append(Notice("tensor", tensor, UNTYPED))
                continue
            if choice == "int32" and node.op_type in RECURRENT_OPS:
                logger.info("%s: bias %s stays float (an int32 bias needs one input scale; the recurrent state has none)",
                            node.name, tensor)
                continue
            if choice == "int32":
                node_uses.append(Use(node.name, index, tensor, role, choice, IntSpec("int32")))
                continue
            rank = ranks.get(tensor)
            output_axis, input_axis = _axes(node, index, rank)
            spec = choice.spec(rank, output_axis, input_axis)
            before = _producer_format(tensor, spec, producers, config, ranks) if config.dual_quant else None
            node_uses.append(Use(node.name, index, tensor, role, choice, spec, before))
        uses.extend(_int32_bias_axes(node_uses))
    warn(logger, notices, [*untyped, *float_tables])
    logger.info("planned %d quantized inputs on %d nodes", len(uses), len({u.node for u in uses}))
    return uses


def _producer_format(
    tensor: str, spec: FormatSpec, producers: dict[str, onnx.NodeProto], config: QuantConfig, ranks: dict[str, int]
) -> Use | None:
    """The producing node's activation format on `tensor` when it differs from the consumer's
    (DualQuantNodes), as a Use that rewires nothing (index -1); None otherwise."""
    producer = producers.get(tensor)
    formats = None if producer is None else config.node_formats(producer.name, producer.op_type)
    choice = None if formats is None else config.tensor_overrides.get(tensor, formats.activation)
    if choice is None:
        return None
    rank = ranks.get(tensor)
    produced = choice.spec(rank, None, 1 if rank is None or rank > 1 else 0)
    return None if produced == spec else Use(producer.name, -1, tensor, "activation", choice, produced)


def _table_problem(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], types: dict[str, int],
                   ranks: dict[str, int]) -> str | None:
    """Why a Gather's constant float table cannot be quantized as a weight (None: it can, or it is no
    such Gather; computed data is an activation, quantized as any other): only a [rows, width] table
    read along axis 0 has rows (tokens) to scale per channel and a width to block."""
    data = node.input[0]
    if node.op_type != TABLE_OP or data not in initializers or types.get(data) not in QUANTIZABLE_ELEMENT_TYPES:
        return None
    axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    if ranks.get(data) != 2 or axis != 0:
        return (f"stays float: its table {data} has rank {ranks.get(data)} and is read along axis {axis}; only a "
                f"[rows, width] table read along axis 0 is quantized")
    return None


def _input_roles(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> list[tuple[int, str]]:
    """(input index, role) of the inputs a quantized node's config applies to (the float ones
    among them are quantized): constant weights and biases of Conv/ConvTranspose/Gemm, constant
    MatMul operands, activations otherwise. An LSTM or GRU quantizes X, W and R and its constant
    bias B only: its sequence lengths, initial states and peepholes stay as they are."""
    roles = []
    for index, name in enumerate(node.input):
        if not name or (node.op_type in RECURRENT_OPS and index > BIAS_INPUT[node.op_type]):
            continue
        constant = name in initializers
        if BIAS_INPUT.get(node.op_type) == index:
            if constant:
                roles.append((index, "bias"))
        else:
            roles.append((index, "weight" if constant else "activation"))
    return roles


def _axes(node: onnx.NodeProto, index: int, rank: int | None) -> tuple[int | None, int | None]:
    """(output-channel axis, reduction axis) of a node's input, for per-channel scales and blocks: a
    weight's (onnx.layers.weight_axes; a Gather's table: rows, width), or an activation's channels
    (none for Gemm's A, read along its columns or with transA its rows, nor for a recurrent layer's X, reduced along its last axis)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    layer = LAYER_OPS.get(node.op_type)
    if node.op_type == TABLE_OP and index == 0:  # one scale per row (token), blocks along the width
        return 0, 1
    if layer is not None and index in layer.weights:
        return weight_axes(node.op_type, index, bool(attrs.get("transB", 0)))
    if node.op_type in ("Conv", "ConvTranspose"):
        return layer.channel_axis, layer.channel_axis
    if node.op_type == "Gemm" and index == 0:
        return (None, 0) if attrs.get("transA", 0) else (None, 1)
    if node.op_type in RECURRENT_OPS:  # X [T, B, I] or [B, T, I]
        return None, -1
    return (None, 1 if rank is None or rank > 1 else 0)


def _int32_bias_axes(uses: list[Use]) -> list[Use]:
    """An int32 bias follows its weight's granularity: per channel when the weight is."""
    weight = next((u for u in uses if u.role == "weight"), None)
    per_channel = weight is not None and isinstance(weight.spec, IntSpec) and weight.spec.axis is not None
    return [
        dataclasses.replace(u, spec=IntSpec("int32", axis=0 if per_channel else None)) if u.choice == "int32" else u
        for u in uses
    ]


def tensor_types_and_ranks(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """Element type and rank of every value the (shape-inferred) graph and its subgraphs know."""
    types, ranks = {}, {}
    for graph in all_graphs(model.graph):
        for info in [*graph.input, *graph.output, *graph.value_info]:
            tensor_type = info.type.tensor_type
            if info.name in types and not tensor_type.elem_type:
                continue  # a subgraph's untyped output naming an outer value keeps the outer type
            types[info.name] = tensor_type.elem_type
            if tensor_type.HasField("shape"):
                ranks[info.name] = len(tensor_type.shape.dim)
        for tensor in graph.initializer:
            types[tensor.name], ranks[tensor.name] = tensor.data_type, len(tensor.dims)
    return types, ranks


def with_producer_formats(uses: list[Use]) -> list[Use]:
    """The uses and, before each, the producer-format use it reads through (dual quant)."""
    return [step for use in uses for step in ((use.before, use) if use.before else (use,))]


def upgrade_opset(model: onnx.ModelProto, uses: list[Use], changes: list[str], notices: list[Notice]) -> onnx.ModelProto:
    """Raise the opset to what the planned quantize-dequantize nodes need (`opset_for`), in place (the
    caller's own copy: a copy would hold the weights twice); whether the version converter managed it is
    for the caller to check (checks.check_opset)."""
    needed = max((opset_for(u.spec) for u in with_producer_formats(uses)), default=PER_CHANNEL_OPSET)
    if (default_opset(model) or 0) >= needed:
        return model
    upgraded, more = normalize_model(model, min_opset=needed, notices=notices, in_place=True)
    changes.extend(more)
    return upgraded


def opset_for(spec: FormatSpec) -> int:
    """The default-domain opset a format's quantize-dequantize nodes need: 13 per channel (and
    for our functions' bodies), 19 FP8, 21 for int4/int16 and blocked scales."""
    if not uses_standard_ops(spec):
        return PER_CHANNEL_OPSET
    if spec.dtype in ("int4", "uint4", "int16", "uint16") or getattr(spec, "block_size", None):
        return STANDARD_QDQ_OPSET
    return FP8_OPSET if spec.dtype.startswith("float8") else PER_CHANNEL_OPSET
