"""A tiny Llama-style decoder (RMSNorm, rotary attention with grouped-query heads, SwiGLU) with seeded
weights, its ONNX exports by both torch.onnx exporters with and without a key/value cache, and a
greedy generation loop over any runner of those exports: the decoder LLMs the library is tested on,
built here in seconds (transformers is no dependency)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class DecoderShape:
    """The widths of a decoder: vocabulary, model width, blocks, query and key/value heads, MLP width."""

    vocabulary: int = 96
    width: int = 64
    blocks: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-5

    @property
    def head_size(self) -> int:
        """The width of one attention head."""
        return self.width // self.heads


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned gain (no mean subtracted, no bias), as Llama's."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The second half of the last axis, negated, before the first: rotary embedding's pairing."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query heads, returning its output and
    the keys and values of every position so far (the present cache)."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        size = shape.head_size
        self.q_proj = nn.Linear(shape.width, shape.heads * size, bias=False)
        self.k_proj = nn.Linear(shape.width, shape.kv_heads * size, bias=False)
        self.v_proj = nn.Linear(shape.width, shape.kv_heads * size, bias=False)
        self.o_proj = nn.Linear(shape.heads * size, shape.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        s = self.shape
        q = self.q_proj(x).view(batch, length, s.heads, s.head_size).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, s.kv_heads, s.head_size).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, s.kv_heads, s.head_size).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        group = s.heads // s.kv_heads
        keys, values = (t[:, :, None].expand(batch, s.kv_heads, group, t.shape[2], s.head_size)
                        .reshape(batch, s.heads, -1, s.head_size) for t in (k, v))  # each key/value head serves `group` queries
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # transformers' default attention
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, s.heads * s.head_size)), k, v


class Block(nn.Module):
    """One decoder block: RMSNorm, attention, residual; RMSNorm, SwiGLU MLP, residual."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.width, shape.eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.width, shape.eps)
        self.gate_proj = nn.Linear(shape.width, shape.mlp, bias=False)
        self.up_proj = nn.Linear(shape.width, shape.mlp, bias=False)
        self.down_proj = nn.Linear(shape.mlp, shape.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attended, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + attended
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h)), k, v


class TinyDecoder(nn.Module):
    """A Llama-style decoder: (input_ids, attention_mask, position_ids[, past key and value of each
    block]) -> (logits[, present key and value of each block]). The attention mask (1 keep, 0 pad)
    covers the past and new positions; the causal mask is built inside."""

    def __init__(self, shape: DecoderShape, cache: bool) -> None:
        super().__init__()
        self.shape, self.cache = shape, cache
        self.embed_tokens = nn.Embedding(shape.vocabulary, shape.width)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.blocks))
        self.norm = RMSNorm(shape.width, shape.eps)
        self.lm_head = nn.Linear(shape.width, shape.vocabulary, bias=False)
        frequencies = shape.rope_base ** -(torch.arange(0, shape.head_size, 2, dtype=torch.float32) / shape.head_size)
        self.register_buffer("inv_freq", frequencies, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.embed_tokens(input_ids)
        angles = position_ids[..., None].to(torch.float32) * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        total, length = attention_mask.shape[1], input_ids.shape[1]
        keys = torch.arange(total, device=x.device)
        queries = torch.arange(length, device=x.device) + (total - length)
        rows = torch.arange(attention_mask.shape[0], device=x.device)
        # indexed by two index tensors, as transformers builds its padding mask
        padding = attention_mask.to(torch.bool)[rows[:, None, None, None], keys[None, None, None, :]]
        mask = (keys[None, :] <= queries[:, None])[None, None] & padding
        presents: list[torch.Tensor] = []
        for k, block in enumerate(self.layers):
            x, key, value = block(x, cos, sin, mask, (past[2 * k], past[2 * k + 1]) if self.cache else None)
            presents += [key, value]
        logits = self.lm_head(self.norm(x))
        return (logits, *presents) if self.cache else (logits,)


def tiny_decoder(cache: bool, seed: int = 0, shape: DecoderShape | None = None) -> TinyDecoder:
    """The decoder with seeded normal weights, in eval mode: the norms' gains near 1, the token table
    at 0.5 and the layers at 0.25, wide enough that greedy decoding wanders over the vocabulary
    (smaller weights settle on one token, and 32 equal tokens would tell little)."""
    model = TinyDecoder(shape or DecoderShape(), cache)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            scale = 0.5 if name.startswith("embed") else 0.25
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)
    return model.eval()


def cache_names(shape: DecoderShape, kind: str) -> list[str]:
    """The names of the cache inputs (kind "past_key_values") or outputs ("present"), key then value per block."""
    return [f"{kind}.{k}.{part}" for k in range(shape.blocks) for part in ("key", "value")]


def export_decoder(path: str | Path, cache: bool, dynamo: bool, seed: int = 0, opset: int = 18,
                   shape: DecoderShape | None = None) -> Path:
    """The seeded decoder (of `shape`, default DecoderShape()) exported to `path` by torch.onnx's
    TorchScript exporter (dynamo False) or its dynamo exporter (see export_module)."""
    return export_module(tiny_decoder(cache, seed, shape), path, dynamo, opset)


def export_module(model: TinyDecoder, path: str | Path, dynamo: bool, opset: int = 18) -> Path:
    """A decoder module (seeded, or with loaded weights) exported to `path` by torch.onnx's TorchScript
    exporter (dynamo False) or its dynamo exporter, with dynamic batch and sequence (and past
    sequence) lengths; with a key/value cache where the module has one."""
    cache, shape, batch, length = model.cache, model.shape, 2, 5
    past = 3 if cache else 0
    ids = torch.randint(0, shape.vocabulary, (batch, length), generator=torch.Generator().manual_seed(0))
    past_names = cache_names(shape, "past_key_values") if cache else []
    caches = [torch.zeros(batch, shape.kv_heads, past, shape.head_size) for _ in past_names]
    args = (ids, torch.ones(batch, past + length, dtype=torch.int64), torch.arange(past, past + length).repeat(batch, 1), *caches)
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names]
    outputs = ["logits", *(cache_names(shape, "present") if cache else [])]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"},
            **{name: {0: "batch", 2: "past"} for name in inputs[3:]}, **{name: {0: "batch", 2: "total"} for name in outputs[1:]}}
    if dynamo:
        dims = {name: {axis: torch.export.Dim.DYNAMIC for axis in axes[name]} for name in inputs}
        past_dims = [tuple(dims[name] for name in past_names)] if cache else []  # *past is one argument: one tuple
        dynamic = (*(dims[name] for name in inputs[:3]), *past_dims)
        program = torch.onnx.export(model, args, input_names=inputs, output_names=outputs, opset_version=opset, dynamo=True,
                                    dynamic_shapes=dynamic, optimize=True, verbose=False)
        program.save(str(path))
    else:
        torch.onnx.export(model, args, str(path), input_names=inputs, output_names=outputs, opset_version=opset,
                          dynamic_axes=axes, dynamo=False)
    return Path(path)


def decoder_feeds(cache: bool, count: int, batch: int = 4, length: int = 8, past: int = 3,
                  seed: int = 1) -> list[dict[str, np.ndarray]]:
    """`count` feeds of random tokens for the seeded decoder's export: `length` new tokens a row and,
    with a cache, the keys and values the float decoder computes for `past` tokens before them."""
    rng, model, shape = np.random.default_rng(seed), tiny_decoder(cache), DecoderShape()
    feeds = []
    for _ in range(count):
        tokens = rng.integers(0, shape.vocabulary, (batch, (past if cache else 0) + length))
        done = past if cache else 0
        feed = {"input_ids": tokens[:, done:], "attention_mask": np.ones_like(tokens),
                "position_ids": np.broadcast_to(np.arange(done, done + length), (batch, length)).copy()}
        if cache:
            empty = [torch.zeros(batch, shape.kv_heads, 0, shape.head_size)] * (2 * shape.blocks)
            with torch.no_grad():
                presents = model(torch.from_numpy(tokens[:, :past]), torch.ones(batch, past, dtype=torch.int64),
                                 torch.arange(past).repeat(batch, 1), *empty)[1:]
            feed.update((name, value.numpy()) for name, value in zip(cache_names(shape, "past_key_values"), presents))
        feeds.append(feed)
    return feeds


Runner = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


def greedy_tokens(run: Runner, prompt: np.ndarray, steps: int, shape: DecoderShape | None = None) -> np.ndarray:
    """The `steps` tokens greedy decoding picks after `prompt` [batch, length]: with `shape` given,
    through the key/value cache (the prompt first, then one token a step, past fed back); without,
    running the whole sequence again each step."""
    tokens, picked = np.asarray(prompt, np.int64), []
    past = {name: np.zeros((len(tokens), shape.kv_heads, 0, shape.head_size), np.float32)
            for name in cache_names(shape, "past_key_values")} if shape else {}
    new, done = tokens, 0
    for _ in range(steps):
        positions = np.broadcast_to(np.arange(done, done + new.shape[1]), new.shape).astype(np.int64)
        outputs = run({"input_ids": new, "attention_mask": np.ones((len(tokens), done + new.shape[1]), np.int64),
                       "position_ids": positions, **past})
        nxt = outputs[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        picked.append(nxt)
        tokens = np.concatenate([tokens, nxt], axis=1)
        if shape:
            past = dict(zip(past, outputs[1:]))
            new, done = nxt, tokens.shape[1] - 1
        else:
            new = tokens
    return np.concatenate(picked, axis=1)
