"""Layer units: one weight layer each (Conv, ConvTranspose, Gemm, MatMul with a constant weight and
the bias Add after such a MatMul; LSTM and GRU with their input and recurrent weights) with the
quantized input it reads, followed by its activation and optionally its output quantizer."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from finetune.lift import FakeQuantize, LiftedModule
from finetune.lift.graph import constant_nodes, parameter_behind
from finetune.lift.kinds import is_activation, is_add, layer_kind
from finetune.notices import Warnings
from finetune.onnx.layers import BIAS_INPUT, LAYER_OPS, RECURRENT_OPS

from .sides import SideInput, measured_outputs, recurrent_sides
from .unit import Layer, Unit

def layer_units(module: LiftedModule, op_types: tuple[str, ...], include_output_quant: bool, warnings: Warnings) -> list[Unit]:
    """The layer units of `module`'s own graph in graph order (not those inside control-flow bodies).
    Layers that cannot be tuned (a weight other layers share, or one computed by other ops) are left
    out, each with a warning."""
    constant = constant_nodes(module.graph)
    found = (_layer_unit(module, node, constant, op_types, include_output_quant, warnings) for node in module.graph.nodes)
    return [unit for unit in found if unit is not None]


def _layer_unit(
    module: LiftedModule, node: fx.Node, constant: set[fx.Node], op_types: tuple[str, ...], include_output_quant: bool,
    warnings: Warnings,
) -> Unit | None:
    """The unit of a weight layer node, or None when the node is not one (or shares its weight)."""
    if node.op != "call_module" or node in constant:
        return None
    op_type = layer_kind(module.get_submodule(node.target))
    if op_type is None or op_type not in op_types:
        return None
    sides = _recurrent_sides(node, module.get_submodule(node.target), constant, warnings) if op_type in RECURRENT_OPS else []
    if sides is None:
        return None
    last = BIAS_INPUT[op_type] + 1 if op_type in RECURRENT_OPS else len(node.args)  # the later ones are side inputs
    activations = [i for i, arg in enumerate(node.args[:last]) if isinstance(arg, fx.Node) and arg not in constant]
    weight_indices = _weight_indices(op_type, activations)
    if len(activations) != 1 or weight_indices is None:
        return None
    weights = [_layer_weight(module, node, index, constant, warnings) for index in weight_indices]
    if None in weights:
        return None
    if op_type == "MatMul":
        bias_add, bias = _bias_add(module, node, constant)
    else:
        bias_index = BIAS_INPUT[op_type]
        bias_add, bias = None, parameter_behind(module, node.args[bias_index] if len(node.args) > bias_index else None, constant)
    tail, outputs, last_float, items = _unit_end(module, bias_add or node, include_output_quant)
    layers = tuple(
        Layer(node.target, op_type, activations[0], weight, module.finetune_params[weight].quantizer, bias if k == 0 else None, index)
        for k, (index, weight) in enumerate(zip(weight_indices, weights))
    )
    return Unit(
        name=node.target, op_type=op_type, layers=layers, input=node.args[activations[0]].name, source=node.target,
        source_argument=activations[0], nodes=tuple(n.name for n in dict.fromkeys([node, bias_add or node, *tail])),
        outputs=tuple(n.name for n in outputs), target_module=last_float.target, side_inputs=tuple(sides), target_outputs=items,
        **_row_axes(module.get_submodule(node.target), items, op_type),
    )


def _unit_end(module: LiftedModule, layer: fx.Node,
              include_output_quant: bool) -> tuple[list[fx.Node], list[fx.Node], fx.Node, tuple[int, ...]]:
    """(the nodes after the layer node that join its unit, the unit's outputs, the last float op,
    which outputs of that op are the targets). A layer with several outputs (an LSTM's Y and final
    states) takes in the getitems reading them and is measured on each the model reads."""
    items, outputs, indices = measured_outputs(layer)
    if items:
        return items, outputs, layer, indices
    tail = _output_tail(module, layer, include_output_quant)
    last_float = next((n for n in reversed(tail) if not isinstance(module.get_submodule(n.target), FakeQuantize)), layer)
    return tail, [tail[-1] if tail else layer], last_float, ()


def _row_axes(layer: nn.Module, items: tuple[int, ...], op_type: str) -> dict[str, Any]:
    """The axes of a layer's input and of its outputs (numbered `items` where it returns several)
    where its training rows lie: the first of each, but for a recurrent layer, whose rows are whole
    sequences (time steps are not independent rows): X [T, B, I], Y [T, D, B, H] or a final
    state [D, B, H]; everything batch-first with layout 1."""
    if op_type not in RECURRENT_OPS or layer.layout:
        return {"input_axis": 0, "output_axes": (0,) * max(len(items), 1)}
    return {"input_axis": 1, "output_axes": tuple(2 if layer.returns[item] == 0 else 1 for item in items or (0,))}


def _weight_indices(op_type: str, activations: list[int]) -> tuple[int, ...] | None:
    """Which arguments hold the weights (onnx.layers.LAYER_OPS): those of the op that are not its one
    activation, which must be its first (the constant operand of a MatMul, read either way round)."""
    weights = tuple(i for i in LAYER_OPS[op_type].weights if i not in activations)
    if op_type == "MatMul":
        return weights if len(activations) == 1 and len(weights) == 1 else None
    return weights if activations == [0] else None


def _recurrent_sides(node: fx.Node, layer: nn.Module, constant: set[fx.Node], warnings: Warnings) -> list[SideInput] | None:
    """The side inputs of an LSTM or GRU (computed sequence lengths or initial states, each with its
    batch axis), or None, with a warning, where it reads a computed value without a batch (peepholes)."""
    sides, unbatched = recurrent_sides(node, BIAS_INPUT[layer_kind(layer)] + 1, layer.layout, constant)
    if unbatched:
        warnings.add(node.target, f"not tuned: besides its input it reads computed values without a batch axis "
                     f"({', '.join(unbatched)}), and a training batch cannot take its rows of them")
        return None
    return sides


def _layer_weight(module: LiftedModule, node: fx.Node, index: int, constant: set[fx.Node], warnings: Warnings) -> str | None:
    """The parameter behind the layer's weight argument `index`, or None (with a warning where it
    is computed or shared)."""
    weight = parameter_behind(module, node.args[index], constant)
    if weight is None:
        if node.args[index] in constant:
            warnings.add(node.target, "not tuned: ops other than quantize/dequantize compute its weight from the initializer "
                         "(a Transpose after a DequantizeLinear, say), so no initializer holds the weight to train")
        return None
    if len(module.finetune_params[weight].consumers) > 1:
        warnings.add(node.target, f"not tuned: its weight is shared with {module.finetune_params[weight].consumers}")
        return None
    return weight


def _bias_add(module: LiftedModule, matmul: fx.Node, constant: set[fx.Node]) -> tuple[fx.Node | None, str | None]:
    """(the Add, its bias parameter) when the MatMul's sole reader adds a constant vector that
    only it reads (a Linear layer's bias, as exporters write it), else (None, None)."""
    users = list(matmul.users)
    if len(users) != 1 or users[0].op != "call_module" or len(users[0].args) != 2:
        return None, None
    add = users[0]
    if not is_add(module.get_submodule(add.target)):
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
    for accepts in (is_activation, _is_fake_quantize)[: 2 if include_output_quant else 1]:
        users = list(current.users)
        if len(users) == 1 and users[0].op == "call_module" and accepts(module.get_submodule(users[0].target)):
            current = users[0]
            tail.append(current)
    return tail


def _is_fake_quantize(module: nn.Module) -> bool:
    """Whether the module is a quantizer (an output quantizer ends a layer's tail)."""
    return isinstance(module, FakeQuantize)

