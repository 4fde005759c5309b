"""The inputs of a decoder that a folder of token ids may leave out, filled as for a first pass over
whole sequences with no past tokens: `attention_mask` all ones, `position_ids` 0 .. seq - 1, and
the past key/value caches empty (length 0 along their past axis). So a folder of input_ids alone
calibrates, tunes and evaluates a decoder exported with a cache (torch.onnx with past inputs, or
onnxruntime-genai's model builder, whose caches every model has)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

IDS, MASK, POSITIONS = "input_ids", "attention_mask", "position_ids"
PAST = "past"  # in a cache input's name, and in the name of its past length's dimension


def fillable_inputs(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """The inputs a feed may leave out, by name, each with its shape as filled: None for the batch
    (and, for the mask and positions, the sequence), 0 for a cache's past axis. A cache is a
    float input whose name starts with "past" and whose shape names one dimension with "past"; a
    dimension named otherwise is taken from the attention reading the cache (the head size of
    onnxruntime's GroupQueryAttention) or the cache cannot be filled."""
    inputs = {value.name: value for value in model.graph.input}
    if IDS not in inputs:
        return {}
    fillable: dict[str, tuple[int | None, ...]] = {name: (None, None) for name in (MASK, POSITIONS) if name in inputs}
    for name, value in inputs.items():
        if name.startswith(PAST) and (shape := _cache_shape(model, value)) is not None:
            fillable[name] = shape
    return fillable


def _cache_shape(model: onnx.ModelProto, value: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    """The cache's shape with no past tokens, or None where a dimension cannot be told."""
    dims = value.type.tensor_type.shape.dim
    past_axes = [k for k, d in enumerate(dims) if PAST in d.dim_param.lower()]
    if len(past_axes) != 1 or len(dims) < 2:
        return None
    shape: list[int | None] = []
    for k, dim in enumerate(dims):
        if k in (0, past_axes[0]):
            shape.append(None if k == 0 else 0)
        elif dim.HasField("dim_value") and dim.dim_value > 0:
            shape.append(dim.dim_value)
        elif k == len(dims) - 1 and (head := _attention_head_size(model, value.name)):
            shape.append(head)
        else:
            return None
    return tuple(shape)


def _attention_head_size(model: onnx.ModelProto, cache: str) -> int | None:
    """The head size of the GroupQueryAttention reading `cache`: its query's width over its heads
    (query, key and value heads where the query input packs all three)."""
    node = next((n for n in model.graph.node if n.op_type == "GroupQueryAttention" and cache in n.input), None)
    if node is None:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    packed = len(node.input) < 2 or not node.input[1]
    heads = attributes["num_heads"] + (2 * attributes["kv_num_heads"] if packed else 0)
    width = _last_dim(model, node.input[0])
    return width // heads if width and width % heads == 0 else None


def _last_dim(model: onnx.ModelProto, name: str) -> int | None:
    """A value's last dimension: from its stored type, or from the MatMul (or MatMulNBits) computing it."""
    typed = next((v for v in model.graph.value_info if v.name == name), None)
    if typed is not None and typed.type.tensor_type.shape.dim:
        last = typed.type.tensor_type.shape.dim[-1]
        if last.HasField("dim_value"):
            return last.dim_value
    producer = next((n for n in model.graph.node if name in n.output), None)
    if producer is None:
        return None
    if producer.op_type == "MatMulNBits":
        return next((a.i for a in producer.attribute if a.name == "N"), None)
    weights = {t.name: t for t in model.graph.initializer}
    if producer.op_type == "MatMul" and producer.input[1] in weights:
        return int(weights[producer.input[1]].dims[-1])
    return None


def filled(feed: Mapping[str, np.ndarray], missing: list[str], fillable: Mapping[str, tuple[int | None, ...]],
           dtypes: Mapping[str, np.dtype | None]) -> dict[str, np.ndarray]:
    """The missing inputs of a feed holding input_ids [batch, seq], made as for no past tokens."""
    ids = np.asarray(feed[IDS])
    batch, length = ids.shape[0], ids.shape[-1]
    made = {}
    for name in missing:
        dtype = dtypes.get(name) or np.dtype(np.int64)
        if name == MASK:
            made[name] = np.ones((batch, length), dtype)
        elif name == POSITIONS:
            made[name] = np.broadcast_to(np.arange(length, dtype=dtype), (batch, length)).copy()
        else:
            made[name] = np.zeros(tuple(batch if d is None else d for d in fillable[name]), dtype)
    return made
