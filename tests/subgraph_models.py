"""Small models with control flow, built with onnx.helper the way exporters write them: If branches
that read the outer graph's initializers and Constant nodes without naming them as inputs, and
weights stored as Constant nodes inside a branch."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
FEATURES, HIDDEN, CLASSES = 16, 32, 4


def _weight(rng: np.random.Generator, name: str, shape: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _info(name: str, shape: list[int | str] | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def if_reading_outer_names(seed: int = 0) -> onnx.ModelProto:
    """x[n, 16] → If(sum(x) > 0): the then branch is MatMul(x, W1) → Relu → MatMul(·, W2) + shift,
    the else branch Gemm(x, W3, B3) with a Constant weight of its own. W1, W2, W3, B3 are outer
    initializers and `shift` an outer Constant, read only inside the branches."""
    rng = np.random.default_rng(seed)
    then_branch = helper.make_graph([
        helper.make_node("MatMul", ["x", "W1"], ["then_hidden"], name="then_matmul1"),
        helper.make_node("Relu", ["then_hidden"], ["then_relu"], name="then_relu"),
        helper.make_node("MatMul", ["then_relu", "W2"], ["then_logits"], name="then_matmul2"),
        helper.make_node("Add", ["then_logits", "shift"], ["then_out"], name="then_add"),
    ], "then", [], [_info("then_out")])
    else_branch = helper.make_graph([
        helper.make_node("Constant", [], ["else_scale"], name="else_scale_constant",
                         value=_weight(rng, "else_scale_value", [CLASSES, CLASSES])),
        helper.make_node("Gemm", ["x", "W3", "B3"], ["else_logits"], name="else_gemm"),
        helper.make_node("MatMul", ["else_logits", "else_scale"], ["else_out"], name="else_matmul"),
    ], "else", [], [_info("else_out")])
    nodes = [
        helper.make_node("Constant", [], ["shift"], name="shift_constant",
                         value=numpy_helper.from_array(np.full([CLASSES], 0.5, np.float32))),
        helper.make_node("ReduceSum", ["x"], ["total"], name="total", keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"], name="positive"),
        helper.make_node("If", ["positive"], ["y"], name="branch", then_branch=then_branch, else_branch=else_branch),
    ]
    initializers = [
        _weight(rng, "W1", [FEATURES, HIDDEN]), _weight(rng, "W2", [HIDDEN, CLASSES]),
        _weight(rng, "W3", [FEATURES, CLASSES]), _weight(rng, "B3", [CLASSES]),
        numpy_helper.from_array(np.array(0, np.float32), "zero"),
    ]
    graph = helper.make_graph(nodes, "if_reading_outer_names", [_info("x", [1, FEATURES])], [_info("y", [1, CLASSES])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def then_branch_alone(model: onnx.ModelProto) -> onnx.ModelProto:
    """The then branch of `if_reading_outer_names` as a model of its own, with the initializers
    and the shift it reads: what the If computes on inputs whose sum is positive."""
    outer = {tensor.name: tensor for tensor in model.graph.initializer}
    branch = next(a.g for a in model.graph.node[-1].attribute if a.name == "then_branch")
    shift = next(node for node in model.graph.node if node.output[0] == "shift")
    graph = helper.make_graph([shift, *branch.node], "then_alone", [_info("x", [1, FEATURES])], [_info("then_out", [1, CLASSES])],
                              [outer[name] for name in ("W1", "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def branch_inputs(count: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """One-row feeds alternating between the then branch (positive sum) and the else branch."""
    rng = np.random.default_rng(seed)
    feeds = []
    for i in range(count):
        x = rng.standard_normal((1, FEATURES)).astype(np.float32)
        x += np.float32((1.0 if i % 2 == 0 else -1.0) - x.mean())  # sum ±16: the branch is known
        feeds.append({"x": x})
    return feeds
