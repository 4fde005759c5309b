"""Converters for the ops onnx2torch lacks or lifts in a way we cannot use, one module per op
family; importing this package registers every one of them with the converter registry."""

from .activation import Gelu
from .cast import Cast, CastLike, cast
from .conv import Conv, ConvTranspose, Pad, Reshape, Resize, Split
from .norm import BatchNorm, LayerNorm
from .reduce import Reduce
from .pool import GlobalMaxPool, Pool

__all__ = [
    "BatchNorm", "Cast", "CastLike", "Conv", "ConvTranspose", "Gelu", "GlobalMaxPool", "LayerNorm", "Pad", "Pool",
    "Reduce", "Reshape", "Resize", "Split", "cast",
]
