"""rotation.heads (finetune.onnx.rotate_heads, QuaRot's R2): every attention's value and output
projections are found in both exporters' graphs and rotated per head, the rotated float decoder
computes the float decoder's logits and greedy tokens (with and without the online rotations, whose
products then follow R^T), each head's values are the float ones times R, an outlier channel of the
values costs per-tensor INT8 less once rotated; a key/value cache or a graph without attention is a
one-line error before any weight changes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from finetune.onnx.hadamard import rotation_matrix
from finetune.onnx.normalize import normalize_model
from finetune.onnx.rotate import rotate_graph
from finetune.quantize import quantize_model
from finetune.quantize.summary import format_summary
from finetune.zoo_decoder import DecoderShape, decoder_feeds, export_decoder, export_module, greedy_tokens, tiny_decoder

from .lift_helpers import run_ort
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_rotation import held_out_error, tied_decoder

SHAPE = DecoderShape()
EXPORTERS = [False, True]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, bool], Path]:
    folder = tmp_path_factory.mktemp("decoders")
    return {(cache, dynamo): export_decoder(folder / f"{cache}-{dynamo}.onnx", cache, dynamo)
            for cache in (False, True) for dynamo in EXPORTERS}


@pytest.mark.parametrize("online", [False, True], ids=["stream", "online"])
@pytest.mark.parametrize("dynamo", EXPORTERS, ids=["torchscript", "dynamo"])
def test_rotated_heads_keep_the_decoders_logits_and_greedy_tokens(exports: dict, dynamo: bool, online: bool) -> None:
    """The logits within float rounding (a few sums over the width and the head more than the stream's
    rotation alone), the same 8 greedy tokens; one pair of projections per block, heads of 16."""
    path = exports[(False, dynamo)]
    original = onnx.load(path)
    result = quantize_model(path, {"preset": "INT4_PER_CHANNEL", "op_types": ["Conv"],
                                   "rotation": {"heads": True, "online": online}}, None)
    entry = result.summary["rotation"]
    assert len(entry["heads"]) == SHAPE.blocks and entry["head_width"] == SHAPE.head_size
    if not dynamo:  # the dynamo exporter's node names say nothing of the module
        assert all("v_proj" in value and "o_proj" in output for value, output in entry["heads"])
    assert f"the values of {SHAPE.blocks} attention(s) rotated per head of {SHAPE.head_size}" in format_summary(result.summary)
    names = [i.name for i in original.graph.input]
    for feed in decoder_feeds(False, 2):
        expected = run_ort(original, [feed[n] for n in names])[0]
        np.testing.assert_allclose(run_ort(result.float_model, [feed[n] for n in names])[0], expected,
                                   rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))
    prompt = np.array([[1, 5, 7, 9], [3, 2, 8, 8]])
    runs = [lambda feed, m=m: run_ort(m, [feed[n] for n in names]) for m in (result.float_model, original)]
    np.testing.assert_array_equal(*(greedy_tokens(run, prompt, 8) for run in runs))


@pytest.mark.parametrize("dynamo", EXPORTERS, ids=["torchscript", "dynamo"])
def test_a_value_projections_bias_is_rotated_with_its_columns(tmp_path: Path, dynamo: bool) -> None:
    """Value projections with a bias (Qwen's, GPT-2's): the Add after the MatMul is followed and its
    constant rotated per head too, so the logits stay the float decoder's."""
    decoder = tiny_decoder(False)
    generator = torch.Generator().manual_seed(4)
    for block in decoder.layers:
        plain = block.self_attn.v_proj
        block.self_attn.v_proj = torch.nn.Linear(plain.in_features, plain.out_features, bias=True)
        with torch.no_grad():
            block.self_attn.v_proj.weight.copy_(plain.weight)
            block.self_attn.v_proj.bias.copy_(torch.randn(plain.out_features, generator=generator))
    path = export_module(decoder, tmp_path / "bias.onnx", dynamo=dynamo)
    result = quantize_model(path, {"preset": "INT4_PER_CHANNEL", "op_types": ["Conv"], "rotation": {"heads": True}}, None)
    assert len(result.summary["rotation"]["heads"]) == SHAPE.blocks
    feed = decoder_feeds(False, 1)[0]
    expected = run_ort(onnx.load(path), list(feed.values()))[0]
    np.testing.assert_allclose(run_ort(result.float_model, list(feed.values()))[0], expected,
                               rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))


def test_each_heads_values_are_the_float_values_times_r(exports: dict) -> None:
    """The value projection's output with heads rotated equals the stream-only rotation's times
    diag(R, R) (two key/value heads of 16), R drawn from the rotation's seed."""
    model, _ = normalize_model(onnx.load(exports[(False, False)]), notices=[], in_place=True)
    stream_only, heads = onnx.ModelProto(), onnx.ModelProto()
    stream_only.CopyFrom(model)
    heads.CopyFrom(model)
    rotate_graph(stream_only.graph, "hadamard", 3)
    plan = rotate_graph(heads.graph, "hadamard", 3, heads=True)
    value_projection = plan.heads[0][0]
    for graph in (stream_only.graph, heads.graph):
        [node] = [n for n in graph.node if n.name == value_projection]
        graph.output.append(helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
    feed = decoder_feeds(False, 1)[0]
    names = [i.name for i in model.graph.input]
    before, after = (run_ort(m, [feed[n] for n in names])[-1] for m in (stream_only, heads))
    r = rotation_matrix(SHAPE.head_size, "hadamard", 3)
    expected = (before.reshape(*before.shape[:-1], SHAPE.kv_heads, SHAPE.head_size) @ r).reshape(before.shape)
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5 * float(np.abs(before).max()))


def test_rotated_heads_spread_an_outlier_channel_of_the_values_for_per_tensor_int8(tmp_path: Path) -> None:
    """One output channel of every value projection 10x (an outlier channel of a head's values, which
    attention's product and the output projection read): INT8 per tensor, weights and activations,
    loses less than 70 % as much once each head is rotated (measured: 48 %). Not with weights per
    channel: R spreads the large column over the head's columns, each then with a coarser scale of its
    own (measured at A8W8: 0.075 -> 0.121), so the guide says where it pays."""
    decoder = tiny_decoder(False)
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            if name.endswith("v_proj.weight"):
                parameter[5] *= 10
    error = held_out_error(export_module(decoder, tmp_path / "outlier.onnx", dynamo=False))
    per_tensor = {"preset": "A8W8", "weight": {"granularity": "tensor"}}
    assert error({**per_tensor, "rotation": {"heads": True}}) < 0.7 * error({**per_tensor, "rotation": {}})


@pytest.mark.parametrize("dynamo", EXPORTERS, ids=["torchscript", "dynamo"])
def test_a_key_value_cache_is_a_one_line_error_before_any_change(exports: dict, dynamo: bool) -> None:
    """The values join the past ones and leave as a model output (present.0.value), which would come out rotated."""
    model = onnx.load(exports[(True, dynamo)])
    before = model.SerializeToString()
    with pytest.raises(ValueError) as caught:
        quantize_model(model, {"preset": "INT4_PER_CHANNEL", "rotation": {"heads": True}}, None)
    assert str(caught.value) == ("rotation.heads: present.0.value (attention's values, rotated per head) is a model output, "
                                 "which would come out rotated (a key/value cache); set rotation.heads to false")
    assert model.SerializeToString() == before


def test_a_graph_without_attention_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"^rotation.heads: no attention's values found .*; set rotation.heads to false$"):
        quantize_model(tied_decoder(), {"preset": "INT4_PER_CHANNEL", "rotation": {"heads": True}}, None)
