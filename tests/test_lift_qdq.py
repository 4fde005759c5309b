"""Quantize-dequantize patterns lifted to FakeQuantize modules, compared with onnxruntime: Q→DQ
pairs (per tensor / per channel / blocked; int4..int16, fp8), lone DQ of quantized weights,
BFP / MX / Extended Q-DQ custom ops of both domains, and onnxruntime's own quantize_static."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from finetune.formats import BFPSpec, FloatSpec, IntSpec, MXSpec
from finetune.lift import FakeQuantize, LiftError, lift_model
from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN

from .lift_helpers import (
    CNN_INPUT,
    FLOAT_ATOL,
    FLOAT_RTOL,
    ResidualCNN,
    assert_same,
    export_legacy,
    onnx_model,
    random_input,
    randomized,
    run_ort,
    run_torch,
    tensor,
)

RNG = np.random.default_rng(0)
SHAPE = (2, 8, 6)  # axis 1 has 8 channels, 2 blocks of 4


def _array(data_type: int, values: np.ndarray) -> onnx.TensorProto:
    """An initializer-ready tensor of values converted to an ONNX type."""
    return numpy_helper.from_array(np.asarray(values).astype(helper.tensor_dtype_to_np_dtype(data_type)))


def _qdq_model(code_type: int, scale: np.ndarray, zero_point: np.ndarray | None, attributes: dict, opset: int) -> onnx.ModelProto:
    """x → QuantizeLinear → DequantizeLinear → y with constant scale and zero point."""
    names = ["x", "s"] + (["zp"] if zero_point is not None else [])
    tensors = [numpy_helper.from_array(scale.astype(np.float32), "s")]
    if zero_point is not None:
        tensors.append(_named(_array(code_type, zero_point), "zp"))
    nodes = [
        helper.make_node("QuantizeLinear", names, ["q"], name="x.q", **attributes),
        helper.make_node("DequantizeLinear", ["q", *names[1:]], ["y"], name="x.dq", **attributes),
    ]
    return onnx_model(nodes, [tensor("x", ["batch", *SHAPE[1:]])], [tensor("y", None)], tensors, opset)


def _named(t: onnx.TensorProto, name: str) -> onnx.TensorProto:
    """The tensor renamed."""
    t.name = name
    return t


def _qdq_input(scale: float) -> np.ndarray:
    """Values spread over and beyond the code range, including exact ties x = (k + 0.5) * scale."""
    x = random_input(SHAPE) * 100 * scale
    x.reshape(-1)[:10] = (np.arange(-5, 5) + 0.5) * scale
    return x


BLOCKED = {"axis": 1, "block_size": 4}
PAIR_CASES = {
    "int8_per_tensor": (TensorProto.INT8, np.array(0.05), np.array(3), {}, 13),
    "uint8_per_tensor": (TensorProto.UINT8, np.array(0.1), np.array(128), {}, 13),
    "int16_per_tensor": (TensorProto.INT16, np.array(0.002), np.array(-7), {}, 21),
    "uint16_per_tensor": (TensorProto.UINT16, np.array(0.01), np.array(30000), {}, 21),
    "int4_per_tensor": (TensorProto.INT4, np.array(0.5), np.array(1), {}, 21),
    "uint4_per_tensor": (TensorProto.UINT4, np.array(0.5), None, {}, 21),
    "int8_per_channel": (TensorProto.INT8, np.linspace(0.01, 0.1, 8), np.arange(-4, 4), {"axis": 1}, 13),
    "int8_blocked": (TensorProto.INT8, np.linspace(0.01, 0.1, 24).reshape(2, 2, 6), None, BLOCKED, 21),
    "int4_blocked": (TensorProto.INT4, np.linspace(0.1, 0.9, 24).reshape(2, 2, 6), np.zeros((2, 2, 6)), BLOCKED, 21),
    "fp8_e4m3fn_per_tensor": (TensorProto.FLOAT8E4M3FN, np.array(0.03), np.array(0.0), {}, 19),
    "fp8_e5m2_per_channel": (TensorProto.FLOAT8E5M2, np.linspace(0.001, 0.01, 8), np.zeros(8), {"axis": 1}, 19),
}


@pytest.mark.parametrize("case", sorted(PAIR_CASES))
def test_quantize_dequantize_pair_is_exact(case: str) -> None:
    """One FakeQuantize per Q→DQ pair, bit-exact with onnxruntime (NaN equal to NaN)."""
    code_type, scale, zero_point, attributes, opset = PAIR_CASES[case]
    model = _qdq_model(code_type, np.asarray(scale), zero_point, attributes, opset)
    module = lift_model(model)
    quantizers = [m for m in module.modules() if isinstance(m, FakeQuantize)]
    assert len(quantizers) == 1 and quantizers[0].source == ("x.q", "x.dq")
    assert isinstance(quantizers[0].spec, IntSpec if "fp8" not in case else FloatSpec)
    assert_same(model, module, [_qdq_input(float(np.min(scale)))])


def test_fake_quantize_can_be_disabled_and_given_a_rounding() -> None:
    """Disabled, a FakeQuantize is the identity; its rounding hook replaces round-half-even."""
    module = lift_model(_qdq_model(TensorProto.INT8, np.array(0.25), np.array(0), {}, 13))
    quantizer = next(m for m in module.modules() if isinstance(m, FakeQuantize))
    x = torch.tensor([0.3, 0.49, -0.2, 100.0])
    assert module(x).tolist() == [0.25, 0.5, -0.25, 31.75]
    quantizer.rounding = torch.floor
    assert module(x).tolist() == [0.25, 0.25, -0.25, 31.75]
    quantizer.enabled = False
    assert torch.equal(module(x), x)


def test_mismatched_pair_lone_quantize_and_unsaturated_fp8_are_errors() -> None:
    """What the lifter cannot represent exactly is an error naming the node, never an approximation."""
    unsaturated = _qdq_model(TensorProto.FLOAT8E4M3FN, np.array(0.5), np.array(0.0), {"saturate": 0}, 19)
    with pytest.raises(LiftError, match=r"'x\.dq'.*saturate"):
        lift_model(unsaturated)
    model = _qdq_model(TensorProto.INT8, np.array(0.25), np.array(0), {}, 13)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "s2"))
    model.graph.node[1].input[1] = "s2"
    with pytest.raises(LiftError, match=r"'x\.dq'.*different scales"):
        lift_model(model)
    lone = _qdq_model(TensorProto.INT8, np.array(0.25), np.array(0), {}, 13)
    lone.graph.output.append(tensor("q", None))
    with pytest.raises(LiftError, match=r"'x\.q' \(ai\.onnx::QuantizeLinear, opset 13\)"):
        lift_model(lone)


def _quantized_layer_model(code_type: int, opset: int, block: int | None) -> tuple[onnx.ModelProto, np.ndarray]:
    """Conv whose weight is a lone DequantizeLinear of codes (per channel or blocked) and whose
    bias is int32 codes; the dequantized weight is also a graph output."""
    codes = RNG.integers(-7, 8, size=(4, 8, 3, 3))
    if block:
        w_scale, axis = RNG.uniform(0.01, 0.1, size=(4, 8 // block, 3, 3)).astype(np.float32), 1
    else:
        w_scale, axis = RNG.uniform(0.01, 0.1, size=4).astype(np.float32), 0
    attributes = {"axis": axis, **({"block_size": block} if block else {})}
    tensors = [
        _named(_array(code_type, codes), "w_codes"), numpy_helper.from_array(w_scale, "w_scale"),
        _named(_array(TensorProto.INT32, RNG.integers(-500, 500, size=4)), "b_codes"),
        numpy_helper.from_array(np.full(4, 0.001, np.float32), "b_scale"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w_codes", "w_scale"], ["w"], name="w.dq", **attributes),
        helper.make_node("DequantizeLinear", ["b_codes", "b_scale"], ["b"], name="b.dq", axis=0),
        helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    model = onnx_model(nodes, [tensor("x", ["batch", 8, 5, 5])], [tensor("y", None), tensor("w", None)], tensors, opset)
    return model, codes


@pytest.mark.parametrize(
    ("code_type", "opset", "block"),
    [(TensorProto.INT8, 13, None), (TensorProto.INT4, 21, 4), (TensorProto.FLOAT8E4M3FN, 21, None)],
)
def test_dequantized_weight_is_a_parameter_with_identical_numerics(code_type: int, opset: int, block: int | None) -> None:
    """A lone DQ of a weight becomes a parameter holding the dequantized values followed by a
    FakeQuantize of the same scale: the weight is bit-exact, the conv equal up to summation order."""
    model, _ = _quantized_layer_model(code_type, opset, block)
    module = lift_model(model)
    x = random_input((2, 8, 5, 5))
    (y_ort, w_ort), (y_torch, w_torch) = run_ort(model, [x]), run_torch(module, [x])
    np.testing.assert_array_equal(w_torch, w_ort)
    np.testing.assert_allclose(y_torch, y_ort, atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    sources = {s.initializer: s for s in module.finetune_params.values()}
    assert set(sources) == {"w_codes", "b_codes"}
    assert sources["w_codes"].quantizer == "w/dq" and sources["w_codes"].consumers == ("conv",)
    assert sources["w_codes"].transform is not None and sources["b_codes"].transform.spec.dtype == "int32"
    np.testing.assert_array_equal(module.get_parameter("initializers.w_codes").detach().numpy(), w_ort)


def test_extended_dequantize_of_uint16_weight() -> None:
    """A lone ExtendedDequantizeLinear (com.amd.quark) of uint16 per-channel codes feeding a MatMul:
    the weight becomes a parameter with a uint16 transform, bit-exact with onnxruntime."""
    codes = RNG.integers(0, 65536, size=(6, 4))
    tensors = [
        _named(_array(TensorProto.UINT16, codes), "w_codes"),
        numpy_helper.from_array(RNG.uniform(1e-5, 1e-4, size=4).astype(np.float32), "w_scale"),
        _named(_array(TensorProto.UINT16, np.full(4, 32768)), "w_zero"),
    ]
    nodes = [
        helper.make_node(
            "ExtendedDequantizeLinear", ["w_codes", "w_scale", "w_zero"], ["w"], name="w.dq", domain=QUARK_DOMAIN, axis=1
        ),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="fc"),
    ]
    model = onnx_model(nodes, [tensor("x", ["batch", 6])], [tensor("y", None), tensor("w", None)], tensors, 13, [QUARK_DOMAIN])
    module = lift_model(model)
    x = random_input((3, 6))
    (y_ort, w_ort), (y_torch, w_torch) = run_ort(model, [x]), run_torch(module, [x])
    np.testing.assert_array_equal(w_torch, w_ort)
    np.testing.assert_allclose(y_torch, y_ort, atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    (source,) = module.finetune_params.values()
    assert source.initializer == "w_codes" and source.transform.spec.dtype == "uint16" and source.consumers == ("fc",)


def _custom_op_model(op_type: str, domain: str, attributes: dict) -> onnx.ModelProto:
    """x → a custom quantize-dequantize node → y."""
    node = helper.make_node(op_type, ["x"], ["y"], name="x.qdq", domain=domain, **attributes)
    return onnx_model([node], [tensor("x", ["batch", *SHAPE[1:]])], [tensor("y", None)], opset=13, domains=[domain])


BLOCK_CASES = {
    "bfp16": ("BFPQuantizeDequantize", {}),
    "bfp16_round_even_axis2": ("BFPQuantizeDequantize", {"bit_width": 16, "block_size": 4, "axis": 2, "rounding_mode": 2}),
    "mx6": ("BFPQuantizeDequantize", {"bfp_method": "to_bfp_prime", "bit_width": 13, "block_size": 8, "sub_block_size": 2}),
    "mxfp8_e4m3": ("MXQuantizeDequantize", {"element_dtype": "fp8_e4m3", "block_size": 4}),
    "mxfp4": ("MXQuantizeDequantize", {"element_dtype": "fp4_e2m1"}),
    "mxint8": ("MXQuantizeDequantize", {"element_dtype": "int8", "block_size": 8, "rounding_mode": 2}),
}


@pytest.mark.parametrize("domain", [CUSTOM_DOMAIN, QUARK_DOMAIN])
@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_block_format_custom_ops_are_exact(case: str, domain: str) -> None:
    """BFP / Microexponents / OCP MX nodes of both domains lift to FakeQuantize with the node's
    attributes (defaults where absent), bit-exact with their function bodies in onnxruntime."""
    op_type, attributes = BLOCK_CASES[case]
    model = _custom_op_model(op_type, domain, attributes)
    module = lift_model(model)
    quantizer = module.get_submodule("x/qdq")
    assert isinstance(quantizer.spec, BFPSpec if op_type.startswith("BFP") else MXSpec)
    assert all(getattr(quantizer.spec, k) == v for k, v in attributes.items())
    x = random_input(SHAPE) * np.exp2(RNG.integers(-8, 8, size=SHAPE)).astype(np.float32)
    assert_same(model, module, [x])


EXTENDED_CASES = {
    "int32": (TensorProto.INT32, np.array(1e-4), np.array(5)),
    "uint16_per_channel": (TensorProto.UINT16, np.linspace(0.001, 0.01, 8), np.full(8, 32768)),
    "bfloat16": (TensorProto.BFLOAT16, np.array(1.0), np.array(0.0)),
    "float16_scaled": (TensorProto.FLOAT16, np.array(0.5), np.array(0.0)),
}


@pytest.mark.parametrize("domain", [CUSTOM_DOMAIN, QUARK_DOMAIN])
@pytest.mark.parametrize("case", sorted(EXTENDED_CASES))
def test_extended_quantize_dequantize_pair_is_exact(case: str, domain: str) -> None:
    """ExtendedQuantizeLinear → ExtendedDequantizeLinear (int32, uint16, bfloat16, float16 codes) of both domains, bit-exact."""
    code_type, scale, zero_point = EXTENDED_CASES[case]
    tensors = [numpy_helper.from_array(scale.astype(np.float32), "s"), _named(_array(code_type, zero_point), "zp")]
    nodes = [
        helper.make_node("ExtendedQuantizeLinear", ["x", "s", "zp"], ["q"], name="x.q", domain=domain, axis=1),
        helper.make_node("ExtendedDequantizeLinear", ["q", "s", "zp"], ["y"], name="x.dq", domain=domain, axis=1),
    ]
    model = onnx_model(nodes, [tensor("x", ["batch", *SHAPE[1:]])], [tensor("y", None)], tensors, 13, [domain])
    module = lift_model(model)
    x = random_input(SHAPE) * np.exp2(RNG.integers(-12, 12, size=SHAPE)).astype(np.float32)
    assert_same(model, module, [x])
    assert module.get_submodule("x/dq").source == ("x.q", "x.dq")


class _Reader(CalibrationDataReader):
    """A few random batches for onnxruntime's calibration."""

    def __init__(self, name: str, batches: int = 4):
        self.batches = iter([{name: random_input(CNN_INPUT, seed)} for seed in range(batches)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next calibration batch, None when done."""
        return next(self.batches, None)


def quantize_with_onnxruntime(tmp_path: Path) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The float residual CNN and its onnxruntime quantize_static QDQ model (int8, per channel)."""
    float_path, qdq_path = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    float_model = export_legacy(randomized(ResidualCNN()), CNN_INPUT, 13, float_path)
    quantize_static(
        str(float_path), str(qdq_path), _Reader("x"), quant_format=QuantFormat.QDQ, per_channel=True,
        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
    )
    return float_model, onnx.load(str(qdq_path))


def output_step(model: onnx.ModelProto) -> float:
    """The scale of the dequantize that produces the graph output: one code step of the result."""
    producer = next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name)
    return float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == producer.input[1]))


def assert_within_one_step(expected: np.ndarray, actual: np.ndarray, step: float) -> None:
    """Quantized outputs agree except where float32 summation order moved a value across a
    rounding boundary of some activation quantizer: then by about one code step, on few elements."""
    difference = np.abs(expected - actual)
    assert difference.max() <= 2 * step + 1e-6, (difference.max(), step)
    assert np.mean(difference > 1e-6) < 0.05


def test_onnxruntime_quantize_static_model_lifts(tmp_path: Path) -> None:
    """onnxruntime's QDQ output (int8 per-channel weights and int32 biases as lone DQs, activation
    Q→DQ pairs) lifts to parameters and FakeQuantize modules that match onnxruntime."""
    _, qdq = quantize_with_onnxruntime(tmp_path)
    module = lift_model(qdq)
    x = random_input((3, *CNN_INPUT[1:]), seed=9)
    assert_within_one_step(run_ort(qdq, [x])[0], run_torch(module, [x])[0], output_step(qdq))
    sources = list(module.finetune_params.values())
    assert sources and all(s.transform is not None and s.quantizer for s in sources)
    assert {s.transform.spec.dtype for s in sources} == {"int8", "int32"}
    pairs = [m for m in module.modules() if isinstance(m, FakeQuantize) and len(m.source) == 2]
    assert len(pairs) == sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
