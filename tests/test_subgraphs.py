"""Subgraphs are part of the model: names read only inside If branches survive every pass, the
quantizer quantizes and calibrates the nodes inside them, and no run hands back a model that
onnxruntime refuses when it loaded the input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from finetune.calibrate import make_observer
from finetune.formats import IntSpec
from finetune.onnx.fold import fold_constants
from finetune.onnx.graphs import all_graphs, all_nodes, node_reads
from finetune.onnx.normalize import normalize_model
from finetune.onnx.session import inference_session, require_loads
from finetune.quantize import quantize_model, quantizer_presets
from finetune.zoo import silero_vad_onnx_path, speech_like_audio, vad_windows
from tests.control_models import loop_model, scan_model
from tests.subgraph_models import branch_inputs, if_reading_outer_names, then_branch_alone

BRANCH_LAYERS = {"then_matmul1": "W1", "then_matmul2": "W2", "else_gemm": "W3", "else_matmul": "else_scale"}


def run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    return inference_session(model).run(None, feed)[0]


def test_node_reads_counts_the_outer_names_of_its_branches() -> None:
    model = if_reading_outer_names()
    branch = model.graph.node[-1]
    assert node_reads(branch) == ["positive", "B3", "W1", "W2", "W3", "shift", "x"]


def test_normalise_and_fold_keep_what_only_branches_read() -> None:
    """The outer Constant and the initializers only the branches read stay (they were dropped
    as unused, leaving a model onnxruntime refused), and the outputs are the input's, bit for bit."""
    model = if_reading_outer_names()
    normalized, _ = normalize_model(model)
    fold_constants(normalized)
    kept = {tensor.name for tensor in normalized.graph.initializer}
    assert {"W1", "W2", "W3", "B3", "shift"} <= kept
    for feed in branch_inputs(4):
        np.testing.assert_array_equal(run(normalized, feed), run(model, feed))


def test_topological_sort_orders_an_outer_producer_before_the_branch_reading_it() -> None:
    """A node whose output a branch reads implicitly, written after the If, is moved before it."""
    model = if_reading_outer_names()
    nodes = list(model.graph.node)
    shift = nodes.pop(0)
    del model.graph.node[:]
    model.graph.node.extend([*nodes, shift])  # the If now precedes the Constant its branch reads
    normalized, changes = normalize_model(model)
    assert any(change.startswith("sorted the nodes") for change in changes)
    np.testing.assert_array_equal(run(normalized, branch_inputs(1)[0]), run(if_reading_outer_names(), branch_inputs(1)[0]))


@pytest.mark.parametrize("preset", quantizer_presets())
def test_every_preset_quantizes_the_layers_inside_branches(preset: str) -> None:
    """Each MatMul/Gemm in a branch reads its weight through a quantizer, and onnxruntime runs
    the result on both branches (it refused the model, or the run ended in a traceback, before)."""
    model = if_reading_outer_names()
    quantized = quantize_model(model, preset, branch_inputs(8)).model
    layers = {node.name: node for node in all_nodes(quantized.graph) if node.name in BRANCH_LAYERS}
    assert set(layers) == set(BRANCH_LAYERS)
    for name, weight in BRANCH_LAYERS.items():
        assert weight not in layers[name].input, f"{name} reads its float weight {weight}"
    for feed in branch_inputs(2):
        assert np.isfinite(run(quantized, feed)).all()


def test_calibration_inside_a_branch_equals_the_branch_calibrated_alone() -> None:
    """The int8 scales of the then branch's activations, calibrated on the rows that take it, are
    those of the same layers in a model of the branch alone calibrated on those rows: the other
    branch's rows (an empty value) leave the statistics untouched."""
    model = if_reading_outer_names()
    feeds = branch_inputs(8)
    branched = quantize_model(model, "XINT8", feeds).model
    alone = quantize_model(then_branch_alone(model), "XINT8", feeds[::2]).model
    assert _scales(branched, "then_relu") == _scales(alone, "then_relu")
    assert _scales(branched, "then_relu")  # the relu's output is quantized with a calibrated scale


def _scales(model: onnx.ModelProto, tensor: str) -> list[float]:
    """The scales of the QuantizeLinear nodes reading `tensor`, anywhere in the model."""
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    return [float(initializers[node.input[1]]) for node in all_nodes(model.graph)
            if node.op_type == "QuantizeLinear" and node.input[0] == tensor]


def test_a_model_onnxruntime_refuses_is_never_handed_back() -> None:
    """require_loads names onnxruntime's reason when the output does not load but the input did,
    and lets a run through whose input onnxruntime refused too (a foreign custom op, say)."""
    model = if_reading_outer_names()
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    del broken.graph.initializer[:1]  # W1, read only inside the then branch
    with pytest.raises(ValueError, match="onnxruntime refuses the model this run made.*W1"):
        require_loads(broken, model, "quantize")
    require_loads(broken, broken, "quantize")
    require_loads(model, model, "quantize")


def test_a_branch_the_data_never_takes_keeps_its_activations_float_and_says_so() -> None:
    """Calibrated on rows that all take the then branch, the else branch's activations have no
    statistics: they stay float, listed in the summary, while its weights are quantized."""
    model = if_reading_outer_names()
    result = quantize_model(model, "XINT8", branch_inputs(8)[::2])
    unreached = {w["tensor"] for w in result.summary["warnings"] if "If branch the data never took" in w["reason"]}
    assert unreached == {"else_logits"}
    layers = {node.name: node for node in all_nodes(result.model.graph)}
    assert layers["else_matmul"].input[0] == "else_logits" and "else_scale" not in layers["else_matmul"].input
    assert _scales(result.model, "then_relu")
    for feed in branch_inputs(2):
        assert np.isfinite(run(result.model, feed)).all()


def _vad_feeds(windows: np.ndarray, rate: int = 16000) -> list[dict[str, np.ndarray]]:
    return [{"input": row[None], "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(rate)} for row in windows]


def _stream_probabilities(model: onnx.ModelProto | str, windows: np.ndarray) -> np.ndarray:
    """Speech probability per window, the recurrent state carried from window to window."""
    session = inference_session(model)
    state, probabilities = np.zeros((2, 1, 128), np.float32), []
    for row in windows:
        probability, state = session.run(None, {"input": row[None], "state": state, "sr": np.array(16000)})
        probabilities.append(float(probability.reshape(-1)[0]))
    return np.array(probabilities)


@pytest.mark.parametrize("preset", ["MX6", "XINT8", "BF16"])
def test_a_real_voice_activity_model_whose_network_is_inside_an_if_is_quantized(preset: str) -> None:
    """Silero's VAD v5 (livekit-plugins-silero): every Conv of both sample-rate branches reads
    quantized weights, onnxruntime runs both branches, and BF16 stays close to the float
    model's speech probability, the state carried over a stream (the model was written unchanged,
    its network being inside the If)."""
    path = silero_vad_onnx_path()
    windows = vad_windows(speech_like_audio(2.0, seed=3))
    result = quantize_model(path, preset, _vad_feeds(windows[::4]))
    convs = [node for node in all_nodes(result.model.graph) if node.op_type == "Conv"]
    weights = {tensor.name for graph in all_graphs(onnx.load(path).graph) for tensor in graph.initializer}
    assert len(convs) == 12 and not any(set(conv.input) & weights for conv in convs)
    probabilities = _stream_probabilities(result.model, windows)
    assert np.isfinite(probabilities).all()
    eight_khz = inference_session(result.model).run(None, _vad_feeds(windows[:1, :288], 8000)[0])[0]
    assert np.isfinite(eight_khz).all()
    if preset == "BF16":  # measured: at most 0.051 apart over the stream, 0.004 on average
        gaps = np.abs(probabilities - _stream_probabilities(str(path), windows))
        assert gaps.max() < 0.1 and gaps.mean() < 0.02


INT8_MINMAX = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}


def test_a_loop_body_value_is_calibrated_over_every_iteration() -> None:
    """The MatMul input inside a Loop body (the carried state h) gets the min-max scale of all the
    values it takes over the iterations of every sample: x, then each state but the last."""
    model = loop_model()
    feeds = [{"x": np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32), "steps": np.array(6)} for seed in range(3)]
    quantized = quantize_model(model, {"activation": INT8_MINMAX, "weight": INT8_MINMAX}, feeds).model
    observer = make_observer("minmax", IntSpec("int8"))
    session = inference_session(model)
    for feed in feeds:
        states = session.run(None, feed)[1]
        observer.update(np.concatenate([feed["x"][None], states[:-1]]))
    assert _scales(quantized, "h_in") == [float(observer.scale_zero_point()[0])]
    for feed in feeds:
        assert np.isfinite(run(quantized, feed)).all()


def test_a_scan_body_value_is_calibrated_and_the_model_runs() -> None:
    model = scan_model()
    feeds = [{"s": np.zeros((1, 8), np.float32), "xs": np.random.default_rng(seed).standard_normal((5, 1, 3)).astype(np.float32)}
             for seed in range(3)]
    quantized = quantize_model(model, {"activation": INT8_MINMAX, "weight": INT8_MINMAX}, feeds).model
    observer = make_observer("minmax", IntSpec("int8"))
    for feed in feeds:
        observer.update(feed["xs"])
    assert _scales(quantized, "x_t") == [float(observer.scale_zero_point()[0])]
    for feed in feeds:
        assert np.isfinite(inference_session(quantized).run(None, feed)[0]).all()
