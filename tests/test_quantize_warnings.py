"""Nothing the quantizer cannot do as configured passes silently: what cannot work is a ValueError
before calibration (an opset too old for a format, NaN/Inf weights, config entries that name
nothing in the model, a fast_finetune section outside the pipeline), and what works other than
configured is a WARNING and an entry of the summary's `warnings` (inputs of unknown type, failed
shape inference, compact storage without a compact form, one-element block tensors, MX rounding
modes without effect), which the command prints and writes into its summary JSON."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from finetune.cli import main
from finetune.config import load_config
from finetune.notices import Notice
from finetune.onnx.normalize import normalize_model
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import format_summary, quantize_model
from finetune.quantize.checks import ONE_ELEMENT
from finetune.quantize.plan import UNTYPED

from .lift_helpers import onnx_model, run_ort, tensor

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 32)).astype(np.float32)
INT4_WEIGHTS = {"weight": {"format": "int", "dtype": "int4", "granularity": "channel"}}


def linear(weight: np.ndarray = W, x_shape: tuple = ("n", 64), opset: int = 17) -> onnx.ModelProto:
    """y = MatMul(x, w) + b, with nodes `mm` and `add`."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Add", ["h", "b"], ["y"], name="add")]
    bias = np.zeros(weight.shape[1], np.float32)
    return onnx_model(nodes, [tensor("x", list(x_shape))], [tensor("y", None)], {"w": weight, "b": bias}, opset=opset)


def behind_custom_op(import_domain: bool) -> onnx.ModelProto:
    """MatMul(Foo(x), w) with Foo a custom-domain op onnx cannot type; its domain imported or not
    (then onnx's shape inference fails on the model)."""
    nodes = [helper.make_node("Foo", ["x"], ["t"], name="foo", domain="my.ops"), helper.make_node("MatMul", ["t", "w"], ["y"], name="mm")]
    return onnx_model(nodes, [tensor("x", [2, 64])], [tensor("y", None)], {"w": W}, opset=17,
                      domains=["my.ops"] if import_domain else [])


def warnings_of(result_summary: dict, reason_start: str) -> list[dict]:
    return [w for w in result_summary["warnings"] if w["reason"].startswith(reason_start)]


def test_an_input_of_unknown_type_stays_float_and_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        result = quantize_model(behind_custom_op(import_domain=True), "MXFP4", None)
    assert result.summary["warnings"] == [{"tensor": "t", "reason": UNTYPED}]
    assert next(n for n in result.model.graph.node if n.name == "mm").input[0] == "t"
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "tensor t: stays float" in caplog.text


def test_a_custom_op_output_typed_by_the_exporter_keeps_its_type_and_is_quantized() -> None:
    """onnx cannot type a custom op's output, but the model's own value_info may: that type is kept
    through constant folding's type refresh (it was dropped, so the MatMul behind stayed float)."""
    model = behind_custom_op(import_domain=True)
    model.graph.value_info.append(helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2, 64]))
    result = quantize_model(model, "MXFP4", None)
    assert result.summary["warnings"] == [] and result.summary["quantized_nodes"] == 1


def test_failed_shape_inference_is_a_warning_and_in_the_summary(caplog: pytest.LogCaptureFixture) -> None:
    model = behind_custom_op(import_domain=False)
    notices: list[Notice] = []
    with caplog.at_level(logging.WARNING, logger="finetune.onnx.normalize"):
        _, changes = normalize_model(model, notices=notices)
    assert [(n.subject, n.reason.split(" (")[0]) for n in notices] == [("model", "onnx shape inference failed")]
    assert "No opset import for domain my.ops" in caplog.text and not any("shape inference" in c for c in changes)
    result = quantize_model(model, "MXFP4", None)  # folding constants goes on with the stored shapes
    assert [w["model"] for w in warnings_of(result.summary, "onnx shape inference failed")] == ["test"]
    assert {"tensor": "t", "reason": UNTYPED} in result.summary["warnings"]


def test_an_opset_the_converter_cannot_reach_is_an_error_naming_format_and_opsets() -> None:
    """int4 needs QuantizeLinear-21; onnx cannot convert a model with an op it does not know, and
    the int4 nodes would make an invalid model: refused before calibration (no data needed to see it)."""
    model = linear()
    model.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"], name="unknown"))
    model.graph.output[0].name = "z"
    with pytest.raises(ValueError, match=r"^int4 on tensor 'w' needs default-domain opset 21, but the model has opset 17 "
                                         r"\(kept opset 17: onnx's version converter could not upgrade to 21 .*convert the model"):
        quantize_model(model, {**INT4_WEIGHTS, "activation": {"format": "int"}}, None)
    assert quantize_model(linear(), INT4_WEIGHTS, None).summary["warnings"] == []


@pytest.mark.parametrize("preset", ["MX4", "MXFP4", "BF16", "BFP16"])
def test_compact_storage_a_format_cannot_have_is_reported_per_weight(preset: str) -> None:
    result = quantize_model(linear(), {"preset": preset, "weight_storage": "compact"}, None)
    assert [w["tensor"] for w in warnings_of(result.summary, "weight_storage compact")] == ["w"]
    assert onnx.numpy_helper.to_array(next(t for t in result.model.graph.initializer if t.name == "w")).dtype == np.float32


def test_compact_storage_of_int_weights_warns_of_nothing() -> None:
    assert quantize_model(linear(), {**INT4_WEIGHTS, "weight_storage": "compact"}, None).summary["warnings"] == []


def test_one_element_tensors_pass_block_formats_as_they_are_and_are_listed(caplog: pytest.LogCaptureFixture) -> None:
    """x and w of one element each (Quark's kernels leave them): numerics kept, each listed, one WARNING line."""
    model = linear(weight=np.array([[1.3]], np.float32), x_shape=(1, 1))
    for preset in ("MXFP4", "BFP16"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            result = quantize_model(model, preset, None)
        assert result.summary["warnings"] == [{"tensor": "x", "reason": ONE_ELEMENT}, {"tensor": "w", "reason": ONE_ELEMENT}]
        assert len(caplog.records) == 1 and "2 tensors (x, w)" in caplog.text
        x = np.array([[0.7]], np.float32)
        assert run_ort(result.model, [x])[0] == run_ort(model, [x])[0]
    assert quantize_model(linear(), "MXFP4", None).summary["warnings"] == []  # shape (n, 64): not known to be one element


def test_an_mx_rounding_mode_float_elements_ignore_is_reported() -> None:
    config = {"preset": "MXFP4", "weight": {"rounding_mode": 1}}
    result = quantize_model(linear(), config, None)
    assert result.summary["warnings"] == [{"tensor": "w", "reason": "MX rounding_mode 1 has no effect: fp4_e2m1 elements "
                                                                    "always round half to even (as AMD Quark's kernels do)"}]
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    assert np.array_equal(run_ort(result.model, [x])[0], run_ort(quantize_model(linear(), "MXFP4", None).model, [x])[0])
    assert quantize_model(linear(), "MXINT8", None).summary["warnings"] == []  # int8 elements honour rounding_mode 2


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("preset", ["XINT8", "BF16", "MX4"])
def test_a_weight_with_nan_or_inf_is_an_error_naming_it(preset: str, bad: float) -> None:
    weight = W.copy()
    weight[3, 5] = bad
    with pytest.raises(ValueError, match=r"^NaN or Inf in weights to quantize: 'w' \(1 of 2048 values\)"):
        quantize_model(linear(weight), preset, None)  # before calibration: XINT8 would ask for data first


def test_config_entries_that_match_nothing_are_an_error_naming_each() -> None:
    mx = {"format": "mx", "element_dtype": "int8"}
    config = {"preset": "MXFP4", "tensor_overrides": {"xx": mx}, "node_overrides": {"mm1": {"weight": mx}},
              "exclude_nodes": ["ad", "/head/.*"], "op_type_overrides": {"Matmul": {"weight": mx}}}
    with pytest.raises(ValueError) as raised:
        quantize_model(linear(), config, None)
    assert str(raised.value) == (
        "the config names what the model does not have: tensor_overrides['xx'] names no tensor (did you mean 'x'?); "
        "node_overrides['mm1'] names no node (did you mean 'mm'?); exclude_nodes[0] 'ad' matches no node (did you mean "
        "'add'?); exclude_nodes[1] '/head/.*' matches no node; op_type_overrides['Matmul'] is no ONNX op type (did you "
        "mean 'MatMul'?)")
    matched = {"preset": "MXFP4", "tensor_overrides": {"x": mx}, "node_overrides": {"mm": {"weight": mx}}, "exclude_nodes": ["a.d"]}
    assert quantize_model(linear(), matched, None).summary["warnings"] == []


def test_a_quark_mixed_precision_tensor_that_matches_nothing_is_an_error() -> None:
    quark = {"quant_format": "QuantFormat.QDQ", "activation_type": "QuantType.QInt8", "weight_type": "QuantType.QInt8",
             "specific_tensor_precision": True, "extra_options": {"MixedPrecisionTensor": {"QuantType.QInt16": ["h0"]}}}
    with pytest.raises(ValueError, match=r"tensor_overrides\['h0'\] names no tensor \(did you mean 'h'\?\)"):
        quantize_model(linear(), quark, None)  # before calibration: no data is asked for


def test_quark_mixed_precision_tensors_apply_only_with_specific_tensor_precision(caplog: pytest.LogCaptureFixture) -> None:
    """As in Quark, MixedPrecisionTensor has no effect unless specific_tensor_precision is true
    (it was applied whatever the switch said): said at WARNING."""
    quark = {"activation_type": "QuantType.QInt8", "weight_type": "QuantType.QInt8",
             "extra_options": {"MixedPrecisionTensor": {"QuantType.QInt16": ["h"]}}}
    with caplog.at_level(logging.WARNING):
        assert load_config(quark, config_format="quark").tensor_overrides == {}
    assert "extra_options.MixedPrecisionTensor given but specific_tensor_precision is false: no effect" in caplog.text
    switched = load_config({**quark, "specific_tensor_precision": True}, config_format="quark")
    assert switched.tensor_overrides["h"].dtype == "int16"


def test_valid_overrides_that_change_nothing_are_reported() -> None:
    """An op type this model lacks (a config shared by models, Quark's AutoMixprecision target
    types), a tensor no quantized node reads: not errors, but listed."""
    bf16 = {"format": "float", "dtype": "bfloat16"}
    config = {"preset": "MXFP4", "op_type_overrides": {"ConvTranspose": {"weight": bf16}}, "tensor_overrides": {"y": bf16}}
    assert quantize_model(linear(), config, None).summary["warnings"] == [
        {"config": "tensor_overrides['y']", "reason": "no quantized node reads this tensor, so the override changes nothing"},
        {"config": "op_type_overrides['ConvTranspose']", "reason": "the model has no node of this op type, so the override changes nothing"},
    ]


def test_quantize_model_refuses_a_fast_finetune_section_the_pipeline_runs() -> None:
    with pytest.raises(ValueError, match=r"fast_finetune section, which quantize_model does not run: call "
                                         r"finetune\.pipeline\.quantize_and_finetune"):
        quantize_model(linear(), "MX4_ADAQUANT", None)
    data = [{"x": RNG.standard_normal((8, 64)).astype(np.float32)}]
    result = quantize_and_finetune(linear(), {"preset": "MX4_ADAQUANT", "fast_finetune": {"iterations": 2}}, data)
    assert result.report is not None and result.summary["quantized_nodes"] == 1


def test_the_command_prints_the_warnings_and_writes_them_into_the_summary_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, output = tmp_path / "linear.onnx", tmp_path / "out" / "q.onnx"
    onnx.save(linear(), model)
    assert main(["quantize", str(model), "--config", "MX4", "--weight-storage", "compact", "-o", str(output)]) == 0
    reason = "weight_storage compact: MX4 has no compact form onnxruntime runs, so it stays float"
    assert f"warning: tensor w: {reason}" in capsys.readouterr().out
    summary = json.loads(output.with_name("q.onnx.summary.json").read_text())
    assert summary["warnings"] == [{"tensor": "w", "reason": reason}]


def test_nan_or_inf_inside_the_calibration_pass_is_reported() -> None:
    """Finite data that overflows inside the model (Exp of 100 is Inf in float32): the activation's
    range leaves the Inf out, and the summary says how many values were left out, per tensor."""
    nodes = [helper.make_node("Exp", ["x"], ["e"], name="exp"), helper.make_node("MatMul", ["e", "w"], ["y"], name="mm")]
    model = onnx_model(nodes, [tensor("x", ["n", 64])], [tensor("y", None)], {"w": W}, opset=17)
    x = np.zeros((4, 64), np.float32)
    x[0, :3] = 100.0
    result = quantize_model(model, "A8W8", [{"x": x}])
    assert warnings_of(result.summary, "3 NaN or Inf values") == [
        {"tensor": "e", "reason": "3 NaN or Inf values in the calibration pass were left out of its range (an overflow in "
                                  "the float model?)"}]
    assert quantize_model(model, "A8W8", [{"x": np.zeros((4, 64), np.float32)}]).summary["warnings"] == []


def test_a_model_with_nothing_to_quantize_is_a_warning() -> None:
    """A config whose op types the model lacks quantizes nothing: said, not reported as a success."""
    result = quantize_model(linear(), {"preset": "A8W8", "op_types": ["Conv"]}, [{"x": np.ones((2, 64), np.float32)}])
    assert result.summary["quantized_nodes"] == 0
    assert result.summary["warnings"] == [{"model": "test", "reason": "nothing was quantized: no node of the config's op types "
                                           "(Conv) has a tensor the config quantizes, so the output computes what the input does"}]


def test_the_summary_names_a_block_format_as_its_preset_with_its_attributes() -> None:
    summary = quantize_model(linear(), "MX6", None).summary
    row = next(row for row in summary["tensors_per_format"] if row["role"] == "weight")
    assert row["format"] == "MX6"
    assert row["attributes"].startswith("bfp_method=to_bfp_prime bit_width=13 block_size=16")
    assert "to_bfp_prime13" not in format_summary(summary)


def test_data_no_format_needs_is_still_checked_on_its_first_sample() -> None:
    """Block formats calibrate nothing, yet data of the wrong shape fails the run (it passed silently);
    a one-pass source is left unread for the run that needs it."""
    with pytest.raises(ValueError, match="input 'x'"):
        quantize_model(linear(), "MX6", [{"x": np.zeros((2, 63), np.float32)}])
    feeds = iter([{"x": np.zeros((2, 64), np.float32)}])
    quantize_model(linear(), "MX6", feeds)
    assert next(feeds)["x"].shape == (2, 64)
