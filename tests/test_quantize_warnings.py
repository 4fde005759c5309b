"""Nothing the quantizer cannot do as configured passes silently: what works other than configured
is a WARNING and an entry of the summary's `warnings` (inputs of unknown type, failed shape
inference)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from finetune.notices import Notice
from finetune.onnx.normalize import normalize_model
from finetune.quantize import quantize_model
from finetune.quantize.plan import UNTYPED

from .lift_helpers import onnx_model, tensor

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 32)).astype(np.float32)


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
