"""The final model's 4-bit block weights as onnxruntime's `com.microsoft.MatMulNBits` (weight_storage
matmul_nbits): the same codes, scales and zero points as the opset-21 DequantizeLinear(block_size)
they replace, packed as the contrib op reads them, so onnxruntime runs its 4-bit kernels. Only a
2-D [K, N] int4/uint4 constant whose blocks run along K and that feeds a MatMul's second input is
packed; every other quantized weight stays QDQ, each logged at WARNING and listed."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from finetune.onnx.contrib import NBITS_SUFFIX
from finetune.onnx.graphs import node_reads

logger = logging.getLogger(__name__)

BITS = 4
DEFAULT_ZERO_POINT = 1 << (BITS - 1)  # MatMulNBits' zero point when none is given (codes are unsigned)
MIN_BLOCK = 16  # the contrib op's smallest block (a power of two)
CODE_OFFSET = {TensorProto.INT4: DEFAULT_ZERO_POINT, TensorProto.UINT4: 0}  # stored code -> MatMulNBits' unsigned code
MICROSOFT_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class PackedWeight:
    """One weight in MatMulNBits' layout: B [N, blocks, block/2] uint8, scales [N * blocks], and
    the zero points packed two a byte per row (None where all are the op's default)."""

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    k: int
    n: int
    block_size: int


def pack_blocks(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, block_size: int) -> PackedWeight:
    """Pack unsigned 4-bit codes [K, N] with their per-block scales and zero points [blocks, N]
    (blocks along K) as MatMulNBits reads them: low nibble first along K, rows by output column;
    the last block padded with its zero point (dequantizes to 0)."""
    k, n = codes.shape
    blocks = scales.shape[0]
    padded = np.repeat(zero_points, block_size, axis=0)[: blocks * block_size].astype(np.uint8)
    padded[:k] = codes
    by_column = padded.T.reshape(n, blocks, block_size)
    packed = by_column[..., 0::2] | (by_column[..., 1::2] << 4)
    zero_rows = zero_points.T.astype(np.uint8)  # [N, blocks]
    packed_zero = None
    if (zero_rows != DEFAULT_ZERO_POINT).any():
        even = np.pad(zero_rows, ((0, 0), (0, blocks % 2)), constant_values=DEFAULT_ZERO_POINT)
        packed_zero = (even[:, 0::2] | (even[:, 1::2] << 4)).reshape(-1)
    return PackedWeight(np.ascontiguousarray(packed), np.ascontiguousarray(scales.T).reshape(-1), packed_zero, k, n, block_size)


def to_matmul_nbits(model: onnx.ModelProto, accuracy_level: int | Mapping[str, int] = 0) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` whose packable DequantizeLinear -> MatMul weights are MatMulNBits nodes,
    and the reasons, one per quantized weight, that the others stay QDQ. With a mapping of MatMul
    names to accuracy levels, only those MatMuls are packed, each at its level (a model that came
    as MatMulNBits goes back to its own form: onnx.contrib.matmul_nbits_to_qdq)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    initializers = {t.name: t for t in graph.initializer}
    consumers = _sole_readers(graph)
    kept: list[str] = []
    replaced: dict[str, onnx.NodeProto] = {}  # by the MatMul's output (nodes are keyed by what they write)
    dropped_nodes, dropped_tensors = set(), set()
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        reason = _unpackable(node, initializers, consumers)
        named = isinstance(accuracy_level, Mapping)
        if named and (reason or consumers[node.output[0]].name not in accuracy_level):
            continue
        if reason:
            if node.input[0] in initializers and initializers[node.input[0]].data_type in CODE_OFFSET:
                kept.append(f"{node.input[0]}: {reason}")
            continue
        matmul = consumers[node.output[0]]
        weight = _packed(node, initializers)
        level = accuracy_level[matmul.name] if isinstance(accuracy_level, Mapping) else accuracy_level
        replaced[matmul.output[0]] = _matmul_nbits(matmul, weight, level, graph)
        dropped_nodes.add(node.output[0])
        dropped_tensors.update(node.input)
    for reason in kept:
        logger.warning("weight_storage matmul_nbits: %s; it stays DequantizeLinear", reason)
    nodes = [replaced.get(n.output[0], n) for n in graph.node if n.output[0] not in dropped_nodes]
    del graph.node[:]
    graph.node.extend(nodes)
    still_read = {name for n in graph.node for name in n.input}
    unused = [t for t in graph.initializer if t.name in dropped_tensors and t.name not in still_read]
    for tensor in unused:
        graph.initializer.remove(tensor)
    if replaced and not any(o.domain == MICROSOFT_DOMAIN for o in result.opset_import):
        result.opset_import.append(helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    return result, kept


def _sole_readers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto | None]:
    """Per tensor of the graph, the one node reading it (None where several nodes, a subgraph or a
    graph output read it)."""
    readers: dict[str, onnx.NodeProto | None] = {}
    for node in graph.node:
        for name in set(node_reads(node)):
            readers[name] = node if name not in readers else None
    for output in graph.output:
        readers[output.name] = None
    return readers


def _unpackable(node: onnx.NodeProto, initializers: dict, consumers: dict) -> str | None:
    """Why a DequantizeLinear's weight cannot become MatMulNBits (None when it can)."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    codes = initializers.get(node.input[0])
    if codes is None or codes.data_type not in CODE_OFFSET:
        return "not a constant int4/uint4 weight"
    matmul = consumers.get(node.output[0])
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx") or matmul.input[1] != node.output[0]:
        return "read by other than one MatMul's second input (Gemm, Conv or several readers)"
    block = attributes.get("block_size", 0)
    if len(codes.dims) != 2 or attributes.get("axis", 1) != 0 or not block:
        return "not a 2-D [K, N] weight with blocks along K"
    if block < MIN_BLOCK or block & (block - 1):
        return f"block_size {block} is not a power of two of at least {MIN_BLOCK}"
    if any(name not in initializers for name in node.input[1:] if name):
        return "its scale or zero point is not a constant"
    return None


def _packed(node: onnx.NodeProto, initializers: dict) -> PackedWeight:
    """The DequantizeLinear's codes, scales and zero points in MatMulNBits' layout."""
    codes_tensor = initializers[node.input[0]]
    offset = CODE_OFFSET[codes_tensor.data_type]
    codes = numpy_helper.to_array(codes_tensor).astype(np.int16) + offset
    scales = numpy_helper.to_array(initializers[node.input[1]])
    has_zero = len(node.input) > 2 and node.input[2]
    zero = numpy_helper.to_array(initializers[node.input[2]]).astype(np.int16) if has_zero else np.zeros(scales.shape, np.int16)
    block = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "block_size")
    return pack_blocks(codes.astype(np.uint8), scales, (zero + offset).astype(np.uint8), block)


def _matmul_nbits(matmul: onnx.NodeProto, weight: PackedWeight, accuracy_level: int, graph: onnx.GraphProto) -> onnx.NodeProto:
    """The MatMulNBits node computing `matmul` from the packed weight (its tensors added to the graph)."""
    stem = f"{matmul.name or matmul.output[0]}{NBITS_SUFFIX}"  # onnxruntime's own quantizer names it so
    tensors = [(f"{stem}_B", weight.packed), (f"{stem}_scales", weight.scales)]
    if weight.zero_points is not None:
        tensors.append((f"{stem}_zero_points", weight.zero_points))
    graph.initializer.extend(numpy_helper.from_array(array, name) for name, array in tensors)
    return helper.make_node("MatMulNBits", [matmul.input[0], *(name for name, _ in tensors)], list(matmul.output),
                            name=stem, domain=MICROSOFT_DOMAIN, K=weight.k, N=weight.n, bits=BITS,
                            block_size=weight.block_size, accuracy_level=accuracy_level)
