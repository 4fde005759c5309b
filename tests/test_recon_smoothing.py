"""carry_smoothing: a quantizer's input smoothing (SmoothQuant's Mul before an input quantizer,
the weight scaled inversely) goes into the float model, so that the float model stays the
reference: same function, weights in the quantized model's coordinates. Layouts it does not
handle are left as they are. On NNCF's own SmoothQuant model: tests/test_third_party.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from finetune.recon.data.smoothing import carry_smoothing

from .lift_helpers import FLOAT_ATOL, FLOAT_RTOL, onnx_model, run_ort, tensor

RNG = np.random.default_rng(0)
M = np.array([0.5, 2.0, 4.0, 0.25], np.float32)  # one scale per input channel
QDQ = {"s": np.float32(0.05), "zp": np.int8(0)}


def models(layer: onnx.NodeProto, weight: np.ndarray) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The float model x -> layer -> y, and its quantized form: x -> Mul(m) -> Q -> DQ -> layer."""
    io = ([tensor("x", [2, 4])], [tensor("y", None)])
    float_model = onnx_model([layer], *io, {"w": weight})
    smoothed = onnx.NodeProto()
    smoothed.CopyFrom(layer)
    smoothed.input[list(layer.input).index("x")] = "dq"
    nodes = [helper.make_node("Mul", ["x", "m"], ["xm"], name="smooth"),
             helper.make_node("QuantizeLinear", ["xm", "s", "zp"], ["q"], name="q"),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["dq"], name="dq"), smoothed]
    return float_model, onnx_model(nodes, *io, {"w": weight, "m": M, **QDQ})


@pytest.mark.parametrize(("op_type", "attributes", "axis"), [("MatMul", {}, 0), ("Gemm", {}, 0), ("Gemm", {"transB": 1}, 1)])
def test_the_mul_goes_into_the_float_model_and_the_weight_is_divided_along_its_input_channels(
        op_type: str, attributes: dict, axis: int) -> None:
    weight = RNG.standard_normal((4, 3) if axis == 0 else (3, 4)).astype(np.float32)
    float_model, quantized = models(helper.make_node(op_type, ["x", "w"], ["y"], name="layer", **attributes), weight)
    carried = onnx.ModelProto()
    carried.CopyFrom(float_model)
    assert carry_smoothing(carried, quantized) == ["layer: input scaled by smooth, weight by its inverse"]
    assert [n.op_type for n in carried.graph.node] == ["Mul", op_type] and carried.graph.node[1].input[0] == "xm"
    divided = numpy_helper.to_array(next(t for t in carried.graph.initializer if t.name == "w"))
    assert np.array_equal(divided, weight / (M[:, None] if axis == 0 else M[None, :]))
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run_ort(carried, [x])[0], run_ort(float_model, [x])[0], rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


def test_a_layer_reading_the_smoothed_value_as_its_weight_operand_is_left_as_it_is() -> None:
    """MatMul(w, x): x's channels are not the weight's rows, so nothing is carried (the weight check
    then names the layer, as for any float model that is not the reference)."""
    weight = RNG.standard_normal((3, 2)).astype(np.float32)
    float_model, quantized = models(helper.make_node("MatMul", ["w", "x"], ["y"], name="layer"), weight)
    carried = onnx.ModelProto()
    carried.CopyFrom(float_model)
    assert carry_smoothing(carried, quantized) == [] and carried == float_model
