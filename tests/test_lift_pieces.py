"""A dequantization checks, encodes and converts a large tensor a slice at a time (Dequantize._pieces): the
values and the answers are those of the whole tensor at once, for every granularity (per tensor, per
channel, blocked along either axis), integer and float8 codes, and sizes that do not divide evenly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto

import finetune.formats.blocks
import finetune.lift.params
from finetune.formats import FloatSpec, IntSpec
from finetune.lift.params import Dequantize, shared_or_made
from finetune.onnx.dtypes import numpy_dtype, to_torch

CASES = {  # name: (ONNX type, spec, values' shape, scale's shape)
    "int4 blocked along axis 0": (TensorProto.INT4, IntSpec("int4", axis=0, block_size=4), (10, 7), (3, 7)),
    "int4 blocked along axis 1 of a 4-D weight": (TensorProto.INT4, IntSpec("int4", axis=1, block_size=2), (5, 6, 3, 2), (5, 3, 3, 2)),
    "uint8 per channel, zero points": (TensorProto.UINT8, IntSpec("uint8", symmetric=False, axis=1), (9, 6), (6,)),
    "int8 per tensor, 3-D": (TensorProto.INT8, IntSpec("int8"), (5, 4, 3), ()),
    "float8 per channel": (TensorProto.FLOAT8E4M3FN, FloatSpec("float8_e4m3fn", axis=0), (6, 11), (6,)),
}


def dequantization(case: str, seed: int = 0) -> tuple[Dequantize, torch.Tensor]:
    """A seeded dequantization of the case and float values for it."""
    data_type, spec, shape, scale_shape = CASES[case]
    rng = np.random.default_rng(seed)
    scale = torch.from_numpy(rng.uniform(0.01, 0.1, scale_shape).astype(np.float32))
    if isinstance(spec, IntSpec) and not spec.symmetric:
        zero_point = torch.from_numpy(rng.integers(100, 150, scale_shape).astype(np.float64))
    else:
        zero_point = torch.zeros(scale_shape, dtype=torch.float64 if isinstance(spec, IntSpec) else torch.float32)
    values = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * 0.3
    return Dequantize(data_type, spec, scale, zero_point), values


@pytest.mark.parametrize("case", CASES)
def test_slices_give_the_whole_tensors_values_and_answers(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    transform, values = dequantization(case)
    codes = transform.encode(values)
    whole = transform._dequantized(codes)
    assert transform.stands_for(whole, codes)  # what the whole-tensor check says (the codes' own values)
    monkeypatch.setattr(finetune.formats.blocks, "SLICE_ELEMENTS", 8)  # many slices, the last one shorter
    assert len(list(transform._pieces(values, codes))) > 2
    assert np.array_equal(transform.encode(values).view(np.uint8), codes.view(np.uint8))  # encoded a slice at a time
    assert torch.equal(transform.apply(codes), whole)
    assert transform.stands_for(whole, codes)
    last = whole.clone()
    last.view(-1)[-1] = whole.view(-1)[-1] + 1.0  # off the grid in the last slice only
    assert not transform.stands_for(last, codes)
    assert not transform.stands_for(whole, transform.encode(last))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint16"])
def test_a_tensor_is_shared_exactly_where_it_holds_the_arrays_bits(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An initializer another model's tensor holds bit for bit reads that storage (compared a slice of
    bytes at a time, without a copy of the array; widened types as made); one bit off in the last
    slice, or another type, and it gets a tensor of its own with the array's values."""
    monkeypatch.setattr(finetune.lift.params, "SLICE_ELEMENTS", 8)  # many slices
    array = (np.arange(50) * 3 % 17).astype(numpy_dtype(dtype)).reshape(5, 10)
    held = to_torch(array)
    shared = shared_or_made(held, array)
    assert shared.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
    off = held.clone()
    off.view(-1)[-1] += 1
    for existing in (off, held.double(), None):
        made = shared_or_made(existing, array)
        assert torch.equal(made, held) and made.dtype == held.dtype
        assert existing is None or made.untyped_storage().data_ptr() != existing.untyped_storage().data_ptr()
