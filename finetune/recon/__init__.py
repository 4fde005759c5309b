"""Accuracy recovery after quantization: AdaRound, AdaQuant and GPTQ on the lifted model, unit by
unit, with float targets from one pass of the float model and quantized inputs pushed through each
tuned unit once; Lightning Fabric runs each unit's optimisation.

The package answers four questions, each in a sub-package that imports only those before it:
`units` (what is tuned), `data` (what each unit trains on), `methods` (how a unit's tensors change)
and, at the root, the engine that runs them (`api`, `tuner`, `callbacks`, ...). The names below are
imported on first use, so `finetune.recon.units` alone does not load Lightning."""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "finetune_model": "api", "preflight": "api", "ActivationCache": "data.cache", "available_devices": "device", "resolve_device": "device",
    "Plan": "units", "Unit": "units", "cut": "units", "find_units": "units", "write_report": "report",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
