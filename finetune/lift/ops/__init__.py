"""Converters for the ops onnx2torch lacks or lifts in a way we cannot use, one module per op
family; importing this package registers every one of them with the converter registry."""

from .activation import Gelu
from .conv import Cast, CastLike, Conv, ConvTranspose, Pad, Reduce, Reshape, Resize, Split, cast
from .norm import BatchNorm, LayerNorm
from .pool import GlobalMaxPool, Pool

__all__ = [
    "BatchNorm", "Cast", "CastLike", "Conv", "ConvTranspose", "Gelu", "GlobalMaxPool", "LayerNorm", "Pad", "Pool",
    "Reduce", "Reshape", "Resize", "Split", "cast",
]
