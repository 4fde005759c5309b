"""Observers by calibration-method name: the one table from the config's method names to observer
classes, kept apart so the observer modules need not know every method."""

from __future__ import annotations

from typing import Any

from .histograms import EntropyObserver, MSEObserver, PercentileObserver
from .observers import CalibrationSpec, MinMaxObserver, Observer

METHODS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "percentile": PercentileObserver,
    "mse": MSEObserver,
    "minmse": MSEObserver,
    "potminmse": MSEObserver,  # the config's name for MinMSE over power-of-two scales (spec.power_of_two)
    "entropy": EntropyObserver,
}


def make_observer(method: str, spec: CalibrationSpec, axis: int | None = None, **options: Any) -> Observer:
    """An observer by method name (case, '_' and '-' ignored): minmax, percentile, mse (alias minmse:
    with a power-of-two spec it is the power-of-two MinMSE) or entropy; options go to its class."""
    key = method.lower().replace("_", "").replace("-", "")
    if key not in METHODS:
        raise ValueError(f"calibration method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[key](spec, axis, **options)
