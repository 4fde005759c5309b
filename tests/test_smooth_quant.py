"""smooth_quant (finetune.onnx.smooth, finetune.quantize.smooth): the smoothed float graph computes
the float model's function; s is SmoothQuant's formula; 1/s goes into the producer where that is
exact and otherwise into an inserted Mul; layers sharing an input share s; and the point of it all,
an input with outlier channels loses less to per-tensor INT8 once smoothed. Quark's include_sq and
SmoothAlpha map to the section; a bad alpha is a one-line config error."""

from __future__ import annotations

import re
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from finetune.config import ConfigError, load_config
from finetune.quantize import quantize_model
from finetune.quantize.smooth import smooth_model

from .lift_helpers import FLOAT_ATOL, FLOAT_RTOL, onnx_model, run_ort, tensor

RNG = np.random.default_rng(0)
OUTLIERS = np.array([40.0, 1, 1, 0.5, 8, 1, 1, 1], np.float32)  # per input channel: the spread SmoothQuant evens out
A8W8 = load_config({"preset": "A8W8", "smooth_quant": {"alpha": 0.5}})


def weights(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def batches(shape: tuple[int, ...], axis: int = -1, count: int = 4) -> list[dict[str, np.ndarray]]:
    """Calibration feeds of `x` whose channels on `axis` carry OUTLIERS' spread."""
    spread = OUTLIERS.reshape([-1 if k == axis % len(shape) else 1 for k in range(len(shape))])
    return [{"x": (RNG.standard_normal(shape) * spread).astype(np.float32)} for _ in range(count)]


def transformer_like() -> onnx.ModelProto:
    """x -> LayerNorm -> MatMul (q, k: one input) -> Add -> fc1 (MatMul + Add bias) -> Relu -> fc2 (Gemm, transB):
    q and k fold into the norm, fc2 into fc1 (through Relu and the bias), fc1 gets a Mul (q + k)."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="norm", axis=-1),
        helper.make_node("MatMul", ["n", "wq"], ["q"], name="q"), helper.make_node("MatMul", ["n", "wk"], ["k"], name="k"),
        helper.make_node("Add", ["q", "k"], ["qk"], name="qk"),
        helper.make_node("MatMul", ["qk", "w1"], ["h"], name="fc1"), helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    constants = {"gamma": weights(8) * OUTLIERS, "beta": weights(8), "wq": weights(8, 8), "wk": weights(8, 8),
                 "w1": weights(8, 8), "b1": weights(8), "w2": weights(5, 8), "b2": weights(5)}
    return onnx_model(nodes, [tensor("x", [4, 8])], [tensor("y", [4, 5])], constants, opset=17)


def cnn_like() -> onnx.ModelProto:
    """x -> Conv -> Relu -> MaxPool -> depthwise Conv -> grouped Conv (2 groups) -> Mul by a constant -> Conv."""
    nodes = [
        helper.make_node("Conv", ["x", "c1", "cb1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["ar"], name="relu"), helper.make_node("MaxPool", ["ar"], ["p"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("Conv", ["p", "dw"], ["d"], name="depthwise", group=8),
        helper.make_node("Conv", ["d", "gw", "gb"], ["g"], name="grouped", group=2),
        helper.make_node("Mul", ["g", "m"], ["gm"], name="mul"),
        helper.make_node("Conv", ["gm", "c3"], ["y"], name="conv3"),
    ]
    constants = {"c1": weights(8, 8, 3, 3), "cb1": weights(8), "dw": weights(8, 1, 3, 3), "gw": weights(8, 4, 1, 1), "gb": weights(8),
                 "m": np.float32(0.5), "c3": weights(4, 8, 1, 1)}
    return onnx_model(nodes, [tensor("x", [2, 8, 8, 8])], [tensor("y", None)], constants, opset=17)


def assert_same_function(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Equal up to float32 rounding: a relative bound on each element, and an absolute one scaled to
    the output (sums of large terms that cancel keep the absolute error of the terms)."""
    np.testing.assert_allclose(ours, theirs, rtol=FLOAT_RTOL, atol=max(FLOAT_ATOL, 1e-5 * float(np.abs(theirs).max())))


def smoothed(model: onnx.ModelProto, data: list[dict[str, np.ndarray]], **section: object) -> tuple[onnx.ModelProto, dict]:
    config = load_config({"preset": "A8W8", "smooth_quant": section or {"alpha": 0.5}})
    return smooth_model(model, config, data, None, [])


def actions(summary: dict) -> dict[str, str]:
    return {layer["node"]: layer["action"] for layer in summary["layers"]}


@pytest.mark.parametrize(("build", "axis"), [(transformer_like, -1), (cnn_like, 1)])
def test_the_smoothed_float_graph_computes_the_float_function(build, axis: int) -> None:
    model = build()
    shape = tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)
    data = batches(shape, axis)
    result, summary = smoothed(model, data)
    assert summary["skipped"] == 0 and summary["smoothed"] == summary["folded"] + summary["mul_inserted"] > 0
    x = batches(shape, axis, 1)[0]["x"]
    assert_same_function(run_ort(result, [x])[0], run_ort(model, [x])[0])
    assert summary["float_output_relative_change"] < 1e-5


def test_fold_goes_through_relu_maxpool_and_constants_into_conv_producers() -> None:
    _, summary = smoothed(cnn_like(), batches((2, 8, 8, 8), 1))
    details = {layer["node"]: layer["detail"] for layer in summary["layers"]}
    assert actions(summary) == {"conv1": "mul", "depthwise": "folded", "grouped": "folded", "conv3": "folded"}
    assert details["depthwise"] == "folded into conv1 (Conv)" and details["conv3"] == "folded into mul (Mul)"
    assert "x is a graph input" in details["conv1"]


def test_scales_are_smoothquants_formula() -> None:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), computed here independently from the data."""
    w = weights(8, 3)
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor("x", [4, 8])], [tensor("y", [4, 3])], {"w": w})
    data = batches((4, 8))
    for alpha in (0.3, 0.7):
        result, _ = smoothed(model, data, alpha=alpha)
        x_max = np.max([np.abs(feed["x"]).max(axis=0) for feed in data], axis=0).astype(np.float64)
        s = x_max**alpha / np.abs(w).max(axis=1).astype(np.float64) ** (1 - alpha)
        stored = {t.name: numpy_helper.to_array(t) for t in result.graph.initializer}
        np.testing.assert_allclose(stored["x_smooth_inverse"], 1 / s, rtol=1e-6)
        np.testing.assert_allclose(stored["w"], w * s[:, None], rtol=1e-6)


def test_fold_where_every_reader_is_smoothed_and_a_mul_otherwise() -> None:
    """LayerNorm -> MatMul folds into gamma and beta; with a residual Add also reading the norm, or
    with fold: false, a Mul goes before the MatMul instead."""
    base = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="norm", axis=-1),
            helper.make_node("MatMul", ["n", "w"], ["y"], name="mm")]
    residual = [*base, helper.make_node("Add", ["n", "y"], ["z"], name="residual")]
    constants = {"gamma": weights(8), "beta": weights(8), "w": weights(8, 8)}
    data = batches((4, 8))
    folded, summary = smoothed(onnx_model(base, [tensor("x", [4, 8])], [tensor("y", [4, 8])], constants, opset=17), data)
    assert actions(summary) == {"mm": "folded"} and [n.op_type for n in folded.graph.node] == ["LayerNormalization", "MatMul"]
    shared = onnx_model(residual, [tensor("x", [4, 8])], [tensor("z", [4, 8])], constants, opset=17)
    with_mul, summary = smoothed(shared, data)
    assert actions(summary) == {"mm": "mul"} and "also read by residual" in summary["layers"][0]["detail"]
    assert [n.op_type for n in with_mul.graph.node] == ["LayerNormalization", "Mul", "MatMul", "Add"]
    x = data[0]["x"]
    assert_same_function(run_ort(with_mul, [x])[0], run_ort(shared, [x])[0])
    _, summary = smoothed(onnx_model(base, [tensor("x", [4, 8])], [tensor("y", [4, 8])], constants, opset=17), data,
                          alpha=0.5, fold=False)
    assert actions(summary) == {"mm": "mul"} and summary["layers"][0]["detail"].endswith("fold: false")


def test_layers_sharing_an_input_share_one_scale() -> None:
    model = transformer_like()
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    result, summary = smoothed(model, batches((4, 8)))
    assert actions(summary)["q"] == actions(summary)["k"] == "folded"
    stored = {t.name: numpy_helper.to_array(t) for t in result.graph.initializer}
    s_q, s_k = stored["wq"] / original["wq"], stored["wk"] / original["wk"]
    np.testing.assert_allclose(s_q, s_k, rtol=1e-5)
    np.testing.assert_allclose(s_q, s_q[:, :1].repeat(8, axis=1), rtol=1e-5)  # one s per input channel (row)
    x_max = np.max([np.abs(f["x"]).max(0) for f in batches((4, 8))], 0)  # the norm's gamma and beta take 1/s
    assert not np.allclose(stored["gamma"], original["gamma"]) and x_max.size == 8


def test_smoothing_shrinks_the_error_of_per_tensor_int8_inputs() -> None:
    """MatMul over an input with outlier channels at A8W8 (per-tensor int8 input, per-channel int8
    weights): the quantized output is closer to the float one with smoothing."""
    w = weights(8, 16)
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor("x", [32, 8])], [tensor("y", [32, 16])], {"w": w})
    data = batches((32, 8))
    x = batches((32, 8), count=1)[0]["x"]
    reference = run_ort(model, [x])[0]
    errors = {}
    for smooth in (None, {"alpha": 0.5}):
        quantized = quantize_model(model, {"preset": "A8W8", "smooth_quant": smooth}, data)
        errors[smooth is not None] = float(np.abs(run_ort(quantized.model, [x])[0] - reference).mean())
    assert errors[True] < 0.7 * errors[False]


def test_quantize_writes_a_qdq_model_onnxruntime_runs_and_a_summary() -> None:
    model = transformer_like()
    result = quantize_model(model, {"preset": "A8W8", "smooth_quant": {"alpha": 0.5}}, batches((4, 8)))
    x = batches((4, 8), count=1)[0]["x"]
    assert run_ort(result.model, [x])[0].shape == (4, 5)
    smooth = result.summary["smooth_quant"]
    assert (smooth["folded"], smooth["mul_inserted"], smooth["skipped"]) == (3, 1, 0)
    assert {layer["node"]: layer["detail"] for layer in smooth["layers"]}["fc2"] == "folded into fc1 (MatMul)"
    assert_same_function(run_ort(result.float_model, [x])[0], run_ort(model, [x])[0])


def test_a_layer_inside_a_subgraph_is_left_alone_and_a_value_it_reads_is_not_folded() -> None:
    branch = helper.make_graph([helper.make_node("MatMul", ["n", "w2"], ["b"], name="inner")], "branch", [],
                               [tensor("b", [4, 8])])
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="norm", axis=-1),
             helper.make_node("MatMul", ["n", "w"], ["y"], name="outer"),
             helper.make_node("If", ["flag"], ["z"], name="if", then_branch=branch, else_branch=branch)]
    constants = {"gamma": weights(8), "beta": weights(8), "w": weights(8, 8), "w2": weights(8, 8), "flag": np.array(True)}
    model = onnx_model(nodes, [tensor("x", [4, 8])], [tensor("y", [4, 8]), tensor("z", [4, 8])], constants, opset=17)
    result, summary = smoothed(model, batches((4, 8)))
    assert actions(summary) == {"inner": "skipped", "outer": "mul"}
    x = batches((4, 8), count=1)[0]["x"]
    for ours, theirs in zip(run_ort(result, [x]), run_ort(model, [x])):
        assert_same_function(ours, theirs)


def test_quarks_include_sq_and_smooth_alpha_map_to_the_section() -> None:
    assert load_config({"include_sq": True, "extra_options": {"SmoothAlpha": 0.7}}).smooth_quant.alpha == 0.7
    assert load_config({"include_sq": True}).smooth_quant.alpha == 0.5  # Quark's default
    assert load_config({"extra_options": {"SmoothAlpha": 0.7}}).smooth_quant is None  # as in Quark: no effect without include_sq


@pytest.mark.parametrize("alpha", [1.5, -0.1, float("nan"), "half"])
def test_a_bad_alpha_is_a_one_line_config_error(alpha: object) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"preset": "A8W8", "smooth_quant": {"alpha": alpha}})
    assert str(caught.value).startswith("smooth_quant.alpha: ") and "\n" not in str(caught.value)


def test_fast_finetune_tunes_a_smoothed_model_towards_the_smoothed_float_graph() -> None:
    """The pipeline hands recon the smoothed float graph (the float function, in the quantized
    layers' coordinates), and the tuned model is a QDQ model onnxruntime runs."""
    from finetune.pipeline import quantize_and_finetune

    config = {"preset": "A8W8", "smooth_quant": {"alpha": 0.5}, "fast_finetune": {"algorithm": "adaquant", "iterations": 2}}
    result = quantize_and_finetune(transformer_like(), config, batches((4, 8)))
    assert result.report["float_reference"] == "float model" and result.summary["smooth_quant"]["smoothed"] == 4
    assert np.isfinite(run_ort(result.model, [batches((4, 8), count=1)[0]["x"]])[0]).all()


def test_a_smoothed_model_is_not_tuned_towards_the_unsmoothed_float_model() -> None:
    """In two steps, the original float model is not the smoothed model's reference: its weights are
    not the smoothed weights the QDQ model stores as float. tune sets it aside with a warning naming a
    layer and tunes towards the QDQ model's own float weights (the same function), rather than towards
    targets of another model; the smoothed float graph (QuantizeResult.float_model) is accepted."""
    from finetune.config import FastFinetune
    from finetune.recon import finetune_model

    original, data = transformer_like(), batches((4, 8))
    result = quantize_model(original, {"preset": "A8W8", "smooth_quant": {"alpha": 0.5}}, data)
    config = FastFinetune(algorithm="adaquant", iterations=2)
    _, report = finetune_model(result.model, data, config, float_model=original)
    assert report["float_reference"] == "quantized model with quantizers disabled"
    [warning] = [w for w in report["warnings"] if w.get("model") == "float model"]
    assert re.match(r"the weights of \d+ layer\(s\), first \S+, do not quantize as the quantized model's float weights do",
                    warning["reason"])
    _, report = finetune_model(result.model, data, config, float_model=result.float_model)
    assert report["float_reference"] == "float model" and not [w for w in report["warnings"] if "model" in w]


def test_fold_goes_past_shape_readers_and_into_the_operand_of_a_product_that_has_the_channels() -> None:
    """x -> norm, whose output a Shape also reads, -> fc1; p = fc1(n) * Mul(z, c) with z [4, 1]
    (broadcast) -> fc2. fc1 folds into the norm (a Shape reads no element); fc2 folds into fc1's
    output channels, not into c, which would widen the narrow operand z * c."""
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="norm", axis=-1),
             helper.make_node("Shape", ["n"], ["shape"], name="shape"),
             helper.make_node("MatMul", ["n", "w1"], ["a"], name="fc1"),
             helper.make_node("Mul", ["z", "c"], ["b"], name="narrow"),
             helper.make_node("Mul", ["a", "b"], ["p"], name="product"),
             helper.make_node("MatMul", ["p", "w2"], ["y"], name="fc2")]
    constants = {"gamma": weights(8), "beta": weights(8), "w1": weights(8, 8), "c": np.float32(1.5), "w2": weights(8, 3)}
    model = onnx_model(nodes, [tensor("x", [4, 8]), tensor("z", [4, 1])], [tensor("y", [4, 3]), tensor("shape", [2], 7)],
                       constants, opset=17)
    data = [{**feed, "z": RNG.standard_normal((4, 1)).astype(np.float32)} for feed in batches((4, 8))]
    result, summary = smoothed(model, data)
    details = {layer["node"]: layer["detail"] for layer in summary["layers"]}
    assert details == {"fc1": "folded into norm (LayerNormalization)", "fc2": "folded into fc1 (MatMul)"}
    feed = [data[0]["x"], data[0]["z"]]
    assert_same_function(run_ort(result, feed)[0], run_ort(model, feed)[0])
