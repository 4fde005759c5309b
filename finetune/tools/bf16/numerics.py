"""The float types a model is converted from, the bfloat16 saturation bound of each, and the
bfloat16 rounding of weight values that every format shares."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from onnx import TensorProto

from finetune.formats import BF16, float_quantize_dequantize

BF16_MAX = BF16.max_value  # the bound finetune.formats saturates bfloat16 at, for both tools and quantizer


@dataclasses.dataclass(frozen=True)
class Source:
    """The float type a model is converted from."""

    name: str
    elem_type: int
    dtype: type
    bound: float  # the largest bfloat16 value that this type holds as a finite number


SOURCES = {
    "float32": Source("float32", TensorProto.FLOAT, np.float32, BF16_MAX),
    "float16": Source("float16", TensorProto.FLOAT16, np.float16, 65280.0),
}


def bf16_values(array: np.ndarray, bound: float = BF16_MAX) -> np.ndarray:
    """float32 array of the bfloat16 values of `array` (RNE, saturating), clamped to ±bound; NaN stays."""
    rounded = float_quantize_dequantize(torch.from_numpy(np.asarray(array, np.float32).copy()), BF16).numpy()
    return np.clip(rounded, -bound, bound)
