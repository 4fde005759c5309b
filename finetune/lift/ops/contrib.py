"""onnxruntime's contrib ops that decoder exports are written with (onnxruntime-genai's model builder
among them): the RMS norm SimplifiedLayerNormalization (SkipSimplifiedLayerNormalization reaches the
lift split into its Adds and one: onnx.contrib), RotaryEmbedding, GroupQueryAttention with its
key/value cache and rotary, and GatherBlockQuantized (a block-quantized token table), each computing
what onnxruntime's CPU kernels compute (tests/test_lift_contrib.py holds them to onnxruntime: within
float rounding where they sum, bit for bit where they do not)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import onnx
import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult
from torch import nn

from finetune.onnx.domains import ONNXRUNTIME_DOMAIN

from ..registry import register
from .common import converted, node_mapping, require_unused_outputs, used_outputs


def rms_normalized(x: torch.Tensor, gamma: torch.Tensor, axis: int, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x / sqrt(mean(x^2) + epsilon) * gamma over the axes from `axis` on, in float32 (stash_type 1),
    and the inverse root (kept dims)."""
    axes = tuple(range(axis % x.dim(), x.dim()))
    wide = x.float()
    inverse = torch.rsqrt(wide.pow(2).mean(dim=axes, keepdim=True) + epsilon)
    return (wide * inverse).to(x.dtype) * gamma, inverse


class SimplifiedLayerNorm(nn.Module):
    """SimplifiedLayerNormalization (an RMS norm with scale) and, when read, its inverse root."""

    def __init__(self, axis: int, epsilon: float, with_inverse: bool):
        super().__init__()
        self.axis, self.epsilon, self.with_inverse = axis, epsilon, with_inverse

    def forward(self, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        y, inverse = rms_normalized(x, gamma, self.axis, self.epsilon)
        return (y, inverse) if self.with_inverse else y


@register("SimplifiedLayerNormalization", (1,))
def _simplified_layer_norm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """onnxruntime's RMS norm (registered in the default domain)."""
    a = node.attributes
    if a.get("stash_type", 1) != 1:
        raise NotImplementedError("stash_type other than float32")
    returns = (0, *(i for i in used_outputs(node, graph) if i))  # the output always, the inverse root where read
    module = SimplifiedLayerNorm(int(a.get("axis", -1)), float(a.get("epsilon", 1e-5)), returns == (0, 1))
    if returns not in ((0,), (0, 1)):
        raise NotImplementedError(f"outputs {returns} are read; the output and the inverse root are lifted")
    return converted(module, node_mapping(node, outputs=len(returns)))


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [..., head] by cos/sin [..., rotary / 2] (broadcast to x's leading axes):
    the first `rotary` channels turn in pairs (halves, or neighbours when interleaved), the rest pass."""
    rotary = 2 * cos.shape[-1]
    turned, kept = x[..., :rotary], x[..., rotary:]
    if interleaved:
        first, second = turned[..., 0::2], turned[..., 1::2]
        out = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)
    else:
        first, second = turned.chunk(2, dim=-1)
        out = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((out, kept), dim=-1) if kept.shape[-1] else out


class RotaryEmbedding(nn.Module):
    """com.microsoft RotaryEmbedding: input [batch, seq, heads * head] or [batch, heads, seq, head],
    positions [batch, seq] (or one offset for every row), cos/sin caches [positions, rotary / 2]."""

    def __init__(self, heads: int, rotary: int, interleaved: bool):
        super().__init__()
        self.heads, self.rotary, self.interleaved = heads, rotary, interleaved

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> torch.Tensor:
        packed = x.dim() == 3
        batch, length = x.shape[0], x.shape[1 if packed else 2]
        heads = self.heads or (x.shape[-1] // (2 * cos_cache.shape[-1]) if packed else x.shape[1])
        four = x.reshape(batch, length, heads, -1).transpose(1, 2) if packed else x
        if positions.numel() == 1:  # one offset: positions offset .. offset + seq for every row
            positions = positions.reshape(1, 1) + torch.arange(length, device=x.device)[None]
        cos, sin = cos_cache[positions.long()][:, None], sin_cache[positions.long()][:, None]
        out = rotated(four, cos.to(x.dtype), sin.to(x.dtype), self.interleaved)
        return out.transpose(1, 2).reshape(x.shape) if packed else out


@register("RotaryEmbedding", (1,), ONNXRUNTIME_DOMAIN)
def _rotary_embedding(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """onnxruntime's rotary embedding (not packed batching)."""
    a = node.attributes
    if a.get("is_packed_batching", 0):
        raise NotImplementedError("is_packed_batching=1")
    require_unused_outputs(node, graph)
    module = RotaryEmbedding(int(a.get("num_heads", 0)), int(a.get("rotary_embedding_dim", 0)), bool(a.get("interleaved", 0)))
    return converted(module, node_mapping(node))


class GroupQueryAttention(nn.Module):
    """com.microsoft GroupQueryAttention, its inputs in the op's order: causal attention of each query
    head over its group's key/value head, over each row's valid past (BNSH cache; seqlens_k holds each
    row's total length - 1, total_sequence_length is the buffers' and not read) and its new keys,
    rotary inside where do_rotary; returns the output [batch, seq, heads * head] and the present keys
    and values."""

    # the arguments holding the batch, and on which axis (recon.units.sides: a block's side inputs)
    batch_axes: ClassVar[dict[str, int]] = {"past_key": 0, "past_value": 0, "seqlens_k": 0, "position_ids": 0, "attention_bias": 0}

    def __init__(self, heads: int, kv_heads: int, scale: float | None, window: int, softcap: float, rotary: bool,
                 interleaved: bool, smooth: bool):
        super().__init__()
        self.heads, self.kv_heads, self.scale, self.window = heads, kv_heads, scale, window
        self.softcap, self.rotary, self.interleaved, self.smooth = softcap, rotary, interleaved, smooth

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                past_key: torch.Tensor | None = None, past_value: torch.Tensor | None = None,
                seqlens_k: torch.Tensor | None = None, total_length: torch.Tensor | None = None,
                cos_cache: torch.Tensor | None = None, sin_cache: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                head_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._heads(query, key, value)
        batch, length, past = q.shape[0], q.shape[2], 0 if past_key is None else past_key.shape[2]
        valid = seqlens_k.long() + 1  # each row's total valid length (seqlens_k is that minus one)
        before = valid - length if past else torch.zeros_like(valid)  # each row's valid past; none in a first prompt
        if self.rotary:
            positions = position_ids.long() if position_ids is not None else before[:, None] + torch.arange(length, device=q.device)
            cos, sin = cos_cache[positions][:, None].to(q.dtype), sin_cache[positions][:, None].to(q.dtype)
            q, k = rotated(q, cos, sin, self.interleaved), rotated(k, cos, sin, self.interleaved)
        keys, values = self._present(past_key, k, before), self._present(past_value, v, before)
        group = self.heads // self.kv_heads
        scale = self.scale if self.scale is not None else 1 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, keys.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
        if self.softcap > 0:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if attention_bias is not None:
            scores = scores + attention_bias
        scores = scores.masked_fill(~self._allowed(before, length, keys.shape[2], q.device), float("-inf"))
        weights = self._softmax(scores, head_sink)
        out = torch.matmul(weights, values.repeat_interleave(group, dim=1))
        return out.transpose(1, 2).reshape(batch, length, -1), keys, values

    def _heads(self, query: torch.Tensor, key: torch.Tensor | None,
               value: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value as [batch, heads, seq, head] (split from the packed query when key is absent)."""
        batch, length, width = query.shape
        if key is None:
            head = width // (self.heads + 2 * self.kv_heads)
            query, key, value = query.split((self.heads * head, self.kv_heads * head, self.kv_heads * head), dim=-1)
        head = query.shape[-1] // self.heads
        return tuple(t.reshape(batch, length, -1, head).transpose(1, 2) for t in (query, key, value))

    @staticmethod
    def _present(past: torch.Tensor | None, new: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """The present cache [batch, kv heads, past + seq, head] as onnxruntime writes it: each row's
        valid past, its new keys right after, zeros after those (a row shorter than the buffer)."""
        if past is None or past.shape[2] == 0:
            return new
        buffered, length = past.shape[2], new.shape[2]
        index = torch.arange(buffered + length, device=new.device)[None]
        source = torch.where(index < before[:, None], index, buffered + index - before[:, None])
        kept = index < before[:, None] + length
        gathered = torch.cat((past, new), dim=2).gather(
            2, source.clamp(max=buffered + length - 1)[:, None, :, None].expand(*new.shape[:2], -1, new.shape[3]))
        return gathered * kept[:, None, :, None].to(new.dtype)

    def _allowed(self, before: torch.Tensor, length: int, total: int, device: torch.device) -> torch.Tensor:
        """[batch, 1, seq, total]: the keys at or before each query's position (its row's past plus its
        index), and only the `window` latest where a local window is set."""
        at = before[:, None, None] + torch.arange(length, device=device)[None, :, None]
        key_index = torch.arange(total, device=device)[None, None]
        allowed = key_index <= at
        if self.window > 0:
            allowed = allowed & (key_index > at - self.window)
        return allowed[:, None]

    def _softmax(self, scores: torch.Tensor, head_sink: torch.Tensor | None) -> torch.Tensor:
        """Softmax over keys; with smooth_softmax or a head sink, one more logit (0, or the head's sink)
        joins the denominator only."""
        if not self.smooth and head_sink is None:
            return torch.softmax(scores, dim=-1)
        sink = torch.zeros(scores.shape[1], device=scores.device, dtype=scores.dtype) if head_sink is None else head_sink
        sink = sink.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


@register("GroupQueryAttention", (1,), ONNXRUNTIME_DOMAIN)
def _group_query_attention(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """onnxruntime's grouped-query attention with separate (not shared) past and present buffers."""
    a = node.attributes
    if len(node.output_values) > 3 and node.output_values[3]:
        raise NotImplementedError("output_qk is read")
    if len(node.input_values) > 12 and any(node.input_values[12:]):
        raise NotImplementedError("quantized key/value cache inputs")
    if int(a.get("local_window_size", -1)) == 0:
        raise NotImplementedError("local_window_size=0 (a window of no key)")
    heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    scale = float(a.get("scale", 0.0)) or None  # None: 1 / sqrt(head size)
    module = GroupQueryAttention(heads, kv_heads, scale, int(a.get("local_window_size", -1)),
                                 float(a.get("softcap", 0.0)), bool(a.get("do_rotary", 0)),
                                 bool(a.get("rotary_interleaved", 0)), bool(a.get("smooth_softmax", 0)))
    return converted(module, OnnxMapping(inputs=tuple(node.input_values[:12]), outputs=tuple(node.output_values[:3])))


class GatherBlockQuantized(nn.Module):
    """com.microsoft GatherBlockQuantized along axis 0 of a [rows, K] table quantized in blocks along K:
    the rows gathered first, then dequantized, (code - zero point) x scale; 4-bit codes packed two a
    byte (low nibble first) in a uint8 table; without zero points, `default_zero` (onnxruntime's: the
    middle code of a uint8 table, 0 for uint4 and int4)."""

    def __init__(self, block: int, default_zero: int, packed: bool):
        super().__init__()
        self.block, self.default_zero, self.packed = block, default_zero, packed

    def forward(self, data: torch.Tensor, indices: torch.Tensor, scales: torch.Tensor,
                zero_points: torch.Tensor | None = None) -> torch.Tensor:
        rows = indices.reshape(-1).long() % data.shape[0]
        codes = self._codes(data.index_select(0, rows))
        row_scales = scales.index_select(0, rows)
        if zero_points is None:
            zero = torch.full_like(row_scales, self.default_zero)
        else:
            zero = self._codes(zero_points.index_select(0, rows))[:, : row_scales.shape[-1]].to(row_scales.dtype)
        width = codes.shape[-1]
        scale, zero = (t.repeat_interleave(self.block, dim=-1)[:, :width] for t in (row_scales, zero))
        return ((codes.to(scale.dtype) - zero) * scale).reshape(*indices.shape, width)

    def _codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Codes from a uint8 tensor packing two 4-bit codes a byte (other tables hold one code an element)."""
        if not self.packed:
            return packed
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


@register("GatherBlockQuantized", (1,), ONNXRUNTIME_DOMAIN)
def _gather_block_quantized(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """onnxruntime's gather of a block-quantized table (a 4-bit token table, tied to the LM head by the genai builder)."""
    a = node.attributes
    table = _table_tensor(graph, node.input_values[0])
    if table is None:
        raise NotImplementedError("a table that is not a constant (or a reshaped one)")
    if int(a.get("gather_axis", 0)) != 0 or int(a.get("quantize_axis", 1)) not in (1, -1):
        raise NotImplementedError("a gather along other than axis 0 of a [rows, K] table quantized along K")
    require_unused_outputs(node, graph)
    bits, element = int(a.get("bits", 4)), table.proto.data_type
    uint8 = element == onnx.TensorProto.UINT8  # onnxruntime's default zero point: the middle code for uint8, else 0
    module = GatherBlockQuantized(int(a.get("block_size", 128)), 1 << (bits - 1) if uint8 else 0, packed=uint8 and bits == 4)
    return converted(module, node_mapping(node))


def _table_tensor(graph: OnnxGraph, name: str) -> Any:
    """The initializer a table is, or is a Reshape of (how the genai builder shares the LM head's packed
    weights with the token table), else None."""
    if name in graph.initializers:
        return graph.initializers[name]
    try:
        producer, _ = graph.value_as_node_output(name)
    except KeyError:
        return None
    return graph.initializers.get(producer.input_values[0]) if producer.operation_type == "Reshape" else None
