"""Models other tools quantized, as those tools wrote them: committed fixtures made by
tests/fixtures/third_party/make_fixtures.py in environments of their own (AMD Quark for ONNX,
onnxruntime's quantize_static, NNCF) from our digits CNN and transformer. They run, lift and tune.
onnxruntime's A16W8 QDQ model uses the com.microsoft contrib QuantizeLinear/DequantizeLinear, which
lifts like the standard pair, tunes and is written back with its contrib nodes as they were; its
QOperator model (QLinearConv, ...) is refused with one line naming the node and saying to quantize
in QDQ format. NNCF's SmoothQuant (model_type=TRANSFORMER) moves activation scales into the
weights; tune carries them into the float model, which stays the reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest

from finetune.config import FastFinetune, load_config
from finetune.lift import FakeQuantize, LiftError, lift_model
from finetune.lift.fake_quant import quantizers_disabled
from finetune.onnx import attach_custom_ops
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.data.smoothing import carry_smoothing

from .lift_helpers import FLOAT_ATOL, FLOAT_RTOL, onnx_model, run_ort, run_torch, tensor
from .recon_helpers import one_thread, run  # noqa: F401  (one_thread: autouse fixture)

FIXTURES = Path(__file__).parent / "fixtures" / "third_party"
MODELS = ("cnn", "transformer")
QUARK_CONFIGS = ("XINT8", "A8W8", "A16W8", "BF16", "BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP4E2M1")
QUARK_CASES = [f"{model}.{config}" for model in MODELS for config in QUARK_CONFIGS]
QDQ_CASES = [f"{model}.ort.{config}" for model in MODELS for config in ("U8S8", "A16W8")]
NNCF_CASES = ["cnn.nncf", "transformer.nncf", "transformer.nncf.TRANSFORMER"]  # defaults; model_type=TRANSFORMER
SMOOTHED = "transformer.nncf.TRANSFORMER"  # SmoothQuant: its input scalings are carried into the float model
STOCK_DOMAINS = {"", "com.microsoft"}  # what stock onnxruntime runs without function bodies


@pytest.fixture(scope="module")
def fixture_data() -> dict[str, np.ndarray]:
    """The calibration and check rows every tool worked from, and Quark's runtime outputs on the check rows."""
    with np.load(FIXTURES / "data.npz") as data, np.load(FIXTURES / "quark_runtime_outputs.npz") as outputs:
        return {"calibration": data["calibration"], "check": data["check"], **{k: outputs[k] for k in outputs.files}}


def calibration_feeds(data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The 64 calibration rows the tools were calibrated on, 16 per batch."""
    return [{"x": data["calibration"][i : i + 16]} for i in range(0, 64, 16)]


def float_model(case: str) -> Path:
    return FIXTURES / f"{case.split('.')[0]}.float.onnx"


def assert_logits_agree(lifted: np.ndarray, expected: np.ndarray) -> None:
    """Logits of a quantized model, lifted and in onnxruntime: the same bits on this machine, but only
    guaranteed where no quantizer meets a value that torch's and onnxruntime's own float summation
    orders put on either side of a rounding boundary (each library picks its kernels by the CPU's
    features), so at most 2 % of them differ, by at most 0.1 (a few steps at these logits' magnitude
    of ~20), and every top-1 is the same."""
    assert np.mean(lifted != expected) <= 0.02 and np.abs(lifted - expected).max() <= 0.1
    assert_same_top1(lifted, expected, 0.1)


def assert_same_top1(lifted: np.ndarray, expected: np.ndarray, allowed: float) -> None:
    """Each row's lifted top-1 is a class onnxruntime's logits put within twice the allowed difference
    (`allowed`) of its top: that is all the bound decides on any CPU. Where onnxruntime's top leads by
    more, as in most rows, that is its own top-1; where 4-bit logits tie, either tied class."""
    chosen = expected[np.arange(len(expected)), lifted.argmax(1)]
    assert np.all(chosen >= expected.max(1) - 2 * allowed)


def assert_int16_close(lifted: np.ndarray, expected: np.ndarray) -> None:
    """With int16 activations a last-bit difference in float summation order before a quantizer
    (torch's and onnxruntime's kernels add in different orders) moves a value by one of its 65536
    steps: lifted and onnxruntime agree to 2e-3 and on every top-1."""
    np.testing.assert_allclose(lifted, expected, atol=2e-3)
    assert_same_top1(lifted, expected, 2e-3)


@pytest.mark.parametrize("model_name", MODELS)
def test_onnxruntime_contrib_qdq_lifts_as_the_standard_pair(model_name: str, fixture_data: dict) -> None:
    """Every Q/DQ of onnxruntime's A16W8 model is a com.microsoft contrib node. Its semantics are
    the standard pair's: the model with those nodes moved to the default domain gives the same bits
    in onnxruntime and in the lifted module."""
    model = onnx.load(FIXTURES / f"{model_name}.ort.A16W8.onnx")
    contrib = [n for n in model.graph.node if n.domain == "com.microsoft"]
    assert {n.op_type for n in contrib} == {"QuantizeLinear", "DequantizeLinear"}
    assert not [n for n in model.graph.node if n.op_type.endswith("QuantizeLinear") and n.domain != "com.microsoft"]
    standard = onnx.ModelProto()
    standard.CopyFrom(model)
    for node in standard.graph.node:
        node.domain = ""
    x = fixture_data["check"]
    assert np.array_equal(run(model, x), run(standard, x))
    assert np.array_equal(run_torch(lift_model(model), [x])[0], run_torch(lift_model(standard), [x])[0])


@pytest.mark.parametrize("case", QDQ_CASES + NNCF_CASES)
def test_an_onnxruntime_or_nncf_model_runs_in_stock_onnxruntime_and_lifts(case: str, fixture_data: dict) -> None:
    """The tool's QDQ model (standard ops; com.microsoft Q/DQ in A16W8) runs in stock onnxruntime,
    its own runtime, and the lifted module gives its logits: the same bits where a quantizer ends
    the model (onnxruntime's U8S8), but for rounding flips (assert_logits_agree). NNCF leaves the last Gemm's output float, where torch's and
    onnxruntime's kernels add in different float32 orders: up to FLOAT_ATOL/RTOL (1e-5), every
    top-1 the same.
    int16 activations: see assert_int16_close. Every quantized value inside (each
    DequantizeLinear's output, made a graph output) has onnxruntime's bits but where that same
    summation order put a value beside a rounding boundary: there it is one step off (at most 2
    of the 8192 values of a CNN activation on these rows)."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    assert {n.domain for n in model.graph.node} <= STOCK_DOMAINS
    x = fixture_data["check"]
    lifted, expected = run_torch(lift_model(model), [x])[0], run(model, x)
    if case.endswith("A16W8"):
        assert_int16_close(lifted, expected)
        return
    if "nncf" in case:
        np.testing.assert_allclose(lifted, expected, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)
        assert_same_top1(lifted, expected, FLOAT_ATOL + FLOAT_RTOL * float(np.abs(expected).max()))
    else:
        assert_logits_agree(lifted, expected)
    assert_quantized_values_agree(model, x)


def assert_quantized_values_agree(model: onnx.ModelProto, x: np.ndarray) -> None:
    """Each DequantizeLinear output of the model, lifted and in onnxruntime: at most 1 in 1000
    values differ, each by at most one step (the largest scale of its quantizer)."""
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    steps = {n.output[0]: scales[n.input[1]].max() for n in model.graph.node if n.op_type == "DequantizeLinear"}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in steps)
    _, *expected = run_ort(model, [x])
    _, *lifted = run_torch(lift_model(model), [x])
    assert len(expected) == len(lifted) == len(steps)
    for ours, theirs, step in zip(lifted, expected, steps.values()):
        assert np.mean(ours != theirs) <= 1e-3 and np.abs(ours - theirs).max() < 1.5 * step  # one step, rounded


@pytest.mark.parametrize("model_name", MODELS)
def test_a_qoperator_model_is_refused_naming_the_node(model_name: str) -> None:
    """onnxruntime's QOperator model (QLinearConv / QLinearMatMul, com.microsoft QGemm, ...) is
    refused in one line naming its first such node."""
    model = onnx.load(FIXTURES / f"{model_name}.ort.QOperator.onnx")
    first = next(n for n in model.graph.node if n.op_type.startswith(("QLinear", "QGemm")))
    domain = first.domain or "ai.onnx"
    with pytest.raises(LiftError, match=rf"^cannot lift node '{first.name}' \({domain}::{first.op_type}\): a "
                                        r"QOperator-format op [^\n]* quantize the float model in QDQ format[^\n]*$"):
        lift_model(model)


# --- AMD Quark for ONNX's own outputs ------------------------------------------------------------


@pytest.mark.parametrize("case", QUARK_CASES)
def test_a_quark_model_runs_in_stock_onnxruntime_as_in_quarks_runtime_and_lifts(case: str, fixture_data: dict) -> None:
    """Quark's model (its domains at version 1000, its attributes, in XINT8 its nodes out of
    topological order) with our function bodies attached gives in stock onnxruntime the bits
    Quark's own custom-op library gave; the lifted module gives onnxruntime's bits but for rounding
    flips (assert_logits_agree; int16 activations: up to summation order, every top-1 the same)."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    x = fixture_data["check"]
    ours = run(attach_custom_ops(model), x)
    assert_logits_agree(ours, fixture_data[case])  # Quark's runtime ran on another CPU, with its own sums
    lifted = run_torch(lift_model(model), [x])[0]
    if case.endswith("A16W8"):
        assert_int16_close(lifted, ours)
    else:
        assert_logits_agree(lifted, ours)


TUNE_CASES = [  # (fixture, algorithm): AdaRound where the tool stores int8 weight codes, as onnxruntime and NNCF do
    *[(case, "adaquant") for case in ("cnn.MX6", "transformer.MX4", "cnn.BF16", "transformer.A16W8")],
    *[(case, "adaround") for case in QDQ_CASES + NNCF_CASES],
]


@pytest.mark.parametrize(("case", "algorithm"), TUNE_CASES)
def test_a_third_party_model_tunes_and_is_written_back_in_its_own_form(case: str, algorithm: str, fixture_data: dict) -> None:
    """A short run lowers the summed reconstruction loss, towards the float model. Quark equalises the
    CNN's Conv pairs first, so the float model is not its reference: where the weights are stored as
    float (MX6, BF16) tune sets it aside with a warning and tunes towards the model's own float
    weights; where stored as codes (XINT8, A8W8, left out here) it refuses. The tuned model keeps the
    tool's nodes, domains and versions (deployable with the tool's runtime; stock onnxruntime runs those of
    onnxruntime and NNCF as they are), and with attach_ops carries the same weights with function
    bodies that stock onnxruntime runs."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    feeds = calibration_feeds(fixture_data)
    config = FastFinetune(algorithm=algorithm, iterations=10, batch_size=16)
    tuned, report = finetune_model(model, feeds, config, float_model(case))
    equalised = case.startswith("cnn.") and case in QUARK_CASES
    assert report["float_reference"] == ("quantized model with quantizers disabled" if equalised else "float model")
    assert any(w.get("model") == "float model" for w in report["warnings"]) == equalised
    assert sum(u["loss_after"] for u in report["units"]) < sum(u["loss_before"] for u in report["units"])
    assert list(tuned.graph.node) == list(model.graph.node) and list(tuned.opset_import) == list(model.opset_import)
    assert list(tuned.graph.initializer) != list(model.graph.initializer) and not tuned.functions
    attached, _ = finetune_model(model, feeds, config, float_model(case), attach_ops=True)
    assert list(attached.graph.initializer) == list(tuned.graph.initializer)
    expected_shape = (len(fixture_data["check"]), 10)
    assert run(attached, fixture_data["check"]).shape == expected_shape
    if {n.domain for n in model.graph.node} <= STOCK_DOMAINS:
        assert run(tuned, fixture_data["check"]).shape == expected_shape


@pytest.mark.parametrize("model_name", MODELS)
def test_a_model_is_its_own_float_reference_with_the_relus_its_quantizers_stand_in_for(model_name: str, fixture_data: dict) -> None:
    """onnxruntime's quantizer removes each Relu whose output it quantizes asymmetrically: the clamp at
    the zero point does its work. With its quantizers off, a model so quantized is its own float
    reference only where each activation quantizer keeps that clamp: then it is closer to the float
    model than the quantized model is; the bare identity drops every Relu and lands far from float.
    Weight and bias quantizers are marked, and stay the identity."""
    model = onnx.load(FIXTURES / f"{model_name}.ort.U8S8.onnx")
    assert "Relu" not in {node.op_type for node in model.graph.node}
    module = lift_model(model)
    marked = {name for name, q in module.named_modules() if isinstance(q, FakeQuantize) and q.on_parameter}
    assert marked == {source.quantizer for source in module.finetune_params.values() if source.quantizer is not None}
    x = fixture_data["check"]
    reference = run_ort(onnx.load(float_model(model_name)), [x])[0]
    quantized = run_torch(module, [x])[0]
    with quantizers_disabled(module):
        kept = run_torch(module, [x])[0]
    with quantizers_disabled(module, keep_ranges=False):
        identity = run_torch(module, [x])[0]
    assert np.array_equal(run_torch(module, [x])[0], quantized)  # the quantizers are back as they were
    def error(y: np.ndarray) -> float:
        return float(np.abs(y - reference).mean())
    assert error(kept) < error(quantized) < error(identity) / 10


def test_tuning_an_onnxruntime_model_without_its_float_model_keeps_its_accuracy(fixture_data: dict) -> None:
    """Tuning and bias correction towards the model's own float reference (no float model given):
    every unit starts near that reference (with the Relus dropped, the last units' losses were 49 and
    223, and bias correction took held-out accuracy from 97 % to 57 %), and the tuned model's top-1
    on the check rows is the untuned model's."""
    model = onnx.load(FIXTURES / "cnn.ort.U8S8.onnx")
    config = FastFinetune(algorithm="adaround", iterations=20, batch_size=16, bias_correction=True)
    tuned, report = finetune_model(model, calibration_feeds(fixture_data), config)
    assert report["float_reference"] == "quantized model with quantizers disabled"
    assert max(u["loss_before"] for u in report["units"]) < 0.01
    check = fixture_data["check"]
    assert np.array_equal(run(tuned, check).argmax(1), run(model, check).argmax(1))


def test_nncfs_smoothquant_is_carried_into_the_float_model(fixture_data: dict) -> None:
    """SmoothQuant scales each MatMul/Gemm input per channel (a Mul NNCF inserts) and the weight
    inversely. carry_smoothing puts the same Muls into the float model and divides its weights: every
    layer of the transformer is carried and the function stays the float model's (up to the float
    rounding of the scales); that its weights then quantize to NNCF's codes, tune checks (the tune
    test above runs this fixture towards its float model)."""
    model, reference = onnx.load(FIXTURES / f"{SMOOTHED}.onnx"), onnx.load(float_model(SMOOTHED))
    smoothed = onnx.ModelProto()
    smoothed.CopyFrom(reference)
    changes = carry_smoothing(smoothed, model)
    initializers = {t.name for t in reference.graph.initializer}
    weighted = [n.name for n in reference.graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & initializers]
    assert [change.split(":")[0] for change in changes] == weighted and len(weighted) == 10
    x = fixture_data["check"]
    np.testing.assert_allclose(run(smoothed, x), run(reference, x), rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


# --- AMD Quark's documented BF16 + AdaQuant config, verbatim --------------------------------------

QUARK_BF16_ADAQUANT = {
    "activation_type": "ExtendedQuantType.QBFloat16", "weight_type": "ExtendedQuantType.QBFloat16", "include_fast_ft": True,
    "extra_options": {"BF16QDQToCast": True, "QuantizeAllOpTypes": True, "ForceQuantizeNoInputCheck": True,
                      "FastFinetune": {"NumIterations": 1000, "LearningRate": 1e-6, "OptimAlgorithm": "adaquant"}},
}


def test_quarks_documented_bf16_adaquant_config_loads_tunes_and_writes_cast_pairs(fixture_data: dict) -> None:
    """The config of Quark's documentation (BF16 with AdaQuant) loads as it is; every op type is
    quantized, tuned (10 iterations here instead of its 1000), and the final model holds its
    bfloat16 quantize-dequantize pairs as Cast pairs: no node outside the standard domain, and the
    same outputs in onnxruntime as the pairs give."""
    config = load_config(QUARK_BF16_ADAQUANT, config_format="quark")
    assert config.bf16_as_cast and config.op_types == "all" and config.fast_finetune.algorithm == "adaquant"
    short = dataclasses.replace(config, fast_finetune=dataclasses.replace(config.fast_finetune, iterations=10))
    feeds = calibration_feeds(fixture_data)
    model = FIXTURES / "cnn.float.onnx"
    cast = quantize_and_finetune(model, short, feeds).model
    pairs = quantize_and_finetune(model, dataclasses.replace(short, bf16_as_cast=False), feeds).model
    assert {n.domain for n in cast.graph.node} == {""} and not cast.functions
    casts = [n for n in cast.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2 * sum(n.op_type == "ExtendedQuantizeLinear" for n in pairs.graph.node) > 0
    kept = {t.name for t in cast.graph.initializer}
    assert [t for t in pairs.graph.initializer if t.name in kept] == list(cast.graph.initializer)  # tuned alike
    assert not {t.name for t in pairs.graph.initializer if t.name.endswith(("_bfloat16_scale", "_bfloat16_zero_point"))} & kept
    assert np.array_equal(run(cast, fixture_data["check"]), run(pairs, fixture_data["check"]))


def test_bf16_cast_pairs_differ_from_the_quantize_dequantize_pairs_only_past_bfloat16s_range() -> None:
    """Both round to nearest even; past bfloat16's largest finite value the pair saturates and the
    Cast gives inf (what bf16_as_cast's documentation says)."""
    relu = onnx.helper.make_node("Relu", ["x"], ["y"], name="relu")
    model = onnx_model([relu], [tensor("x", [4])], [tensor("y", None)], opset=17)
    pairs = quantize_model(model, {"preset": "BF16", "op_types": "all"}, None).model
    cast = quantize_model(model, {"preset": "BF16", "op_types": "all", "bf16_as_cast": True}, None).model
    x = np.array([1.00390625, 3.3e38, 3.4e38, np.nan], np.float32)
    (from_pairs,), (from_cast,) = inference_session(pairs).run(None, {"x": x}), inference_session(cast).run(None, {"x": x})
    assert np.array_equal(from_pairs[[0, 1, 3]], from_cast[[0, 1, 3]], equal_nan=True) and from_pairs[0] == 1.0
    assert from_pairs[2] == np.float32(3.3895314e38) and from_cast[2] == np.inf
