"""Converters for the ops onnx2torch lacks or lifts in a way we cannot use, one module per op
family: layers take their weights as inputs (so a weight can be a parameter behind a fake-quant
module), padding follows auto_pad and asymmetric pads, normalisations keep their inference
semantics, recurrent layers (LSTM, GRU) step through time in plain torch ops, onnxruntime's decoder contrib
ops (RMS norms, rotary, grouped-query attention) compute what its CPU kernels do, and newer op
versions (Cast-19+, Reduce*-18, Pad-18+, Resize-18/19, Split-18, Gelu-20, Conv-22, ...) work. Importing this package registers every converter."""

from . import qdq  # noqa: F401  (registers the quantize-dequantize converters)
from .activation import Gelu
from .cast import Cast, CastLike, cast
from .contrib import GroupQueryAttention, RotaryEmbedding, SimplifiedLayerNorm
from .conv import Conv, ConvTranspose
from .norm import BatchNorm, LayerNorm
from .pool import GlobalMaxPool, Pool
from .reduce import Reduce
from .resize import Resize
from .rnn import GRU, LSTM
from .shape import Pad, Reshape, Split

__all__ = [
    "GRU", "LSTM", "BatchNorm", "Cast", "CastLike", "Conv", "ConvTranspose", "Gelu", "GlobalMaxPool", "GroupQueryAttention",
    "LayerNorm", "Pad", "Pool", "Reduce", "Reshape", "Resize", "RotaryEmbedding", "SimplifiedLayerNorm", "Split",
    "cast",
]
