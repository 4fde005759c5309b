"""normalize_model: constants to initializers, Identity-shared weights, node names, opset upgrade,
shape inference; a readable list of changes, the input untouched, onnxruntime results unchanged."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from finetune.onnx.normalize import default_opset, keep_only, normalize_model

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


def test_keep_only_removes_entries_in_place_without_copying_the_kept_ones() -> None:
    """Dropping unused initializers kept the others by re-adding them, which copies every message: a
    2.5 GB decoder's weights twice over (+2.4 GB resident after folding its exported constants). The
    kept entries are the very messages held before, in their order."""
    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.full(4, i, np.float32), f"w{i}") for i in range(6)])
    held = list(graph.initializer)
    assert keep_only(graph.initializer, lambda t: t.name not in {"w1", "w4"}) == 2
    assert [t.name for t in graph.initializer] == ["w0", "w2", "w3", "w5"]
    assert all(now is before for now, before in zip(graph.initializer, [held[0], held[2], held[3], held[5]]))
    assert keep_only(graph.initializer, lambda t: True) == 0 and len(graph.initializer) == 4


def test_the_opset_is_raised_for_int4_blocks_in_the_callers_own_model() -> None:
    """quantize_model raises the opset of its own copy of the float model in place (a copy held a 2.5 GB
    decoder's weights a second time): the model it gets back is the one it gave, at opset 21."""
    from finetune.config import load_config
    from finetune.quantize.plan import plan, upgrade_opset

    weight = numpy_helper.from_array(np.ones((256, 8), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [weight])
    model, _ = normalize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    changes: list[str] = []
    upgraded = upgrade_opset(model, plan(model, load_config("INT4_BLOCK32"), []), changes, [])
    assert upgraded is model and default_opset(model) == 21 and changes == ["upgraded the default opset from 13 to 21"]


def resident_kib() -> int:
    """This process's resident memory now, in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc (Linux)")
def test_folding_a_node_leaves_nothing_that_keeps_the_model_alive() -> None:
    """onnx's reference evaluator lives in reference cycles; handed the model's own node to fold, it kept
    the whole model (a 2.5 GB decoder's weights) alive after its last reference went, until Python's
    cycle collector ran. With the collector off, dropping a folded model of 64 MiB gives the memory back."""
    from finetune.onnx.fold import fold_constants

    size = 1 << 24
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal(size, dtype=np.float32), "w")
    shape = numpy_helper.from_array(np.array([size // 4, 4], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["w", "shape"], ["w2"], name="reshape"),
                               helper.make_node("MatMul", ["x", "w2"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size // 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    del weight, graph
    gc.collect()
    gc.disable()
    try:
        assert fold_constants(model)[0].startswith("folded 1 constant node")
        before = resident_kib()
        del model
        freed = before - resident_kib()
    finally:
        gc.enable()
    assert freed > 48 * 1024  # at least the folded copy, 64 MiB (the dropped weight may have gone already)
