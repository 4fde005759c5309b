"""Rank-0 and one-element tensors in every block format (BFP, MX4/6/9, OCP MX), bit for bit as AMD
Quark's own kernels return them (tests/data/vectors/scalars), in the torch kernels, in the function
bodies run by stock onnxruntime and in the lifted fake-quant module; and function bodies that take
shapes from the data when a model declares a 0 or symbolic batch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from finetune.formats import BFPSpec, MXSpec, quantize_dequantize
from finetune.lift import lift_model
from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN

from .test_custom_ops_vectors import one_node_model, session
from .vectors import VectorSet, assert_same_values, load_scalar_vector_sets, load_vector_sets

SCALAR_SETS = load_scalar_vector_sets()
RANKS = sorted({x.ndim for s in SCALAR_SETS for x, _ in s.pairs})


def spec_of(vectors: VectorSet) -> BFPSpec | MXSpec:
    """The torch spec of a vector set's node attributes (less Quark's kernel-choice flag, which is 0)."""
    attributes = {k: v for k, v in vectors.attributes.items() if k != "use_compiler_version_cpu_kernel"}
    return (BFPSpec if vectors.op_type == "BFPQuantizeDequantize" else MXSpec)(**attributes)


def pairs_of_rank(vectors: VectorSet, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The set's (x, y) pairs whose x has the given rank."""
    return [(x, y) for x, y in vectors.pairs if x.ndim == rank]


def test_scalar_vectors_cover_every_block_format() -> None:
    """Every bfp_method and element type, rank 0, [1] and [1, 1], an axis out of range for them."""
    methods = {s.attributes.get("bfp_method", s.attributes.get("element_dtype")) for s in SCALAR_SETS}
    assert methods == {"to_bfp", "to_bfp_prime", "fp8_e5m2", "fp8_e4m3", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8"}
    assert {0, 1, 2} <= set(RANKS) and {s.attributes["axis"] for s in SCALAR_SETS} == {0, 1, 3, -3}


@pytest.mark.parametrize("vectors", SCALAR_SETS, ids=lambda v: v.name)
def test_torch_kernel(vectors: VectorSet) -> None:
    """The torch kernel, with and without a gradient, gives Quark's values and keeps the shape."""
    spec = spec_of(vectors)
    for i, (x, y) in enumerate(vectors.pairs):
        got = quantize_dequantize(torch.from_numpy(x), spec)
        assert got.shape == x.shape
        assert_same_values(got.numpy(), y, f"{vectors.name} torch input {i}")
        tracked = torch.from_numpy(x).requires_grad_()
        assert_same_values(quantize_dequantize(tracked, spec).detach().numpy(), y, f"{vectors.name} grad input {i}")


@pytest.mark.parametrize("level", ["disable", "all"])
@pytest.mark.parametrize("domain, opset", [(QUARK_DOMAIN, 17), (CUSTOM_DOMAIN, 17), (QUARK_DOMAIN, 13)])
@pytest.mark.parametrize("vectors", SCALAR_SETS, ids=lambda v: v.name)
def test_function_body_of_unknown_shape(vectors: VectorSet, domain: str, opset: int, level: str) -> None:
    """One session whose input shape, even rank, is unknown runs every rank, at opset 13 too."""
    runner = session(one_node_model(vectors.op_type, vectors.attributes, domain, opset), level)
    for i, (x, y) in enumerate(vectors.pairs):
        got = runner.run(None, {"x": x})[0]
        assert got.shape == x.shape
        assert_same_values(got, y, f"{vectors.name} {domain} opset {opset} {level} input {i}")


@pytest.mark.parametrize("level", ["disable", "all"])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("vectors", SCALAR_SETS, ids=lambda v: v.name)
def test_function_body_of_static_shape(vectors: VectorSet, rank: int, level: str) -> None:
    """With the shape declared, as Quark declares its rank-0 attention scale (onnxruntime then
    checks and folds the body's shape arithmetic when it loads the model)."""
    pairs = pairs_of_rank(vectors, rank)
    runner = session(one_node_model(vectors.op_type, vectors.attributes, QUARK_DOMAIN, shape=list(pairs[0][0].shape)), level)
    for i, (x, y) in enumerate(pairs):
        assert_same_values(runner.run(None, {"x": x})[0], y, f"{vectors.name} rank {rank} {level} input {i}")


@pytest.mark.parametrize("vectors", SCALAR_SETS, ids=lambda v: v.name)
def test_lifted_fake_quant(vectors: VectorSet) -> None:
    """A lifted node on a declared rank-0 input runs every rank in its FakeQuantize."""
    model = one_node_model(vectors.op_type, vectors.attributes, QUARK_DOMAIN, shape=[])
    model.opset_import.append(helper.make_opsetid(QUARK_DOMAIN, 1))
    module = lift_model(model)
    for i, (x, y) in enumerate(vectors.pairs):
        with torch.no_grad():
            got = module(torch.from_numpy(x))
        assert got.shape == x.shape
        assert_same_values(got.numpy(), y, f"{vectors.name} lifted input {i}")


# ---------------------------------------------------------------- declared shapes that are not real

BATCH_CASES = ["bfp_tobfp_bw16_ax1_rm2", "bfpprime_mx4_bw11_ax1_rm2", "mx_fp4_e2m1_ax1_rm2", "mx_int8_ax1_rm2"]


def batch_model(vectors: VectorSet, shape: tuple[int, ...], batch: int | str) -> onnx.ModelProto:
    """x [N, ...] -> Mul by 1 -> t -> the custom node -> y, where t's value_info and y declare the
    batch as `batch` (AMD Quark writes 0 there); the Mul keeps t an inner tensor."""
    declared = [batch, *shape[1:]]
    nodes = [
        helper.make_node("Mul", ["x", "one"], ["t"]),
        helper.make_node(vectors.op_type, ["t"], ["y"], name="qdq", domain=QUARK_DOMAIN, **vectors.attributes),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, declared)],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
        value_info=[helper.make_tensor_value_info("t", TensorProto.FLOAT, declared)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(QUARK_DOMAIN, 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("level", ["disable", "all"])
@pytest.mark.parametrize("batch", [0, "batch"])
@pytest.mark.parametrize("name", BATCH_CASES)
def test_declared_zero_or_symbolic_batch(name: str, batch: int | str, level: str) -> None:
    """A body takes x's shape from the data, not from a declared 0 (or symbolic) batch: the same
    bits as the reference vectors and the torch kernel."""
    vectors = next(v for v in load_vector_sets() if v.name == name)
    for i, (x, y) in enumerate(vectors.pairs):
        if x.ndim < 2:
            continue
        got = session(batch_model(vectors, x.shape, batch), level).run(None, {"x": x})[0]
        assert_same_values(got, y, f"{name} batch {batch!r} {level} input {i}")
        assert_same_values(got, quantize_dequantize(torch.from_numpy(x), spec_of(vectors)).numpy(), f"{name} torch input {i}")
