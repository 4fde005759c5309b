"""A unit's values viewed rows first, as its training batches take them. A training batch takes the
same rows of each side input along that input's own batch axis (an initial state [D, B, H]: axis 1),
and a side input without one that is the same in every calibration batch (a sample rate, a trip
count) is passed as it is; side inputs take the quantized model's values, unmixed. A unit with
several outputs is measured on each, joined into one target (measured on the probability alone,
silero v5 tuned at MX6 carried a state that drifted over a stream, and its mean distance from the
float model went from 0.077 to 0.542)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from lightning.fabric import Fabric
from torch import nn

from ..units.sides import SideInput
from .cache import CachedValue
from .shards import sum_across


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
    unit holds its batch (None: an input passed as it is) on the way in; on the way out its
    output's rows come first or, with `scales`, its several outputs are joined into one (join_rows)."""

    def __init__(self, train: nn.Module, input_axes: Sequence[int | None], output_axes: Sequence[int],
                 scales: Sequence[float] | None = None) -> None:
        super().__init__()
        self.train_module, self.input_axes, self.output_axes = train, tuple(input_axes), tuple(output_axes)
        self.scales = None if scales is None else tuple(scales)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        moved = (x if axis is None else x.movedim(0, axis) for x, axis in zip(inputs, self.input_axes))
        outputs = self.train_module(*moved)
        if self.scales is None:
            return (outputs[0].movedim(self.output_axes[0], 0),)
        return (join_rows(outputs, self.output_axes, self.scales),)


def join_rows(values: Sequence[torch.Tensor], axes: Sequence[int], scales: Sequence[float]) -> torch.Tensor:
    """Several outputs as one [rows, n] tensor: each output's rows (along its axis) flattened,
    times its scale, side by side; a unit's loss on it weighs each output by its scale squared."""
    moved = [value.movedim(axis, 0) for value, axis in zip(values, axes)]
    return torch.cat([value.reshape(value.shape[0], -1) * scale for value, scale in zip(moved, scales)], dim=1)


def output_scales(targets: Sequence[CachedValue], fabric: Fabric) -> tuple[float, ...]:
    """A power of two per output such that, joined, each output's squared error relative to its
    mean square counts about alike in the loss (to a factor of two; an LSTM's Y is T times its final
    state's size, an If's state 256 times its probability's). Powers of two keep the scaling exact
    and make every process of a data-parallel run, whose float sums differ in the last bits, pick the same."""
    sums = [float(sum(np.square(np.asarray(chunk, np.float64)).sum() for chunk in value.chunks)) for value in targets]
    counts = [sum(math.prod(np.shape(chunk)) for chunk in value.chunks) for value in targets]
    rows = sum(np.shape(chunk)[0] for chunk in targets[0].chunks)
    totals = sum_across(fabric, [*sums, *counts, rows])
    half = len(targets)
    powers = [total / max(count, 1) for total, count in zip(totals[:half], totals[half:2 * half])]
    floor = max(max(powers) * 1e-12, 1e-30)
    widths = [count / max(totals[-1], 1) for count in totals[half:2 * half]]  # elements per row
    return tuple(2.0 ** round(0.5 * math.log2(sum(widths) / (half * width * max(power, floor))))
                 for width, power in zip(widths, powers))


@dataclass(frozen=True)
class UnitData:
    """What a unit is measured and trained on, rows first: its module, its inputs, its float main
    input and its float targets (its outputs' joined, made for the unit: `release` frees them);
    `problem` says why it cannot be trained (None: it can)."""

    train: nn.Module
    inputs: UnitInputs
    float_inputs: CachedValue
    targets: CachedValue
    problem: str | None
    joined: bool = False

    def release(self) -> None:
        """Free the joined targets made for the unit, if any."""
        if self.joined:
            self.targets.clear()


def unit_data(train: nn.Module, input_axis: int, output_axes: Sequence[int | None], inputs: CachedValue,
              float_inputs: CachedValue, targets: Sequence[CachedValue], sides: Sequence[tuple[SideInput, CachedValue]],
              fabric: Fabric) -> UnitData:
    """A unit's values viewed rows first (the main input's rows along `input_axis`, each target's
    along its output's axis, found from the values where None, each side input's along its own
    axis), with its module wrapped to move them back; several targets are joined in one. A side
    input that has no such axis and differs between calibration batches, or an output without
    one, is a problem (then side inputs are all passed as they are and only the first output is
    measured, so the loss can still be measured)."""
    rows = [np.shape(chunk)[input_axis] for chunk in inputs.chunks]
    found = [side_axis(side, value, rows) for side, value in sides]
    disagreement = _disagreement(fabric, found, sides)  # first: every process takes part in its all-reduce
    outputs = [axis if axis is not None else _output_axis(value, rows) for axis, value in zip(output_axes, targets)]
    problem = next((axis for axis in [*found, *outputs] if isinstance(axis, str)), None) or disagreement
    axes = (input_axis, *([None] * len(sides) if problem else found))
    outputs = outputs[:1] if problem else outputs
    values = tuple(value.rows_along(axis) if axis else value for value, axis in zip([inputs, *(v for _, v in sides)], axes))
    float_inputs = float_inputs.rows_along(input_axis) if input_axis else float_inputs
    if len(outputs) == 1:
        if any(axis not in (0, None) for axis in axes) or outputs[0]:
            train = RowsFirst(train, axes, outputs)
        target = targets[0].rows_along(outputs[0]) if outputs[0] else targets[0]
        return UnitData(train, UnitInputs(values, tuple(axis is not None for axis in axes)), float_inputs, target, problem)
    scales = output_scales([value.rows_along(axis) if axis else value for value, axis in zip(targets, outputs)], fabric)
    joined = _joined(targets, outputs, scales)
    return UnitData(RowsFirst(train, axes, outputs, scales), UnitInputs(values, tuple(axis is not None for axis in axes)),
                    float_inputs, joined, problem, joined=True)


def _output_axis(value: CachedValue, rows: list[int]) -> int | str:
    """The axis of an output holding the main input's rows, found from the values, or why none is."""
    axis = side_axis(SideInput(value.name), value, rows)
    if isinstance(axis, str):
        return axis.replace("its side input", "its output")
    return axis if axis is not None else f"its output {value.name} does not follow the rows of its input"


def _joined(targets: Sequence[CachedValue], axes: Sequence[int], scales: Sequence[float]) -> CachedValue:
    """The targets joined chunk by chunk as the unit's module joins its outputs (counted in the cache)."""
    joined = CachedValue(targets[0].cache, f"{targets[0].name}:joined")
    for chunks in zip(*(value.chunks for value in targets)):
        joined.append(join_rows([torch.from_numpy(np.array(chunk)) for chunk in chunks], axes, scales))
    return joined


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
