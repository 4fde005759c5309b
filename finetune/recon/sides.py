"""Side inputs of a unit: computed values it reads besides its main input (the one QDrop mixes and
whose rows are the training rows), such as an LSTM's initial states, an If's condition or a Loop's
trip count. A training batch takes the same rows of each side input along that input's own batch
axis (an initial state [D, B, H]: axis 1), and a side input without one that is the same in every
calibration batch (a sample rate, a trip count) is passed as it is; side inputs take the quantized
model's values, unmixed. Also where a unit's outputs lie when its node has several."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from lightning.fabric import Fabric
from torch import fx, nn

from .cache import CachedValue
from .parallel import sum_across

# The inputs of an LSTM or GRU after its bias (torch argument names of the lifted module), and the
# axis of each holding the batch in layout 0 and in layout 1; None: it has no batch (peepholes).
RECURRENT_SIDES = {"sequence_lens": (0, 0), "initial_h": (1, 0), "initial_c": (1, 0), "p": (None, None)}


@dataclass(frozen=True)
class SideInput:
    """A computed value a unit reads besides its main input, by fx name, with the axis holding its
    rows where the op defines it (None: found from the values when tuning)."""

    name: str
    axis: int | None = None


def recurrent_sides(node: fx.Node, first_side: int, layout: int, constant: set[fx.Node]) -> tuple[list[SideInput], list[str]]:
    """The computed inputs of an LSTM or GRU node from argument `first_side` on (positional or by
    keyword) as side inputs with their batch axes, and the names of those without a batch axis."""
    named = {**dict(zip(RECURRENT_SIDES, node.args[first_side:])), **node.kwargs}
    sides, unbatched = [], []
    for name, value in named.items():
        if isinstance(value, fx.Node) and value not in constant:
            axis = RECURRENT_SIDES.get(name, (None, None))[layout]
            if axis is None:
                unbatched.append(value.name)
            else:
                sides.append(SideInput(value.name, axis))
    return sides, unbatched


def measured_output(node: fx.Node) -> tuple[list[fx.Node], fx.Node, int | None]:
    """(the getitems taking apart the outputs of a node with several, the value a unit ending at the
    node is measured on, which of its outputs that is): the first output read, or the node itself."""
    items = [user for user in node.users if user.op == "call_function" and len(user.args) == 2 and user.args[0] is node]
    items.sort(key=lambda item: item.args[1])
    return (items, items[0], items[0].args[1]) if items else ([], node, None)


# --- while tuning -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitInputs:
    """A unit's inputs over the calibration set: its main input, then its side inputs in the unit's
    order; those `gathered` are viewed rows first and a batch takes its rows of each, the others
    are passed as they are (the same in every calibration batch)."""

    values: tuple[CachedValue, ...]
    gathered: tuple[bool, ...]

    @property
    def main(self) -> CachedValue:
        """The main input (rows first)."""
        return self.values[0]

    @property
    def rowed(self) -> list[CachedValue]:
        """The inputs a batch takes rows of, the main input first."""
        return [value for value, gathered in zip(self.values, self.gathered) if gathered]

    def chunk(self, chunk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Every input's values of one calibration batch, on `device`."""
        return tuple(value.tensor(chunk, device) for value in self.values)


class RowsFirst(nn.Module):
    """A unit's module fed and read with its rows first: each input's rows go to the axis where the
    unit holds its batch (None: an input passed as it is) on the way in, and the output's come back first."""

    def __init__(self, train: nn.Module, input_axes: Sequence[int | None], output_axis: int) -> None:
        super().__init__()
        self.train_module, self.input_axes, self.output_axis = train, tuple(input_axes), output_axis

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        moved = (x if axis is None else x.movedim(0, axis) for x, axis in zip(inputs, self.input_axes))
        first, *rest = self.train_module(*moved)
        return (first.movedim(self.output_axis, 0), *rest)


@dataclass(frozen=True)
class UnitData:
    """What a unit is measured and trained on, rows first: its module, its inputs, its float main
    input and its float targets; `problem` says why it cannot be trained (None: it can)."""

    train: nn.Module
    inputs: UnitInputs
    float_inputs: CachedValue
    targets: CachedValue
    problem: str | None


def unit_data(train: nn.Module, row_axes: tuple[int, int], inputs: CachedValue, float_inputs: CachedValue,
              targets: CachedValue, sides: Sequence[tuple[SideInput, CachedValue]], fabric: Fabric) -> UnitData:
    """A unit's values viewed rows first (the main input's and target's rows along `row_axes`, each
    side input's along its own axis), with its module wrapped to move them back; a side input
    that has no such axis and differs between calibration batches is a problem (then side inputs
    are all passed as they are, so the loss can still be measured)."""
    rows = [np.shape(chunk)[row_axes[0]] for chunk in inputs.chunks]
    found = [side_axis(side, value, rows) for side, value in sides]
    disagreement = _disagreement(fabric, found, sides)  # first: every process takes part in its all-reduce
    problem = next((axis for axis in found if isinstance(axis, str)), None) or disagreement
    axes = (row_axes[0], *([None] * len(sides) if problem else found))
    if any(axis not in (0, None) for axis in axes) or row_axes[1]:
        train = RowsFirst(train, axes, row_axes[1])
    values = tuple(value.rows_along(axis) if axis else value for value, axis in zip([inputs, *(v for _, v in sides)], axes))
    float_inputs, targets = (float_inputs.rows_along(row_axes[0]) if row_axes[0] else float_inputs,
                             targets.rows_along(row_axes[1]) if row_axes[1] else targets)
    return UnitData(train, UnitInputs(values, tuple(axis is not None for axis in axes)), float_inputs, targets, problem)


def side_axis(side: SideInput, value: CachedValue, rows: list[int]) -> int | None | str:
    """The axis of a side input holding the main input's rows: the op's, checked, or else the one
    axis as long as the main input's row count in every calibration batch (`rows`); None for one
    without such an axis that is the same in every batch; a sentence saying why neither holds."""
    shapes = [np.shape(chunk) for chunk in value.chunks]
    if side.axis is not None:
        if all(len(shape) > side.axis and shape[side.axis] == count for shape, count in zip(shapes, rows)):
            return side.axis
        return f"its side input {side.name} does not hold the main input's rows along its batch axis {side.axis}"
    same_rank = len({len(shape) for shape in shapes}) == 1
    axes = [d for d in range(len(shapes[0])) if all(s[d] == n for s, n in zip(shapes, rows))] if same_rank else []
    if len(axes) == 1:
        return axes[0]
    if not axes and all(np.array_equal(np.asarray(chunk), np.asarray(value.chunks[0])) for chunk in value.chunks):
        return None
    which = f"several axes ({', '.join(map(str, axes))}) are" if axes else "no axis is"
    return (f"its side input {side.name} differs between calibration batches and {which} as long as the main input's "
            "rows, so its rows cannot be told (calibration batches of several rows may tell them)")


def _disagreement(fabric: Fabric, found: list[int | None | str], sides: Sequence[tuple[SideInput, CachedValue]]) -> str | None:
    """Why the processes of a data-parallel run cannot train the unit alike (they found other axes,
    or other values of an input passed as it is), else None; every process gets the same answer."""
    codes = [-1.0 if isinstance(axis, str) else -2.0 if axis is None else float(axis) for axis in found]
    codes += [float(np.asarray(value.chunks[0], np.float64).sum()) if axis is None else 0.0 for (_, value), axis in zip(sides, found)]
    if fabric.world_size == 1 or not codes:
        return None
    totals = sum_across(fabric, [*codes, *(c * c for c in codes)])
    world, half = fabric.world_size, len(codes)
    agree = all(np.isclose(totals[i], world * c, rtol=1e-9) and np.isclose(totals[half + i], world * c * c, rtol=1e-9)
                for i, c in enumerate(codes))
    return None if agree else "the processes of the data-parallel run found its side inputs laid out differently"
