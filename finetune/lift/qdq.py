"""Which ONNX nodes quantize-dequantize: the standard QuantizeLinear / DequantizeLinear, their
Extended pair and the block-format ops of com.finetune / com.amd.quark, and which quantize nodes
fold into the dequantize nodes after them. The builder and the parameter tracing ask this of the
graph; the converters that lift these nodes are in ops/qdq.py."""

from __future__ import annotations

from onnx2torch.onnx_node import OnnxNode

from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN
from finetune.onnx.domains import DEFAULT_DOMAINS, ONNXRUNTIME_DOMAIN

CUSTOM_DOMAINS = (CUSTOM_DOMAIN, QUARK_DOMAIN)
QUANTIZE_TO_DEQUANTIZE = {"QuantizeLinear": "DequantizeLinear", "ExtendedQuantizeLinear": "ExtendedDequantizeLinear"}
BLOCK_OPS = ("BFPQuantizeDequantize", "MXQuantizeDequantize")
EXTENDED_OPS = ("ExtendedQuantizeLinear", "ExtendedDequantizeLinear")
# Domains whose QuantizeLinear / DequantizeLinear have the standard semantics: onnxruntime's contrib
# pair (com.microsoft) is the standard one with int16/uint16/int4/uint4 codes before opset 21.
LINEAR_QDQ_DOMAINS = (*DEFAULT_DOMAINS, ONNXRUNTIME_DOMAIN)
# Ops of the QOperator format (integer arithmetic inside the op, onnxruntime's quantize_static with
# QuantFormat.QOperator): there is no float op with a quantizer around it to lift.
QOPERATOR_OPS = frozenset((
    "QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearAveragePool", "QLinearGlobalAveragePool",
    "QLinearConcat", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearSoftmax", "QLinearReduceMean", "QLinearWhere",
    "QAttention", "QEmbedLayerNormalization", "MatMulInteger", "ConvInteger", "MatMulIntegerToFloat",
    "DynamicQuantizeLinear", "DynamicQuantizeMatMul",
))


def is_quantizer(domain: str, op_type: str) -> bool:
    """Whether a node of this domain and type quantizes and/or dequantizes its first input."""
    if domain in LINEAR_QDQ_DOMAINS:
        return op_type in ("QuantizeLinear", "DequantizeLinear")
    return domain in CUSTOM_DOMAINS and (op_type in BLOCK_OPS or op_type in EXTENDED_OPS)


def is_folded_quantize(node: OnnxNode, consumers: list[OnnxNode], graph_outputs: set[str]) -> bool:
    """Whether a quantize node disappears into the dequantize nodes that all its consumers are."""
    dequantize = QUANTIZE_TO_DEQUANTIZE.get(node.operation_type)
    if dequantize is None or not is_quantizer(node.domain, node.operation_type):
        return False
    return bool(consumers) and node.output_values[0] not in graph_outputs and all(
        c.operation_type == dequantize and c.domain == node.domain and c.input_values[0] == node.output_values[0]
        for c in consumers
    )
