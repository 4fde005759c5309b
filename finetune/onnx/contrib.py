"""onnxruntime's contrib ops that onnxruntime-genai's model builder writes, rewritten exactly into
standard ops: SkipSimplifiedLayerNormalization into the residual Add(s) and a
SimplifiedLayerNormalization, for the torch lift, so the residual joins fused into a decoder's norms
show as the Adds that block finding follows (onnxruntime adds input + skip, then the bias, in float:
the same sums in the same order); and 4-bit MatMulNBits into the DequantizeLinear(block_size) ->
MatMul it computes, so a model quantized that way is tuned as a QDQ model (export.matmul_nbits
packs it back)."""

from __future__ import annotations

import logging
from collections import Counter

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from .domains import DEFAULT_DOMAINS, ONNXRUNTIME_DOMAIN
from .graphs import all_graphs, node_reads, unique_name

logger = logging.getLogger(__name__)

SKIP_NORM = "SkipSimplifiedLayerNormalization"
SKIP_SUM = 3  # its output of input + skip (+ bias), the residual stream
# RMS norms over the last axis and the input index of their gain, which scales their first output only
_RMS_GAINS = {("", "RMSNormalization"): 1, ("", "SimplifiedLayerNormalization"): 1, (ONNXRUNTIME_DOMAIN, SKIP_NORM): 2}


def split_skip_norms(model: onnx.ModelProto) -> int:
    """Replace, in place, every SkipSimplifiedLayerNormalization whose mean output (which an RMS norm
    does not compute) nothing reads by its Adds and a SimplifiedLayerNormalization; the count replaced."""
    replaced = 0
    for graph in all_graphs(model.graph):
        taken = {name for node in graph.node for name in (*node.input, *node.output, node.name)}
        nodes = []
        for node in graph.node:
            if node.op_type == SKIP_NORM and node.domain == ONNXRUNTIME_DOMAIN and not _output(node, 1):
                nodes.extend(_split(node, taken))
                replaced += 1
            else:
                nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    return replaced


def rms_gain_input(node: onnx.NodeProto) -> int | None:
    """The gain's input index of an RMS norm over the last axis (the ONNX op, onnxruntime's
    SimplifiedLayerNormalization and its skip form), else None."""
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    return _RMS_GAINS.get((domain, node.op_type)) if axis == -1 else None


def _output(node: onnx.NodeProto, index: int) -> str:
    """The node's output at `index`, "" when absent."""
    return node.output[index] if index < len(node.output) else ""


def _split(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The Adds (input + skip, then + bias) and the RMS norm one SkipSimplifiedLayerNormalization fuses,
    its outputs keeping their names (the sum gets a new one where the node left it unnamed)."""
    x, skip, gamma, *rest = node.input
    bias = rest[0] if rest else ""
    summed = _output(node, SKIP_SUM) or unique_name(f"{node.name}/input_skip_bias_sum", taken)
    first = unique_name(f"{node.name}/input_skip", taken) if bias else summed
    adds = [helper.make_node("Add", [x, skip], [first], name=unique_name(f"{node.name}/skip_add", taken))]
    if bias:
        adds.append(helper.make_node("Add", [first, bias], [summed], name=unique_name(f"{node.name}/bias_add", taken)))
    epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    outputs = [node.output[0], *([_output(node, 2)] if _output(node, 2) else [])]
    norm = helper.make_node("SimplifiedLayerNormalization", [summed, gamma], outputs, name=node.name, axis=-1,
                            epsilon=epsilon, stash_type=1)
    return [*adds, norm]


MATMUL_NBITS = "MatMulNBits"
NBITS_BITS = 4  # the width read here (and written by export.matmul_nbits)
NBITS_DEFAULT_ZERO = 1 << (NBITS_BITS - 1)  # the op's zero point where it is given none
QDQ_BLOCK_OPSET = 21  # DequantizeLinear's block_size and 4-bit codes
NBITS_SUFFIX = "_Q4"  # what onnxruntime's matmul_nbits_quantizer and onnxruntime-genai's builder add to a MatMul's name


def matmul_nbits_to_qdq(model: onnx.ModelProto) -> dict[str, int]:
    """Replace, in place, every 4-bit MatMulNBits of the main graph (onnxruntime's packed weights:
    B [N, blocks, block / 2] low nibble first along K, scales [N * blocks], zero points packed two a
    byte per row or the default 8) by the DequantizeLinear(block_size) -> MatMul (-> Add of its bias)
    it computes: uint4 codes [K, N], scales and zero points [blocks, N]; the MatMul keeps the node's
    output, and its name less NBITS_SUFFIX (so a float model's MatMul of that name is its reference).
    Returns each MatMul's accuracy_level by its name. A node this cannot read
    (other widths, g_idx, float zero points) is a one-line error naming it."""
    nodes = [n for n in model.graph.node if n.op_type == MATMUL_NBITS and n.domain == ONNXRUNTIME_DOMAIN]
    if not nodes:
        return {}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < QDQ_BLOCK_OPSET:
        raise ValueError(f"MatMulNBits node {nodes[0].name!r}: its weights are read as DequantizeLinear(block_size), which "
                         f"needs opset {QDQ_BLOCK_OPSET}; the model imports opset {opset} (convert it to {QDQ_BLOCK_OPSET} first)")
    initializers = {t.name: t for t in model.graph.initializer}
    taken = {name for node in model.graph.node for name in (*node.input, *node.output, node.name)} | set(initializers)
    reads = Counter(name for node in model.graph.node for name in node_reads(node))
    levels, rewritten = {}, []
    for node in model.graph.node:
        if node not in nodes:
            rewritten.append(node)
            continue
        rewritten.extend(_dequantized_matmul(node, initializers, model.graph, taken, reads))
        levels[node.name.removesuffix(NBITS_SUFFIX)] = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    return levels


def _dequantized_matmul(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], graph: onnx.GraphProto,
                        taken: set[str], reads: Counter[str]) -> list[onnx.NodeProto]:
    """The nodes one MatMulNBits computes, its weight's tensors replaced in the graph by the QDQ ones
    (added beside them where other nodes read them too: `reads` counts each tensor's readers)."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [*node.input, "", "", "", ""][:6]
    a, packed_name, scales_name, zero_name, g_idx, bias = inputs
    problem = (f"bits {attributes.get('bits', 4)}" if attributes.get("bits", 4) != NBITS_BITS else
               "a g_idx input" if g_idx else
               "a weight that is not a constant" if packed_name not in initializers or scales_name not in initializers else
               "float zero points" if zero_name and initializers.get(zero_name, onnx.TensorProto()).data_type != onnx.TensorProto.UINT8
               else None)
    if problem:
        raise ValueError(f"MatMulNBits node {node.name!r} has {problem}, which is not read (4-bit weights with uint8-packed "
                         "zero points or none); re-export it with plain MatMul weights")
    k, n, block = int(attributes["K"]), int(attributes["N"]), int(attributes["block_size"])
    blocks = -(-k // block)
    codes = _nibbles(numpy_helper.to_array(initializers[packed_name]), n)[:, :k].T
    scales = numpy_helper.to_array(initializers[scales_name]).reshape(n, blocks).T
    if zero_name:
        zero = _nibbles(numpy_helper.to_array(initializers[zero_name]), n)[:, :blocks].T
    else:
        zero = np.full((blocks, n), NBITS_DEFAULT_ZERO, np.uint8)
    zero_name = zero_name or unique_name(f"{packed_name}_zero_point", taken)
    if shared := [name for name in (packed_name, scales_name, zero_name) if reads[name] > 1]:
        logger.warning("MatMulNBits node %r shares %s with other nodes (a token table tied to the LM head): it is tuned as "
                       "a copy of its own, which the written model holds beside the shared tensors", node.name, shared)
    named = []  # a tensor other nodes read too stays as it is; the QDQ form gets its own
    for name, array in ((packed_name, codes.astype(ml_dtypes.uint4)), (scales_name, np.ascontiguousarray(scales)),
                        (zero_name, zero.astype(ml_dtypes.uint4))):
        named.append(unique_name(f"{name}_qdq", taken) if name in shared else name)
        _replace_initializer(graph, initializers, numpy_helper.from_array(np.ascontiguousarray(array), named[-1]))
    packed_name, scales_name, zero_name = named
    weight = unique_name(f"{packed_name}_dequantized", taken)
    product = unique_name(f"{node.output[0]}_product", taken) if bias else node.output[0]
    made = [helper.make_node("DequantizeLinear", [packed_name, scales_name, zero_name], [weight],
                             name=unique_name(f"{node.name}/DequantizeLinear", taken), axis=0, block_size=block),
            helper.make_node("MatMul", [a, weight], [product], name=node.name.removesuffix(NBITS_SUFFIX))]
    if bias:
        made.append(helper.make_node("Add", [product, bias], [node.output[0]], name=unique_name(f"{node.name}/bias_add", taken)))
    return made


def _nibbles(packed: np.ndarray, rows: int) -> np.ndarray:
    """[rows, 2 x bytes a row] 4-bit codes from bytes packing two each, low nibble first (MatMulNBits' layout)."""
    by_row = packed.reshape(rows, -1)
    return np.stack((by_row & 0xF, by_row >> 4), axis=-1).reshape(rows, -1)


def _replace_initializer(graph: onnx.GraphProto, initializers: dict[str, onnx.TensorProto], tensor: onnx.TensorProto) -> None:
    """Put `tensor` in the graph in place of the initializer of its name, or add it."""
    if tensor.name in initializers:
        initializers[tensor.name].CopyFrom(tensor)
    else:
        graph.initializer.append(tensor)
        initializers[tensor.name] = graph.initializer[-1]
