"""Small float32/float16 models for the tools' tests, built with onnx.helper: an MLP, an
attention block with parallel Q/K/V projections, and a CNN with a Resize."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ELEM_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}
mk = helper.make_node


def make_model(nodes: list[onnx.NodeProto], x_shape: list, y_shape: list | None, weights: dict[str, np.ndarray],
           dtype: type, opset: int = 17) -> onnx.ModelProto:
    """A model with one input x and one output y of `dtype`."""
    elem = ELEM_TYPES[dtype]
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in weights.items()]
    graph = helper.make_graph(nodes, "test", [helper.make_tensor_value_info("x", elem, x_shape)],
                              [helper.make_tensor_value_info("y", elem, y_shape)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _weight(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Normal weights scaled by 1/sqrt(fan-in), so activations stay of order one."""
    fan_in = int(np.prod(shape[1:])) if len(shape) == 4 else shape[0]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)


def mlp(dtype: type = np.float32, seed: int = 0) -> onnx.ModelProto:
    """x[4,16] -> MatMul -> Add -> Relu -> MatMul -> Add -> Tanh -> y[4,8]."""
    rng = np.random.default_rng(seed)
    weights = {"w1": _weight(rng, (16, 32), dtype), "b1": (0.1 * rng.standard_normal(32)).astype(dtype),
               "w2": _weight(rng, (32, 8), dtype), "b2": (0.1 * rng.standard_normal(8)).astype(dtype)}
    nodes = [mk("MatMul", ["x", "w1"], ["h"], name="fc1"), mk("Add", ["h", "b1"], ["hb"], name="bias1"),
             mk("Relu", ["hb"], ["r"], name="relu"), mk("MatMul", ["r", "w2"], ["o"], name="fc2"),
             mk("Add", ["o", "b2"], ["ob"], name="bias2"), mk("Tanh", ["ob"], ["y"], name="tanh")]
    return make_model(nodes, [4, 16], [4, 8], weights, dtype)


def attention(dtype: type = np.float32, seed: int = 0, width: int = 16) -> onnx.ModelProto:
    """x[2,5,D] -> Q/K/V MatMuls sharing x -> softmax(Q K^T * s) V -> output MatMul -> + x -> y."""
    rng = np.random.default_rng(seed)
    weights = {name: _weight(rng, (width, width), dtype) for name in ("wq", "wk", "wv", "wo")}
    weights["scale"] = np.array(1 / np.sqrt(width), dtype)
    nodes = [mk("MatMul", ["x", "wq"], ["q"], name="q_proj"), mk("MatMul", ["x", "wk"], ["k"], name="k_proj"),
             mk("MatMul", ["x", "wv"], ["v"], name="v_proj"), mk("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             mk("MatMul", ["q", "kt"], ["s"], name="scores"), mk("Mul", ["s", "scale"], ["ss"], name="scaled"),
             mk("Softmax", ["ss"], ["p"], name="softmax", axis=-1), mk("MatMul", ["p", "v"], ["a"], name="mix"),
             mk("MatMul", ["a", "wo"], ["o"], name="out_proj"), mk("Add", ["o", "x"], ["y"], name="residual")]
    return make_model(nodes, [2, 5, width], [2, 5, width], weights, dtype)


def cnn(dtype: type = np.float32, seed: int = 0) -> onnx.ModelProto:
    """x[2,3,8,8] -> Conv -> Relu -> MaxPool -> Resize(x1.5) -> Conv -> GlobalAveragePool -> Flatten -> Gemm -> y[2,10]."""
    rng = np.random.default_rng(seed)
    weights = {"c1": _weight(rng, (8, 3, 3, 3), dtype), "c1b": (0.1 * rng.standard_normal(8)).astype(dtype),
               "c2": _weight(rng, (8, 8, 3, 3), dtype), "fc": _weight(rng, (8, 10), dtype),
               "fcb": (0.1 * rng.standard_normal(10)).astype(dtype),
               "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 1.5, 1.5], np.float32)}
    nodes = [mk("Conv", ["x", "c1", "c1b"], ["c"], name="conv1", pads=[1, 1, 1, 1]), mk("Relu", ["c"], ["r"], name="relu"),
             mk("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             mk("Resize", ["p", "roi", "scales"], ["u"], name="resize", mode="linear"),
             mk("Conv", ["u", "c2"], ["c2o"], name="conv2", pads=[1, 1, 1, 1]),
             mk("GlobalAveragePool", ["c2o"], ["g"], name="gap"), mk("Flatten", ["g"], ["f"], name="flatten"),
             mk("Gemm", ["f", "fc", "fcb"], ["y"], name="fc")]
    return make_model(nodes, [2, 3, 8, 8], [2, 10], weights, dtype)


def data_movement(dtype: type = np.float32, seed: int = 0) -> onnx.ModelProto:
    """Only ops with bfloat16 kernels on onnxruntime's CPU provider: x[2,3,8] -> Transpose ->
    LayerNormalization -> Split -> Concat (swapped halves) -> Reshape -> y[2,24]."""
    rng = np.random.default_rng(seed)
    weights = {"gamma": (1 + 0.1 * rng.standard_normal(3)).astype(dtype), "beta": (0.1 * rng.standard_normal(3)).astype(dtype),
               "halves": np.array([4, 4], np.int64), "flat": np.array([2, 24], np.int64)}
    nodes = [mk("Transpose", ["x"], ["t"], name="transpose", perm=[0, 2, 1]),
             mk("LayerNormalization", ["t", "gamma", "beta"], ["n"], name="layernorm", axis=-1),
             mk("Split", ["n", "halves"], ["n0", "n1"], name="split", axis=1),
             mk("Concat", ["n1", "n0"], ["c"], name="concat", axis=1), mk("Reshape", ["c", "flat"], ["y"], name="flatten")]
    return make_model(nodes, [2, 3, 8], [2, 24], weights, dtype)


MODELS = {"mlp": mlp, "attention": attention, "cnn": cnn}
INPUT_SHAPES = {"mlp": (4, 16), "attention": (2, 5, 16), "cnn": (2, 3, 8, 8), "data_movement": (2, 3, 8)}


def longest_path(model: onnx.ModelProto) -> int:
    """The number of nodes on the longest path from a graph input to an output."""
    depth: dict[str, int] = {}
    for node in model.graph.node:
        level = 1 + max((depth.get(name, 0) for name in node.input), default=0)
        depth.update({name: level for name in node.output})
    return max(depth[o.name] for o in model.graph.output)


def run(model: onnx.ModelProto, x: np.ndarray, optimize: bool = True) -> np.ndarray:
    """The first output on onnxruntime's CPU provider (graph optimisations on by default)."""
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]
