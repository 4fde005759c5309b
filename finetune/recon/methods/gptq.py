"""GPTQ as a method: each layer of a unit gets GPTQ's weights, layer after layer in graph order, from
the inputs it receives with the earlier layers already replaced (the solver: gptq_solver; how a layer
is laid out as a matrix: gptq_layouts). As the run's algorithm it is all the unit's tuning; with
gptq_init it is where AdaRound or AdaQuant start."""

from __future__ import annotations

import contextlib
import logging

import torch

from finetune.config import GPTQ as GPTQSettings
from finetune.config import FastFinetune
from finetune.formats.grids import FixedGrid, fixed_grid
from finetune.lift import FakeQuantize
from finetune.lift.fake_quant import quantizers_disabled

from ..units import Layer
from .base import Algorithm, Method, UnitWork
from .gptq_layouts import input_hessian, layout_of
from .gptq_solver import gptq_into

logger = logging.getLogger(__name__)


class GPTQ(Algorithm):
    """GPTQ as the run's algorithm: one pass per unit, no learning rate or iterations."""

    name = "gptq"
    optimises = False
    rounds = True

    def start(self, work: UnitWork) -> bool:
        quantize_unit(work, self.config.gptq, self.gptq_start)
        return True


class GPTQStart(Method):
    """gptq_init: AdaRound or AdaQuant start from GPTQ's weights (the ones the algorithm asks for)."""

    @classmethod
    def applies(cls, config: FastFinetune, algorithm: Algorithm) -> bool:
        return config.gptq_init

    def start(self, work: UnitWork) -> bool:
        quantize_unit(work, self.config.gptq, self.algorithm.gptq_start)
        return True


def quantize_unit(work: UnitWork, settings: GPTQSettings, weights: str) -> None:
    """Replace the weights of the unit's layers by GPTQ's, layer after layer in graph order, each
    from the inputs it receives from the unit's quantized inputs with the earlier layers already
    replaced; a layer GPTQ cannot treat keeps its weights, with a warning. `weights` says which:
    `compensated` (each column's values when its turn came, which round to GPTQ's: where AdaRound,
    which chooses between the two codes around its starting weights, starts) or `quantized` (on the
    grid). The chunks held out of training are not measured."""
    for layer in work.unit.layers:
        reason = _quantize_layer(layer, work, settings, weights)
        if reason is not None:
            work.warnings.add(work.unit.name, f"{layer.name}: not quantized by GPTQ (its weights round to nearest): {reason}")


def _quantize_layer(layer: Layer, work: UnitWork, settings: GPTQSettings, weights: str) -> str | None:
    """GPTQ's weights for one layer, written into its parameter; or why not (nothing changed)."""
    module = work.module
    quantizer = module.get_submodule(layer.weight_quantizer) if layer.weight_quantizer else None
    if not isinstance(quantizer, FakeQuantize) or not quantizer.enabled:
        return "its weight is not quantized"
    weight = module.get_parameter(layer.weight)
    op = module.get_submodule(layer.name)
    layout = layout_of(layer, op, weight.shape)
    if isinstance(layout, str):
        return layout

    def grid() -> FixedGrid:  # made once the Hessian is factored (the weight has not moved since)
        return fixed_grid(weight, quantizer.spec, quantizer.scale, quantizer.zero_point).laid_out(layout.to_matrix)

    # the passes stop at the layer: where its weight quantizer feeds it alone, that quantizer is the identity
    # meanwhile (at width 4096 its quantize-dequantize made ~250 MiB of temporaries per pass, read by no one)
    with quantizers_disabled(quantizer, keep_ranges=False) if _feeds_only(module, layer) else contextlib.nullcontext():
        held = [input_hessian(op, layout, work.data.train, work.data.inputs, work.fabric, work.held)]
    groups, columns = held[0].shape[0], held[0].shape[-1]
    matrix = layout.to_matrix(weight)
    if matrix.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():  # a reshape that had to copy
        return "its weight's strides give GPTQ no view of it to write through"
    gptq_into(matrix, held, grid, weights == "compensated", settings.perc_damp, settings.block_size,  # consumes the Hessian
              settings.act_order)
    logger.debug("GPTQ: %s, %d column(s) in %d group(s)", layer.name, columns, groups)
    return None


def _feeds_only(module: torch.nn.Module, layer: Layer) -> bool:
    """Whether the layer's weight quantizer feeds the layer's op alone, so the passes that measure the
    op's inputs (which stop at the op) need not quantize its weight."""
    users = [user for node in module.graph.nodes if node.op == "call_module" and node.target == layer.weight_quantizer
             for user in node.users]
    return bool(users) and all(user.op == "call_module" and user.target == layer.name for user in users)
