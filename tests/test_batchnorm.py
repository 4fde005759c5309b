"""BatchNormalization folded into the Conv or Gemm before it (finetune.onnx.batchnorm, QuantConfig
fold_batch_norm, AMD Quark's FoldBatchNorm / optimize_model): the weights and biases the formula
gives, the float function kept up to float rounding, the cases left alone, and PP-OCR's angle
classifier (35 batch norms after Convs without biases) folded whole."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from finetune.config import load_config
from finetune.onnx.batchnorm import fold_batch_norms
from finetune.quantize import quantize_model
from finetune.zoo import text_angle_classifier_onnx_path, text_angle_lines

from .lift_helpers import onnx_model, run_ort, tensor

RNG = np.random.default_rng(0)
CHANNELS = 4


def bn_parameters(prefix: str = "bn") -> dict[str, np.ndarray]:
    return {f"{prefix}_scale": RNG.uniform(0.5, 2, CHANNELS).astype(np.float32),
            f"{prefix}_b": RNG.normal(size=CHANNELS).astype(np.float32),
            f"{prefix}_mean": RNG.normal(size=CHANNELS).astype(np.float32),
            f"{prefix}_var": RNG.uniform(0.1, 3, CHANNELS).astype(np.float32)}


def batch_norm(x: str, y: str, prefix: str = "bn", **attributes: object) -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", [x, *(f"{prefix}_{p}" for p in ("scale", "b", "mean", "var"))], [y],
                            name=prefix, epsilon=1e-3, **attributes)


def conv_bn(with_bias: bool) -> onnx.ModelProto:
    weights = {"w": RNG.normal(size=(CHANNELS, 3, 3, 3)).astype(np.float32), **bn_parameters()}
    if with_bias:
        weights["cb"] = RNG.normal(size=CHANNELS).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", *(["cb"] if with_bias else [])], ["c"], name="conv", pads=[1, 1, 1, 1]),
             batch_norm("c", "y")]
    return onnx_model(nodes, [tensor("x", [2, 3, 6, 6])], [tensor("y", [2, CHANNELS, 6, 6])], weights)


def gemm_bn(trans_b: int) -> onnx.ModelProto:
    w = RNG.normal(size=(CHANNELS, 5) if trans_b else (5, CHANNELS)).astype(np.float32)
    weights = {"w": w, "gb": RNG.normal(size=CHANNELS).astype(np.float32), **bn_parameters()}
    nodes = [helper.make_node("Gemm", ["x", "w", "gb"], ["g"], name="gemm", transB=trans_b), batch_norm("g", "y")]
    return onnx_model(nodes, [tensor("x", [3, 5])], [tensor("y", [3, CHANNELS])], weights)


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


@pytest.mark.parametrize("build", [lambda: conv_bn(True), lambda: conv_bn(False), lambda: gemm_bn(1), lambda: gemm_bn(0)],
                         ids=["conv with bias", "conv without bias", "gemm transB", "gemm"])
def test_a_batch_norm_folds_into_the_layer_before_it(build) -> None:
    """The layer's weight is scaled per output channel by k = scale / sqrt(var + eps) and its bias
    becomes (bias - mean) * k + B (one is added where it had none); the model computes what it did,
    to float rounding, and the input model is unchanged."""
    model = build()
    before = model.SerializeToString()
    folded, changes = fold_batch_norms(model)
    assert model.SerializeToString() == before
    assert changes[0] == "fold_batch_norm: 1 BatchNormalization node(s) folded into the Conv/Gemm before them"
    assert [n.op_type for n in folded.graph.node] == [model.graph.node[0].op_type]
    layer = folded.graph.node[0]
    assert layer.output[0] == "y"
    p = {n: initializer(model, n).astype(np.float64) for n in ("bn_scale", "bn_b", "bn_mean", "bn_var")}
    k = p["bn_scale"] / np.sqrt(p["bn_var"] + np.float64(np.float32(1e-3)))
    w = initializer(model, "w").astype(np.float64)
    axis = 1 if layer.op_type == "Gemm" and not any(a.name == "transB" and a.i for a in layer.attribute) else 0
    shape = [1] * w.ndim
    shape[axis] = CHANNELS
    assert np.array_equal(initializer(folded, "w"), (w * k.reshape(shape)).astype(np.float32))
    bias_name = next(name for name in ("cb", "gb") if any(t.name == name for t in model.graph.initializer)) \
        if len(model.graph.node[0].input) > 2 else None
    bias = initializer(model, bias_name).astype(np.float64) if bias_name else np.zeros(CHANNELS)
    assert np.array_equal(initializer(folded, layer.input[2]), ((bias - p["bn_mean"]) * k + p["bn_b"]).astype(np.float32))
    x = RNG.normal(size=[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    np.testing.assert_allclose(run_ort(folded, [x])[0], run_ort(model, [x])[0], rtol=1e-5, atol=1e-5)


def shared_weight() -> onnx.ModelProto:
    weights = {"w": RNG.normal(size=(CHANNELS, 3, 1, 1)).astype(np.float32), **bn_parameters()}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Conv", ["x", "w"], ["d"], name="other"),
             batch_norm("c", "bn_out"), helper.make_node("Add", ["bn_out", "d"], ["y"])]
    return onnx_model(nodes, [tensor("x", [1, 3, 4, 4])], [tensor("y", [1, CHANNELS, 4, 4])], weights)


def input_read_twice() -> onnx.ModelProto:
    weights = {"w": RNG.normal(size=(CHANNELS, 3, 1, 1)).astype(np.float32), **bn_parameters()}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), batch_norm("c", "bn_out"),
             helper.make_node("Add", ["bn_out", "c"], ["y"])]
    return onnx_model(nodes, [tensor("x", [1, 3, 4, 4])], [tensor("y", [1, CHANNELS, 4, 4])], weights)


def after_relu() -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["r"]), batch_norm("r", "y")]
    return onnx_model(nodes, [tensor("x", [1, CHANNELS, 4, 4])], [tensor("y", [1, CHANNELS, 4, 4])], bn_parameters())


@pytest.mark.parametrize("build", [shared_weight, input_read_twice, after_relu],
                         ids=["weight shared", "layer output read twice", "no layer before it"])
def test_a_batch_norm_stays_where_folding_would_change_something_else(build) -> None:
    model = build()
    folded, changes = fold_batch_norms(model)
    assert changes == [] and folded.SerializeToString() == model.SerializeToString()


def test_quantize_folds_batch_norms_unless_told_not_to() -> None:
    """On by default (as in AMD Quark, whose FoldBatchNorm follows optimize_model, on by default):
    the QDQ model and its float reference hold no BatchNormalization, and the summary says so."""
    model, data = conv_bn(False), [{"x": RNG.normal(size=(2, 3, 6, 6)).astype(np.float32)} for _ in range(2)]
    result = quantize_model(model, "XINT8", data)
    assert "BatchNormalization" not in {n.op_type for n in result.model.graph.node}
    assert "BatchNormalization" not in {n.op_type for n in result.float_model.graph.node}
    assert any(c.startswith("fold_batch_norm: 1 ") for c in result.summary["normalization"])
    kept = quantize_model(model, {"preset": "XINT8", "fold_batch_norm": False}, data)
    assert "BatchNormalization" in {n.op_type for n in kept.model.graph.node}
    with pytest.raises(ValueError, match=r"exclude_nodes\[0\] 'bn' matches no node.*fold_batch_norm folded the model's "
                                         r"BatchNormalization nodes .* or set fold_batch_norm: false"):
        quantize_model(model, {"preset": "XINT8", "exclude_nodes": ["bn"]}, data)
    assert quantize_model(model, {"preset": "XINT8", "exclude_nodes": ["bn"], "fold_batch_norm": False}, data).model


@pytest.mark.parametrize(("options", "folds"), [
    ({}, True), ({"optimize_model": False}, False), ({"optimize_model": False, "extra_options": {"FoldBatchNorm": True}}, True),
    ({"extra_options": {"FoldBatchNorm": False}}, False),
])
def test_quarks_fold_batch_norm_follows_optimize_model(options: dict, folds: bool) -> None:
    config = load_config({"quant_format": "QDQ", "activation_type": "QInt8", "weight_type": "QInt8", **options}, "quark")
    assert config.fold_batch_norm is folds


def test_pp_ocrs_angle_classifier_folds_every_batch_norm_and_computes_what_it_did() -> None:
    """A real MobileNetV3 from Paddle (rapidocr-onnxruntime's file): each of its 35 BatchNormalization
    nodes follows a Conv without a bias; all fold, and the classifier's probabilities move by float
    rounding only."""
    from finetune.onnx.fold import fold_constants
    from finetune.onnx.normalize import normalize_model

    model, _ = normalize_model(onnx.load(text_angle_classifier_onnx_path()))
    fold_constants(model)
    folded, changes = fold_batch_norms(model)
    assert changes[0].startswith("fold_batch_norm: 35 ")
    assert "BatchNormalization" not in {n.op_type for n in folded.graph.node}
    lines = text_angle_lines(8, seed=3)
    np.testing.assert_allclose(run_ort(folded, [lines])[0], run_ort(model, [lines])[0], atol=1e-5)
