"""Reconstruction units of a lifted module: one weight layer (Conv, ConvTranspose, Gemm, MatMul
with a constant weight, and the bias Add after such a MatMul) with the quantized input it reads,
followed by its activation and optionally its output quantizer, in graph order."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from onnx2torch.node_converters.activations import OnnxHardSigmoid
from onnx2torch.node_converters.binary_math_operations import OnnxBinaryMathOperation
from onnx2torch.node_converters.clip import OnnxClip
from onnx2torch.node_converters.gemm import OnnxGemm
from onnx2torch.node_converters.matmul import OnnxMatMul
from torch import fx, nn

from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.converters import Conv, ConvTranspose, Gelu

logger = logging.getLogger(__name__)

LAYER_TYPES: dict[type, str] = {Conv: "Conv", ConvTranspose: "ConvTranspose", OnnxGemm: "Gemm", OnnxMatMul: "MatMul"}
ACTIVATION_TYPES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softsign,
    nn.Hardswish, nn.Hardtanh, OnnxHardSigmoid, OnnxClip, Gelu,
)
BIAS_INDEX = 2  # Conv, ConvTranspose and Gemm take their bias as the third input


class UnsupportedUnit(NotImplementedError, ValueError):
    """A unit kind not implemented yet (a ValueError too, so the command line reports it in one line)."""


@dataclass(frozen=True)
class Unit:
    """One reconstruction unit. Names are fx node names (`input`, `nodes`, `output`) and module
    names (`layer`, `target_module`: the last float op, whose output is the float target); the
    unit's input is its input quantizer's output, so QDrop mixes quantized and float values."""

    layer: str
    op_type: str
    input: str
    input_index: int
    nodes: tuple[str, ...]
    output: str
    target_module: str
    weight: str
    weight_quantizer: str | None
    bias: str | None


def find_units(
    module: LiftedModule, op_types: tuple[str, ...], include_output_quant: bool = False, unit: str = "layer"
) -> list[Unit]:
    """The layer units of `module` in graph order; layers whose weight other layers share are
    left out (tuning one would change the others), with a warning naming them."""
    if unit == "block":
        raise UnsupportedUnit("unit: block (reconstructing several layers at once) is not implemented yet; it is planned "
                              "in a later issue; use unit: layer")
    if unit != "layer":
        raise ValueError(f"unit must be layer or block, got {unit!r}")
    constant = constant_nodes(module.graph)
    units = []
    for node in module.graph.nodes:
        found = _layer_unit(module, node, constant, op_types, include_output_quant)
        if found is not None:
            units.append(found)
    return units


def constant_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value does not depend on a graph input: initializers and what is computed from
    them alone (weights behind their quantizers)."""
    constant: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or (node.op in ("call_module", "call_function", "call_method") and inputs and all(i in constant for i in inputs)):
            constant.add(node)
    return constant


def _layer_unit(
    module: LiftedModule, node: fx.Node, constant: set[fx.Node], op_types: tuple[str, ...], include_output_quant: bool
) -> Unit | None:
    """The unit of a weight layer node, or None when the node is not one (or shares its weight)."""
    if node.op != "call_module" or node in constant:
        return None
    op_type = LAYER_TYPES.get(type(module.get_submodule(node.target)))
    if op_type is None or op_type not in op_types:
        return None
    activations = [i for i, arg in enumerate(node.args) if isinstance(arg, fx.Node) and arg not in constant]
    weight_index = _weight_index(op_type, activations)
    if len(activations) != 1 or weight_index is None:
        return None
    weight = parameter_behind(module, node.args[weight_index], constant)
    if weight is None:
        return None
    if len(module.finetune_params[weight].consumers) > 1:
        logger.warning("%s is not tuned: its weight is shared with %s", node.target, module.finetune_params[weight].consumers)
        return None
    if op_type == "MatMul":
        bias_add, bias = _bias_add(module, node, constant)
    else:
        bias_add, bias = None, parameter_behind(module, node.args[BIAS_INDEX] if len(node.args) > BIAS_INDEX else None, constant)
    tail = ([bias_add] if bias_add is not None else []) + _output_tail(module, bias_add or node, include_output_quant)
    last_float = next((n for n in reversed(tail) if not isinstance(module.get_submodule(n.target), FakeQuantize)), node)
    return Unit(
        layer=node.target, op_type=op_type, input=node.args[activations[0]].name, input_index=activations[0],
        nodes=tuple(n.name for n in [node, *tail]), output=(tail[-1] if tail else node).name,
        target_module=last_float.target, weight=weight, weight_quantizer=module.finetune_params[weight].quantizer,
        bias=bias,
    )


def _weight_index(op_type: str, activations: list[int]) -> int | None:
    """Which argument holds the weight: the second of Conv/ConvTranspose/Gemm (whose activation
    must be the first), the constant operand of MatMul."""
    if op_type == "MatMul":
        return {(0,): 1, (1,): 0}.get(tuple(activations))
    return 1 if activations == [0] else None


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


def _bias_add(module: LiftedModule, matmul: fx.Node, constant: set[fx.Node]) -> tuple[fx.Node | None, str | None]:
    """(the Add, its bias parameter) when the MatMul's sole reader adds a constant vector that
    only it reads (a Linear layer's bias, as exporters write it), else (None, None)."""
    users = list(matmul.users)
    if len(users) != 1 or users[0].op != "call_module" or len(users[0].args) != 2:
        return None, None
    add = users[0]
    operation = module.get_submodule(add.target)
    if not isinstance(operation, OnnxBinaryMathOperation) or operation.math_op_function is not torch.add:
        return None, None
    other = add.args[0] if add.args[1] is matmul else add.args[1]
    bias = parameter_behind(module, other if isinstance(other, fx.Node) else None, constant)
    if bias is None or len(module.finetune_params[bias].consumers) > 1 or module.get_parameter(bias).dim() != 1:
        return None, None
    return add, bias


def _output_tail(module: LiftedModule, layer: fx.Node, include_output_quant: bool) -> list[fx.Node]:
    """The layer's activation (so the loss ignores what the activation discards, as AdaRound's
    paper does) and, when asked, then its output quantizer; each taken only when it is the sole
    reader of the value before it."""
    tail: list[fx.Node] = []
    current = layer
    for kinds in (ACTIVATION_TYPES, (FakeQuantize,))[: 2 if include_output_quant else 1]:
        users = list(current.users)
        if len(users) == 1 and users[0].op == "call_module" and isinstance(module.get_submodule(users[0].target), kinds):
            current = users[0]
            tail.append(current)
    return tail
