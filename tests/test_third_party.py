"""Models another tool quantized, made here with onnxruntime's own quantizer (part of onnxruntime,
a dependency): its A16W8 QDQ model uses the com.microsoft contrib QuantizeLinear/DequantizeLinear
(int16 Q/DQ below opset 21), which lifts like the standard pair, tunes and is written back with its
contrib nodes as they were; its QOperator model (QLinearConv, ...) is refused with one line naming
the node and saying to quantize in QDQ format."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from finetune.config import FastFinetune
from finetune.lift import LiftError, lift_model
from finetune.recon import finetune_model
from finetune.zoo import digits_split

from .lift_helpers import run_torch
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
