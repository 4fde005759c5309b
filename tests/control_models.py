"""Small control-flow models for the lifting tests, built with onnx.helper: Ifs with a constant
condition, branches sharing a weight, a whole network inside a top-level If, a Loop with a
condition and scan outputs, and a Scan running backwards."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.subgraph_models import CLASSES, FEATURES, OPSET

HIDDEN = 8
SAMPLE_RATE = 16000  # the voice-activity model's switch: its network sits in a top-level If on the rate


def _weight(rng: np.random.Generator, name: str, shape: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _info(name: str, shape: list[int | str] | None = None, elem_type: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           initializers: list[onnx.TensorProto]) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(nodes, "control", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _matmul_branch(name: str, weight: str) -> onnx.GraphProto:
    return helper.make_graph([helper.make_node("MatMul", ["x", weight], [f"{name}_out"], name=f"{name}_matmul")],
                             name, [], [_info(f"{name}_out")])


def constant_if(condition: str, seed: int = 0) -> onnx.ModelProto:
    """x[1, 16] → If → MatMul(x, W_then) or MatMul(x, W_else). `condition` "initializer": a stored
    true; "shape": Equal(Shape(x)[1], 16), true from the static shape alone."""
    rng = np.random.default_rng(seed)
    nodes = []
    initializers = [_weight(rng, "W_then", [FEATURES, CLASSES]), _weight(rng, "W_else", [FEATURES, CLASSES])]
    if condition == "initializer":
        initializers.append(numpy_helper.from_array(np.array(True), "flag"))
    else:
        initializers += [numpy_helper.from_array(np.array(1, np.int64), "one"),
                         numpy_helper.from_array(np.array(FEATURES, np.int64), "features")]
        nodes += [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
                  helper.make_node("Gather", ["shape", "one"], ["width"], name="width"),
                  helper.make_node("Equal", ["width", "features"], ["flag"], name="flag")]
    nodes.append(helper.make_node("If", ["flag"], ["y"], name="choice", then_branch=_matmul_branch("then", "W_then"),
                                  else_branch=_matmul_branch("else", "W_else")))
    return _model(nodes, [_info("x", [1, FEATURES])], [_info("y", [1, CLASSES])], initializers)


def shared_weight_if(seed: int = 0) -> onnx.ModelProto:
    """x[1, 16] → If(sum(x) > 0): MatMul(x, W) in one branch, MatMul(Neg(x), W) in the other: one
    initializer read in both branches."""
    rng = np.random.default_rng(seed)
    else_branch = helper.make_graph([
        helper.make_node("Neg", ["x"], ["negated"], name="else_neg"),
        helper.make_node("MatMul", ["negated", "W"], ["else_out"], name="else_matmul"),
    ], "else", [], [_info("else_out")])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], name="total", keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"], name="positive"),
        helper.make_node("If", ["positive"], ["y"], name="branch", then_branch=_matmul_branch("then", "W"),
                         else_branch=else_branch),
    ]
    initializers = [_weight(rng, "W", [FEATURES, CLASSES]), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    return _model(nodes, [_info("x", [1, FEATURES])], [_info("y", [1, CLASSES])], initializers)


def network_in_if(seed: int = 0) -> onnx.ModelProto:
    """x[batch, 3, 8, 8], rate (int64 scalar) → If(rate == 16000): a conv network
    (Conv-Relu-Conv-Relu-GlobalAveragePool-Flatten-Gemm) or, at any other rate, a cheaper one
    (GlobalAveragePool-Flatten-Gemm), the way a voice-activity model holds its whole network in an If."""
    rng = np.random.default_rng(seed)
    full = helper.make_graph([
        helper.make_node("Conv", ["x", "C1", "c1"], ["conv1"], name="net/conv1/Conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv1"], ["relu1"], name="net/relu1/Relu"),
        helper.make_node("Conv", ["relu1", "C2", "c2"], ["conv2"], name="net/conv2/Conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv2"], ["relu2"], name="net/relu2/Relu"),
        helper.make_node("GlobalAveragePool", ["relu2"], ["pooled"], name="net/pool"),
        helper.make_node("Flatten", ["pooled"], ["flat"], name="net/flatten"),
        helper.make_node("Gemm", ["flat", "G", "g"], ["full_out"], name="net/head/Gemm", transB=1),
    ], "full", [], [_info("full_out")])
    cheap = helper.make_graph([
        helper.make_node("GlobalAveragePool", ["x"], ["cheap_pooled"], name="cheap/pool"),
        helper.make_node("Flatten", ["cheap_pooled"], ["cheap_flat"], name="cheap/flatten"),
        helper.make_node("Gemm", ["cheap_flat", "H", "h"], ["cheap_out"], name="cheap/head/Gemm"),
    ], "cheap", [], [_info("cheap_out")])
    nodes = [helper.make_node("Equal", ["rate", "expected_rate"], ["at_rate"], name="at_rate"),
             helper.make_node("If", ["at_rate"], ["y"], name="If_0", then_branch=full, else_branch=cheap)]
    initializers = [
        _weight(rng, "C1", [HIDDEN, 3, 3, 3]), _weight(rng, "c1", [HIDDEN]), _weight(rng, "C2", [HIDDEN, HIDDEN, 3, 3]),
        _weight(rng, "c2", [HIDDEN]), _weight(rng, "G", [CLASSES, HIDDEN]), _weight(rng, "g", [CLASSES]),
        _weight(rng, "H", [3, CLASSES]), _weight(rng, "h", [CLASSES]),
        numpy_helper.from_array(np.array(SAMPLE_RATE, np.int64), "expected_rate"),
    ]
    inputs = [_info("x", ["batch", 3, 8, 8]), _info("rate", [], TensorProto.INT64)]
    return _model(nodes, inputs, [_info("y", ["batch", CLASSES])], initializers)


def loop_model(stop_after: int = 4, seed: int = 0) -> onnx.ModelProto:
    """x[2, 8], steps (int64 scalar) → Loop(steps, true): h ← Tanh(h·W + b) while the iteration is
    below `stop_after` (the body's condition); returns the last h and every h stacked."""
    rng = np.random.default_rng(seed)
    body = helper.make_graph([
        helper.make_node("MatMul", ["h_in", "W"], ["product"], name="body_matmul"),
        helper.make_node("Add", ["product", "b"], ["summed"], name="body_add"),
        helper.make_node("Tanh", ["summed"], ["h_out"], name="body_tanh"),
        helper.make_node("Identity", ["h_out"], ["h_scan"], name="body_scan"),
        helper.make_node("Less", ["iteration", "stop"], ["keep"], name="body_keep"),
    ], "body", [_info("iteration", [], TensorProto.INT64), _info("cond_in", [], TensorProto.BOOL), _info("h_in", [2, HIDDEN])],
        [_info("keep", [], TensorProto.BOOL), _info("h_out", [2, HIDDEN]), _info("h_scan", [2, HIDDEN])])
    nodes = [helper.make_node("Loop", ["steps", "true", "x"], ["h", "states"], name="loop", body=body)]
    initializers = [_weight(rng, "W", [HIDDEN, HIDDEN]), _weight(rng, "b", [HIDDEN]),
                    numpy_helper.from_array(np.array(True), "true"),
                    numpy_helper.from_array(np.array(stop_after - 1, np.int64), "stop")]
    inputs = [_info("x", [2, HIDDEN]), _info("steps", [], TensorProto.INT64)]
    return _model(nodes, inputs, [_info("h", [2, HIDDEN]), _info("states", ["iterations", 2, HIDDEN])], initializers)


def scan_model(seed: int = 0) -> onnx.ModelProto:
    """s[1, 8], xs[T, 1, 3] → Scan backwards over xs: s ← Tanh(x_t·W + s); returns the last s and
    every s stacked along axis 1."""
    rng = np.random.default_rng(seed)
    body = helper.make_graph([
        helper.make_node("MatMul", ["x_t", "W"], ["product"], name="body_matmul"),
        helper.make_node("Add", ["product", "s_in"], ["summed"], name="body_add"),
        helper.make_node("Tanh", ["summed"], ["s_out"], name="body_tanh"),
        helper.make_node("Identity", ["s_out"], ["s_scan"], name="body_scan"),
    ], "body", [_info("s_in", [1, HIDDEN]), _info("x_t", [1, 3])], [_info("s_out", [1, HIDDEN]), _info("s_scan", [1, HIDDEN])])
    nodes = [helper.make_node("Scan", ["s", "xs"], ["last", "states"], name="scan", body=body, num_scan_inputs=1,
                              scan_input_directions=[1], scan_output_axes=[1])]
    inputs = [_info("s", [1, HIDDEN]), _info("xs", ["T", 1, 3])]
    outputs = [_info("last", [1, HIDDEN]), _info("states", [1, "T", HIDDEN])]
    return _model(nodes, inputs, outputs, [_weight(rng, "W", [3, HIDDEN])])
