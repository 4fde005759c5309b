"""awq (finetune.quantize.awq): the rescaled float graph computes the float model's function; the
searched calibration loss is the output error it claims (checked against onnxruntime's outputs) and
never above rounding to nearest's, strictly below it with an outlier input channel; the weights are
rounded exactly as the quantizer rounds them; on a tiny decoder with an outlier channel, int4 weights
lose less of the output with awq, and GPTQ runs after it; bad configs are one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from finetune.config import ConfigError, load_config
from finetune.quantize import quantize_model
from finetune.quantize.awq import OUTPUT_LAYER, activation_aware_scales
from finetune.quantize.calibrate import quantize_weight
from finetune.quantize.plan import plan
from finetune.zoo_decoder import decoder_feeds, export_module, tiny_decoder

from .lift_helpers import onnx_model, run_ort, tensor
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_smooth_quant import assert_same_function, transformer_like

SPREAD = np.array([30.0, 1, 1, 0.5, 2, 1, 1, 1] * 8, np.float32)  # per input channel: one outlier
WEIGHT_ONLY = {"INT4 channel": {"preset": "INT4_PER_CHANNEL"}, "INT4 g32": {"preset": "INT4_BLOCK32"},
               "MXFP4": {"preset": "MXFP4", "activation": None}, "MX6": {"preset": "MX6", "activation": None}}


def matmul(inputs: int = 64, outputs: int = 48, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """x [n, inputs] @ w: one MatMul with a seeded weight, and the weight."""
    w = np.random.default_rng(seed).standard_normal((inputs, outputs)).astype(np.float32)
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor("x", ["n", inputs])],
                       [tensor("y", ["n", outputs])], {"w": w})
    return model, w


def batches(spread: np.ndarray, count: int = 4, rows: int = 32, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """Seeded calibration feeds whose channels carry `spread`."""
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((rows, spread.size)) * spread).astype(np.float32)} for _ in range(count)]


def with_awq(config: dict, **section: object) -> dict:
    """`config` with an awq section that also takes layers writing a model output (each test model's last layer)."""
    return {**config, "awq": {"output_layers": True, **section}}


@pytest.mark.parametrize(("name", "seed"), [(name, seed) for name in WEIGHT_ONLY for seed in (0, 1)])
def test_the_searched_loss_is_the_output_error_and_never_above_rounding_to_nearest(name: str, seed: int) -> None:
    """Weight-only: summed over the calibration rows, ||x Q(W) - x W||^2 of the plain quantized model
    is the summary's rtn_loss, and ||y_awq - y||^2 of the AWQ model its loss (the rescaling's own
    float rounding apart); with a 30x outlier channel the search beats rounding to nearest on int4
    (the power-of-two block scales of MXFP4 and MX6 may keep alpha 0: the loss is then rounding to nearest's)."""
    model, _ = matmul(seed=seed)
    data = batches(SPREAD, seed=seed + 10)
    plain = quantize_model(model, WEIGHT_ONLY[name], data)
    result = quantize_model(model, with_awq(WEIGHT_ONLY[name]), data)
    [group] = result.summary["awq"]["groups"]
    assert group["layers"] == ["mm"] and group["loss"] <= group["rtn_loss"]
    if name.startswith("INT4"):
        assert group["alpha"] > 0 and group["loss"] < 0.7 * group["rtn_loss"]
    for quantized, loss in ((plain.model, group["rtn_loss"]), (result.model, group["loss"])):
        measured = sum(float(((run_ort(quantized, [f["x"]])[0].astype(np.float64) - run_ort(model, [f["x"]])[0]) ** 2).sum())
                       for f in data)
        assert measured == pytest.approx(loss, rel=1e-3)
    assert result.summary["awq"]["loss_over_rtn"] == pytest.approx(group["loss"] / group["rtn_loss"])


def test_alpha_zero_is_rounding_to_nearest_and_wins_ties() -> None:
    """With equal input channels every alpha gives s = 1: the loss equals rounding to nearest's and
    alpha 0 is kept; s is 1 at alpha 0 whatever the means, and normalised around 1 otherwise."""
    model, _ = matmul()
    result = quantize_model(model, with_awq(WEIGHT_ONLY["INT4 channel"]), [{"x": np.ones((8, 64), np.float32)}])
    [group] = result.summary["awq"]["groups"]
    assert group["alpha"] == 0 and group["loss"] == group["rtn_loss"] > 0
    means = np.array([4.0, 1.0, 0.25, 0.0])
    assert np.array_equal(activation_aware_scales(means, 0.0), np.ones(4))
    np.testing.assert_allclose(activation_aware_scales(means, 0.5), [2.0, 1.0, 0.5, 1.0])


@pytest.mark.parametrize("name", list(WEIGHT_ONLY))
def test_the_search_rounds_weights_as_the_quantized_model_does(name: str) -> None:
    """quantize_weight gives the weights the QDQ model computes with, bit for bit (read through an
    identity input: each output is one product by 1)."""
    model, w = matmul()
    config = load_config(WEIGHT_ONLY[name])
    [use] = [u for u in plan(model, config, []) if u.role == "weight"]
    quantized = quantize_model(model, config, None).model  # weight-only: no calibration pass
    assert np.array_equal(run_ort(quantized, [np.eye(64, dtype=np.float32)])[0], quantize_weight(use, w))


def test_the_rescaled_float_graph_computes_the_float_function_and_folds_into_the_norm() -> None:
    """LayerNorm -> q, k (sharing one input and one scale) folds into the norm; the rest as
    smooth_quant rewrites them; W+A (A8W8) takes every layer, weight-only formats too."""
    model = transformer_like()
    data = batches(SPREAD[:8], rows=4)
    for config in ({"preset": "A8W8"}, WEIGHT_ONLY["INT4 channel"]):
        result = quantize_model(model, with_awq(config, grid=10), data)
        awq = result.summary["awq"]
        assert (awq["folded"], awq["mul_inserted"], awq["skipped"], awq["grid"]) == (3, 1, 0, 10)
        assert [g["layers"] for g in awq["groups"]] == [["q", "k"], ["fc1"], ["fc2"]]
        assert all(g["loss"] <= g["rtn_loss"] for g in awq["groups"])
        assert_same_function(run_ort(result.float_model, [data[0]["x"]])[0], run_ort(model, [data[0]["x"]])[0])
        assert awq["float_output_relative_change"] < 1e-5


@pytest.fixture(scope="module")
def outlier_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny seeded decoder with one channel of every norm's gain 12x: an outlier input channel
    for q, k, v, gate, up and the LM head, as real decoders have."""
    decoder = tiny_decoder(False)
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            if name.endswith("norm.weight"):
                parameter[5] *= 12
    return export_module(decoder, tmp_path_factory.mktemp("decoder") / "decoder.onnx", dynamo=False)


def logits_error(model: onnx.ModelProto, reference: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    """Mean squared difference of the logits over `feeds`."""
    return float(np.mean([((run_ort(model, list(f.values()))[0] - run_ort(reference, list(f.values()))[0]) ** 2).mean()
                          for f in feeds]))


@pytest.mark.parametrize("name", ["INT4 channel", "INT4 g32"])
def test_awq_lowers_the_output_error_of_int4_weights_on_a_decoder(outlier_decoder: Path, name: str) -> None:
    """Weight-only int4 on the decoder: held-out logits are closer to float with awq than without,
    every group's loss is at most rounding to nearest's, 1/s is folded into the norms and, through
    SwiGLU's product, into the up projection, and the rescaled float graph computes the decoder's logits."""
    calibration, held_out = decoder_feeds(False, 4, seed=1), decoder_feeds(False, 2, seed=2)
    original = onnx.load(outlier_decoder)
    plain = quantize_model(original, WEIGHT_ONLY[name], calibration)
    result = quantize_model(original, with_awq(WEIGHT_ONLY[name]), calibration)
    awq = result.summary["awq"]
    assert awq["smoothed"] == 15 and all(g["loss"] <= g["rtn_loss"] for g in awq["groups"])  # 7 per block, the LM head
    details = {layer["node"]: layer["detail"] for layer in awq["layers"] if layer["action"] != "skipped"}
    assert (awq["folded"], awq["mul_inserted"]) == (13, 2)  # the norms (whose outputs' shapes are read too), down into up
    assert details["/layers.1/down_proj/MatMul"] == "folded into /layers.1/up_proj/MatMul (MatMul)"
    assert "Reshape" in details["/layers.1/self_attn/o_proj/MatMul"]  # after attention: a Mul
    assert awq["loss_over_rtn"] < 0.9
    assert logits_error(result.model, original, held_out) < logits_error(plain.model, original, held_out)
    logits = [run_ort(m, list(held_out[0].values()))[0] for m in (result.float_model, original)]
    np.testing.assert_allclose(*logits, rtol=1e-4, atol=1e-4 * float(np.abs(logits[1]).max()))


def test_gptq_tunes_after_awq_which_leaves_the_lm_head_alone_by_default(outlier_decoder: Path, tmp_path: Path) -> None:
    """AWQ then GPTQ: the tuned model runs in onnxruntime and is tuned towards the rescaled float
    graph; without output_layers the LM head (it writes the logits) is skipped, with a warning."""
    from finetune.pipeline import quantize_and_finetune

    calibration = decoder_feeds(False, 4, seed=1)
    config = {**WEIGHT_ONLY["INT4 g32"], "awq": {}, "fast_finetune": {"algorithm": "gptq", "threads": 1}}
    result = quantize_and_finetune(str(outlier_decoder), config, calibration, model_path=tmp_path / "tuned.onnx")
    awq = result.summary["awq"]
    assert result.report["float_reference"] == "float model" and awq["smoothed"] == 14
    assert {layer["node"]: layer["detail"] for layer in awq["layers"]}["/lm_head/MatMul"] == OUTPUT_LAYER
    assert any(w.get("node") == "/lm_head/MatMul" and w["reason"].startswith("awq: it writes a model output")
               for w in result.summary["warnings"])
    assert np.isfinite(run_ort(onnx.load(tmp_path / "tuned.onnx"), list(calibration[0].values()))[0]).all()


def test_an_awq_model_packs_as_matmul_nbits(outlier_decoder: Path, tmp_path: Path) -> None:
    """weight_storage matmul_nbits after awq: every 4-bit MatMul weight is packed (the Muls awq
    inserts act on the inputs), and the packed model computes the QDQ model's logits."""
    from finetune.pipeline import quantize_and_finetune

    calibration = decoder_feeds(False, 2, seed=1)
    config = {"preset": "INT4_BLOCK32", "awq": {}}
    packed = quantize_and_finetune(str(outlier_decoder), {**config, "weight_storage": "matmul_nbits"}, calibration).model
    assert sum(node.op_type == "MatMulNBits" for node in packed.graph.node) == 15
    qdq = quantize_model(str(outlier_decoder), config, calibration).model
    logits = [run_ort(model, list(calibration[0].values()))[0] for model in (packed, qdq)]
    # the same products summed by other kernels (equal to the bit on the machine this was written on)
    np.testing.assert_allclose(*logits, rtol=1e-4, atol=1e-4 * float(np.abs(logits[1]).max()))


@pytest.mark.parametrize(("section", "path"), [({"grid": 1}, "awq.grid"), ({"grid": 2.5}, "awq.grid"),
                                               ({"grid": "fine"}, "awq.grid"), ({"op_types": ["Conv"]}, "awq.op_types[0]"),
                                               ({"op_types": []}, "awq.op_types")])
def test_a_bad_awq_section_is_a_one_line_config_error(section: dict, path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"preset": "INT4_PER_CHANNEL", "awq": section})
    assert str(caught.value).startswith(f"{path}: ") and "\n" not in str(caught.value)


def test_awq_and_smooth_quant_together_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"preset": "A8W8", "awq": {}, "smooth_quant": {"alpha": 0.5}})
    message = str(caught.value)
    assert message.startswith("awq: ") and "pick one" in message and "\n" not in message
    defaults = load_config({"preset": "A8W8", "awq": {}}).awq
    assert (defaults.grid, defaults.op_types, defaults.fold, defaults.output_layers) == (20, ("MatMul", "Gemm"), True, False)


def test_awq_needs_calibration_data() -> None:
    model, _ = matmul()
    with pytest.raises(ValueError, match="^awq needs calibration data"):
        quantize_model(model, with_awq(WEIGHT_ONLY["MXFP4"]), None)


def test_the_summary_names_each_group_and_the_cli_table_says_what_awq_did() -> None:
    from finetune.quantize.summary import format_summary

    model, w = matmul()
    result = quantize_model(model, with_awq(WEIGHT_ONLY["INT4 g32"], grid=4), batches(SPREAD))
    [group] = result.summary["awq"]["groups"]
    assert group["input"] == "x" and group["alpha"] in (0.25, 0.5, 0.75)
    line = "awq (grid 4): 1 layer(s) scaled, 0 folded into their producer, 1 behind an inserted Mul"
    assert line in format_summary(result.summary)
    stored = {t.name: numpy_helper.to_array(t) for t in result.float_model.graph.initializer}
    s = stored["w"][:, 0] / w[:, 0]
    np.testing.assert_allclose(stored["x_smooth_inverse"], 1 / s, rtol=1e-5)
