"""The float reference a run tunes towards: the given float model, checked to be the one the quantized
model was made from, or the quantized model itself with its quantizers off; and the float values the
float model gives the weights and int32 biases stored as codes."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from finetune.lift import LiftedModule
from finetune.lift.graph import constant_nodes, parameter_behind
from finetune.notices import Warnings
from finetune.onnx.layers import BIAS_INPUT

from ..units import Layer, Unit

logger = logging.getLogger(__name__)

# How near a rounding tie (relative to the weight) a float weight may quantize to the code beside the
# stored one: another tool's arithmetic (dividing in float64, multiplying by 1/scale) rounds such
# weights the other way. onnxruntime's quantize_static and our own quantizer store exactly the codes
# the float weights quantize to (int8, uint8, int16, per tensor and per channel, on the digits CNN).
TIE = 2.0**-20
SELF_REFERENCE = "quantized model with quantizers disabled"


def choose_reference(module: LiftedModule, float_module: LiftedModule | None, units: list[Unit],
                     warnings: Warnings) -> LiftedModule:
    """The lifted float model (`float_module`), where every weight of the quantized model quantizes as the float model's
    does; else the QDQ module itself (run with its quantizers off), which computes the float function in
    the quantized model's own weights. A float model whose weights differ (the quantized model was
    equalised or smoothed first, as AMD Quark does to Conv pairs) is refused where those weights are
    stored as codes (their float values would be lost) and set aside with a warning where they are
    stored as float (they are the float weights). A weight stored as codes without a float model has
    its dequantized codes as reference, which is reported."""
    if float_module is not None:
        reference = float_module
        differing = [layer.name for layer, parameter, value, coded in float_values(module, reference, units)
                     if parameter == layer.weight and differs(module, layer, value, warnings, coded)]
        if not differing:
            logger.info("float reference: the given float model")
            return reference
        warnings.add("float model", f"the weights of {len(differing)} layer(s), first {differing[0]}, do not quantize "
                     "as the quantized model's float weights do (its batch norms were folded, or it was equalised or smoothed, "
                     "before quantizing): the "
                     "float model is set aside and tuning goes towards the quantized model's own float weights, which "
                     "compute the same function", "model")
        codes_values(module, reference)
    weights = [module.finetune_params[layer.weight] for unit in units for layer in unit.layers]
    coded = sorted(source.initializer for source in weights if source.transform is not None)
    logger.info("float reference: the %s", SELF_REFERENCE)
    for name in coded:
        warnings.add(name, "stored as quantized codes and no float model was given: its float reference is the dequantized "
                     "codes (pass the float model, --float-model, to tune towards the real float weights)", "tensor")
    return module


def codes_values(module: LiftedModule, float_module: LiftedModule) -> None:
    """Give each weight of codes that was lifted into the float model's weight (lift_model's reuse)
    the codes' dequantized values again: a model that is its own reference computes the float function
    in its own (dequantized) weights, and tuning starts from them."""
    floats = {tensor.untyped_storage().data_ptr() for tensor in float_module.parameters()}
    with torch.no_grad():
        for name, source in module.finetune_params.items():
            parameter = module.get_parameter(name)
            if source.transform is not None and parameter.untyped_storage().data_ptr() in floats:
                parameter.data = source.transform.apply(source.transform.encode(parameter)).to(parameter.dtype)


def float_values(module: LiftedModule, reference: LiftedModule,
                 units: list[Unit]) -> Iterator[tuple[Layer, str, torch.Tensor, bool]]:
    """(layer, parameter, the float model's value, whether the quantized model stores it as codes) for
    each layer's weight, and its bias where stored as codes, that the float model holds in the same
    shape (found by layer name and input position)."""
    layers = {n.target: n for n in reference.graph.nodes if n.op == "call_module"}
    constant = constant_nodes(reference.graph)
    for layer in (layer for unit in units for layer in unit.layers):
        if layer.name not in layers:
            continue
        bias = [(layer.bias, BIAS_INPUT[layer.op_type])] if layer.bias and layer.op_type in BIAS_INPUT else []
        for parameter, index in [(layer.weight, layer.weight_index), *bias]:
            coded = module.finetune_params[parameter].transform is not None
            if not (coded or parameter == layer.weight):
                continue
            node = layers[layer.name]
            name = parameter_behind(reference, node.args[index] if index < len(node.args) else None, constant)
            value = None if name is None else reference.get_parameter(name).detach()
            if value is not None and value.shape == module.get_parameter(parameter).shape:
                yield layer, parameter, value, coded


def float_starts(module: LiftedModule, reference: LiftedModule, units: list[Unit]) -> dict[str, torch.Tensor]:
    """The float model's values of the weights stored as codes, so the optimisation starts from the real
    float values; and of the biases behind int32 codes, which bias correction's float pass reads
    (training keeps the codes)."""
    starts = {parameter: value for _, parameter, value, coded in float_values(module, reference, units) if coded}
    if starts:
        logger.info("%d unit(s) stored as codes start from the float model's weights", len(starts))
    return starts


def differs(module: LiftedModule, layer: Layer, value: torch.Tensor, warnings: Warnings, coded: bool) -> bool:
    """Whether the float model's weight `value` quantizes to other codes than the quantized model's
    weight: its targets would belong to another model (input smoothing written as a Mul, as NNCF's
    SmoothQuant, is carried into the float model before, see carry_smoothing). Where the weight is
    stored as codes that is an error (the float values are nowhere else). Only a weight within TIE of
    a rounding tie may have the code beside its own; for stored codes those are counted per layer in a
    warning (training starts from the float weights, so they may round either way)."""
    stored = module.get_parameter(layer.weight)
    if layer.weight_quantizer is None or _same_tensor(stored, value):
        return False  # lift_model reused the float weight: it quantizes to the codes (Dequantize.stands_for)
    quantizer = module.get_submodule(layer.weight_quantizer)
    with torch.no_grad():
        value = value.to(stored.device)
        ours, theirs = quantizer(value), quantizer(stored)
        differ = ours != theirs
        ties = differ & ((2 * value - ours - theirs).abs() <= 2 * TIE * value.abs())
    count, total, away = int(differ.sum()), differ.numel(), int(differ.sum()) - int(ties.sum())
    if away and coded:
        raise ValueError(f"the float model's weight of {layer.name} does not quantize to the codes the quantized model stores "
                         f"({away} of {total} differ away from rounding ties): pass the float model it was quantized from "
                         "(for a model quantized with fold_batch_norm, cross_layer_equalization, rotation or smooth_quant, "
                         "the folded, equalised, rotated or smoothed one: QuantizeResult.float_model, or the <output>.float.onnx that "
                         "finetune quantize writes beside codes), or, where the quantizer changed "
                         "the weights itself (AMD Quark equalises Conv pairs), tune without a float model")
    if count and not away and coded:
        warnings.add(layer.name, f"{count} of {total} weight codes ({count / total:.3%}) differ from those the float model's "
                     "weight quantizes to, each at a rounding tie (another tool's arithmetic); tuning starts from the float "
                     "weights")
    return bool(away)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are one view of the same memory (equal without reading them)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())
