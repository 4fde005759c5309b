"""Accuracy recovery after quantization: AdaRound and AdaQuant on the lifted model, unit by unit
(layer-wise), with float targets from one pass of the float model and quantized inputs pushed
through each tuned unit once; Lightning Fabric runs each unit's optimisation."""

from .api import finetune_model
from .cache import ActivationCache
from .device import available_devices, resolve_device
from .partition import Plan, cut
from .report import write_report
from .units import Unit, find_units

__all__ = ["ActivationCache", "Plan", "Unit", "available_devices", "cut", "find_units", "finetune_model",
           "resolve_device", "write_report"]
