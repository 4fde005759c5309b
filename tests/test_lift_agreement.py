"""The lifted module computes what onnxruntime computes, and a run refuses one that does not:
quantized rank-0 and one-element tensors in every block format (in AMD Quark's own form and as our
quantizer writes them) lift to onnxruntime's bits; AMD Quark's transformers whose attention scale
goes through a block format lift to onnxruntime's logits, node by node, and tune; a converter made
subtly wrong is refused before any tuning, in one line naming its node; a last-bit difference that
crosses a quantizer's rounding boundary is not."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from finetune.config import FastFinetune, load_config
from finetune.formats import NAMED_BLOCK_FORMATS
from finetune.lift import FakeQuantize, LiftMismatch, builder, check_lifted, lift_model
from finetune.lift.agreement import FLOAT32_BOUND, first_disagreeing_node
from finetune.onnx import QUARK_DOMAIN
from finetune.quantize import quantize_model
from finetune.recon import finetune_model

from .lift_helpers import assert_same, run_ort, run_torch
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .vectors import VectorSet, load_scalar_vector_sets

FIXTURES = Path(__file__).parent / "fixtures" / "third_party"
QUARK_TRANSFORMERS = ["transformer.MX6", "transformer.MXFP4E2M1", "transformer.MXINT8"]  # attention scale in a block format
SCALAR_SETS = load_scalar_vector_sets()
SCALE = np.float32(8**-0.25)  # the digits transformer's attention scale (head size 8), off every block grid
SCALAR_SHAPES = {"rank 0": [], "one element": [1]}


@pytest.fixture(scope="module")
def digits() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "data.npz") as data:
        return {"calibration": data["calibration"], "check": data["check"]}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """The largest difference over the largest expected magnitude."""
    return float(np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max())


# ---------------------------------------------------------------- quantized scalars in every block format


def scaled_model(op_type: str, attributes: dict, shape: list[int], domain: str = QUARK_DOMAIN) -> onnx.ModelProto:
    """x [N, 4, 16] -> block node (last axis) -> Mul by a scale of `shape` through the same format
    (its `attributes`, as a vector set gives them) -> block node -> y, the scale declared with its
    shape as AMD Quark declares its rank-0 attention scale."""
    node = {"axis": -1, **{k: v for k, v in attributes.items() if k != "axis"}}
    nodes = [
        helper.make_node(op_type, ["x"], ["xq"], name="x_qdq", domain=domain, **node),
        helper.make_node(op_type, ["scale"], ["scale_q"], name="scale_qdq", domain=domain, **attributes),
        helper.make_node("Mul", ["xq", "scale_q"], ["scaled"], name="mul"),
        helper.make_node(op_type, ["scaled"], ["y"], name="y_qdq", domain=domain, **node),
    ]
    graph = helper.make_graph(
        nodes, "scaled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16])],
        [numpy_helper.from_array(np.full(shape, SCALE, np.float32), "scale")],
        value_info=[helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name in ("scale", "scale_q")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("shape", SCALAR_SHAPES.values(), ids=SCALAR_SHAPES.keys())
@pytest.mark.parametrize("vectors", SCALAR_SETS, ids=lambda v: v.name)
def test_a_quantized_scalar_in_quarks_form_lifts_to_onnxruntimes_bits(vectors: VectorSet, shape: list[int]) -> None:
    """A rank-0 or one-element scale through a block node (every format and axis of Quark's scalar
    vectors) multiplying a block-quantized activation: the lifted module gives onnxruntime's bits,
    and the check refuses nothing."""
    model = scaled_model(vectors.op_type, vectors.attributes, shape)
    x = np.random.default_rng(0).standard_normal((3, 4, 16)).astype(np.float32) * 4
    module = lift_model(model)
    assert_same(model, module, [x])
    assert first_disagreeing_node(model, module, {"x": x}) is None
    check_lifted(model, module, {"x": x})


def float_scaled_model(shape: list[int]) -> onnx.ModelProto:
    """The float model our quantizer gets: x [N, 8] -> MatMul W -> Mul by a scale of `shape` -> MatMul V -> y."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="first"), helper.make_node("Mul", ["h", "scale"], ["s"], name="mul"),
             helper.make_node("MatMul", ["s", "v"], ["y"], name="second")]
    graph = helper.make_graph(
        nodes, "float", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.standard_normal((8, 32)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "v"),
         numpy_helper.from_array(np.full(shape, SCALE, np.float32), "scale")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shape", SCALAR_SHAPES.values(), ids=SCALAR_SHAPES.keys())
@pytest.mark.parametrize("preset", sorted(NAMED_BLOCK_FORMATS))
def test_a_scalar_our_quantizer_quantizes_lifts_to_onnxruntime(preset: str, shape: list[int]) -> None:
    """With every op type quantized, our quantizer puts the scale through the block format too;
    lifted, the model gives onnxruntime's outputs (within float sums: two MatMuls) and every node
    gives onnxruntime's values on onnxruntime's inputs."""
    x = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32)
    config = dataclasses.replace(load_config(preset), op_types="all")
    model = quantize_model(float_scaled_model(shape), config, [{"x": x}]).model
    assert any(node.input[0] == "scale" and node.domain for node in model.graph.node)
    module = lift_model(model)
    expected = run_ort(model, [x])[0]
    assert relative_error(run_torch(module, [x])[0], expected) <= FLOAT32_BOUND
    assert first_disagreeing_node(model, module, {"x": x}) is None


# ---------------------------------------------------------------- AMD Quark's transformers


@pytest.mark.parametrize("case", QUARK_TRANSFORMERS)
def test_a_quark_transformer_lifts_to_onnxruntimes_logits(case: str, digits: dict) -> None:
    """The held-out rows' logits agree within what float sums give (here bit for bit), every node
    gives onnxruntime's values on onnxruntime's inputs, and the check passes."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    module = lift_model(model)
    x = digits["check"]
    assert relative_error(run_torch(module, [x])[0], run_ort(model, [x])[0]) <= FLOAT32_BOUND
    assert first_disagreeing_node(model, module, {"x": x}) is None
    check_lifted(model, module, {"x": x})


@pytest.mark.parametrize("case", QUARK_TRANSFORMERS)
def test_a_quark_transformer_tunes_and_is_written_back(case: str, digits: dict) -> None:
    """A short AdaQuant run lowers the summed loss and writes the tuned weights into Quark's graph."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    feeds = [{"x": digits["calibration"][i : i + 16]} for i in range(0, 64, 16)]
    tuned, report = finetune_model(model, feeds, FastFinetune(algorithm="adaquant", iterations=10, batch_size=16),
                                   FIXTURES / "transformer.float.onnx")
    assert sum(u["loss_after"] for u in report["units"]) < sum(u["loss_before"] for u in report["units"])
    assert list(tuned.graph.node) == list(model.graph.node) and list(tuned.graph.initializer) != list(model.graph.initializer)
    assert run_ort(tuned, [digits["check"]])[0].shape == (len(digits["check"]), 10)


# ---------------------------------------------------------------- a converter that computes otherwise


class _Scaled(nn.Module):
    """A converted module whose output is off by a relative `error`."""

    def __init__(self, inner: nn.Module, error: float) -> None:
        super().__init__()
        self.inner, self.error = inner, error

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args) * (1 + self.error)


def break_converter(monkeypatch: pytest.MonkeyPatch, op_type: str, error: float) -> None:
    """Make the lifter's converter of `op_type` return modules whose output is off by `error`."""
    found = builder.find_converter

    def find(domain: str, op: str, opset: int):
        converter = found(domain, op, opset)
        if op != op_type:
            return converter

        def convert(node, graph) -> OperationConverterResult:
            result = converter(node, graph)
            return OperationConverterResult(torch_module=_Scaled(result.torch_module, error), onnx_mapping=result.onnx_mapping)

        return convert

    monkeypatch.setattr(builder, "find_converter", find)


def test_a_subtly_wrong_converter_is_refused_before_tuning(monkeypatch: pytest.MonkeyPatch, digits: dict) -> None:
    """LayerNormalization lifted 0.1 % off (an epsilon or a scale read wrongly would do as much):
    tuning stops before any unit, in one line naming the first such node."""
    break_converter(monkeypatch, "LayerNormalization", 1e-3)
    model = onnx.load(FIXTURES / "transformer.MX6.onnx")
    feeds = [{"x": digits["calibration"][i : i + 16]} for i in range(0, 64, 16)]
    pattern = (r"^the lifted module computes node '/encoder/layers\.0/norm1/LayerNormalization' \(LayerNormalization\) "
               r"other than onnxruntime: [^\n]*report this with the model$")
    with pytest.raises(LiftMismatch, match=pattern):
        finetune_model(model, feeds, FastFinetune(algorithm="adaquant", iterations=5, batch_size=16))


def test_a_wrong_quantizer_is_named_exactly(digits: dict) -> None:
    """A quantizer is compared bit for bit on onnxruntime's input: one whose values are off by one
    part in a million (far inside the float-sum bound) is named."""
    model = onnx.load(FIXTURES / "transformer.MXINT8.onnx")
    module = lift_model(model)
    target = "/encoder/layers.0/self_attn/Softmax_output_0_DequantizeLinear"
    quantizer = module.get_submodule(target.replace(".", "/"))
    assert isinstance(quantizer, FakeQuantize)
    quantizer.forward = lambda x: FakeQuantize.forward(quantizer, x) * (1 + 1e-6)
    found = first_disagreeing_node(model, module, {"x": digits["check"]})
    assert found.startswith(f"the lifted module computes node '{target}' (MXQuantizeDequantize) other than onnxruntime")
    assert "where none (a quantizer on the same input gives the same bits) is allowed" in found and "\n" not in found


def flip_model() -> onnx.ModelProto:
    """x -> Mul by 1.25 -> MXFP4 block (last axis) -> y: [2, 4] * 1.25 = [2.5, 5] is a block of
    scale 1 whose values both lie on rounding ties of E2M1 (steps of 1 between 2 and 4, of 2 above),
    which round to even: [2, 4]."""
    nodes = [helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
             helper.make_node("MXQuantizeDequantize", ["m"], ["y"], name="qdq", domain=QUARK_DOMAIN,
                              element_dtype="fp4_e2m1", axis=-1, block_size=32)]
    graph = helper.make_graph(
        nodes, "flip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [numpy_helper.from_array(np.float32(1.25), "c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(QUARK_DOMAIN, 1)])


def test_a_rounding_flip_after_a_last_bit_difference_is_not_refused(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The Mul one unit in the last place off (as a float sum in another order can be) moves both
    values off their ties, and the quantizer then rounds them a whole step up: the outputs differ
    past the bound, but every node agrees on onnxruntime's inputs, so the module is kept (and it is said)."""
    break_converter(monkeypatch, "Mul", 2.0**-23)
    model, x = flip_model(), np.array([[2.0, 4.0]], np.float32)
    module = lift_model(model)
    lifted, expected = run_torch(module, [x])[0], run_ort(model, [x])[0]
    assert expected.tolist() == [[2.0, 4.0]] and lifted.tolist() == [[3.0, 6.0]]
    with caplog.at_level(logging.INFO, logger="finetune.lift.agreement"):
        check_lifted(model, module, {"x": x})
    assert "crossed a quantizer's rounding boundary" in caplog.text
