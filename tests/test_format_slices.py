"""Element-wise quantizers and the codes a weight is stored as are computed a slice at a time on CPU
(formats.blocks.in_slices, quantizer_slices): bit for bit the whole tensor's values, masks and codes,
for every granularity (per tensor, per channel, blocked along either axis), integer and float8,
channels-last layouts and sizes that do not divide evenly; on other devices and while torch.compile
traces the tensor stays whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import numpy_helper

import finetune.formats.blocks
from finetune.formats import FloatSpec, IntSpec, float_values, floats, int_quantize_dequantize, int_values, integer
from finetune.formats.blocks import in_slices, quantizer_slices
from finetune.quantize.insert import _stored_codes

CASES = {  # name: (spec, values' shape, scale's shape)
    "int4 blocked along axis 0": (IntSpec("int4", axis=0, block_size=4), (10, 7), (3, 7)),
    "int4 blocked along axis 1 of a 4-D weight": (IntSpec("int4", axis=1, block_size=2), (5, 6, 3, 2), (5, 3, 3, 2)),
    "uint8 per channel, zero points": (IntSpec("uint8", symmetric=False, axis=1), (9, 6), (6,)),
    "int8 per tensor, 3-D": (IntSpec("int8"), (5, 4, 3), ()),
    "float8 per channel": (FloatSpec("float8_e4m3fn", axis=0), (6, 11), (6,)),
}


def seeded(case: str) -> tuple[IntSpec | FloatSpec, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's spec, values (some clamped) and seeded scale and zero point."""
    spec, shape, scale_shape = CASES[case]
    rng = np.random.default_rng(0)
    scale = torch.from_numpy(rng.uniform(0.01, 0.1, scale_shape).astype(np.float32))
    integer = isinstance(spec, IntSpec)
    zero_point = torch.from_numpy(rng.integers(100, 150, scale_shape).astype(np.float32)) if integer and not spec.symmetric \
        else torch.zeros(scale_shape)
    values = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * (6.0 if integer else 30.0)
    return spec, values, scale, zero_point


def quantized(spec: IntSpec | FloatSpec, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The format's values and mask of x."""
    if isinstance(spec, IntSpec):
        return int_values(x, scale, zero_point, spec, with_mask=True)
    return float_values(x, spec, scale, zero_point, with_mask=True)


def spy(module: object, name: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes `module.name` is called with from now on."""
    calls, original = [], getattr(module, name)

    def recorded(x: torch.Tensor, *args: object) -> object:
        calls.append(tuple(x.shape))
        return original(x, *args)

    monkeypatch.setattr(module, name, recorded)
    return calls


@pytest.mark.parametrize("case", CASES)
def test_slices_give_the_whole_tensors_values_masks_and_stored_codes(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, values, scale, zero_point = seeded(case)
    whole, whole_mask = quantized(spec, values, scale, zero_point)
    tensor = numpy_helper.from_array(values.numpy(), "w")
    whole_codes = numpy_helper.to_array(_stored_codes(tensor, spec, scale.numpy(), zero_point.numpy(), "codes"))
    assert not whole_mask.all()  # some values clamped or saturated: the mask is tested too
    monkeypatch.setattr(finetune.formats.blocks, "SLICE_ELEMENTS", 8)  # many slices, the last one shorter
    slices = quantizer_slices(values.shape, spec.axis, (scale, zero_point))
    assert len(slices) > 2
    module, name = (integer, "_int_values") if isinstance(spec, IntSpec) else (floats, "_float_values")
    calls = spy(module, name, monkeypatch)
    sliced, sliced_mask = quantized(spec, values, scale, zero_point)
    assert len(calls) == len(slices)
    assert torch.equal(sliced, whole) and torch.equal(sliced_mask, whole_mask)
    codes = numpy_helper.to_array(_stored_codes(tensor, spec, scale.numpy(), zero_point.numpy(), "codes"))
    assert codes.dtype == whole_codes.dtype and np.array_equal(codes.view(np.uint8), whole_codes.view(np.uint8))


def test_a_channels_last_weight_keeps_its_layout_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = IntSpec("int8", axis=0)
    values = torch.randn(8, 3, 5, 5, generator=torch.Generator().manual_seed(1)).to(memory_format=torch.channels_last)
    scale, zero_point = torch.full((8,), 0.02), torch.zeros(8)
    whole, _ = int_values(values, scale, zero_point, spec, with_mask=False)
    monkeypatch.setattr(finetune.formats.blocks, "SLICE_ELEMENTS", 16)
    calls = spy(integer, "_int_values", monkeypatch)
    sliced, mask = int_values(values, scale, zero_point, spec, with_mask=False)
    assert len(calls) > 1 and mask is None and torch.equal(sliced, whole) and sliced.stride() == values.stride()


def test_the_slice_dimension_is_never_the_quantized_axis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finetune.formats.blocks, "SLICE_ELEMENTS", 4)
    blocked = torch.ones(2, 40)
    for index, (scale,) in quantizer_slices((12, 40), 0, (blocked,)):
        assert index[0] == slice(None) and scale.shape == (2, index[1].stop - index[1].start)
    assert len(quantizer_slices((12, 40), 1, (torch.ones(40),))) > 1  # per channel: rows
    assert len(quantizer_slices((40,), 0, (torch.ones(40),))) == 1  # rank 1 along its axis: whole


def test_tensors_off_the_cpu_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finetune.formats.blocks, "SLICE_ELEMENTS", 4)
    calls = []

    def values(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, None]:
        calls.append(tuple(x.shape))
        return x * scale, None

    in_slices(values, torch.empty(6, 6, device="meta"), None, torch.ones(()))
    assert calls == [(6, 6)]
    in_slices(values, torch.zeros(6, 6), None, torch.ones(()))
    assert len(calls) == 7


@pytest.mark.parametrize("grad", [True, False])
def test_a_parameter_quantized_without_grad_builds_no_mask(grad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The straight-through mask is built only where autograd records the op: a weight (a parameter,
    so requires_grad) run under no_grad needs none (GPTQ's passes, the audit: 62 MiB for an LM head)."""
    masks: list[bool] = []
    original = integer._int_values

    def recorded(x: torch.Tensor, scale: object, zero_point: object, spec: IntSpec, with_mask: bool) -> object:
        masks.append(with_mask)
        return original(x, scale, zero_point, spec, with_mask)

    monkeypatch.setattr(integer, "_int_values", recorded)
    weight = torch.nn.Parameter(torch.randn(4, 8, generator=torch.Generator().manual_seed(2)))
    with torch.set_grad_enabled(grad):
        y = int_quantize_dequantize(weight, torch.full((4,), 0.01), torch.zeros(4), IntSpec("int8", axis=0))
    assert masks == [grad] and y.requires_grad == grad
