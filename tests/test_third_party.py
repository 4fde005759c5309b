"""Models other tools quantized. AMD Quark for ONNX's own outputs (committed fixtures, made by
tests/fixtures/third_party/make_fixtures.py in a separate environment) attach, run, lift and tune.
onnxruntime's own quantizer (part of onnxruntime, a dependency) runs here: its A16W8 QDQ model uses the com.microsoft contrib QuantizeLinear/DequantizeLinear
(int16 Q/DQ below opset 21), which lifts like the standard pair, tunes and is written back with its
contrib nodes as they were; its QOperator model (QLinearConv, ...) is refused with one line naming
the node and saying to quantize in QDQ format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from finetune.config import FastFinetune, load_config
from finetune.lift import LiftError, lift_model
from finetune.onnx import attach_custom_ops
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.zoo import digits_split

from .lift_helpers import onnx_model, run_torch, tensor
from .recon_helpers import export_digits_cnn, one_thread, run  # noqa: F401  (one_thread: autouse fixture)


class Batches(CalibrationDataReader):
    """onnxruntime's calibration protocol over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN as ONNX, quantized by onnxruntime in QDQ format (A16W8 through its contrib
    ops) and in QOperator format (A8W8), with calibration feeds and held-out digits."""
    root = tmp_path_factory.mktemp("third_party")
    x_train, _, x_test, y_test = digits_split()
    path = export_digits_cnn(root / "digits.onnx", x_test[:1])
    feeds = [{"x": x_train[i : i + 32].numpy()} for i in range(0, 96, 32)]
    contrib, qoperator = root / "a16w8_contrib.onnx", root / "qoperator.onnx"
    quantize_static(str(path), str(contrib), Batches(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt16, weight_type=QuantType.QInt8,
                    extra_options={"UseQDQContribOps": True, "ActivationSymmetric": True})
    quantize_static(str(path), str(qoperator), Batches(feeds), quant_format=QuantFormat.QOperator, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return {"float": path, "contrib": contrib, "qoperator": qoperator, "feeds": feeds, "x": x_test.numpy(),
            "y": y_test.numpy()}


def contrib_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "com.microsoft"]


def test_onnxruntime_contrib_qdq_lifts_as_the_standard_pair(digits: dict) -> None:
    """Every Q/DQ of the A16W8 model is a com.microsoft contrib node. Its semantics are the standard
    pair's: the model with those nodes moved to the default domain gives the same bits in
    onnxruntime and in the lifted module. Lifted and onnxruntime agree up to float summation order
    (a last-bit Conv difference moves an int16 activation by one step) and on every top-1."""
    model = onnx.load(digits["contrib"])
    assert {n.op_type for n in contrib_nodes(model)} == {"QuantizeLinear", "DequantizeLinear"}
    assert not [n for n in model.graph.node if n.op_type.endswith("QuantizeLinear") and n.domain != "com.microsoft"]
    standard = onnx.ModelProto()
    standard.CopyFrom(model)
    for node in contrib_nodes(standard):
        node.domain = ""
    x = digits["x"][:64]
    lifted = run_torch(lift_model(model), [x])[0]
    assert np.array_equal(run(model, x), run(standard, x))
    assert np.array_equal(lifted, run_torch(lift_model(standard), [x])[0])
    np.testing.assert_allclose(lifted, run(model, x), atol=2e-3)
    assert np.array_equal(lifted.argmax(1), run(model, x).argmax(1))


def test_onnxruntime_contrib_qdq_tunes_and_keeps_its_form(digits: dict) -> None:
    """AdaRound (towards the float model: the weights are stored as int8 codes) lowers the
    reconstruction loss of every unit it keeps; the tuned model has the input's nodes, domains and
    opsets (contrib Q/DQ included), other weight codes, and classifies as well."""
    model = onnx.load(digits["contrib"])
    tuned, report = finetune_model(model, digits["feeds"], FastFinetune(iterations=40, batch_size=16), digits["float"])
    assert report["kept"] >= 1 and all(u["loss_after"] <= u["loss_before"] for u in report["units"])
    assert any(u["loss_after"] < u["loss_before"] for u in report["units"])
    assert list(tuned.graph.node) == list(model.graph.node) and list(tuned.opset_import) == list(model.opset_import)
    assert list(tuned.graph.initializer) != list(model.graph.initializer) and not tuned.functions
    accuracy = (run(tuned, digits["x"]).argmax(1) == digits["y"]).mean()
    assert accuracy >= (run(model, digits["x"]).argmax(1) == digits["y"]).mean() - 0.01


def test_a_qoperator_model_is_refused_naming_the_node(digits: dict) -> None:
    model = onnx.load(digits["qoperator"])
    first = next(n for n in model.graph.node if n.op_type.startswith("QLinear"))
    with pytest.raises(LiftError, match=rf"^cannot lift node '{first.name}' \(ai.onnx::{first.op_type}\): a "
                                        "QOperator-format op .* quantize the float model in QDQ format"):
        lift_model(model)


# --- AMD Quark for ONNX's own outputs (tests/fixtures/third_party, made by its make_fixtures.py) ----

FIXTURES = Path(__file__).parent / "fixtures" / "third_party"
QUARK_CONFIGS = ("XINT8", "A8W8", "A16W8", "BF16", "BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP4E2M1")
QUARK_CASES = [f"{model}.{config}" for model in ("cnn", "transformer") for config in QUARK_CONFIGS]


@pytest.fixture(scope="module")
def quark_data() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "data.npz") as data, np.load(FIXTURES / "quark_runtime_outputs.npz") as outputs:
        return {"calibration": data["calibration"], "check": data["check"], **{k: outputs[k] for k in outputs.files}}


@pytest.mark.parametrize("case", QUARK_CASES)
def test_a_quark_model_runs_in_stock_onnxruntime_as_in_quarks_runtime_and_lifts(case: str, quark_data: dict) -> None:
    """Quark's model (its domains at version 1000, its attributes, in XINT8 its nodes out of
    topological order) with our function bodies attached gives in stock onnxruntime the bits
    Quark's own custom-op library gave; the lifted module gives onnxruntime's bits (int16
    activations: up to summation order, every top-1 the same)."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    x = quark_data["check"]
    ours = run(attach_custom_ops(model), x)
    assert np.array_equal(ours, quark_data[case])
    lifted = run_torch(lift_model(model), [x])[0]
    if case.endswith("A16W8"):
        np.testing.assert_allclose(lifted, ours, atol=2e-3)
        assert np.array_equal(lifted.argmax(1), ours.argmax(1))
    else:
        assert np.array_equal(lifted, ours)


@pytest.mark.parametrize("case", ["cnn.MX6", "transformer.MX4", "cnn.BF16", "transformer.A16W8"])
def test_a_quark_model_tunes_and_is_written_back_in_its_own_form(case: str, quark_data: dict) -> None:
    """A short AdaQuant run lowers the summed reconstruction loss (XINT8 and A8W8 are left out: Quark equalises
    its weights across layers first, so the float model is not its reference, which tune refuses
    with that reason); the tuned model keeps Quark's
    nodes, domains and versions (deployable with Quark's runtime), and with attach_ops carries the
    same weights with function bodies that stock onnxruntime runs."""
    model = onnx.load(FIXTURES / f"{case}.onnx")
    feeds = [{"x": quark_data["calibration"][i : i + 16]} for i in range(0, 64, 16)]
    config = FastFinetune(algorithm="adaquant", iterations=10, batch_size=16)
    float_model = FIXTURES / f"{case.split('.')[0]}.float.onnx"
    tuned, report = finetune_model(model, feeds, config, float_model)
    assert sum(u["loss_after"] for u in report["units"]) < sum(u["loss_before"] for u in report["units"])
    assert list(tuned.graph.node) == list(model.graph.node) and list(tuned.opset_import) == list(model.opset_import)
    assert not tuned.functions
    attached, _ = finetune_model(model, feeds, config, float_model, attach_ops=True)
    assert list(attached.graph.initializer) == list(tuned.graph.initializer)
    assert run(attached, quark_data["check"]).shape == quark_data[case].shape


# --- AMD Quark's documented BF16 + AdaQuant config, verbatim --------------------------------------

QUARK_BF16_ADAQUANT = {
    "activation_type": "ExtendedQuantType.QBFloat16", "weight_type": "ExtendedQuantType.QBFloat16", "include_fast_ft": True,
    "extra_options": {"BF16QDQToCast": True, "QuantizeAllOpTypes": True, "ForceQuantizeNoInputCheck": True,
                      "FastFinetune": {"NumIterations": 1000, "LearningRate": 1e-6, "OptimAlgorithm": "adaquant"}},
}


def test_quarks_documented_bf16_adaquant_config_loads_tunes_and_writes_cast_pairs(quark_data: dict) -> None:
    """The config of Quark's documentation (BF16 with AdaQuant) loads as it is; every op type is
    quantized, tuned (10 iterations here instead of its 1000), and the final model holds its
    bfloat16 quantize-dequantize pairs as Cast pairs: no node outside the standard domain, and the
    same outputs in onnxruntime as the pairs give."""
    config = load_config(QUARK_BF16_ADAQUANT, config_format="quark")
    assert config.bf16_as_cast and config.op_types == "all" and config.fast_finetune.algorithm == "adaquant"
    short = dataclasses.replace(config, fast_finetune=dataclasses.replace(config.fast_finetune, iterations=10))
    feeds = [{"x": quark_data["calibration"][i : i + 16]} for i in range(0, 64, 16)]
    model = FIXTURES / "cnn.float.onnx"
    cast = quantize_and_finetune(model, short, feeds).model
    pairs = quantize_and_finetune(model, dataclasses.replace(short, bf16_as_cast=False), feeds).model
    assert {n.domain for n in cast.graph.node} == {""} and not cast.functions
    casts = [n for n in cast.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2 * sum(n.op_type == "ExtendedQuantizeLinear" for n in pairs.graph.node) > 0
    kept = {t.name for t in cast.graph.initializer}
    assert [t for t in pairs.graph.initializer if t.name in kept] == list(cast.graph.initializer)  # tuned alike
    assert not {t.name for t in pairs.graph.initializer if t.name.endswith(("_bfloat16_scale", "_bfloat16_zero_point"))} & kept
    assert np.array_equal(run(cast, quark_data["check"]), run(pairs, quark_data["check"]))


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
