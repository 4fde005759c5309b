"""onnxruntime's decoder contrib ops lifted to torch (finetune/lift/ops/contrib.py) against onnxruntime
itself: GroupQueryAttention (packed and separate inputs, with and without a past cache, rotary inside,
interleaved, a local window, softcap, smooth softmax, head sinks, right-padded rows),
RotaryEmbedding, SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization, each as one
node; and onnxruntime-genai's own decoders (tests/fixtures/genai): every output of the lifted model
within float rounding of onnxruntime's, and greedy decoding through the key/value cache picking the
same 32 tokens. Attention and norms sum in float, in each library by its own kernels: the bounds
are float rounding's (lift_helpers.float_sum_bound), not this machine's bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from finetune.lift import lift_model
from tests.lift_helpers import float_sum_bound, onnx_model, run_ort, run_torch, tensor

GENAI = Path(__file__).parent / "fixtures" / "genai"
MS = "com.microsoft"
HEADS, KV_HEADS, HEAD = 4, 2, 16
BATCH, LENGTH, PAST = 2, 5, 3
POSITIONS = 32


def rope_caches(rotary: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [POSITIONS, rotary / 2] as Llama's rotary embedding makes them."""
    inverse = 1.0 / (10000 ** (np.arange(0, rotary, 2) / rotary))
    angles = np.outer(np.arange(POSITIONS), inverse)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def gqa_case(packed: bool = True, past: int = 0, rotary: bool = False, padded: int = 0,
             attributes: dict[str, Any] | None = None, bias: bool = False, sink: bool = False,
             batch: int = BATCH, length: int = LENGTH) -> tuple[onnx.ModelProto, list[np.ndarray], np.ndarray]:
    """One GroupQueryAttention node, its inputs and the mask of the output rows that mean something
    (a row's positions past its length, `padded` shorter than the first, do not). onnxruntime takes
    a past with several new tokens a row for a batch of one only."""
    rng = np.random.default_rng(0)
    width = (HEADS + 2 * KV_HEADS) * HEAD
    qkv = rng.normal(size=(batch, length, width)).astype(np.float32)
    lengths = past + length - padded * (np.arange(batch) % 2)
    values: dict[str, np.ndarray] = {}
    if packed:
        values["query"] = qkv
    else:
        values.update(query=qkv[..., :HEADS * HEAD].copy(), key=qkv[..., HEADS * HEAD:(HEADS + KV_HEADS) * HEAD].copy(),
                      value=qkv[..., (HEADS + KV_HEADS) * HEAD:].copy())
    values["past_key"] = rng.normal(size=(batch, KV_HEADS, past, HEAD)).astype(np.float32)
    values["past_value"] = rng.normal(size=(batch, KV_HEADS, past, HEAD)).astype(np.float32)
    values["seqlens_k"] = (lengths - 1).astype(np.int32)
    values["total_sequence_length"] = np.array(past + length, np.int32)
    initializers = {}
    if rotary:
        initializers["cos_cache"], initializers["sin_cache"] = rope_caches(HEAD)
    if bias:
        values["attention_bias"] = rng.normal(size=(batch, 1, length, past + length)).astype(np.float32)
    if sink:
        initializers["head_sink"] = rng.normal(size=HEADS).astype(np.float32)
    order = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
             "sin_cache", "position_ids", "attention_bias", "head_sink"]
    used = max(i for i, name in enumerate(order) if name in values or name in initializers) + 1
    names = [name if name in values or name in initializers else "" for name in order[:used]]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"], domain=MS,
                            num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=int(rotary), **(attributes or {}))
    types = {"seqlens_k": TensorProto.INT32, "total_sequence_length": TensorProto.INT32}
    inputs = [tensor(name, list(array.shape), types.get(name, TensorProto.FLOAT)) for name, array in values.items()]
    outputs = [tensor("out", None), tensor("present_key", None), tensor("present_value", None)]
    model = onnx_model([node], inputs, outputs, initializers, opset=21, domains=[MS])
    rows = np.arange(length)[None, :] < (lengths - past)[:, None]
    return model, list(values.values()), rows


def assert_lifted_like_onnxruntime(model: onnx.ModelProto, inputs: list[np.ndarray], rows: np.ndarray | None = None,
                                   terms: int = 64) -> None:
    """Every output of the lifted node within float rounding of onnxruntime's (the main output at
    `rows` only, where rows are given; the present caches everywhere)."""
    expected, actual = run_ort(model, inputs), run_torch(lift_model(model), inputs)
    assert len(expected) == len(actual)
    for index, (e, a) in enumerate(zip(expected, actual)):
        assert e.shape == a.shape
        if index == 0 and rows is not None:
            e, a = e[rows], a[rows]
        np.testing.assert_allclose(a, e, rtol=0, atol=float_sum_bound([e], terms))


GQA_CASES = {
    "packed first prompt": {},
    "separate first prompt": {"packed": False},
    "decode step": {"past": PAST, "length": 1},
    "continued prompt": {"past": PAST, "batch": 1},
    "rotary first prompt": {"rotary": True},
    "rotary decode step": {"rotary": True, "past": PAST, "length": 1},
    "rotary continued prompt": {"rotary": True, "past": PAST, "batch": 1},
    "rotary interleaved continued prompt": {"rotary": True, "past": PAST, "batch": 1, "attributes": {"rotary_interleaved": 1}},
    "scale and softcap": {"past": PAST, "batch": 1, "attributes": {"scale": 0.2, "softcap": 3.0}},
    "local window": {"past": PAST, "batch": 1, "attributes": {"local_window_size": 2}},
    "local window first prompt": {"rotary": True, "attributes": {"local_window_size": 3}},
    "smooth softmax": {"past": PAST, "batch": 1, "attributes": {"smooth_softmax": 1}},
    "head sink": {"past": PAST, "batch": 1, "sink": True},
    "attention bias": {"past": PAST, "batch": 1, "bias": True},
    "right-padded first prompt": {"rotary": True, "padded": 2},
    "decode step, rows of different lengths": {"rotary": True, "past": PAST + 1, "length": 1, "padded": 2},
}


@pytest.mark.parametrize("case", GQA_CASES)
def test_group_query_attention_lifts_as_onnxruntime_computes_it(case: str) -> None:
    model, inputs, rows = gqa_case(**GQA_CASES[case])
    assert_lifted_like_onnxruntime(model, inputs, rows)


@pytest.mark.parametrize("four_dimensional", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offset", [False, True])
def test_rotary_embedding_lifts_as_onnxruntime_computes_it(four_dimensional: bool, interleaved: bool, offset: bool) -> None:
    """com.microsoft RotaryEmbedding on [batch, seq, heads * head] or [batch, heads, seq, head], by
    position ids or one offset, rotating the first half of each head only (partial rotary)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, HEADS, LENGTH, HEAD) if four_dimensional else (BATCH, LENGTH, HEADS * HEAD)).astype(np.float32)
    positions = np.array([7], np.int64) if offset else rng.integers(0, POSITIONS, (BATCH, LENGTH))
    cos, sin = rope_caches(HEAD // 2)
    node = helper.make_node("RotaryEmbedding", ["x", "positions", "cos", "sin"], ["y"], domain=MS,
                            interleaved=int(interleaved), num_heads=HEADS, rotary_embedding_dim=HEAD // 2)
    model = onnx_model([node], [tensor("x", list(x.shape)), tensor("positions", list(positions.shape), TensorProto.INT64)],
                       [tensor("y", None)], {"cos": cos, "sin": sin}, opset=21, domains=[MS])
    assert_lifted_like_onnxruntime(model, [x, positions], terms=2)


def test_rms_norms_lift_as_onnxruntime_computes_them() -> None:
    """SimplifiedLayerNormalization (over the last two axes, with its inverse root read) and
    SkipSimplifiedLayerNormalization (with a bias, every output but the mean it does not compute)."""
    rng = np.random.default_rng(2)
    x, skip = (rng.normal(size=(BATCH, LENGTH, 24)).astype(np.float32) for _ in range(2))
    arrays = {"gamma": rng.normal(size=24).astype(np.float32), "gamma2": rng.normal(size=(LENGTH, 24)).astype(np.float32),
              "bias": rng.normal(size=24).astype(np.float32)}
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "gamma2"], ["y", "inverse"], axis=1, epsilon=1e-3),
             helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"], ["z", "", "inv", "sum"],
                              domain=MS, epsilon=1e-5)]
    model = onnx_model(nodes, [tensor("x", list(x.shape)), tensor("skip", list(skip.shape))],
                       [tensor(name, None) for name in ("y", "inverse", "z", "inv", "sum")], arrays, opset=21, domains=[MS])
    assert_lifted_like_onnxruntime(model, [x, skip], terms=48)


def genai_feed(model: onnx.ModelProto, ids: np.ndarray, past: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The inputs of an onnxruntime-genai decoder for new tokens `ids` after `past` (empty caches when None)."""
    past_names = [i.name for i in model.graph.input if i.name.startswith("past_key_values")]
    if past is None:
        past = {name: np.zeros((len(ids), KV_HEADS, 0, HEAD), np.float32) for name in past_names}
    done = next(iter(past.values())).shape[2]
    return {"input_ids": ids, "attention_mask": np.ones((len(ids), done + ids.shape[1]), np.int64), **past}


def greedy(run: Any, model: onnx.ModelProto, prompt: np.ndarray, steps: int) -> np.ndarray:
    """The tokens greedy decoding picks through the key/value cache (the prompt first, then one token a step)."""
    names = [o.name for o in model.graph.output]
    feed, picked = genai_feed(model, prompt), []
    for _ in range(steps):
        outputs = dict(zip(names, run(feed)))
        token = outputs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        picked.append(token)
        feed = genai_feed(model, token, {n.replace("present", "past_key_values"): v for n, v in outputs.items() if n != "logits"})
    return np.concatenate(picked, axis=1)


@pytest.mark.parametrize("precision", ["fp32"])
def test_an_onnxruntime_genai_decoder_lifts_and_decodes_the_same_tokens(precision: str) -> None:
    """onnxruntime-genai's CPU decoder (opset 22, external data, GroupQueryAttention with rotary inside
    and a packed projection, RMS norms fused with the residual adds): the prompt's logits and caches
    within float rounding, then 32 greedy tokens through the cache equal to onnxruntime's."""
    path = GENAI / precision / "model.onnx"
    model = onnx.load(path)
    lifted = lift_model(model)
    prompt = np.random.default_rng(3).integers(3, 96, (BATCH, 6))
    feed = genai_feed(model, prompt)
    names = [i.name for i in model.graph.input]
    expected, actual = run_ort(model, [feed[n] for n in names]), run_torch(lifted, [feed[n] for n in names])
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=0, atol=float_sum_bound([e], 256))

    def lifted_run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            return run_torch(lifted, [inputs[n] for n in names])

    def ort_run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return run_ort(model, [inputs[n] for n in names])

    np.testing.assert_array_equal(greedy(lifted_run, model, prompt, 32), greedy(ort_run, model, prompt, 32))


@pytest.mark.parametrize("table", ["uint8", "uint4", "int4"])
@pytest.mark.parametrize("zero_points", [False, True])
def test_gather_block_quantized_lifts_as_onnxruntime_computes_it(table: str, zero_points: bool) -> None:
    """com.microsoft GatherBlockQuantized of a [rows, K] table in blocks of 32 along K (K = 80: a partial
    last block): 4-bit codes packed two a byte in uint8 or typed uint4/int4, with zero points or the
    type's default; indices of any shape, negative ones from the end. Element-wise: equal bits."""
    rng = np.random.default_rng(4)
    rows, width, block = 12, 80, 32
    blocks = -(-width // block)
    low, high = (-8, 8) if table == "int4" else (0, 16)
    codes = rng.integers(low, high, (rows, width))
    scales = rng.uniform(0.01, 0.1, (rows, blocks)).astype(np.float32)
    zero = rng.integers(low, high, (rows, blocks))
    element = {"uint8": TensorProto.UINT8, "uint4": TensorProto.UINT4, "int4": TensorProto.INT4}[table]
    if table == "uint8":
        data = helper.make_tensor("data", element, [rows, width // 2], (codes[:, 0::2] | (codes[:, 1::2] << 4)).ravel().tolist())
        zero_bytes = np.pad(zero, ((0, 0), (0, blocks % 2)))
        zp = helper.make_tensor("zp", element, [rows, -(-blocks // 2)], (zero_bytes[:, 0::2] | (zero_bytes[:, 1::2] << 4)).ravel().tolist())
    else:
        data = helper.make_tensor("data", element, [rows, width], codes.ravel().tolist())
        zp = helper.make_tensor("zp", element, [rows, blocks], zero.ravel().tolist())
    indices = np.array([[0, 5, -1], [11, 3, 3]], np.int64)
    node = helper.make_node("GatherBlockQuantized", ["data", "indices", "scales", *(["zp"] if zero_points else [])], ["y"],
                            domain=MS, block_size=block, bits=4, gather_axis=0, quantize_axis=1)
    model = onnx_model([node], [tensor("indices", list(indices.shape), TensorProto.INT64)], [tensor("y", None)],
                       [data, helper.make_tensor("scales", TensorProto.FLOAT, [rows, blocks], scales.ravel().tolist()),
                        *([zp] if zero_points else [])], opset=21, domains=[MS])
    expected, actual = run_ort(model, [indices]), run_torch(lift_model(model), [indices])
    np.testing.assert_array_equal(actual[0], expected[0])
