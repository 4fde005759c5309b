"""The quantizer: every preset on a real (digits) model runs in onnxruntime and equals its lifted
torch simulation; mixed precision at all three granularities; storage, opsets and the CLI."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from finetune.config import load_config
from finetune.lift import lift_model
from finetune.onnx.normalize import default_opset
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model, quantizer_presets
from finetune.zoo import digits_split, train_digits_cnn

from .lift_helpers import assert_same

EXACT_PRESETS = {"XINT8"}  # power-of-two scales: every Conv/Gemm sum is exact in float32 (assert_same checks it)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN exported to ONNX (opset 17, dynamic batch), calibration and test data."""
    x_train, _, x_test, y_test = digits_split()
    path = tmp_path_factory.mktemp("digits") / "digits.onnx"
    module = train_digits_cnn()
    torch.onnx.export(module, (x_test[:1],), str(path), opset_version=17, input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "n"}}, dynamo=False)
    calibration = [{"x": x_train[i : i + 32].numpy()} for i in range(0, 256, 32)]
    return {"path": path, "module": module, "calibration": calibration, "x": x_test.numpy(), "y": y_test.numpy()}


def run(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    return inference_session(model).run(None, {"x": x})[0]


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(1) == labels).mean())


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


@pytest.mark.parametrize("preset", quantizer_presets())  # presets with a fast_finetune section are the pipeline's
def test_preset_runs_and_equals_its_torch_simulation(digits: dict, preset: str) -> None:
    """onnxruntime and the lifted module agree: exactly where all arithmetic is exact (power-of-two
    scales); elsewhere torch and onnxruntime add Conv/Gemm products in different orders, and a
    last-bit difference can cross a rounding boundary of the next quantizer, so the bound is a
    few output quantization steps (0.1 on logits of magnitude ~20) and the same predictions."""
    quantized = quantize_model(digits["path"], preset, digits["calibration"]).model
    onnx.checker.check_model(quantized)
    expected = run(quantized, digits["x"])
    if preset in EXACT_PRESETS:
        assert_same(quantized, lift_model(quantized), [digits["x"]])
    else:
        with torch.no_grad():
            simulated = lift_model(quantized)(torch.from_numpy(digits["x"])).numpy()
        assert np.abs(simulated - expected).max() <= 0.1
        assert (simulated.argmax(1) == expected.argmax(1)).mean() >= 0.995
    float_accuracy = accuracy(run(digits["path"], digits["x"]), digits["y"])
    assert accuracy(expected, digits["y"]) >= float_accuracy - 0.03


def test_input_model_is_never_modified(digits: dict) -> None:
    before = digits["path"].read_bytes()
    proto = onnx.load(digits["path"])
    snapshot = proto.SerializeToString()
    quantize_model(digits["path"], "A8W8", digits["calibration"])
    quantize_model(proto, "MX4", None)
    assert digits["path"].read_bytes() == before and proto.SerializeToString() == snapshot


def test_compact_storage_keeps_codes_and_the_same_outputs(digits: dict) -> None:
    as_float = quantize_model(digits["path"], "A8W8", digits["calibration"]).model
    compact = quantize_model(digits["path"], {"preset": "A8W8", "weight_storage": "compact"}, digits["calibration"]).model
    assert np.array_equal(run(compact, digits["x"]), run(as_float, digits["x"]))
    stored = {t.data_type for t in compact.graph.initializer if len(t.dims) > 1}
    assert stored == {onnx.TensorProto.INT8}
    assert compact.ByteSize() < as_float.ByteSize() / 3
    assert op_counts(compact)["QuantizeLinear"] == 5  # activations only; weights and biases are DequantizeLinear alone


def test_element_wise_mixed_precision(digits: dict) -> None:
    """BFP16 activations with BF16 weights."""
    config = {"preset": "BFP16", "weight": {"format": "float", "dtype": "bfloat16"}, "bias": "float"}
    model = quantize_model(digits["path"], config, None).model
    counts = op_counts(model)
    assert counts["BFPQuantizeDequantize"] == 5 and counts["ExtendedQuantizeLinear"] == 5
    run(model, digits["x"])


def test_layer_wise_mixed_precision(digits: dict) -> None:
    """Conv/Gemm in BFP16, every other op type (Relu, MaxPool, Flatten) in BF16."""
    bfp = {"format": "bfp", "bfp_method": "to_bfp", "bit_width": 16, "block_size": 8}
    config = {"preset": "BF16", "op_types": "all", "op_type_overrides": {
        "Conv": {"activation": bfp, "weight": bfp, "bias": "float"}, "Gemm": {"activation": bfp, "weight": bfp, "bias": "float"}}}
    model = quantize_model(digits["path"], config, None).model
    consumers = {node.input[0]: node for node in model.graph.node}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "Relu", "MaxPool"):
            producer = next(n for n in model.graph.node if node.input[0] in n.output)
            expected = "BFPQuantizeDequantize" if node.op_type in ("Conv", "Gemm") else "ExtendedDequantizeLinear"
            assert producer.op_type == expected, node.name
    assert consumers
    float_logits = run(digits["path"], digits["x"])
    assert (run(model, digits["x"]).argmax(1) == float_logits.argmax(1)).mean() >= 0.99


def test_tensor_wise_mixed_precision(digits: dict) -> None:
    """INT16 for the sensitive model input in an INT8 model."""
    config = {"preset": "A8W8", "tensor_overrides": {"x": {"format": "int", "dtype": "int16"}}}
    model = quantize_model(digits["path"], config, digits["calibration"]).model
    zero_points = {t.name: t.data_type for t in model.graph.initializer if t.name.endswith("_zero_point")}
    first = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    assert zero_points[first.input[2]] == onnx.TensorProto.INT16
    assert Counter(zero_points.values())[onnx.TensorProto.INT16] == 1


def test_dual_quant_puts_both_formats_on_a_boundary_tensor(digits: dict) -> None:
    """A Conv output read by a Relu in another format gets the producer's then the consumer's QDQ."""
    mx = {"format": "mx", "element_dtype": "int8"}
    base = {"preset": "BF16", "op_types": "all", "op_type_overrides": {"Conv": {"activation": mx, "weight": mx, "bias": "float"}}}
    single = quantize_model(digits["path"], base, None).model
    dual = quantize_model(digits["path"], {**base, "dual_quant": True}, None).model
    relu = next(n for n in dual.graph.node if n.op_type == "Relu")
    chain = []
    value = relu.input[0]
    while (producer := next((n for n in dual.graph.node if value in n.output), None)) is not None and producer.op_type != "Conv":
        chain.append(producer.op_type)
        value = producer.input[0]
    assert chain == ["ExtendedDequantizeLinear", "ExtendedQuantizeLinear", "MXQuantizeDequantize"]
    assert op_counts(dual)["MXQuantizeDequantize"] > op_counts(single)["MXQuantizeDequantize"]


def test_excluded_nodes_stay_float(digits: dict) -> None:
    model = onnx.load(digits["path"])
    gemm = next(n.name for n in model.graph.node if n.op_type == "Gemm")
    quantized = quantize_model(model, {"preset": "A8W8", "exclude_nodes": [gemm]}, digits["calibration"]).model
    node = next(n for n in quantized.graph.node if n.name == gemm)
    assert all(not name.endswith("_qdq") for name in node.input)


def test_opset_is_raised_for_int4_weights(digits: dict) -> None:
    quantized = quantize_model(digits["path"], "INT4_BLOCK32", None).model
    assert default_opset(quantized) == 21
    assert default_opset(onnx.load(digits["path"])) == 17


def test_activation_formats_need_data(digits: dict) -> None:
    with pytest.raises(ValueError, match="calibration data"):
        quantize_model(digits["path"], "A8W8", None)


def test_matmul_blocks_run_along_the_reduction_axis(tmp_path: Path) -> None:
    """A transformer-style Linear on (batch, tokens, features) is a MatMul; its activation and
    weight blocks run along the features, not the tokens."""
    path = tmp_path / "linear.onnx"
    torch.onnx.export(torch.nn.Linear(64, 32, bias=False), (torch.randn(2, 5, 64),), str(path), opset_version=17,
                      input_names=["x"], dynamo=False)
    model = quantize_model(path, "MXFP4", None).model
    axes = {n.input[0]: next(a.i for a in n.attribute if a.name == "axis") for n in model.graph.node if n.op_type == "MXQuantizeDequantize"}
    assert axes == {"x": 2, next(t.name for t in onnx.load(path).graph.initializer): 0}


def test_weight_computed_from_a_constant_is_quantized_and_tuned_as_a_weight() -> None:
    """TorchScript export without constant folding writes a Linear as MatMul(x, Transpose(W)); the
    quantizer folds the Transpose, so the weight gets its per-channel format (not an activation's
    calibrated per-tensor one) and the lifted model can tune it."""
    weight = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), onnx.helper.make_node("MatMul", ["x", "Wt"], ["y"])],
        "linear", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 16])], [onnx.numpy_helper.from_array(weight, "W")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    calibration = [{"x": np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32)} for i in range(4)]
    result = quantize_model(model, "A8W8", calibration)
    assert "folded 1 constant node(s) into initializers" in result.summary["normalization"]
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in result.model.graph.initializer}
    weight_quantizer = next(n for n in result.model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] != "x")
    assert weight_quantizer.input[0] in initializers
    assert initializers[weight_quantizer.input[1]].shape == (16,)  # one scale per output channel
    assert list(lift_model(result.model).finetune_params) == [f"initializers.{weight_quantizer.input[0]}"]
    x = calibration[0]["x"]
    np.testing.assert_allclose(run(result.model, x), x @ weight.T, atol=0.1)


def test_cli_quantize_writes_model_and_summary(digits: dict, tmp_path: Path) -> None:
    data = tmp_path / "calib"
    data.mkdir()
    for i, feed in enumerate(digits["calibration"]):
        np.save(data / f"{i:03d}.npy", feed["x"])
    out = tmp_path / "out" / "digits_mx9.onnx"
    before = digits["path"].read_bytes()
    result = subprocess.run([sys.executable, "-m", "finetune.cli", "quantize", str(digits["path"]), "--config", "A16W8",
                             "--data", str(data), "-o", str(out)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "int16" in result.stdout and "quantized nodes: 5" in result.stdout
    summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
    assert {"role": "activation", "format": "int16", "tensors": 5} in summary["tensors_per_format"]
    assert digits["path"].read_bytes() == before
    assert accuracy(run(out, digits["x"]), digits["y"]) >= 0.95
    missing = subprocess.run([sys.executable, "-m", "finetune.cli", "quantize", str(digits["path"]), "--config", "A8W8",
                              "-o", str(tmp_path / "x.onnx")], capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "calibration data" in missing.stderr


def test_config_object_equals_preset_name(digits: dict) -> None:
    by_name = quantize_model(digits["path"], "MX6", None).model
    by_object = quantize_model(digits["path"], load_config("MX6"), None).model
    assert by_name.SerializeToString() == by_object.SerializeToString()


@pytest.mark.parametrize("preset", ["A8W8", "MX6", "BF16"])
def test_float16_model_is_quantized_in_float32_between_casts(digits: dict, tmp_path: Path, preset: str) -> None:
    """float16 tensors are quantized as FORMATS.md says: computed in float32 and cast back."""
    x_test = torch.from_numpy(digits["x"])
    path = tmp_path / "digits16.onnx"
    torch.onnx.export(copy.deepcopy(digits["module"]).half(), (x_test[:1].half(),), str(path), opset_version=17, input_names=["x"],
                      dynamic_axes={"x": {0: "n"}}, dynamo=False)
    calibration = [{"x": feed["x"].astype(np.float16)} for feed in digits["calibration"]]
    quantized = quantize_model(path, preset, calibration).model
    assert quantized.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    logits = run(quantized, digits["x"].astype(np.float16))
    assert logits.dtype == np.float16
    assert accuracy(logits.astype(np.float32), digits["y"]) >= accuracy(run(path, digits["x"].astype(np.float16)), digits["y"]) - 0.03


INT_PRESETS = ("XINT8", "A8W8", "A16W8", "INT4_PER_CHANNEL", "UINT4_PER_CHANNEL", "INT4_BLOCK32", "UINT4_BLOCK32")


@pytest.mark.parametrize("preset", INT_PRESETS)
def test_int_presets_write_plain_qdq_with_int32_bias_codes(digits: dict, preset: str) -> None:
    """Every INT preset writes a model of the standard domain only (an NPU compiler or another QDQ
    tool takes it): each int32 bias is its codes read by a standard DequantizeLinear (it was a
    com.finetune ExtendedQuantizeLinear/ExtendedDequantizeLinear pair), tuned or not."""
    model = quantize_model(digits["path"], preset, digits["calibration"]).model
    assert {n.domain for n in model.graph.node} == {""} and not model.functions
    first_inputs = {n.input[0]: n for n in model.graph.node}
    biases = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT32 and t.name in first_inputs]
    assert all(first_inputs[t.name].op_type == "DequantizeLinear" for t in biases)
    assert len(biases) == (5 if preset in ("XINT8", "A8W8", "A16W8") else 0)  # INT4 presets leave activations float
    tuned = quantize_and_finetune(digits["path"], {"preset": preset, "fast_finetune": {"iterations": 2}}, digits["calibration"]).model
    assert {n.domain for n in tuned.graph.node} == {""} and not tuned.functions
