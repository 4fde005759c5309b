"""What reconstruction asks of a lifted module's type: which weight layer it is, whether it is an
activation, a bias Add or a Shape op. Lift owns the module classes (its converters' and
onnx2torch's), so callers classify modules here instead of importing those classes."""

from __future__ import annotations

import torch
from onnx2torch.node_converters.activations import OnnxHardSigmoid
from onnx2torch.node_converters.binary_math_operations import OnnxBinaryMathOperation
from onnx2torch.node_converters.clip import OnnxClip
from onnx2torch.node_converters.gemm import OnnxGemm
from onnx2torch.node_converters.matmul import OnnxMatMul
from onnx2torch.node_converters.shape import OnnxShape
from torch import nn

from .ops import GRU, LSTM, Conv, ConvTranspose, Gelu

_LAYER_KINDS: dict[type, str] = {
    Conv: "Conv", ConvTranspose: "ConvTranspose", OnnxGemm: "Gemm", OnnxMatMul: "MatMul", LSTM: "LSTM", GRU: "GRU",
}
_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softsign,
    nn.Hardswish, nn.Hardtanh, OnnxHardSigmoid, OnnxClip, Gelu,
)


def layer_kind(module: nn.Module) -> str | None:
    """The ONNX op type of a weight layer's module ("Conv", "ConvTranspose", "Gemm", "MatMul",
    "LSTM" or "GRU"), None for any other module."""
    return _LAYER_KINDS.get(type(module))


def is_activation(module: nn.Module) -> bool:
    """Whether the module is an element-wise activation (ReLU and its kin, sigmoids, Clip, Gelu)."""
    return isinstance(module, _ACTIVATIONS)


def is_add(module: nn.Module) -> bool:
    """Whether the module is an ONNX Add."""
    return isinstance(module, OnnxBinaryMathOperation) and module.math_op_function is torch.add


def is_shape(module: nn.Module) -> bool:
    """Whether the module is an ONNX Shape (its output depends on the input's shape alone)."""
    return isinstance(module, OnnxShape)
