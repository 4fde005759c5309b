"""What is tuned: the units of a lifted model (layers, blocks of them, control-flow bodies, each
with its side inputs) and the cut of its graph around them. Pure graph work: no Lightning, no data."""

from .find import find_units
from .partition import Plan, cut
from .unit import Layer, Unit, parameters_of, tuned_tensor

__all__ = ["Layer", "Plan", "Unit", "cut", "find_units", "parameters_of", "tuned_tensor"]
