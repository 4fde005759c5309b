"""The sections that rewrite a float graph before it is quantized: rotation (QuaRot-style, AMD
Quark's include_rotation; finetune.onnx.rotate), then SmoothQuant (AMD Quark's include_sq with
SmoothAlpha) or AWQ-style activation-aware scaling (finetune.quantize.smooth, finetune.quantize.awq);
a config takes one of the last two."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .schema import ConfigError, Section

SMOOTHABLE_OP_TYPES = ("MatMul", "Gemm", "Conv")
AWQ_OP_TYPES = ("MatMul", "Gemm")  # the search's loss reads the input's Gram matrix: exact for these, not for a Conv's patches
DEFAULT_ALPHA = 0.5  # Quark's SmoothAlpha default, and the SmoothQuant paper's
DEFAULT_GRID = 20  # alphas 0, 0.05, ..., 0.95, as the AWQ paper's search


def check_op_types(op_types: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    """A one-line ConfigError unless `op_types` names at least one op type, each of `allowed`."""
    if not op_types:
        raise ConfigError("op_types", f"name at least one of {', '.join(allowed)}")
    for i, op_type in enumerate(op_types):
        if op_type not in allowed:
            raise ConfigError(f"op_types[{i}]", f"must be one of {', '.join(allowed)}; got {op_type!r}")


@dataclass(frozen=True)
class SmoothQuant(Section):
    """Move activation range into the weights of the quantized MatMul / Gemm / Conv layers of
    `op_types`: s = max|X|^alpha / max|W|^(1 - alpha) per input channel, weights times s, inputs
    divided by s, folded into the producer where `fold` allows and that is exact, else by a Mul."""

    alpha: float = field(default=DEFAULT_ALPHA, metadata={"min": 0, "max": 1})
    op_types: tuple[str, ...] = SMOOTHABLE_OP_TYPES
    fold: bool = True

    def _check(self) -> None:
        if not math.isfinite(self.alpha):
            raise ConfigError("alpha", f"must be a number from 0 to 1; got {self.alpha!r}")
        check_op_types(self.op_types, SMOOTHABLE_OP_TYPES)


@dataclass(frozen=True)
class AWQ(Section):
    """Activation-aware weight scaling (AWQ, Lin et al. 2023) of the MatMul / Gemm layers of
    `op_types` whose weights are quantized: s = mean|X|^alpha per input channel (normalised), with
    alpha searched over `grid` values from 0 for the least output error of the weights' own format;
    rewritten as smooth_quant's, with `fold` likewise. Layers writing a model output (an LM head)
    only with `output_layers`: on SmolLM2 scaling its head lowered the logits' error but agreed
    less with the float model's next tokens."""

    grid: int = field(default=DEFAULT_GRID, metadata={"min": 2})
    op_types: tuple[str, ...] = AWQ_OP_TYPES
    fold: bool = True
    output_layers: bool = False  # off: a layer writing a model output (an LM head) is left alone (see the guide)

    def _check(self) -> None:
        check_op_types(self.op_types, AWQ_OP_TYPES)


@dataclass(frozen=True)
class Rotation(Section):
    """Rotate the residual stream of a decoder (from its token table to its LM head) by one
    orthogonal matrix folded into the weights, so that outlier channels of the activations the
    layers read are spread over all channels (QuaRot's R1): a randomised Hadamard matrix (`kind:
    hadamard`, where one of the stream's width is built here) or a random orthogonal one
    (`random`), drawn from `seed`. With `online`, the inputs of the layers writing into the stream
    from outside it (attention's output and the MLP's down projections) are rotated too, by Hadamard
    products inserted before them (float nodes: QuaRot's online Hadamard). With `heads`, each
    attention head's values too, by one matrix of the head's width folded into the value and output
    projections (QuaRot's R2). The float graph computes the same function."""

    kind: Literal["hadamard", "random"] = "hadamard"
    seed: int = 0
    online: bool = False
    heads: bool = False
