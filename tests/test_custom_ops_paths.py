"""The block-format function bodies take one of two paths (an If): the ordinary body, free of the
rare-case handling and of Where, or the general one for tensors with NaN, Inf, magnitudes of 2^64 or
more, or a single element. Both must give the reference's values exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from finetune.formats import BFP16, MX4, MX6, MX9, MXFP4, MXFP6_E2M3, MXFP8_E4M3, MXFP8_E5M2, MXINT8, quantize_dequantize
from finetune.onnx import attach_custom_ops
from finetune.onnx.functions.arithmetic import Body
from finetune.onnx.functions.blocks import block_dims
from finetune.onnx.graphs import all_nodes
from finetune.onnx.qdq import STANDARD_QDQ_OPSET, make_qdq
from finetune.onnx.session import inference_session

from .vectors import assert_same_values

SPECS = {"BFP16": BFP16, "MX4": MX4, "MX6": MX6, "MX9": MX9, "MXINT8": MXINT8, "MXFP8_E4M3": MXFP8_E4M3,
         "MXFP8_E5M2": MXFP8_E5M2, "MXFP6_E2M3": MXFP6_E2M3, "MXFP4": MXFP4,
         "BFP16 ties up": dataclasses.replace(BFP16, rounding_mode=1),
         "MX9 ties even": dataclasses.replace(MX9, rounding_mode=2),
         "MXINT8 ties away": dataclasses.replace(MXINT8, rounding_mode=0)}


def qdq_model(spec, shape: tuple[int, ...]) -> onnx.ModelProto:
    """x -> the spec's custom op -> y, with bodies attached."""
    qdq = make_qdq("x", "y", spec, "q")
    graph = helper.make_graph(qdq.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", STANDARD_QDQ_OPSET)])
    model.ir_version = 10
    return attach_custom_ops(model)


def hard_tensor(seed: int) -> np.ndarray:
    """Values over many binades, with zeros of both signs, subnormals, exact ties of the codes,
    blocks of zeros and of subnormals only, and magnitudes up to 2^63."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 96)) * np.exp2(rng.integers(-20, 20, (6, 96)))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-39)
    x[2] = (rng.integers(-64, 64, 96) + 0.5).astype(np.float32) / 8
    x[3, ::7] = -0.0
    x[4, :5] = [2.0**63, -(2.0**62), 1e-45, -1e-45, 2.0**-126]
    return x


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("rare", [None, np.nan, np.inf, -np.inf, 2.0**64, -(2.0**70)])
@pytest.mark.parametrize("name", SPECS)
def test_both_paths_match_the_reference(name: str, rare: float | None, axis: int) -> None:
    """Blocks along the last axis (the ordinary body's flat view) and along the first (its view
    with the length after the axis innermost)."""
    spec = dataclasses.replace(SPECS[name], axis=axis)
    x = hard_tensor(len(name))
    if rare is not None:
        x[5, 3] = rare
    x = x if axis == 1 else np.ascontiguousarray(x.T)
    y = inference_session(qdq_model(spec, x.shape)).run(None, {"x": x})[0]
    expected = quantize_dequantize(torch.from_numpy(x), spec).numpy()
    assert_same_values(y, expected, f"{name} with {rare} along axis {axis}")


@pytest.mark.parametrize("name", ["BFP16", "MX9", "MXFP4"])
def test_two_elements_take_the_ordinary_path_and_one_is_returned(name: str) -> None:
    spec = SPECS[name]
    for x in (np.array([0.3, -1.7], np.float32), np.array([0.3], np.float32), np.array(0.3, np.float32)):
        y = inference_session(qdq_model(spec, list(x.shape))).run(None, {"x": x})[0]
        assert_same_values(y, quantize_dequantize(torch.from_numpy(x), spec).numpy(), f"{name} {x.shape}")


@pytest.mark.parametrize("name", ["BFP16", "MXINT8", "MXFP8_E4M3", "MX4"])
def test_ordinary_body_has_no_elementwise_where(name: str) -> None:
    """onnxruntime's Where costs ~20 Muls; the ordinary body, which nearly every tensor takes, has
    (in both of its views) only the Wheres that block_dims computes on shape vectors."""
    (function,) = qdq_model(SPECS[name], [4, 64]).functions
    (branch,) = [node for node in function.node if node.op_type == "If"]
    ordinary = next(a.g for a in branch.attribute if a.name == "else_branch")
    shapes = Body(STANDARD_QDQ_OPSET)
    block_dims(shapes, "x", 1, SPECS[name].block_size)
    nodes = list(all_nodes(ordinary))
    assert len(nodes) > len(shapes.nodes)
    assert sum(n.op_type == "Where" for n in nodes) == sum(n.op_type == "Where" for n in shapes.nodes)
