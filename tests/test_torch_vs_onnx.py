"""The torch formats and the ONNX function bodies in onnxruntime agree bit for bit on random
shapes, axes, attributes and scales, beyond the fixed reference vectors."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from finetune.formats import MX_ELEMENTS, BFPSpec, FloatSpec, FormatSpec, IntSpec, MXSpec, quantize_dequantize
from finetune.onnx.qdq import STANDARD_QDQ_OPSET, make_qdq

from .test_custom_ops_vectors import run
from .vectors import assert_same_values

EXTENDED_CODE_TYPES = ["int32", "uint32", "bfloat16", "float16"]


@st.composite
def tensors(draw: st.DrawFn) -> np.ndarray:
    """Random float32 tensors of rank 1-4 mixing scales, with zeros, ties-prone values and specials."""
    shape = draw(st.lists(st.integers(1, 23), min_size=1, max_size=4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 30, shape)
    x = np.where(rng.random(shape) < 0.1, np.round(x * 4) / 4, x)
    x = np.where(rng.random(shape) < 0.05, 0.0, x)
    if draw(st.booleans()):
        specials = np.array([np.nan, np.inf, -np.inf, 1e-40, -3e38])
        x = np.where(rng.random(shape) < 0.02, rng.choice(specials, shape), x)
    return x.astype(np.float32)


@st.composite
def bfp_specs(draw: st.DrawFn, rank: int) -> BFPSpec:
    method = draw(st.sampled_from(["to_bfp", "to_bfp_prime"]))
    shift_bits = draw(st.integers(0, 2))
    sub = draw(st.sampled_from([1, 2, 4]))
    block = sub * draw(st.integers(1, 8))
    widest = 32 - (2**shift_bits - 1 if method == "to_bfp_prime" else 0)
    return BFPSpec(method, draw(st.integers(10, min(widest, 24))), block, draw(st.integers(-rank, rank - 1)),
                   draw(st.integers(0, 2)), sub, shift_bits, draw(st.integers(0, 1)))


@st.composite
def mx_specs(draw: st.DrawFn, rank: int) -> MXSpec:
    return MXSpec(draw(st.sampled_from(sorted(MX_ELEMENTS))), draw(st.integers(1, 40)),
                  draw(st.integers(-rank, rank - 1)), draw(st.integers(0, 2)))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_bfp_torch_equals_onnxruntime(data: st.DataObject) -> None:
    x = data.draw(tensors())
    spec = data.draw(bfp_specs(x.ndim))
    expected = run(qdq_model(spec, None, None), {"x": x})[0]
    assert_same_values(quantize_dequantize(torch.from_numpy(x), spec).numpy(), expected, str(spec))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_mx_torch_equals_onnxruntime(data: st.DataObject) -> None:
    x = data.draw(tensors())
    spec = data.draw(mx_specs(x.ndim))
    expected = run(qdq_model(spec, None, None), {"x": x})[0]
    assert_same_values(quantize_dequantize(torch.from_numpy(x), spec).numpy(), expected, str(spec))


def qdq_model(spec: FormatSpec, scale: np.ndarray | None, zero_point: np.ndarray | None) -> onnx.ModelProto:
    """x -> make_qdq(spec) -> y at opset 21."""
    qdq_nodes = make_qdq("x", "y", spec, "t", scale, zero_point)
    graph = helper.make_graph(qdq_nodes.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], qdq_nodes.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", STANDARD_QDQ_OPSET)])
    model.ir_version = 10
    return model


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_extended_qdq_torch_equals_onnxruntime(data: st.DataObject) -> None:
    x = data.draw(tensors())
    x = np.nan_to_num(x, nan=0.0, posinf=3e38, neginf=-3e38)  # a NaN has no integer code
    code = data.draw(st.sampled_from(EXTENDED_CODE_TYPES))
    per_axis = data.draw(st.booleans()) and x.ndim > 1
    axis = data.draw(st.integers(0, x.ndim - 1)) if per_axis else 1
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shape = (x.shape[axis],) if per_axis else ()
    scale = np.asarray(2.0 ** rng.uniform(-20, 20, shape), np.float32)
    if code in ("int32", "uint32"):
        spec = IntSpec(code, axis=axis if per_axis else None)
        zero_point = np.asarray(rng.integers(spec.qmin, 2**20, shape) if code == "int32" else rng.integers(0, 2**20, shape), np.float32)
        got = quantize_dequantize(torch.from_numpy(x), spec, torch.from_numpy(scale), torch.from_numpy(zero_point))
    else:
        spec = FloatSpec(code, axis=axis if per_axis else None)
        zero_point = np.asarray(rng.integers(-4, 4, shape), np.float32)
        got = quantize_dequantize(torch.from_numpy(x), spec, torch.from_numpy(scale), torch.from_numpy(zero_point))
    expected = run(qdq_model(spec, scale, zero_point), {"x": x})[0]
    assert_same_values(got.numpy(), expected, f"{spec} scale {scale} zp {zero_point}")
