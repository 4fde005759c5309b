"""ONNX → torch: a GraphModule whose QDQ patterns are fake-quant modules and whose weights are
trainable parameters that know the initializers they came from."""

from .builder import INITIALIZERS, LiftedModule, LiftError, lift_model
from .fake_quant import FakeQuantize
from .params import Dequantize, ParamSource
from .preflight import check_liftable, unliftable_ops

__all__ = [
    "INITIALIZERS", "Dequantize", "FakeQuantize", "LiftError", "LiftedModule", "ParamSource", "check_liftable", "lift_model",
    "unliftable_ops",
]
