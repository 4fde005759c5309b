"""The observer contract: streaming calibration statistics for one tensor, grouped per tensor, per
channel or per block and updated batch by batch in fixed memory, turned into QuantizeLinear's scale
and zero point (`qparams`); MinMax is its plain case, the histogram methods live in histograms.py."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from finetune.formats import FloatSpec, IntSpec, int_scale_zero_point

CalibrationSpec = IntSpec | FloatSpec


class Observer(ABC):
    """Statistics of one tensor, updated batch by batch, turned into QuantizeLinear's scale and
    zero point: per tensor (axis None), per channel (axis) or, where supported, per block."""

    supports_blocks = False

    def __init__(self, spec: CalibrationSpec, axis: int | None = None) -> None:
        _check_spec(spec)
        self.spec = spec
        self.axis = spec.axis if axis is None else axis
        self.block_size = spec.block_size if isinstance(spec, IntSpec) else None
        if self.block_size and not self.supports_blocks:
            raise ValueError(f"{type(self).__name__} has no per-block mode; use MinMax for blocked scales")
        self._param_shape: tuple[int, ...] | None = None
        self._axis_index = 0
        self._min = np.empty(0, np.float32)
        self._max = np.empty(0, np.float32)
        self.non_finite = 0  # NaN and infinite values seen, left out of the statistics

    def update(self, x: np.ndarray | torch.Tensor) -> None:
        """Fold one batch into the statistics; NaN and infinities are left out (and counted)."""
        array = _float32(x)
        if array.size == 0:
            return
        rows = self._rows(array)
        lo, hi, finite = _finite_min_max(rows)
        if not finite:
            self.non_finite += int(rows.size - np.count_nonzero(np.isfinite(rows)))
        first = self._min.size == 0
        self._min = lo if first else np.minimum(self._min, lo)
        self._max = hi if first else np.maximum(self._max, hi)
        self._update_rows(rows, lo, hi, finite)

    @property
    def observed(self) -> bool:
        """Whether any batch reached the observer (a value inside an If branch the data never took gets none)."""
        return self._param_shape is not None

    def clip_range(self) -> tuple[np.ndarray, np.ndarray]:
        """The calibrated range [lo, hi], shaped like the scale."""
        lo, hi = self._calibrated()
        return self._ungroup(lo), self._ungroup(hi)

    def scale_zero_point(self) -> tuple[np.ndarray, np.ndarray]:
        """QuantizeLinear's scale and zero point as float32: a scalar per tensor, 1-D per channel,
        the tensor's shape with the blocked axis shortened per block."""
        scale, zero_point = qparams(*self._calibrated(), self.spec)
        return self._ungroup(scale), self._ungroup(zero_point)

    def _calibrated(self) -> tuple[np.ndarray, np.ndarray]:
        if self._param_shape is None:
            raise RuntimeError(f"{type(self).__name__}: no data observed yet")
        return self._range()

    def _observed(self) -> tuple[np.ndarray, np.ndarray]:
        """Observed min/max per group widened to include 0 (0 for a group that saw no finite value)."""
        return np.minimum(self._min, 0.0), np.maximum(self._max, 0.0)

    def _update_rows(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, finite: bool) -> None:
        """Method-specific statistics of one batch, given as [groups, values]."""

    @abstractmethod
    def _range(self) -> tuple[np.ndarray, np.ndarray]:
        """The calibrated [lo, hi] per group."""

    def _rows(self, array: np.ndarray) -> np.ndarray:
        """The batch as [groups, values]; the grouping must match earlier batches."""
        rows, shape, axis_index = _group_rows(array, self.axis, self.block_size)
        if self._param_shape is not None and shape != self._param_shape:
            raise ValueError(
                f"{type(self).__name__}: a batch gives scale shape {shape}, earlier batches {self._param_shape} "
                f"(axis {self.axis}, block size {self.block_size})"
            )
        self._param_shape, self._axis_index = shape, axis_index
        return rows

    def _ungroup(self, values: np.ndarray) -> np.ndarray:
        """Per-group values in QuantizeLinear's scale shape."""
        shape = self._param_shape
        if self.block_size is None:
            return values.reshape(shape)
        a = self._axis_index
        moved = shape[:a] + shape[a + 1:] + (shape[a],)
        return np.moveaxis(values.reshape(moved), -1, a)


class MinMaxObserver(Observer):
    """The observed minimum and maximum: nothing clipped."""

    supports_blocks = True

    def _range(self) -> tuple[np.ndarray, np.ndarray]:
        return self._observed()


def qparams(lo: np.ndarray, hi: np.ndarray, spec: CalibrationSpec) -> tuple[np.ndarray, np.ndarray]:
    """Float32 scale and zero point covering [lo, hi]: `int_scale_zero_point` for integers; for FP8
    scale = amax / the type's largest value and zero point 0 (scale 1 for an all-zero range)."""
    if isinstance(spec, IntSpec):
        scale, zero_point = int_scale_zero_point(torch.as_tensor(lo), torch.as_tensor(hi), spec)
        return scale.numpy(), zero_point.numpy().astype(np.float32)
    amax = np.maximum(np.maximum(-np.asarray(lo), np.asarray(hi)), 0.0).astype(np.float32)
    scale = amax / np.float32(spec.max_value)
    return np.where(scale > 0, scale, np.float32(1.0)), np.zeros_like(scale)


def _check_spec(spec: CalibrationSpec) -> None:
    if isinstance(spec, IntSpec) or (isinstance(spec, FloatSpec) and spec.torch_dtype.itemsize == 1):
        return
    if isinstance(spec, FloatSpec):
        raise ValueError(f"{spec.dtype} runs with scale 1 and needs no calibration; observers serve INT and FP8")
    raise TypeError(
        f"observers serve IntSpec and FP8 FloatSpec, not {type(spec).__name__} (its scales come from the data)"
    )


def _float32(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().float().numpy()
    array = np.asarray(x)
    return array if array.dtype == np.float32 else array.astype(np.float32)


def _group_rows(x: np.ndarray, axis: int | None, block_size: int | None) -> tuple[np.ndarray, tuple[int, ...], int]:
    """x as [groups, values], the scale shape QuantizeLinear wants and the normalised axis. Blocks
    are padded with zeros, which no range can exclude anyway (ranges always contain 0)."""
    if axis is None:
        return x.reshape(1, -1), (), 0
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {x.ndim}")
    a = axis % x.ndim
    if block_size is None:
        return np.moveaxis(x, a, 0).reshape(x.shape[a], -1), (x.shape[a],), a
    blocks = -(-x.shape[a] // block_size)
    moved = np.moveaxis(x, a, -1)
    padded = np.pad(moved, [(0, 0)] * (x.ndim - 1) + [(0, blocks * block_size - x.shape[a])])
    return padded.reshape(-1, block_size), x.shape[:a] + (blocks,) + x.shape[a + 1:], a


def _finite_min_max(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Min and max of each row over its finite values, and whether every value was finite."""
    lo, hi = rows.min(axis=1), rows.max(axis=1)
    if np.isfinite(lo).all() and np.isfinite(hi).all():
        return lo, hi, True
    valid = np.isfinite(rows)
    return np.where(valid, rows, np.inf).min(axis=1), np.where(valid, rows, -np.inf).max(axis=1), False
