"""ONNX → torch: a GraphModule whose QDQ patterns are fake-quant modules and whose weights are
trainable parameters that know the initializers they came from."""

from .agreement import LiftMismatch, check_lifted
from .builder import INITIALIZERS, LiftedModule, LiftError, lift_model
from .fake_quant import FakeQuantize
from .params import Dequantize, ParamSource
from .preflight import check_liftable, unliftable_ops

__all__ = [
    "INITIALIZERS", "Dequantize", "FakeQuantize", "LiftError", "LiftMismatch", "LiftedModule", "ParamSource", "check_liftable",
    "check_lifted", "lift_model", "unliftable_ops",
]
