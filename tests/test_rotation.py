"""rotation (finetune.onnx.hadamard, finetune.onnx.rotate, finetune.quantize.rotate): the Hadamard
matrices are Hadamard (exactly, in integers) at every order the module claims; the rotated float
decoder computes the float decoder's logits and greedy tokens for both exporters, with and without a
key/value cache, its stream's values are the float stream's times Q and its norms' gains are ones;
a tied token table read by a transposed head is copied, not shared; the point of it: an outlier
channel costs per-tensor INT8 activations less once rotated; a stream that does not commute with a
rotation is a one-line error naming the node; Quark's include_rotation maps to the section."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from finetune.config import ConfigError, load_config
from finetune.onnx.hadamard import hadamard_matrix, online_factors, rotation_matrix
from finetune.onnx.normalize import normalize_model
from finetune.onnx.rotate import rotate_graph
from finetune.quantize import quantize_model
from finetune.quantize.summary import format_summary
from finetune.zoo_decoder import DecoderShape, decoder_feeds, export_decoder, export_module, greedy_tokens, tiny_decoder

from .lift_helpers import onnx_model, run_ort, tensor
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_smooth_quant import assert_same_function

# orders up to 128 that are multiples of 4 and that Sylvester doubling of Paley I and II over prime fields misses
UNBUILT = (52, 92, 100, 116)
DECODER_WIDTHS = (576, 768, 2048, 3072, 4096, 5120)  # SmolLM2-135M, GPT-2 / BERT base, Llama 1B-3B, Llama 7B-8B, 13B
EXPORTS = [(cache, dynamo) for cache in (False, True) for dynamo in (False, True)]


@pytest.mark.parametrize("order", [n for n in range(4, 132, 4) if n not in UNBUILT] + [1, 2, *DECODER_WIDTHS])
def test_hadamard_matrices_are_hadamard(order: int) -> None:
    """Entries ±1 and H H^T = n I, in exact integer arithmetic (float64 sums of at most 5120 ±1 terms)."""
    matrix = hadamard_matrix(order)
    assert matrix is not None and matrix.shape == (order, order) and set(np.unique(matrix)) <= {-1, 1}
    gram = matrix.astype(np.float64) @ matrix.T.astype(np.float64)
    np.testing.assert_array_equal(gram, order * np.eye(order))


@pytest.mark.parametrize("order", [n for n in range(4, 132, 4) if n not in UNBUILT] + [576, 1536, 4096, 5120])
def test_online_factors_are_a_hadamard_matrix_in_two_small_pieces(order: int) -> None:
    """A (Sylvester's, a power of two at most sqrt(n)) x B has order n and is Hadamard: an online
    rotation costs a + n / a products per element."""
    left, right = online_factors(order)
    assert left.shape[0] ** 2 <= order and left.shape[0] & (left.shape[0] - 1) == 0
    matrix = np.kron(left, right).astype(np.float64)
    np.testing.assert_array_equal(matrix @ matrix.T, order * np.eye(order))


@pytest.mark.parametrize("order", [*UNBUILT, 3, 6, 10])
def test_an_order_without_a_hadamard_matrix_says_to_take_a_random_rotation(order: int) -> None:
    assert hadamard_matrix(order) is None and online_factors(order) is None
    with pytest.raises(ValueError, match=rf"no Hadamard matrix of order {order} .*: set rotation.kind to random$"):
        rotation_matrix(order, "hadamard", 0)
    q = rotation_matrix(order, "random", 0)
    np.testing.assert_allclose(q @ q.T, np.eye(order), atol=1e-12)


def test_the_rotation_is_orthogonal_and_its_seed_draws_its_signs() -> None:
    first, again, other = (rotation_matrix(64, "hadamard", seed) for seed in (0, 0, 1))
    np.testing.assert_allclose(first @ first.T, np.eye(64), atol=1e-12)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    np.testing.assert_array_equal(np.abs(first), np.abs(other))  # the same Hadamard matrix, other signs


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, bool], Path]:
    folder = tmp_path_factory.mktemp("decoders")
    return {(cache, dynamo): export_decoder(folder / f"{cache}-{dynamo}.onnx", cache, dynamo) for cache, dynamo in EXPORTS}


@pytest.mark.parametrize(("cache", "dynamo"), EXPORTS)
def test_the_rotated_decoder_computes_the_float_decoders_outputs(exports: dict, cache: bool, dynamo: bool) -> None:
    """Every output within float rounding (the rotation's sums add ~width roundings, far below the
    bound), the same 8 greedy tokens; every layer reading the stream (q, k, v, gate, up of each
    block and the head) and writing into it (o, down) rotated, every norm's gain folded and set to ones."""
    original = quantize_model(exports[(cache, dynamo)], {"preset": "INT4_PER_CHANNEL", "op_types": ["Conv"]}, None).float_model
    rotated = quantize_model(exports[(cache, dynamo)], {"preset": "INT4_PER_CHANNEL", "op_types": ["Conv"], "rotation": {}}, None)
    entry, blocks = rotated.summary["rotation"], DecoderShape().blocks
    assert (entry["width"], entry["layers_reading"], entry["layers_writing"], entry["gains_folded"]) == \
        (64, 5 * blocks + 1, 2 * blocks, 2 * blocks + 1)
    names = [i.name for i in original.graph.input]
    for feed in decoder_feeds(cache, 2):
        for ours, theirs in zip(run_ort(rotated.float_model, [feed[n] for n in names]), run_ort(original, [feed[n] for n in names])):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(np.abs(theirs).max()))
    if not cache:
        prompt = np.array([[1, 5, 7, 9], [3, 2, 8, 8]])
        runs = [lambda feed, m=m: run_ort(m, [feed[n] for n in names]) for m in (rotated.float_model, original)]
        np.testing.assert_array_equal(*(greedy_tokens(run, prompt, 8) for run in runs))


def test_the_stream_is_the_float_stream_times_q_and_the_gains_are_ones(exports: dict) -> None:
    """The embedding's output (the stream's first value) equals the float one times Q; the gains read 1."""
    model, _ = normalize_model(onnx.load(exports[(False, False)]), notices=[], in_place=True)  # as the quantizer does first
    rotated = onnx.ModelProto()
    rotated.CopyFrom(model)
    plan = rotate_graph(rotated.graph, "hadamard", 3)
    q = rotation_matrix(64, "hadamard", 3)
    [gather] = [n for n in model.graph.node if n.name == plan.table]
    for graph in (model.graph, rotated.graph):
        graph.output.append(helper.make_tensor_value_info(gather.output[0], onnx.TensorProto.FLOAT, None))
    feed = decoder_feeds(False, 1)[0]
    names = [i.name for i in model.graph.input]
    before, after = (run_ort(m, [feed[n] for n in names])[-1] for m in (model, rotated))
    np.testing.assert_allclose(after, before @ q, rtol=1e-5, atol=1e-5 * float(np.abs(before).max()))
    tensors = {t.name: numpy_helper.to_array(t) for t in rotated.graph.initializer}
    nodes = {n.name: n for n in rotated.graph.node}
    for node_name, index in plan.gains:
        np.testing.assert_array_equal(tensors[nodes[node_name].input[index]], 1)


def tied_decoder() -> onnx.ModelProto:
    """ids -> Gather(E) -> x + x @ W (a layer writing into the stream) -> RMS norm (Pow, ReduceMean,
    Add eps, Sqrt, Reciprocal, Mul) * gain -> Gemm(n, E, transB): the head reads the token table itself."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["x"], name="embed"),
        helper.make_node("MatMul", ["x", "W"], ["h"], name="layer"), helper.make_node("Add", ["x", "h"], ["s"], name="residual"),
        helper.make_node("Pow", ["s", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq", "last"], ["ms"], name="mean"),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="eps_add"), helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
        helper.make_node("Reciprocal", ["rms"], ["inv"], name="inv"), helper.make_node("Mul", ["s", "inv"], ["n"], name="norm"),
        helper.make_node("Mul", ["n", "gain"], ["g"], name="gain_mul"),
        helper.make_node("Gemm", ["g", "E"], ["logits"], name="head", transB=1),
    ]
    constants = {"E": rng.standard_normal((20, 8)).astype(np.float32), "W": rng.standard_normal((8, 8)).astype(np.float32),
                 "two": np.array(2, np.float32), "last": np.array([-1], np.int64), "eps": np.array(1e-6, np.float32),
                 "gain": (1 + rng.random(8)).astype(np.float32)}
    return onnx_model(nodes, [tensor("ids", [5], onnx.TensorProto.INT64)], [tensor("logits", [5, 20])], constants, opset=18)


def test_a_tied_token_table_is_copied_for_the_head_and_its_gain_scales_the_columns() -> None:
    model = tied_decoder()
    rotated = onnx.ModelProto()
    rotated.CopyFrom(model)
    plan = rotate_graph(rotated.graph, "hadamard", 0)
    assert (sorted(plan.reading), plan.writing) == (["head", "layer"], ["layer"])  # the layer reads and writes the stream: Q^T W Q
    nodes = {n.name: n for n in rotated.graph.node}
    assert nodes["head"].input[1] != nodes["embed"].input[0]  # E Q for the Gather, (E diag(gain)) Q for the head
    assert len(rotated.graph.initializer) == len(model.graph.initializer) + 1
    ids = np.array([0, 3, 19, 7, 7])
    assert_same_function(run_ort(rotated, [ids])[0], run_ort(model, [ids])[0])


@pytest.mark.parametrize(("change", "message"), [
    (lambda nodes: nodes.append(helper.make_node("ReduceMean", ["s", "last"], ["mean_out"], name="bad_mean")),
     "rotation: s (the residual stream) meets bad_mean (ReduceMean), which does not commute"),
    (lambda nodes: nodes.append(helper.make_node("Add", ["s", "eps"], ["shifted"], name="shift")),
     "rotation: shifted (the residual stream) meets shift (Add), whose constant eps is not one value per channel"),
])
def test_a_stream_that_does_not_commute_is_a_one_line_error_before_any_change(change, message: str) -> None:
    model = tied_decoder()
    nodes = list(model.graph.node)
    change(nodes)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    before = model.SerializeToString()
    with pytest.raises(ValueError) as caught:
        quantize_model(model, {"preset": "INT4_PER_CHANNEL", "rotation": {}}, None)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert model.SerializeToString() == before


def test_a_model_without_a_token_table_is_a_one_line_error() -> None:
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor("x", [2, 4])],
                       [tensor("y", [2, 4])], {"w": np.eye(4, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"^rotation: no token table .*remove `rotation` from the config$"):
        quantize_model(model, {"preset": "INT4_PER_CHANNEL", "rotation": {}}, None)


def test_rotation_spreads_an_outlier_channel_for_per_tensor_int8_activations(tmp_path: Path) -> None:
    """The tiny decoder with one channel of every norm's gain 12x (an outlier input channel of every
    layer reading the stream): A8W8's held-out logits lose less than half as much once rotated."""
    decoder = tiny_decoder(False)
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            if name.endswith("norm.weight"):
                parameter[5] *= 12
    error = held_out_error(export_module(decoder, tmp_path / "outlier.onnx", dynamo=False))
    assert error({"preset": "A8W8", "rotation": {}}) < 0.5 * error({"preset": "A8W8"})


def held_out_error(path: Path) -> Callable[[dict], float]:
    """The mean squared error of the decoder's logits quantized by a config (calibrated on 4 feeds),
    against the float decoder's, on 2 other feeds."""
    calibration, held_out = decoder_feeds(False, 4, seed=1), decoder_feeds(False, 2, seed=2)
    reference = [run_ort(onnx.load(path), list(f.values()))[0] for f in held_out]

    def error(config: dict) -> float:
        model = quantize_model(path, config, calibration).model
        return float(np.mean([((run_ort(model, list(f.values()))[0] - r) ** 2).mean() for f, r in zip(held_out, reference)]))

    return error


def test_the_summary_says_what_was_rotated_and_quark_include_rotation_maps_to_the_section(exports: dict) -> None:
    result = quantize_model(exports[(False, True)], {"preset": "INT4_PER_CHANNEL", "rotation": {"seed": 2}}, None)
    assert "rotation (hadamard, seed 2): residual stream of width 64, 11 layer(s) reading it, 4 writing into it, " \
        "5 norm gain(s) folded" in format_summary(result.summary)
    assert load_config({"include_rotation": True}).rotation == load_config({"rotation": {}}).rotation
    assert load_config({"include_rotation": False}).rotation is None
    with pytest.raises(ConfigError, match=r"^rotation.kind: "):
        load_config({"preset": "A8W8", "rotation": {"kind": "givens"}})


def test_constants_rotated_by_pieces_are_those_rotated_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of a few rows or columns (as an LM head of 128 k x 4096 is rotated) give the whole
    product's values, within the rounding of sums over the width (BLAS may order a piece's sums otherwise)."""
    from finetune.onnx import rotate_steps

    whole, pieces = tied_decoder(), tied_decoder()
    rotate_graph(whole.graph, "hadamard", 0)
    monkeypatch.setattr(rotate_steps, "PIECE_ELEMENTS", 20)
    rotate_graph(pieces.graph, "hadamard", 0)
    for ours, theirs in zip(pieces.graph.initializer, whole.graph.initializer):
        assert ours.name == theirs.name
        np.testing.assert_allclose(numpy_helper.to_array(ours), numpy_helper.to_array(theirs), rtol=1e-6, atol=1e-6)


def test_a_large_model_is_rotated_from_its_data_file_to_the_same_bytes(exports: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """From BY_FILE_BYTES on, the loaded weights are set aside in a data file and each rotated tensor is
    read from it (protobuf would keep a replaced tensor's bytes beside its new ones until the model is
    dropped): the rotated float graph is the in-memory one's, byte for byte."""
    from finetune.onnx import io
    from finetune.quantize import api

    config = {"preset": "INT4_PER_CHANNEL", "rotation": {}}
    in_memory = quantize_model(exports[(False, True)], config, None)
    monkeypatch.setattr(io, "BY_FILE_BYTES", 1)
    folders: list[Path] = []
    monkeypatch.setattr(api, "set_aside", lambda model, folder: folders.append(folder) or io.set_aside(model, folder))
    by_file = quantize_model(exports[(False, True)], config, None)
    assert len(folders) == 1 and not folders[0].exists()  # the data file's folder is gone with the rotation
    assert by_file.float_model.SerializeToString() == in_memory.float_model.SerializeToString()
    assert by_file.model.SerializeToString() == in_memory.model.SerializeToString()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_online_rotations_keep_the_function_and_stay_float(exports: dict, dynamo: bool) -> None:
    """rotation.online: the inputs of o_proj and down_proj of each block are rotated by inserted
    Hadamard products (two each: 64 = 8 x 8, 128 = 8 x 16), left float while every
    layer is quantized; the float graph keeps the decoder's logits and the quantized model loads in onnxruntime."""
    path = exports[(False, dynamo)]
    original = onnx.load(path)
    result = quantize_model(path, {"preset": "A8W8", "rotation": {"online": True}}, decoder_feeds(False, 2))
    entry, blocks = result.summary["rotation"], DecoderShape().blocks
    assert len(entry["online"]) == 2 * blocks and len(entry["inserted_nodes"]) == 4 * blocks
    assert "4 layer input(s) rotated online" in format_summary(result.summary)
    producers = {output: node for node in result.model.graph.node for output in node.output}
    initializers = {t.name for t in result.model.graph.initializer}
    for node in (n for n in result.model.graph.node if n.name in entry["inserted_nodes"]):  # no quantizer before them
        assert all(name in initializers or producers[name].op_type in ("Reshape", "MatMul") for name in node.input)
    names = [i.name for i in original.graph.input]
    feed = decoder_feeds(False, 1)[0]
    expected = run_ort(original, [feed[n] for n in names])[0]
    np.testing.assert_allclose(run_ort(result.float_model, [feed[n] for n in names])[0], expected,
                               rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))
    assert np.isfinite(run_ort(result.model, [feed[n] for n in names])[0]).all()


def test_an_online_width_without_a_hadamard_matrix_is_a_one_line_error() -> None:
    """The tied decoder's layer writes the stream from the stream itself (no online rotation); a
    layer of input width 52 writing into it from outside has none built here."""
    model = tied_decoder()
    rng = np.random.default_rng(1)
    model.graph.initializer.extend([numpy_helper.from_array(rng.standard_normal((8, 52)).astype(np.float32), "up"),
                                    numpy_helper.from_array(rng.standard_normal((52, 8)).astype(np.float32), "down")])
    nodes = list(model.graph.node)
    nodes[1:3] = [helper.make_node("MatMul", ["x", "up"], ["u"], name="up_proj"),
                  helper.make_node("MatMul", ["u", "down"], ["h"], name="down_proj"),
                  helper.make_node("Add", ["x", "h"], ["s"], name="residual")]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    with pytest.raises(ValueError, match=r"^rotation: no Hadamard matrix of order 52 is built here for the online rotation "
                                         r"of u, the input of down_proj; set rotation.online to false$"):
        quantize_model(model, {"preset": "INT4_PER_CHANNEL", "rotation": {"online": True}}, None)
    assert quantize_model(model, {"preset": "INT4_PER_CHANNEL", "rotation": {}}, None).summary["rotation"]["online"] == []
