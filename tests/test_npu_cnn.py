"""npu_cnn (AMD Quark's enable_npu_cnn): the documented Ryzen AI CNN config loads verbatim and gives
a model whose every scale is a power of two, whose activations are symmetric, whose Concat, pooling,
Pad and Slice share their inputs' and outputs' scale, and which still computes what the float model
does; what the NPU cannot read is refused when the config is loaded, naming the key."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from finetune.config import ConfigError, from_quark, load_config
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model

# the Ryzen AI CNN example of AMD Quark for ONNX's documentation, as users write it
QUARK_NPU_CNN = """\
calibrate_method: PowerOfTwoMethod.MinMSE
activation_type: QuantType.QUInt8
weight_type: QuantType.QInt8
enable_npu_cnn: True
extra_options: {ActivationSymmetric: True}
"""
OP_TYPES = ["Conv", "Concat", "MaxPool", "Add", "Mul"]


def _graph_model(nodes: list[onnx.NodeProto], weights: dict[str, np.ndarray], shape: list[int]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "npu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(value.astype(np.float32), name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def concat_pool_add_model() -> onnx.ModelProto:
    """Two Convs of ranges 8x apart -> Concat -> MaxPool -> Conv, added to the pooled tensor, times
    a constant (an element-wise op with a weight operand)."""
    rng = np.random.default_rng(0)
    weights = {
        "w1": rng.normal(0, 0.3, (4, 3, 3, 3)), "w2": 8 * rng.normal(0, 0.3, (4, 3, 3, 3)),
        "w3": rng.normal(0, 0.2, (8, 8, 1, 1)), "b3": rng.normal(0, 0.1, 8), "k": rng.uniform(0.5, 1.5, (1, 8, 1, 1)),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="/conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w2"], ["b"], name="/conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["a", "b"], ["c"], name="/cat", axis=1),
        helper.make_node("MaxPool", ["c"], ["p"], name="/pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "w3", "b3"], ["d"], name="/conv3"),
        helper.make_node("Add", ["d", "p"], ["e"], name="/add"),
        helper.make_node("Mul", ["e", "k"], ["y"], name="/mul"),
    ]
    return _graph_model(nodes, weights, [1, 8, 4, 4])


def _data(count: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(count)]


def qdq_params(model: onnx.ModelProto) -> dict[str, tuple[float, int, int]]:
    """tensor -> (scale, zero point, zero point's ONNX type) of each QuantizeLinear and of each
    DequantizeLinear of stored codes (int32 biases: named after their float tensor, "b3_int32...")."""
    initializers = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" or (node.op_type == "DequantizeLinear" and node.input[0] in initializers):
            zero_point = initializers[node.input[2]]
            name = node.input[0] if node.op_type == "QuantizeLinear" else node.input[0].split("_int32")[0]
            out[name] = (float(numpy_helper.to_array(initializers[node.input[1]])),
                                  int(numpy_helper.to_array(zero_point)), zero_point.data_type)
    return out


@pytest.fixture(scope="module")
def quark_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("npu") / "ryzen_ai_cnn.yaml"
    path.write_text(QUARK_NPU_CNN, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def quantized(quark_example: Path):
    return quantize_model(concat_pool_add_model(), quark_example, _data())


def test_documented_example_loads_verbatim(quark_example: Path) -> None:
    config = load_config(quark_example)
    assert config.npu_cnn
    activation, weight = config.activation, config.weight
    assert (activation.dtype, activation.symmetric, activation.power_of_two, activation.calibration) == (
        "uint8", True, True, "pot_minmse")
    assert (weight.dtype, weight.granularity, weight.power_of_two) == ("int8", "tensor", True)
    assert all(config.selects("/n", op_type) for op_type in OP_TYPES)


def test_every_scale_is_a_power_of_two_and_activations_symmetric(quantized) -> None:
    params = qdq_params(quantized.model)
    assert {"x", "a", "b", "c", "p", "d", "e", "w1", "w2", "w3", "k"} <= set(params)
    for tensor, (scale, zero_point, code_type) in params.items():
        assert np.log2(scale) == np.round(np.log2(scale)), tensor
        assert zero_point == (128 if code_type == TensorProto.UINT8 else 0), tensor
    assert {params[t][2] for t in ("x", "a", "b", "c", "p", "d", "e")} == {TensorProto.UINT8}


def test_concat_and_pool_share_one_scale(quantized) -> None:
    params = qdq_params(quantized.model)
    assert params["a"][0] == params["b"][0] == params["c"][0] == params["p"][0]


def test_quantized_model_computes_what_the_float_model_does(quantized) -> None:
    feeds = _data(2)[1]
    (expected,) = inference_session(concat_pool_add_model()).run(None, feeds)
    (actual,) = inference_session(quantized.model).run(None, feeds)
    cosine = float(np.sum(expected * actual) / (np.linalg.norm(expected) * np.linalg.norm(actual)))
    assert cosine > 0.995
    assert np.max(np.abs(actual - expected)) < 0.05 * np.max(np.abs(expected))


def test_summary_lists_every_alignment_and_the_constraints_not_applied(quantized) -> None:
    alignments = quantized.summary["npu_cnn_alignments"]
    scales = {a["tensor"]: a for a in alignments if "scale_before" in a}
    assert scales["a"]["nodes"] == ["/cat (Concat)", "/pool (MaxPool)"]
    assert scales["a"]["scale_before"] < scales["a"]["scale_after"] == qdq_params(quantized.model)["a"][0]
    formats = [a for a in alignments if "format_before" in a]
    assert formats == [{"nodes": ["/mul (Mul)"], "tensor": "k", "format_before": "int8", "format_after": "uint8"}]
    reasons = [w["reason"] for w in quantized.summary["warnings"] if w.get("config") == "npu_cnn"]
    assert len(reasons) == 1 and "AdjustShiftCut" in reasons[0] and "not applied" in reasons[0]


def test_alignment_changes_scales_that_differed(caplog: pytest.LogCaptureFixture) -> None:
    model, data = concat_pool_add_model(), _data()
    base = {"preset": "XINT8", "op_types": OP_TYPES}
    before = qdq_params(quantize_model(model, base, data).model)
    assert len({before[t][0] for t in ("a", "b", "c")}) > 1
    with caplog.at_level(logging.INFO, logger="finetune.quantize.npu"):
        result = quantize_model(model, {**base, "npu_cnn": True}, data)
    after = qdq_params(result.model)
    largest = max(before[t][0] for t in ("a", "b", "c", "p"))
    assert after["a"][0] == after["b"][0] == after["c"][0] == after["p"][0] == largest
    changed = {a["tensor"] for a in result.summary["npu_cnn_alignments"]}
    assert changed == {t for t in ("a", "b", "c", "p") if before[t][0] != largest}
    assert any("npu_cnn: scale of tensor" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert any("not applied" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert after["b3"][0] == after["p"][0] * after["w3"][0]


def test_pad_average_pool_and_slice_keep_their_input_scale() -> None:
    """And the int32 bias of the Conv after them follows its input's raised scale."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="/conv1"),
        helper.make_node("Pad", ["a", "pads"], ["b"], name="/pad"),
        helper.make_node("AveragePool", ["b"], ["c"], name="/avg", kernel_shape=[3, 3]),
        helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["d"], name="/slice"),
        helper.make_node("Conv", ["d", "w2", "b2"], ["y"], name="/conv2"),
    ]
    weights = {"w1": rng.normal(0, 0.3, (4, 3, 1, 1)), "w2": rng.normal(0, 0.3, (4, 4, 1, 1)), "b2": rng.normal(0, 0.1, 4)}
    model = _graph_model(nodes, weights, [1, 4, 4, 8])
    for name, value in {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "starts": [2], "ends": [6], "axes": [2]}.items():
        model.graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    result = quantize_model(model, {"preset": "XINT8", "npu_cnn": True}, _data())
    params = qdq_params(result.model)
    assert params["a"][0] == params["b"][0] == params["c"][0] == params["d"][0]
    assert "d" in {a["tensor"] for a in result.summary["npu_cnn_alignments"]}
    assert params["b2"][0] == params["d"][0] * params["w2"][0]


def test_enable_dpu_is_the_former_name_and_the_int32_bias_is_said(caplog: pytest.LogCaptureFixture) -> None:
    options = yaml_options()
    options["enable_dpu"] = options.pop("enable_npu_cnn")
    with caplog.at_level(logging.WARNING):
        assert from_quark(options).npu_cnn
    assert any("Int32Bias" in r.getMessage() for r in caplog.records)
    assert not from_quark({**yaml_options(), "enable_npu_cnn": False}).npu_cnn


def yaml_options() -> dict:
    return yaml.safe_load(QUARK_NPU_CNN)


NATIVE_REFUSALS = [
    ({"preset": "XINT8", "npu_cnn": True, "activation": {"format": "float", "dtype": "bfloat16"}}, "activation.format"),
    ({"preset": "MX6", "npu_cnn": True}, "activation.format"),
    ({"preset": "A8W8", "npu_cnn": True}, "activation.power_of_two"),
    ({"preset": "XINT8", "npu_cnn": True, "weight": {"granularity": "channel"}}, "weight.granularity"),
    ({"preset": "XINT8", "npu_cnn": True, "activation": {"symmetric": False}}, "activation.symmetric"),
    ({"preset": "XINT8", "npu_cnn": True, "op_type_overrides": {"Add": {"activation": {"format": "mx"}}}},
     "op_type_overrides['Add'].activation.format"),
    ({"preset": "XINT8", "npu_cnn": True, "tensor_overrides": {"x": {"format": "int", "dtype": "int8"}}},
     "tensor_overrides['x'].power_of_two"),
    ({"preset": "XINT8", "npu_cnn": True, "dual_quant": True}, "dual_quant"),
]
QUARK_REFUSALS = [
    ({"calibrate_method": "CalibrationMethod.MinMax"}, "calibrate_method"),
    ({"per_channel": True}, "per_channel"),
    ({"activation_type": "QuantType.QInt16", "calibrate_method": "CalibrationMethod.Percentile"}, "calibrate_method"),
    ({"extra_options": {"ActivationSymmetric": True, "AlignConcat": False}}, "extra_options.AlignConcat"),
    ({"enable_npu_cnn": False, "extra_options": {"AlignPool": True}}, "extra_options.AlignPool"),
    ({"quant_format": "VitisQuantFormat.BFPFixNeuron"}, "activation_type"),
]


@pytest.mark.parametrize(("mapping", "key"), NATIVE_REFUSALS, ids=[k for _, k in NATIVE_REFUSALS])
def test_native_refusals_name_the_key(mapping: dict, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(mapping)
    assert error.value.path == key and "\n" not in str(error.value)


@pytest.mark.parametrize(("changes", "key"), QUARK_REFUSALS, ids=[k for _, k in QUARK_REFUSALS])
def test_quark_refusals_name_the_option(changes: dict, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        from_quark({**yaml_options(), **changes})
    assert error.value.path == key and "\n" not in str(error.value)
