"""weight_storage matmul_nbits: 4-bit block weights of MatMul packed as onnxruntime's MatMulNBits hold
exactly the QDQ model's codes, scales and zero points, and compute its outputs within a float sum's
bound; weights the op cannot take stay QDQ with a warning; the pipeline writes the packed form."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from finetune.export.matmul_nbits import DEFAULT_ZERO_POINT, to_matmul_nbits
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.zoo_decoder import decoder_feeds, export_decoder

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

U32 = np.finfo(np.float32).eps / 2  # unit roundoff of float32


def _qdq_matmul(k: int, n: int, block: int, dtype: int, zero_point: bool, seed: int, op: str = "MatMul") -> onnx.ModelProto:
    """x [3, k] @ DequantizeLinear(codes [k, n], blocks of `block` along k) with seeded codes."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    low, high = (-8, 8) if dtype == TensorProto.INT4 else (0, 16)
    codes = helper.make_tensor("codes", dtype, [k, n], rng.integers(low, high, k * n).tolist())
    scale = numpy_helper.from_array(rng.uniform(0.01, 0.1, (blocks, n)).astype(np.float32), "scale")
    tensors, inputs = [codes, scale], ["codes", "scale"]
    if zero_point:
        tensors.append(helper.make_tensor("zp", dtype, [blocks, n], rng.integers(low, high, blocks * n).tolist()))
        inputs.append("zp")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["w"], axis=0, block_size=block),
             helper.make_node(op, ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _unpacked(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [K, N], scales [blocks, N], zero points [blocks, N]) read back from the MatMulNBits node."""
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, block = attributes["K"], attributes["N"], attributes["block_size"]
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    packed = tensors[node.input[1]]
    blocks = packed.shape[1]
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, blocks * block)[:, :k]
    if len(node.input) > 3:
        zero_bytes = tensors[node.input[3]].reshape(n, -1)
        zero = np.stack([zero_bytes & 0xF, zero_bytes >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        zero = np.full((n, blocks), DEFAULT_ZERO_POINT)
    return nibbles.T, tensors[node.input[2]].reshape(n, blocks).T, zero.T


CASES = [(64, 8, 32, TensorProto.INT4, False), (80, 6, 32, TensorProto.UINT4, True), (96, 5, 16, TensorProto.INT4, True),
         (256, 7, 128, TensorProto.UINT4, True)]


@pytest.mark.parametrize("k,n,block,dtype,zero_point", CASES)
def test_matmul_nbits_holds_the_qdq_codes_and_computes_its_outputs(k: int, n: int, block: int, dtype: int,
                                                                   zero_point: bool) -> None:
    qdq = _qdq_matmul(k, n, block, dtype, zero_point, seed=k + n)
    packed, kept = to_matmul_nbits(qdq)
    assert kept == [] and [node.op_type for node in packed.graph.node] == ["MatMulNBits"]
    tensors = {t.name: numpy_helper.to_array(t).astype(np.int64) for t in qdq.graph.initializer}
    offset = DEFAULT_ZERO_POINT if dtype == TensorProto.INT4 else 0
    codes, scales, zero = _unpacked(packed)
    assert np.array_equal(codes, tensors["codes"] + offset)
    assert np.array_equal(scales, numpy_helper.to_array(qdq.graph.initializer[1]))
    assert np.array_equal(zero, tensors.get("zp", np.zeros_like(zero)) + offset)
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    reference = inference_session(qdq).run(None, {"x": x})[0]
    measured = inference_session(packed).run(None, {"x": x})[0]
    weight = (codes.astype(np.float64) - np.repeat(zero, block, axis=0)[:k]) * np.repeat(scales, block, axis=0)[:k]
    # Both sum K float32 products, in orders of their own: each within gamma_K * sum|x w| of the exact sum.
    gamma = k * U32 / (1 - k * U32)
    bound = 2 * gamma * (np.abs(x.astype(np.float64)) @ np.abs(weight)) + 2 * U32 * np.abs(reference)
    assert (np.abs(measured.astype(np.float64) - reference) <= bound).all()


def test_weights_matmul_nbits_cannot_take_stay_qdq_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    gemm = _qdq_matmul(64, 8, 32, TensorProto.INT4, False, seed=1, op="Gemm")
    with caplog.at_level(logging.WARNING):
        packed, kept = to_matmul_nbits(gemm)
    assert [node.op_type for node in packed.graph.node] == ["DequantizeLinear", "Gemm"]
    assert kept == ["codes: read by other than one MatMul's second input (Gemm, Conv or several readers)"]
    assert "stays DequantizeLinear" in caplog.text
    small_blocks = _qdq_matmul(64, 8, 8, TensorProto.INT4, False, seed=1)
    assert "block_size 8 is not a power of two of at least 16" in to_matmul_nbits(small_blocks)[1][0]


def test_the_pipeline_writes_the_tiny_decoder_with_matmul_nbits(tmp_path: Path) -> None:
    path = export_decoder(tmp_path / "decoder.onnx", cache=False, dynamo=False)
    feeds = decoder_feeds(False, 2)
    config = {"preset": "INT4_BLOCK32", "weight_storage": "matmul_nbits"}
    result = quantize_and_finetune(path, config, feeds, model_path=tmp_path / "int4.onnx")
    written = onnx.load(tmp_path / "int4.onnx")
    assert sum(node.op_type == "MatMulNBits" for node in written.graph.node) == 15  # 7 per block, and the LM head
    assert not any(node.op_type == "DequantizeLinear" for node in written.graph.node)
    qdq = quantize_and_finetune(path, {**config, "weight_storage": "compact"}, feeds).model
    assert written.graph == result.model.graph == to_matmul_nbits(qdq)[0].graph  # the compact codes, packed
    assert result.summary["matmul_nbits_kept_qdq"] == []  # every block weight of the decoder feeds a MatMul
    assert np.isfinite(inference_session(written).run(None, feeds[0])[0]).all()
