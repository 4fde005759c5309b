"""find_units: the units a run tunes, in graph order: layer units, or blocks of them, and a unit for
each control-flow node whose bodies hold layers."""

from __future__ import annotations

from torch import fx

from finetune.lift import LiftedModule
from finetune.lift.graph import constant_nodes
from finetune.notices import Subject, Warnings

from .blocks import blocks
from .bodies import with_bodies
from .layers import layer_units
from .residual import residual_blocks
from .unit import Unit


def find_units(
    module: LiftedModule, op_types: tuple[str, ...], include_output_quant: bool = False, unit: str = "layer",
    warnings: Warnings | None = None,
) -> list[Unit]:
    """The layer or block units of `module` in graph order. Layers that cannot be tuned (a weight
    other layers share, or one computed by other ops) are left out, and layers that cannot join a
    block stay layer units: each is a warning, added to `warnings` when given. A residual block
    (units.residual) gets its own copy of the shape arithmetic it reads, in `module`'s graph: the
    module computes the same values."""
    warnings = Warnings() if warnings is None else warnings
    if unit not in ("layer", "block"):
        raise ValueError(f"unit must be layer or block, got {unit!r}")
    if unit == "block" and include_output_quant:
        raise ValueError("include_output_quant applies to layer units only: a block ends where one value is live, and the "
                         "quantizers reading it belong to the next block")
    layers = layer_units(module, op_types, include_output_quant, warnings)
    constant = constant_nodes(module.graph)
    units = layers if unit == "layer" else _blocks(module, layers, constant, warnings)
    return with_bodies(module, units, constant, op_types, include_output_quant, warnings)  # the layers of If/Loop/Scan bodies


def _blocks(module: LiftedModule, layers: list[Unit], constant: set[fx.Node], warnings: Warnings) -> list[Unit]:
    """Blocks by the exporter's scopes, then by residual chains among the layers those leave alone;
    a warning for each layer that is still alone."""
    held = HeldWarnings()
    units = residual_blocks(module, blocks(module, layers, constant, held), constant)
    held.pass_on(warnings, {u.name for u in units if u.op_type != "block"})
    return units


class HeldWarnings(Warnings):
    """Warnings kept back, not logged: those of layers that scopes leave alone, which the residual
    chain may still take into blocks."""

    def add(self, name: str, reason: str, subject: Subject = "unit") -> None:
        """Keep the warning for pass_on."""
        self.append({"unit": name, "reason": reason, "subject": subject})

    def pass_on(self, warnings: Warnings, names: set[str]) -> None:
        """Give `warnings` those held about the units named."""
        for held in self:
            if held["unit"] in names:
                warnings.add(held["unit"], held["reason"], held["subject"])
