"""normalize_model: constants to initializers, Identity-shared weights, node names, opset upgrade,
shape inference; a readable list of changes, the input untouched, onnxruntime results unchanged."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from finetune.onnx.normalize import default_opset, normalize_model

from .lift_helpers import onnx_model, random_input, run_ort, tensor

W = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)


def _messy_model() -> onnx.ModelProto:
    """Constant / ConstantOfShape weights, a weight shared through Identity, unnamed and
    duplicate node names, an initializer listed as a graph input, no intermediate shapes."""
    mk = helper.make_node
    nodes = [
        mk("Constant", [], ["w"], value=numpy_helper.from_array(W, "w")),
        mk("Constant", [], ["shape"], value_ints=[3]),
        mk("ConstantOfShape", ["shape"], ["bias"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
        mk("Identity", ["scale"], ["scale_copy"], name="dup"),
        mk("MatMul", ["x", "w"], ["h"], name="dup"),
        mk("Add", ["h", "bias"], ["hb"]),
        mk("Mul", ["hb", "scale_copy"], ["y"]),
    ]
    model = onnx_model(nodes, [tensor("x", ["batch", 3])], [tensor("y", None)], {"scale": np.full(3, 2.0, np.float32)})
    model.graph.input.append(tensor("scale", [3]))
    return model


def test_normalize_reports_every_change_and_keeps_results(caplog: pytest.LogCaptureFixture) -> None:
    """Every normalisation step runs, is listed and logged, and the input stays as it was."""
    model = _messy_model()
    before = model.SerializeToString()
    with caplog.at_level(logging.INFO, logger="finetune.onnx.normalize"):
        normalized, changes = normalize_model(model)
    assert model.SerializeToString() == before
    assert changes == [
        "turned 2 Constant node(s) into initializers",
        "turned 1 ConstantOfShape node(s) into initializers",
        "bypassed 1 Identity node(s) of initializers",
        "removed 1 initializer(s) from the graph inputs",
        "named 2 node(s) that had no name or a duplicate one",
        "inferred the shapes of 2 value(s)",
    ]
    assert [r.getMessage() for r in caplog.records] == changes
    assert [n.op_type for n in normalized.graph.node] == ["MatMul", "Add", "Mul"]
    assert len({n.name for n in normalized.graph.node}) == 3
    x = random_input((2, 3))  # onnxruntime refuses the original's duplicate node names
    np.testing.assert_allclose(run_ort(normalized, [x])[0], (x @ W + 0.5) * 2, rtol=1e-6)


def test_old_opset_is_upgraded() -> None:
    """An opset-11 model (ReduceMean with axes as an attribute) is converted to opset 13."""
    node = helper.make_node("ReduceMean", ["x"], ["y"], name="mean", axes=[1], keepdims=0)
    model = onnx_model([node], [tensor("x", [2, 4])], [tensor("y", None)], opset=11)
    normalized, changes = normalize_model(model)
    assert default_opset(normalized) == 13 and "upgraded the default opset from 11 to 13" in changes
    x = random_input((2, 4))
    np.testing.assert_array_equal(run_ort(normalized, [x])[0], run_ort(model, [x])[0])


def test_unconvertible_opset_is_kept_and_reported() -> None:
    """A model the version converter rejects stays at its opset, with the reason in the changes."""
    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="unknown")
    model = onnx_model([node], [tensor("x", [2])], [tensor("y", None)], opset=11)
    normalized, changes = normalize_model(model)
    assert default_opset(normalized) == 11 and changes[0].startswith("kept opset 11")
