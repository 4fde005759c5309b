"""Bias correction (fast_finetune.bias_correction, issue 33): each layer's bias gets the mean per output
channel of its float output minus its quantized output over the training rows, checked here against
onnxruntime and numpy on a single Gemm; an int32 bias stays on its grid and saturates; a correction that
makes the held-out loss worse is undone; Quark's BiasCorrection maps to the key."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from finetune.config import ConfigError, FastFinetune, from_quark
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.data.heldout import held_out_batches
from finetune.recon.methods import corrects_bias
from finetune.recon.report import format_report

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

EPS32 = 2.0**-24  # float32's unit roundoff


def gemm_model(bias: np.ndarray | None = None, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """x[n, 16] -> Gemm (W [4, 16], transB) + b -> y; returns the model, W and b."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((4, 16)) / 4).astype(np.float32)
    bias = (rng.standard_normal(4) / 10).astype(np.float32) if bias is None else bias.astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=1)
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weight, bias


def feeds(means: list[float], seed: int = 1) -> list[dict[str, np.ndarray]]:
    """One batch of 8 rows per entry of `means`, x around that mean (a spread of 1)."""
    rng = np.random.default_rng(seed)
    return [{"x": (mean + rng.standard_normal((8, 16))).astype(np.float32)} for mean in means]


def layer_output(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The Gemm's own output, by onnxruntime (made a graph output where a quantizer follows it)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    if gemm.output[0] not in [o.name for o in model.graph.output]:
        model.graph.output.append(helper.make_tensor_value_info(gemm.output[0], TensorProto.FLOAT, None))
    names = [o.name for o in model.graph.output]
    return inference_session(model).run(None, {"x": x})[names.index(gemm.output[0])].astype(np.float64)


def stored_bias(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray | None]:
    """The Gemm's bias as stored (float values, or int32 codes) and, for codes, their scale."""
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = next((n for n in model.graph.node if gemm.input[2] in n.output), None)
    if producer is None:
        return inits[gemm.input[2]], None
    assert producer.op_type == "DequantizeLinear"
    return inits[producer.input[0]], inits[producer.input[1]]


def corrected(quantized: onnx.ModelProto, data: list[dict[str, np.ndarray]], float_model: onnx.ModelProto | None = None,
              **settings: object) -> tuple[onnx.ModelProto, dict]:
    """The model after bias correction alone (iterations 0), every batch a training batch unless told."""
    config = FastFinetune(**{"iterations": 0, "bias_correction": True, "validation_share": 0.0, **settings})
    return finetune_model(quantized, data, config, float_model=float_model)


@pytest.mark.parametrize("preset", ["MX6", "BF16"])
def test_a_float_bias_gets_the_mean_error_per_channel_as_numpy_computes_it(preset: str) -> None:
    """Float reference x W^T + b in numpy, quantized output by onnxruntime: the new bias is the old one
    plus their mean difference per channel. Bound: torch and onnxruntime sum the 16 products of each
    output in other orders, each off by at most 16 units of roundoff of sum |w x| (so their means too),
    plus the float32 rounding of the bias itself."""
    model, weight, bias = gemm_model()
    data = feeds([0.5] * 4)
    quantized = quantize_model(model, preset, data).model
    x = np.concatenate([f["x"] for f in data])
    reference = x.astype(np.float64) @ weight.T.astype(np.float64) + bias
    shift = (reference - layer_output(quantized, x)).mean(axis=0)
    tuned, report = corrected(quantized, data)
    new, scale = stored_bias(tuned)
    assert scale is None
    old = stored_bias(quantized)[0].astype(np.float64)
    bound = 16 * EPS32 * (np.abs(x) @ np.abs(weight.T)).max() + np.spacing(np.abs(old + shift).astype(np.float32))
    assert np.all(np.abs(new - (old + shift)) <= bound) and np.any(new != old)
    assert report["units"][0]["bias_correction"]["start"]["status"] == "kept"
    remaining = (reference - layer_output(tuned, x)).mean(axis=0)  # the exported model's output, corrected
    assert np.all(np.abs(remaining) <= 2 * bound) and np.abs(remaining).max() < np.abs(shift).max() / 10


def test_an_int32_bias_is_corrected_on_its_grid_and_runs_in_onnxruntime() -> None:
    """A8W8: the bias is int32 codes with scale s_x * s_w; the corrected codes are the old value plus
    the mean error, quantized again (round half to even, in float32 as QuantizeLinear does). The float
    model is given, so the float output has the float bias, not its codes."""
    model, weight, bias = gemm_model()
    data = feeds([0.5] * 4)
    quantized = quantize_model(model, "A8W8", data).model
    x = np.concatenate([f["x"] for f in data])
    reference = x.astype(np.float64) @ weight.T.astype(np.float64) + bias
    shift = (reference - layer_output(quantized, x)).mean(axis=0)
    codes, scale = stored_bias(quantized)
    tuned, _ = corrected(quantized, data, model)
    new, new_scale = stored_bias(tuned)
    assert new.dtype == np.int32 and np.array_equal(new_scale, scale)
    value = (codes.astype(np.float64) * scale + shift).astype(np.float32)
    assert np.array_equal(new, np.rint(value / np.float32(scale)).astype(np.int32)) and np.any(new != codes)
    remaining = (reference - layer_output(tuned, x)).mean(axis=0)
    assert np.all(np.abs(remaining) <= scale / 2 + 1e-5)


def test_an_int32_bias_saturates_at_the_types_limit() -> None:
    """A float bias far past int32's range times its scale is stored saturated; the correction pushes it
    further out and its codes stay at the limit (the other channels are corrected as usual)."""
    model, _, _ = gemm_model(np.array([1e9, 0.1, -0.2, 0.0]))
    data = feeds([0.5] * 4)
    quantized = quantize_model(model, "A8W8", data).model
    codes, _ = stored_bias(quantized)
    assert codes[0] == np.iinfo(np.int32).max
    tuned, _ = corrected(quantized, data)
    new, _ = stored_bias(tuned)
    assert new[0] == np.iinfo(np.int32).max and np.any(new[1:] != codes[1:])


def test_a_correction_that_makes_the_held_out_loss_worse_is_undone() -> None:
    """The training batches' inputs sit at +3, the held-out ones' at -3: the weights' rounding error
    shifts the output's mean one way on the first and the other way on the second, so the correction
    learned on the training rows doubles the held-out error; it is reverted and the bias kept."""
    means = [3.0] * 10
    for batch in held_out_batches(10, 0.2, seed=0):
        means[batch] = -3.0
    data = feeds(means)
    quantized = quantize_model(gemm_model()[0], "A8W8", data).model
    tuned, report = corrected(quantized, data, validation_share=0.2)
    record = report["units"][0]["bias_correction"]["start"]
    assert record["status"] == "reverted" and record["held_out_after"] > record["held_out_before"]
    assert np.array_equal(stored_bias(tuned)[0], stored_bias(quantized)[0])


@pytest.mark.parametrize("algorithm", ["adaround", "adaquant", "gptq"])
def test_every_algorithm_corrects_before_and_after_tuning(algorithm: str) -> None:
    """AdaRound and AdaQuant correct at the start and after tuning; GPTQ, which has no iterations, once."""
    data = feeds([0.5] * 5)
    quantized = quantize_model(gemm_model()[0], "A8W8", data).model
    _, report = finetune_model(quantized, data, FastFinetune(algorithm=algorithm, iterations=20, bias_correction=True))
    record = report["units"][0]["bias_correction"]
    assert record["layers"] == ["gemm"] and not record["not_corrected"]
    assert set(record) - {"layers", "not_corrected"} == ({"start"} if algorithm == "gptq" else {"start", "final"})
    assert "bias correction kept in" in format_report({**report, "total_seconds": 1.0})
    _, off = finetune_model(quantized, data, FastFinetune(algorithm=algorithm, iterations=20, bias_correction=False))
    assert off["units"][0]["bias_correction"] is None


def test_a_layer_without_a_bias_is_listed_with_the_reason() -> None:
    model, _, _ = gemm_model()
    del model.graph.node[0].input[2]
    data = feeds([0.5] * 5)
    quantized = quantize_model(model, "MX6", data).model
    _, report = finetune_model(quantized, data, FastFinetune(algorithm="adaquant", iterations=5, bias_correction=True))
    assert report["units"][0]["bias_correction"]["not_corrected"][0]["layer"] == "gemm"
    assert any("bias not corrected" in w["reason"] for w in report["warnings"])


def test_quarks_bias_correction_maps_to_the_key() -> None:
    """Quark runs BiasCorrection after quantizing, with or without fast finetune: alone, it is the
    correction alone (iterations 0); with fast finetune, the key in that section."""
    alone = from_quark({"extra_options": {"BiasCorrection": True}}).fast_finetune
    assert alone.iterations == 0 and alone.bias_correction is True
    assert from_quark({"extra_options": {"BiasCorrection": False}}).fast_finetune is None
    both = from_quark({"include_fast_ft": True, "extra_options": {"BiasCorrection": False, "FastFinetune": {"NumIterations": 5}}})
    assert both.fast_finetune.bias_correction is False and both.fast_finetune.iterations == 5
    assert from_quark({"include_fast_ft": True}).fast_finetune.bias_correction == "auto"


def test_iterations_zero_without_bias_correction_is_refused() -> None:
    with pytest.raises(ConfigError, match="iterations"):
        FastFinetune(iterations=0, bias_correction=False)


@pytest.mark.parametrize(("algorithm", "iterations", "setting", "on"), [
    ("adaround", 1000, "auto", True), ("gptq", 1000, "auto", True), ("adaquant", 0, "auto", True),
    ("adaquant", 1000, "auto", False), ("adaquant", 1000, True, True), ("adaround", 1000, False, False)])
def test_auto_corrects_where_it_was_measured_to_help(algorithm: str, iterations: int, setting: object, on: bool) -> None:
    """auto: the correction alone, AdaRound and GPTQ; not after AdaQuant (docs/fine-tuning.md, Bias correction)."""
    assert corrects_bias(FastFinetune(algorithm=algorithm, iterations=iterations, bias_correction=setting)) is on
