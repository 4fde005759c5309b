"""Format numerics beyond the reference vectors: notable values in both directions, agreement with
onnxruntime's standard QuantizeLinear/DequantizeLinear, any rank/axis, float16 and gradients."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from finetune.formats import (
    BF16,
    BFP16,
    FP8_E4M3FN,
    FP8_E5M2,
    FP16,
    MX4,
    MX9,
    MX_ELEMENTS,
    MXFP4,
    MXINT8,
    BFPSpec,
    FloatSpec,
    IntSpec,
    MXSpec,
    bfp_quantize_dequantize,
    float_quantize_dequantize,
    int_quantize_dequantize,
    int_range_clamp,
    int_scale_zero_point,
    mx_quantize_dequantize,
    quantize_dequantize,
)
from finetune.formats.bits import (
    branch_free,
    exponent_field,
    needs,
    quantize_scaled,
    round_half_away_from_zero,
    round_half_even,
    round_half_up,
    scale_by_pow2,
)

from .vectors import assert_same_values

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
F32_SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)

# --- building blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "half_away", "half_up", "half_even"),
    [(0.5, 1, 1, 0), (-0.5, -1, 0, 0), (1.5, 2, 2, 2), (-1.5, -2, -1, -2), (2.5, 3, 3, 2), (-2.5, -3, -2, -2),
     (0.49999997, 0, 0, 0), (-0.49999997, 0, 0, 0), (8388607.5, 8388608, 8388608, 8388608), (-0.3, 0, 0, 0)],
)
def test_rounding_modes_on_ties_and_near_ties(value: float, half_away: int, half_up: int, half_even: int) -> None:
    v = torch.tensor([value])
    assert round_half_away_from_zero(v).item() == half_away
    assert round_half_up(v).item() == half_up
    assert round_half_even(v).item() == half_even


def test_exponent_field_is_exact_just_below_powers_of_two() -> None:
    below = np.nextafter(np.float32(2.0) ** np.arange(-125, 127, dtype=np.float32), np.float32(0))
    fields = exponent_field(torch.from_numpy(below)).numpy()
    assert np.array_equal(fields, np.arange(-125, 127) - 1 + 127)
    assert exponent_field(torch.tensor([F32_SUBNORMAL, 0.0, math.inf, F32_MAX])).tolist() == [0, 0, 255, 254]


def test_scale_by_pow2_is_exact_beyond_the_normal_range_of_the_factor() -> None:
    x = torch.tensor([F32_SUBNORMAL, 3 * F32_SUBNORMAL, 1.5])
    up = scale_by_pow2(x, torch.tensor([149, 148, -130]))
    assert up.tolist() == [1.0, 1.5, 1.5 * 2.0**-130]


def test_scale_by_pow2_rounds_each_element_once_whatever_its_neighbours_need() -> None:
    """Only the elements whose shift is beyond the normal range take two steps: 11 * 2^-149 halved
    three times is 1.375 * 2^-149, rounded once to 2^-149 (two roundings would give 2^-148)."""
    x, k = torch.tensor([11 * F32_SUBNORMAL, F32_SUBNORMAL]), torch.tensor([-3, 149])
    for forced in (False, True):
        with branch_free() if forced else contextlib.nullcontext():
            assert scale_by_pow2(x, k).tolist() == [F32_SUBNORMAL, 1.0]


def test_quantize_scaled_matches_two_exact_scalings_inside_and_beyond_the_shared_factor_range() -> None:
    x = torch.tensor([F32_SUBNORMAL, 3 * F32_SUBNORMAL, 1.5, -2.5e-38, 7.0, 2.0**-120])
    for k in ([-20, -3, 5, -126, 1, 126], [-149, -148, 5, -130, 2, 127]):  # one factor for both ways, then split
        k = torch.tensor(k)
        y, scaled = quantize_scaled(x, k, round_half_even)
        assert torch.equal(scaled, scale_by_pow2(x, -k))
        assert torch.equal(y, scale_by_pow2(round_half_even(scale_by_pow2(x, -k)), k))


# --- notable values, both directions ----------------------------------------------------------

MX_FP_GRIDS = {
    "fp4_e2m1": [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
    "fp6_e2m3": [0.0, 0.125, 0.875, 1.0, 1.125, 7.0, 7.5],
    "fp6_e3m2": [0.0, 0.0625, 0.1875, 0.25, 1.0, 1.25, 24.0, 28.0],
    "fp8_e4m3": [0.0, 2.0**-9, 2.0**-6, 1.0, 1.125, 256.0, 448.0],
    "fp8_e5m2": [0.0, 2.0**-16, 2.0**-14, 1.0, 1.25, 49152.0, 57344.0],
}


@pytest.mark.parametrize("element", list(MX_FP_GRIDS))
def test_mx_element_grid_values_are_fixed_points(element: str) -> None:
    """A block whose maximum is the element's largest value has shared scale 1, so every grid
    value (zero, subnormals, normals, the maximum) and its negative must come back unchanged."""
    grid = MX_FP_GRIDS[element]
    assert MX_ELEMENTS[element].max_value == grid[-1]
    values = torch.tensor(grid + [-g for g in grid], dtype=torch.float32)
    got = mx_quantize_dequantize(values, MXSpec(element, block_size=values.numel()))
    assert got.tolist() == values.tolist()


@pytest.mark.parametrize(
    ("element", "value", "expected"),
    [("fp4_e2m1", 5.0, 4.0), ("fp4_e2m1", 2.5, 2.0), ("fp4_e2m1", 0.25, 0.0), ("fp4_e2m1", 0.75, 1.0),
     ("fp8_e4m3", 464.0, 448.0), ("fp6_e3m2", 26.0, 24.0), ("fp6_e2m3", 0.0625, 0.0)],
)
def test_mx_element_rounds_half_to_even_and_saturates(element: str, value: float, expected: float) -> None:
    """Between grid points ties go to the even code; the block maximum pins the scale to 1."""
    top = MX_ELEMENTS[element].max_value
    got = mx_quantize_dequantize(torch.tensor([top, value, -value]), MXSpec(element, block_size=3))
    assert got.tolist() == [top, expected, -expected]


def test_mxint8_reaches_minus_two_and_clamps_plus_two() -> None:
    """int8 codes are q/64 of the scale in [-128, 127]: just below -2 rounds to -2.0 (code -128),
    just below +2 saturates to 127/64; the block maximum in [1, 2) pins the scale to 1."""
    got = mx_quantize_dequantize(torch.tensor([-1.999, 1.999, 1.0, 1.984375]), MXSpec("int8", block_size=4))
    assert got.tolist() == [-2.0, 1.984375, 1.0, 1.984375]


def test_bfp16_notable_values() -> None:
    """BFP16: 8-bit sign-magnitude codes under the block's exponent (scale 2^-6 here); NaN/Inf pass
    through and do not set the shared exponent; half a step rounds away from zero; the block
    maximum clamps to 127 * scale; all-zero blocks stay zero."""
    x = torch.tensor([1.0, 1.9999999, 0.0078125, 0.00390625, -0.0, math.nan, math.inf, -math.inf])
    got = bfp_quantize_dequantize(x, BFPSpec(block_size=8, axis=0))
    assert_same_values(got.numpy(), np.array([1.0, 1.984375, 0.015625, 0.0, 0.0, np.nan, np.inf, -np.inf], np.float32))
    assert bfp_quantize_dequantize(torch.zeros(16), BFP16).tolist() == [0.0] * 16


def test_mx9_block_with_inf_becomes_nan_and_subnormals_flush() -> None:
    x = torch.zeros(32)
    x[0], x[1] = math.inf, 1.0
    x[16], x[17] = F32_SUBNORMAL * 8, F32_TINY
    got = bfp_quantize_dequantize(x, MX9)
    assert torch.isnan(got[:16]).all()
    assert got[16].item() == 0.0 and got[17].item() == F32_TINY


@pytest.mark.parametrize(
    ("spec", "big", "expected"),
    [(BF16, 3.5e38, float(torch.finfo(torch.bfloat16).max)), (FP16, 70000.0, 65504.0),
     (FP8_E4M3FN, 1000.0, 448.0), (FP8_E5M2, 1e6, 57344.0)],
)
def test_narrow_floats_saturate_and_keep_nan(spec: FloatSpec, big: float, expected: float) -> None:
    got = float_quantize_dequantize(torch.tensor([big, -big, math.nan, 1.0]), spec)
    assert got[:2].tolist() == [expected, -expected]
    assert math.isnan(got[2].item()) and got[3].item() == 1.0


@pytest.mark.parametrize("spec", [BF16, FP16])
def test_without_overflow_protection_16_bit_floats_overflow_to_inf(spec: FloatSpec) -> None:
    got = float_quantize_dequantize(torch.tensor([1e39, -1e39]), FloatSpec(spec.dtype, saturate=False))
    assert got.tolist() == [math.inf, -math.inf]


def test_fp8_requires_saturation() -> None:
    with pytest.raises(ValueError, match="saturate"):
        FloatSpec("float8_e4m3fn", saturate=False)


def test_bf16_rounds_to_nearest_even() -> None:
    one_ulp = 2.0**-7
    x = torch.tensor([1.0 + one_ulp / 2, 1.0 + 1.5 * one_ulp, 1.0 + one_ulp / 2 + 2**-20])
    assert float_quantize_dequantize(x, BF16).tolist() == [1.0, 1.0 + 2 * one_ulp, 1.0 + one_ulp]


@pytest.mark.parametrize(
    ("dtype", "symmetric", "lo", "hi", "scale", "zero_point"),
    [("int8", True, -1.0, 2.54, 0.02, 0.0), ("uint8", True, -1.0, 2.54, 0.02, 128.0),
     ("uint8", False, -1.0, 1.55, 0.01, 100.0), ("int4", False, 0.5, 1.5, 0.1, -8.0),
     ("int8", True, 0.0, 0.0, 1.0, 0.0)],
)
def test_int_scale_zero_point_from_range(dtype: str, symmetric: bool, lo: float, hi: float, scale: float, zero_point: float) -> None:
    s, zp = int_scale_zero_point(torch.tensor(lo), torch.tensor(hi), IntSpec(dtype, symmetric=symmetric))
    assert s.item() == pytest.approx(scale, rel=1e-6) and zp.item() == zero_point


@pytest.mark.parametrize(("spec", "scale", "zero_point"), [
    (IntSpec("uint8", symmetric=False), torch.tensor(0.02), torch.tensor(0.0)),  # a removed Relu: 0 .. 5.1
    (IntSpec("int8", symmetric=False), torch.tensor(0.05), torch.tensor(-28.0)),  # -5 .. 7.75
    (IntSpec("int8", axis=1), torch.tensor([0.01, 0.1]), torch.tensor([0.0, 0.0])),  # per channel
])
def test_int_range_clamp_is_quantize_dequantize_without_rounding(spec: IntSpec, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
    """The clamp keeps every value the range holds as it is (no rounding) and clamps the others to
    the range's ends, which are exactly the values the lowest and highest codes dequantize to."""
    x = torch.linspace(-20.0, 20.0, 2001).reshape(-1, 1).repeat(1, 2) * 1.000123
    clamped = int_range_clamp(x, scale, zero_point, spec)
    ends = int_quantize_dequantize(torch.tensor([[-1e9, -1e9], [1e9, 1e9]]), scale, zero_point, spec)
    assert torch.equal(clamped, torch.minimum(torch.maximum(x, ends[0]), ends[1]))
    inside = (x > ends[0]) & (x < ends[1])
    assert inside.any() and (~inside).any() and torch.equal(clamped[inside], x[inside])


def test_power_of_two_scale_rounds_up() -> None:
    s, _ = int_scale_zero_point(torch.tensor(-3.0), torch.tensor(2.0), IntSpec(power_of_two=True))
    assert s.item() == 2.0**-5  # 3/127 = 0.0236 -> 2^-5 = 0.03125 covers the range


# --- torch against onnxruntime's standard QuantizeLinear / DequantizeLinear --------------------

INT_ONNX_TYPES = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "int16": TensorProto.INT16,
                  "uint16": TensorProto.UINT16, "int4": TensorProto.INT4, "uint4": TensorProto.UINT4}
FLOAT_ONNX_TYPES = {"float8_e4m3fn": TensorProto.FLOAT8E4M3FN, "float8_e5m2": TensorProto.FLOAT8E5M2}


def run_standard_qdq(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, elem_type: int,
                     axis: int | None, block_size: int | None) -> np.ndarray:
    """Run QuantizeLinear -> DequantizeLinear (opset 21) in onnxruntime with all optimisations off."""
    attrs = {} if axis is None else {"axis": axis}
    if block_size:
        attrs["block_size"] = block_size
    zp = helper.make_tensor("zp", elem_type, zero_point.shape, zero_point.flatten().tolist())
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **attrs),
         helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], **attrs)],
        "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        [numpy_helper.from_array(scale.astype(np.float32), "s"), zp],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@st.composite
def int_cases(draw: st.DrawFn) -> tuple:
    dtype = draw(st.sampled_from(sorted(INT_ONNX_TYPES)))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    granularity = draw(st.sampled_from(["tensor", "channel", "block"]))
    axis = None if granularity == "tensor" else draw(st.integers(-len(shape), len(shape) - 1))
    block = draw(st.integers(1, 4)) if granularity == "block" else None
    if granularity == "tensor":
        param_shape: list[int] = []
    elif granularity == "channel":
        param_shape = [shape[axis]]
    else:
        param_shape = list(shape)
        param_shape[axis] = -(-shape[axis] // block)
        assume(math.prod(param_shape) > 1)  # onnxruntime treats a one-element blocked scale as per tensor
    spec = IntSpec(dtype, axis=axis, block_size=block)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = np.asarray(2.0 ** rng.uniform(-8, 2, param_shape), np.float32)
    zero_point = np.asarray(rng.integers(spec.qmin, spec.qmax + 1, param_shape), np.float32)
    spread = float(spec.qmax - spec.qmin) * float(scale.max())
    x = (rng.standard_normal(shape) * spread / 3).astype(np.float32)
    return x, scale, zero_point, spec


@settings(max_examples=60, deadline=None)
@given(int_cases())
def test_int_matches_onnxruntime(case: tuple) -> None:
    x, scale, zero_point, spec = case
    got = int_quantize_dequantize(torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zero_point), spec)
    expected = run_standard_qdq(x, scale, zero_point, INT_ONNX_TYPES[spec.dtype], spec.axis, spec.block_size)
    assert_same_values(got.numpy(), expected, str(spec))


@pytest.mark.parametrize("dtype", sorted(FLOAT_ONNX_TYPES))
def test_fp8_matches_onnxruntime(dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.uniform(-6, 6, 4000), [1e9, -1e9, np.nan]])
    x = x.astype(np.float32).reshape(1, -1)
    scale = np.array(0.37, np.float32)
    got = float_quantize_dequantize(torch.from_numpy(x), FloatSpec(dtype), torch.from_numpy(scale))
    expected = run_standard_qdq(x, scale, np.zeros((), np.float32), FLOAT_ONNX_TYPES[dtype], None, None)
    assert_same_values(got.numpy(), expected, dtype)


# --- shapes, axes, dtypes ---------------------------------------------------------------------

BLOCK_SPECS = [BFP16, MX9, MX4, BFPSpec("to_bfp", 12, 8, rounding_mode=1), MXFP4, MXINT8,
               MXSpec("fp6_e2m3", 32, rounding_mode=0)]


def blocked_along_last(x: torch.Tensor, spec: BFPSpec | MXSpec) -> torch.Tensor:
    """Reference for any axis: move the axis last, quantize along the last axis, move it back."""
    axis = spec.axis % x.dim()
    moved = x.movedim(axis, -1).contiguous()
    return quantize_dequantize(moved, type(spec)(**{**spec.__dict__, "axis": -1})).movedim(-1, axis)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(BLOCK_SPECS), st.lists(st.integers(1, 40), min_size=2, max_size=4), st.data())
def test_any_axis_equals_moving_the_axis_last(spec: BFPSpec | MXSpec, shape: list[int], data: st.DataObject) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    spec = type(spec)(**{**spec.__dict__, "axis": axis})
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 7 + axis)) * 10
    assert_same_values(quantize_dequantize(x, spec).numpy(), blocked_along_last(x, spec).numpy(), str(spec))


@pytest.mark.parametrize("spec", BLOCK_SPECS + [BF16, FP8_E4M3FN], ids=str)
def test_float16_input_is_computed_in_float32(spec: BFPSpec | MXSpec | FloatSpec) -> None:
    x = (torch.randn(4, 48, 3) * 100).half()
    got = quantize_dequantize(x, spec)
    assert got.dtype == torch.float16
    assert_same_values(got.numpy(), quantize_dequantize(x.float(), spec).half().numpy(), str(spec))


@pytest.mark.parametrize("shape", [(4, 40, 6, 7), (2, 48, 160, 80)], ids=["one chunk", "chunked"])
@pytest.mark.parametrize("spec", BLOCK_SPECS, ids=str)
def test_channels_last_input_gives_the_same_bits_and_keeps_its_layout(spec: BFPSpec | MXSpec, shape: tuple[int, ...]) -> None:
    """A channels-last activation (as a convolution in that layout gives) is blocked in its own memory
    order: values and gradient equal the contiguous tensor's, and the output stays channels last."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 10
    x[:, 16:32] = 0.0
    contiguous = outputs_and_gradient(x, spec)
    channels_last = outputs_and_gradient(x.contiguous(memory_format=torch.channels_last), spec)
    for a, b in zip(contiguous, channels_last):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), str(spec)
    assert channels_last[0].is_contiguous(memory_format=torch.channels_last)


def test_padding_is_zero_and_undone() -> None:
    """A partial block behaves as if padded with zeros: same result as explicit zero padding."""
    x = torch.randn(3, 21) * 5
    padded = torch.cat([x, torch.zeros(3, 11)], dim=1)
    for spec in (MXSpec("fp4_e2m1", 16, axis=1), BFPSpec(block_size=8, axis=1), MX4):
        assert_same_values(quantize_dequantize(x, spec).numpy(), quantize_dequantize(padded, spec)[:, :21].numpy())


def test_format_specs_reject_invalid_attributes() -> None:
    with pytest.raises(ValueError, match="element_dtype"):
        MXSpec("fp5")
    with pytest.raises(ValueError, match="rounding_mode"):
        BFPSpec(rounding_mode=3)
    with pytest.raises(ValueError, match="sub_block_size"):
        BFPSpec("to_bfp_prime", block_size=16, sub_block_size=3)
    with pytest.raises(ValueError, match="dtype"):
        IntSpec("int7")
    with pytest.raises(ValueError, match="axis"):
        quantize_dequantize(torch.zeros(2, 3), MXSpec(axis=2))
    with pytest.raises(ValueError, match="per-channel"):
        int_quantize_dequantize(torch.zeros(2, 3), torch.ones(4), 0.0, IntSpec(axis=1))


# --- gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", BLOCK_SPECS, ids=str)
def test_block_formats_pass_gradient_inside_the_range(spec: BFPSpec | MXSpec) -> None:
    """On values already on the grid nothing saturates, so the gradient is exactly the identity."""
    x = quantize_dequantize(torch.randn(2, 64) * 3, spec).requires_grad_()
    quantize_dequantize(x, spec).mul(torch.arange(128.0).reshape(2, 64)).sum().backward()
    assert torch.equal(x.grad, torch.arange(128.0).reshape(2, 64))


def test_clamped_values_get_zero_gradient() -> None:
    x = torch.tensor([0.5, 10.0, -10.0, 1.0], requires_grad=True)
    int_quantize_dequantize(x, 0.01, 0.0, IntSpec("int8")).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 0.0, 1.0]
    x = torch.tensor([1.0, 500.0, -1000.0], requires_grad=True)
    float_quantize_dequantize(x, FP8_E4M3FN).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 0.0]
    x = torch.tensor([6.0, 2.9, 0.4, 7.0], requires_grad=True)  # 7.0 is above the block's grid (max 6 * 2^1)
    mx_quantize_dequantize(x, MXSpec("fp4_e2m1", 4, axis=0)).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_rounding_hook_replaces_round_half_even() -> None:
    """AdaRound's soft rounding plugs in here: floor + learned offset, with its own gradient."""
    x = torch.tensor([0.26, -0.26, 0.74])
    offset = torch.tensor([0.0, 1.0, 0.3], requires_grad=True)
    y = int_quantize_dequantize(x, 0.5, 0.0, IntSpec("int8"), rounding=lambda v: torch.floor(v) + offset)
    assert torch.allclose(y, torch.tensor([0.0, 0.0, 0.65]))
    y.sum().backward()
    assert offset.grad.tolist() == [0.5, 0.5, 0.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm device on this machine")
@pytest.mark.parametrize("spec", BLOCK_SPECS + [BF16, FP8_E4M3FN], ids=str)
def test_cuda_equals_cpu(spec: BFPSpec | MXSpec | FloatSpec) -> None:
    x = torch.randn(8, 64, 5) * 100
    x[0, 0, 0] = math.nan
    assert_same_values(quantize_dequantize(x.cuda(), spec).cpu().numpy(), quantize_dequantize(x, spec).numpy(), str(spec))


# --- branch-free path (what accelerators run) against the checked path ---------------------------

EVERY_BLOCK_CASE = BLOCK_SPECS + [BF16, FP8_E4M3FN]


def rare_case_data() -> torch.Tensor:
    """[8, 64, 5] data whose blocks (along axis 1) hit every rare case, one kind per row: NaN/Inf,
    subnormals beside a tiny normal, values near 1e-38 and 1e-45 (scales beyond the normal range),
    signed zeros, values near float32 max, every magnitude mixed, and plain normals."""
    g = torch.Generator().manual_seed(3)
    normal = torch.randn(8, 64, 5, generator=g)
    x = normal * 100
    x[0, 0, 0], x[0, 20, 1], x[0, 40, 2], x[0, 63, 4] = math.nan, math.inf, -math.inf, math.nan
    x[1] = torch.randint(-2**23, 2**23, (64, 5), generator=g).float() * F32_SUBNORMAL
    x[1, ::16] = F32_TINY * 3
    x[2] = normal[2] * 1e-38
    x[3] = normal[3] * 1e-45
    x[4] = torch.where(normal[4] > 0, 0.0, -0.0)
    x[5] = (normal[5] * 1e38).clamp(-F32_MAX, F32_MAX)
    x[5, 0] = F32_MAX
    x[6] = normal[6] * torch.pow(10.0, torch.rand(64, 5, generator=g) * 83 - 45)
    x[7] = normal[7]
    return x


def outputs_and_gradient(x: torch.Tensor, spec: BFPSpec | MXSpec | FloatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized values and the gradient of a weighted sum (zero where the mask stops it)."""
    x = x.clone().requires_grad_()
    y = quantize_dequantize(x, spec)
    y.backward(torch.arange(1.0, x.numel() + 1).reshape(x.shape))
    return y.detach(), x.grad


def test_needs_checks_on_cpu_and_assumes_elsewhere() -> None:
    assert needs(torch.tensor([False, True])) and not needs(torch.tensor([False, False])) and not needs(torch.tensor([]) > 0)
    with branch_free():
        assert needs(torch.tensor([False, False]))
    assert not needs(torch.tensor([False]))
    assert needs(torch.zeros(2, dtype=torch.bool, device="meta"))


def zero_block_data() -> torch.Tensor:
    """Ordinary data in which whole blocks (and sub-blocks) along axis 1 are zero, of either sign,
    as after a ReLU or in a zero-padded image: on CPU these take the fast path."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, 5, generator=g) * 100
    x[:, 16:32] = 0.0
    x[:, 40:48, 1] = -0.0
    x[2, :, 3] = 0.0
    x[3, 50:52] = 0.0
    return x


def boundary_field_data() -> torch.Tensor:
    """One row per block maximum's exponent field near either end of float32 (fields 0-14 and
    240-254), each row's elements spread over the 8 binades below it: where the CPU's fast path
    ends and the general path begins."""
    g = torch.Generator().manual_seed(6)
    fields = [*range(15), *range(240, 255)]
    rows = []
    for field in fields:
        exponents = field - 127 - torch.randint(0, 8, (64, 5), generator=g)
        rows.append((1 + torch.rand(64, 5, generator=g)) * torch.pow(2.0, exponents.double()).float()
                    * torch.where(torch.rand(64, 5, generator=g) < 0.5, -1.0, 1.0))
    return torch.stack(rows)


DATA_KINDS = {"boundary fields": boundary_field_data, "rare": rare_case_data, "zero blocks": zero_block_data,
              "ordinary": lambda: torch.randn(8, 64, 5, generator=torch.Generator().manual_seed(4)) * 100,
              **{f"rare row {i}": lambda i=i: rare_case_data()[i:i + 1] for i in range(8)}}


@pytest.mark.parametrize("data", list(DATA_KINDS))
@pytest.mark.parametrize("spec", EVERY_BLOCK_CASE, ids=str)
def test_branch_free_path_gives_the_same_bits(spec: BFPSpec | MXSpec | FloatSpec, data: str) -> None:
    """Forcing what accelerators run (every rare-case fix, no check) changes no bit of the values or
    the gradient, on data that has every rare case, each rare case alone, zero blocks, and none (the
    CPU fast paths)."""
    x = DATA_KINDS[data]()
    checked = outputs_and_gradient(x, spec)
    with branch_free():
        forced = outputs_and_gradient(x, spec)
    for a, b in zip(checked, forced):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), str(spec)


EVERY_QUANTIZER = EVERY_BLOCK_CASE + [IntSpec("int8", axis=1), IntSpec("int4", axis=1, block_size=16)]


def quantize_with_params_beside(x: torch.Tensor, spec: IntSpec | BFPSpec | MXSpec | FloatSpec) -> torch.Tensor:
    """quantize_dequantize of x as a lifted quantizer runs it: an integer format's per-channel or
    blocked scale (0.25) and zero point (0) held on x's device."""
    if not isinstance(spec, IntSpec):
        return quantize_dequantize(x, spec)
    shape = [x.shape[1]] if spec.block_size is None else [x.shape[0], -(-x.shape[1] // spec.block_size), x.shape[2]]
    return quantize_dequantize(x, spec, torch.full(shape, 0.25, device=x.device), torch.zeros(shape, device=x.device))


@pytest.mark.parametrize("spec", EVERY_QUANTIZER, ids=str)
def test_quantizers_never_read_data_on_the_host(spec: IntSpec | BFPSpec | MXSpec | FloatSpec) -> None:
    """On the meta device any read of a value by the host (item, bool, int) raises, so a forward
    and backward there show that accelerators run without host synchronisation."""
    x = torch.empty(8, 64, 5, device="meta", requires_grad=True)
    y = quantize_with_params_beside(x, spec)
    y.sum().backward()
    assert y.shape == x.grad.shape == x.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm device on this machine")
@pytest.mark.parametrize("spec", EVERY_QUANTIZER, ids=str)
def test_cuda_quantizers_do_not_synchronise(spec: IntSpec | BFPSpec | MXSpec | FloatSpec) -> None:
    """CUDA's sync debug mode raises on any synchronising call: a value read, and a blocking copy
    such as that of a scale made on the host."""
    x = rare_case_data().cuda().requires_grad_()
    grad = torch.ones_like(x)
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = quantize_with_params_beside(x, spec)
        y.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = quantize_with_params_beside(rare_case_data(), spec)
    assert_same_values(y.detach().cpu().numpy(), expected.numpy(), str(spec))  # NaN payloads differ between devices
