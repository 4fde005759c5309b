"""Element types, named once: a format's dtype name ("int4", "bfloat16", "float8_e4m3fn") is also
its numpy or ml_dtypes name and its torch name, and onnx.helper maps numpy types to TensorProto
types and back; so every conversion goes through these functions instead of a map per module."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from onnx import TensorProto, helper

TORCH_LACKS = {"int4": np.int8, "uint4": np.uint8, "uint16": np.int32, "uint32": np.int64}  # held widened, exactly


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an element type name (ml_dtypes for int4, bfloat16, float8)."""
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def onnx_type(name: str) -> int:
    """The TensorProto element type of a name."""
    return helper.np_dtype_to_tensor_dtype(numpy_dtype(name))


def type_name(onnx_element_type: int) -> str:
    """The name of a TensorProto element type; one without a numpy counterpart (string) raises."""
    try:
        return helper.tensor_dtype_to_np_dtype(onnx_element_type).name
    except (KeyError, ValueError) as error:
        raise NotImplementedError(f"element type {TensorProto.DataType.Name(onnx_element_type)}") from error


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an element type name; int4 and uint4, which torch only names, raise."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or name in ("int4", "uint4"):
        raise NotImplementedError(f"torch has no usable {name} type")
    return dtype


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor of the same values: integer types torch lacks are widened exactly, the
    ml_dtypes floats (bfloat16, float8) pass through float32, which holds each of them exactly."""
    name = array.dtype.name
    if name in TORCH_LACKS:
        return torch.from_numpy(array.astype(TORCH_LACKS[name]))
    if hasattr(ml_dtypes, name):
        return torch.from_numpy(array.astype(np.float32)).to(torch_dtype(name))
    return torch.from_numpy(np.array(array))
