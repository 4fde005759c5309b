"""What a reconstruction unit is: its layers (each weight layer with its parameters and quantizer),
its input and outputs in the lifted graph, and the tensors tuning it may change."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.lift import LiftedModule

from .sides import SideInput


@dataclass(frozen=True)
class Layer:
    """One weight layer: its module (the ONNX node's name), which argument is its activation and
    which its weight, and the trainable parameters behind its weight (with the weight's quantizer
    module) and bias. A recurrent layer is two: its input weight W with the bias, and R."""

    name: str
    op_type: str
    input_index: int
    weight: str
    weight_quantizer: str | None
    bias: str | None
    weight_index: int = 1


@dataclass(frozen=True)
class Unit:
    """One reconstruction unit. Names are fx node names (`input`, `nodes`, `outputs`) and module
    names (`target_module`: the last float op, whose outputs are the float targets). The float
    counterpart of `input` is argument `source_argument` of module `source`, or its output when
    that is None ("" is the whole model). A layer unit's input is its input quantizer's output, so
    QDrop mixes quantized and float values; a block's is the value live where the block starts.
    A unit whose last node returns several values the model reads (an LSTM's Y and final states,
    an If's probability and state) is measured on all of them (see recon.data.rows.join_rows)."""

    name: str
    op_type: str  # the layer's, or "block"
    layers: tuple[Layer, ...]
    input: str
    source: str
    source_argument: int | None
    nodes: tuple[str, ...]
    outputs: tuple[str, ...]
    target_module: str
    side_inputs: tuple[SideInput, ...] = ()  # computed values it reads besides `input` (units.sides)
    target_outputs: tuple[int, ...] = ()  # which outputs of `target_module` are the float targets, when it returns several
    input_axis: int = 0  # the axis of the input holding a training row (a recurrent layer's batch)
    output_axes: tuple[int | None, ...] = (0,)  # the same for each output; None: found from the values when tuning
    scales: tuple[str, ...] = ()  # quantizer buffers (scale, zero point) learned with the weights (see recon.methods.scales)
    # a module of the unit reading its input as positional argument k: where the float model names the input's
    # producer otherwise (a token table gathered by another op), its input is taken there (recon.data.streams)
    source_reader: tuple[str, int] | None = None


def parameters_of(unit: Unit) -> list[str]:
    """The names of the tensors tuning `unit` may change: its layers' weights and biases, and the
    quantizer scales and zero points it learns (buffers: read them with tuned_tensor)."""
    return [name for layer in unit.layers for name in (layer.weight, layer.bias) if name] + list(unit.scales)


def tuned_tensor(module: LiftedModule, name: str) -> torch.Tensor:
    """The parameter or quantizer buffer of that name (one of parameters_of)."""
    return module.get_parameter(name) if name in module.finetune_params else module.get_buffer(name)
