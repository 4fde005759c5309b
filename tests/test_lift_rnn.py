"""LSTM and GRU: lifted modules equal onnxruntime within the bound float32 arithmetic gives (hand-
built nodes over every direction, layout, sequence lengths, initial states, peepholes and GRU's
linear_before_reset; torch exports of nn.LSTM and nn.GRU), their W and R are quantized as weights
in every preset, and they are tuned as layers and written back."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from finetune.export import export_model
from finetune.lift import LiftError, lift_model
from finetune.notices import Warnings
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model, quantizer_presets
from finetune.recon.units import find_units
from finetune.recon.units.sides import SideInput

from .lift_helpers import onnx_model, randomized, run_ort, run_torch, tensor

GATES = {"LSTM": 4, "GRU": 3}
ULPS_PER_STEP = 4  # per time step: the gate sums' last bits (torch and MLAS add in other orders) and MLAS's sigmoid/tanh


def bound(steps: int, expected: Sequence[np.ndarray]) -> float:
    """The largest difference float32 arithmetic allows: a few ulps of the outputs' magnitude per
    time step, since each step's rounding differences enter the state and are carried onward."""
    magnitude = max(1.0, *(float(np.abs(e).max()) for e in expected if e.size))
    return ULPS_PER_STEP * steps * float(np.finfo(np.float32).eps) * magnitude


def rnn_node_model(op: str, direction: str = "forward", layout: int = 0, lengths: Sequence[int] | None = None,
                   initial: bool = False, peepholes: bool = False, outputs: Sequence[str] | None = None,
                   opset: int = 14, steps: int = 7, batch: int = 3, size: int = 5, hidden: int = 4,
                   **attributes: object) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """One LSTM or GRU node with random W, R, B (and P) and its inputs."""
    rng = np.random.default_rng(0)
    directions, gates = 2 if direction == "bidirectional" else 1, GATES[op]
    weights = {"W": (directions, gates * hidden, size), "R": (directions, gates * hidden, hidden), "B": (directions, 2 * gates * hidden)}
    if peepholes:
        weights["P"] = (directions, 3 * hidden)
    initializers = {name: (rng.standard_normal(shape) * 0.5).astype(np.float32) for name, shape in weights.items()}
    x_shape, state_shape = ((batch, steps, size), (batch, directions, hidden)) if layout else ((steps, batch, size), (directions, batch, hidden))
    names = ["X", "W", "R", "B", "", "", ""][: 7 if op == "LSTM" else 6]
    inputs, feeds = [tensor("X", x_shape)], [rng.standard_normal(x_shape).astype(np.float32)]
    if lengths is not None:
        names[4] = "lengths"
        inputs.append(tensor("lengths", [batch], TensorProto.INT32))
        feeds.append(np.array(lengths, np.int32))
    for index, state in enumerate(("h0", "c0")[: 2 if op == "LSTM" else 1] if initial else ()):
        names[5 + index] = state
        inputs.append(tensor(state, state_shape))
        feeds.append(rng.standard_normal(state_shape).astype(np.float32))
    names += ["P"] if peepholes else []
    all_outputs = ["Y", "Y_h", "Y_c"][: 3 if op == "LSTM" else 2]
    output_names = [o if outputs is None or o in outputs else "" for o in all_outputs]
    if opset >= 14:
        attributes["layout"] = layout
    node = helper.make_node(op, _trimmed(names), _trimmed(output_names), name="rnn", hidden_size=hidden, direction=direction,
                            **attributes)
    return onnx_model([node], inputs, [tensor(o, None) for o in output_names if o], initializers, opset=opset), feeds


def _trimmed(names: list[str]) -> list[str]:
    """Names without trailing omitted ("") entries."""
    while names and not names[-1]:
        names = names[:-1]
    return names


def onnxruntime_outputs(op: str, **case: object) -> tuple[onnx.ModelProto, list[np.ndarray], list[np.ndarray]]:
    """The node's model, inputs and onnxruntime's outputs; for layout 1, which onnxruntime refuses,
    the outputs of the same node at layout 0 on the same inputs (transposed), transposed back."""
    model, feeds = rnn_node_model(op, **case)
    if not case.get("layout"):
        return model, feeds, run_ort(model, feeds)
    time_first_model, time_first = rnn_node_model(op, **{**case, "layout": 0})
    outputs = run_ort(time_first_model, time_first)
    batch_first = [x.swapaxes(0, 1) if x.ndim == 3 else x for x in time_first]
    return model, batch_first, [y.transpose(2, 0, 1, 3) if y.ndim == 4 else y.swapaxes(0, 1) for y in outputs]


def assert_lifted_equals_onnxruntime(op: str, **case: object) -> float:
    """Lift one node and compare every output with onnxruntime's within `bound`; the worst difference."""
    model, feeds, expected = onnxruntime_outputs(op, **case)
    actual = run_torch(lift_model(model), feeds)
    assert len(expected) == len(actual)
    limit = bound(int(case.get("steps", 7)), expected)
    worst = 0.0
    for e, a in zip(expected, actual):
        assert e.shape == a.shape and e.dtype == a.dtype
        np.testing.assert_allclose(a, e, atol=limit, rtol=0)
        worst = max(worst, float(np.abs(a - e).max()))
    return worst


CASES = [
    {"direction": "forward"}, {"direction": "reverse"}, {"direction": "bidirectional"},
    {"direction": "bidirectional", "layout": 1, "initial": True},
    {"direction": "forward", "lengths": [7, 3, 5], "initial": True},
    {"direction": "reverse", "lengths": [7, 3, 5]},
    {"direction": "bidirectional", "lengths": [2, 7, 0], "layout": 1},
    {"direction": "bidirectional", "opset": 7}, {"direction": "reverse", "opset": 22, "initial": True},
    {"direction": "forward", "outputs": ["Y_h"]}, {"direction": "bidirectional", "outputs": ["Y", "Y_h"]},
    {"direction": "forward", "clip": 0.5},
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(f"{k}={v}" for k, v in case.items()))
@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_node_lifts_as_onnxruntime_computes(op: str, case: dict) -> None:
    """Every direction, layout, sequence lengths (zero too), initial states, opset and subset of
    outputs agrees with onnxruntime within the bound of float32 arithmetic (and GRU's both resets)."""
    for extra in ({"linear_before_reset": 0}, {"linear_before_reset": 1}) if op == "GRU" else ({},):
        assert_lifted_equals_onnxruntime(op, **case, **extra)


@pytest.mark.parametrize("case", [
    {"peepholes": True, "direction": "bidirectional"}, {"peepholes": True, "lengths": [7, 2, 4], "initial": True},
    {"input_forget": 1}, {"activations": ["Relu", "Tanh", "Sigmoid"]}, {"outputs": ["Y_c"], "direction": "reverse"},
], ids=str)
def test_lstm_peepholes_input_forget_and_activations(case: dict) -> None:
    """LSTM's peepholes, coupled input and forget gates and activations without parameters."""
    assert_lifted_equals_onnxruntime("LSTM", **case)


def test_gru_activations() -> None:
    """GRU with activations other than the defaults."""
    assert_lifted_equals_onnxruntime("GRU", activations=["Softsign", "Relu"], linear_before_reset=0)


def test_activation_parameters_are_refused_naming_node_and_attribute() -> None:
    """An activation's alpha/beta is refused in one line naming the node and the attribute."""
    model, _ = rnn_node_model("LSTM", activations=["HardSigmoid", "Tanh", "Tanh"], activation_alpha=[0.2])
    with pytest.raises(LiftError, match=r"'rnn' \(ai.onnx::LSTM, opset 14\).*activation_alpha"):
        lift_model(model)
    model, _ = rnn_node_model("GRU", activations=["HardSigmoid", "Tanh"])
    with pytest.raises(LiftError, match=r"'rnn'.*activations=\['HardSigmoid', 'Tanh'\]"):
        lift_model(model)


class Recurrent(nn.Module):
    """nn.LSTM or nn.GRU returning its output sequence."""

    def __init__(self, kind: str, layers: int, bidirectional: bool, batch_first: bool):
        super().__init__()
        self.rnn = getattr(nn, kind)(6, 8, layers, bidirectional=bidirectional, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def export(module: nn.Module, shape: tuple[int, ...], batch_axis: int, opset: int, dynamo: bool, path: Path) -> onnx.ModelProto:
    """The module exported with a dynamic batch, by TorchScript or by torch.export."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(module, (torch.randn(*shape),), dynamo=True, opset_version=opset, verbose=False,
                                        dynamic_shapes=({batch_axis: torch.export.Dim("batch", min=2, max=64)},))
            program.save(str(path))
        else:
            torch.onnx.export(module, (torch.randn(*shape),), str(path), opset_version=opset, dynamo=False,
                              input_names=["x"], output_names=["y"], dynamic_axes={"x": {batch_axis: "b"}, "y": {batch_axis: "b"}})
    return onnx.load(str(path))


@pytest.mark.parametrize("exporter", [(13, False), (17, False), (18, True)], ids=["opset13", "opset17", "dynamo18"])
@pytest.mark.parametrize("shape", [(1, False, False), (2, True, True)], ids=["1-layer", "2-layer-bidirectional-batch-first"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_torch_exports_lift_as_onnxruntime_computes(tmp_path: Path, kind: str, shape: tuple, exporter: tuple) -> None:
    """nn.LSTM / nn.GRU exports agree with onnxruntime, each W, R and B a parameter (3 per layer)
    and the initial states the exporters build from the batch size lifted as the zero default."""
    layers, bidirectional, batch_first = shape
    steps, batch = 20, 3
    x_shape = (batch, steps, 6) if batch_first else (steps, batch, 6)
    model = export(randomized(Recurrent(kind, layers, bidirectional, batch_first)), x_shape, 0 if batch_first else 1,
                   *exporter, tmp_path / "rnn.onnx")
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    lifted = lift_model(model)
    expected, actual = run_ort(model, [x])[0], run_torch(lifted, [x])[0]
    np.testing.assert_allclose(actual, expected, atol=bound(steps * layers, [expected]), rtol=0)
    assert len(lifted.finetune_params) == 3 * layers
    assert len(find_units(lifted, (kind,))) == layers


class CRNN(nn.Module):
    """A small text-recogniser shape: Conv1d features, a bidirectional LSTM, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.rnn = nn.LSTM(16, 16, bidirectional=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x)).permute(2, 0, 1)
        return self.head(self.rnn(features)[0])


@pytest.fixture(scope="module")
def crnn(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The CRNN exported (opset 17, dynamic batch) with calibration and test inputs [batch, 4, 12]."""
    path = tmp_path_factory.mktemp("crnn") / "crnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(randomized(CRNN()), (torch.randn(2, 4, 12),), str(path), opset_version=17, dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {1: "b"}})
    rng = np.random.default_rng(0)
    calibration = [{"x": rng.standard_normal((8, 4, 12)).astype(np.float32)} for _ in range(4)]
    return {"path": path, "calibration": calibration, "x": rng.standard_normal((8, 4, 12)).astype(np.float32)}


@pytest.mark.parametrize("preset", quantizer_presets())
def test_every_preset_quantizes_lstm_weights_and_lifts(crnn: dict, preset: str) -> None:
    """Every preset quantizes the LSTM's input, W and R (listed in the summary), the model runs in
    onnxruntime, and the lifted model agrees: the LSTM's sums differ from onnxruntime's in their
    last bits (no preset is exact here), and a last-bit difference may cross a rounding boundary
    of the head's input quantizer, so the bound is that of the digits test (0.1 on outputs ~1)."""
    result = quantize_model(crnn["path"], preset, crnn["calibration"])
    model = result.model
    lstm = next(node for node in model.graph.node if node.op_type == "LSTM")
    producers = {output: node for node in model.graph.node for output in node.output}
    assert all(index < len(lstm.input) and lstm.input[index] in producers for index in (1, 2))  # W and R behind Q/DQ
    assert result.summary["quantized_nodes"] == 3
    assert sum(row["tensors"] for row in result.summary["tensors_per_format"] if row["role"] == "weight") == 4
    expected, actual = run_ort(model, [crnn["x"]])[0], run_torch(lift_model(model), [crnn["x"]])[0]
    assert np.abs(actual - expected).max() <= 0.1


def test_lstm_bias_stays_float_under_int32_bias(crnn: dict) -> None:
    """INT presets give Conv and Gemm an int32 bias; the LSTM's B stays float."""
    model = quantize_model(crnn["path"], "A8W8", crnn["calibration"]).model
    lstm = next(node for node in model.graph.node if node.op_type == "LSTM")
    assert lstm.input[3] in {t.name for t in model.graph.initializer}


@pytest.mark.parametrize(("preset", "algorithm"), [("MX6", "adaquant"), ("XINT8", "adaround")])
def test_lstm_is_tuned_as_a_layer_and_the_model_runs(crnn: dict, preset: str, algorithm: str) -> None:
    """The LSTM is a unit of its own (W and R tuned, B with update_bias), the tuned model runs in
    onnxruntime and its lift agrees."""
    config = {"preset": preset, "fast_finetune": {"iterations": 4, "algorithm": algorithm}}
    result = quantize_and_finetune(crnn["path"], config, crnn["calibration"])
    assert [unit["op_type"] for unit in result.report["units"]] == ["Conv", "LSTM", "MatMul"]
    expected, actual = run_ort(result.model, [crnn["x"]])[0], run_torch(lift_model(result.model), [crnn["x"]])[0]
    assert np.abs(actual - expected).max() <= 0.1


def test_tuned_w_and_r_are_written_back(crnn: dict) -> None:
    """Changing the lifted LSTM's W and R parameters changes those initializers in the export."""
    model = quantize_model(crnn["path"], "MX6", crnn["calibration"]).model
    lifted = lift_model(model)
    (unit,) = find_units(lifted, ("LSTM",))
    assert len(unit.layers) == 2 and unit.layers[0].bias is not None
    with torch.no_grad():
        for layer in unit.layers:
            lifted.get_parameter(layer.weight).mul_(0.5)
    exported = {t.name: numpy_helper.to_array(t) for t in export_model(lifted, model).graph.initializer}
    for layer in unit.layers:
        source = lifted.finetune_params[layer.weight]
        np.testing.assert_array_equal(exported[source.initializer], lifted.get_parameter(layer.weight).detach().numpy())
    expected, actual = run_ort(export_model(lifted, model), [crnn["x"]])[0], run_torch(lifted, [crnn["x"]])[0]
    assert np.abs(actual - expected).max() <= 0.1


@pytest.mark.parametrize("layout", [0, 1])
def test_lstm_reading_computed_states_and_lengths_is_a_unit_with_side_inputs(layout: int) -> None:
    """An LSTM whose sequence lengths and initial states are graph inputs (a streaming voice-activity
    model) is a unit reading them as side inputs, each with its batch axis; measured on Y, Y_h and Y_c,
    the outputs the model returns, each along its batch axis."""
    model, _ = rnn_node_model("LSTM", layout=layout, initial=True, lengths=[7, 5, 3])
    (unit,) = find_units(lift_model(model), ("LSTM",))
    state_axis = 0 if layout else 1
    assert unit.side_inputs == (SideInput("lengths", 0), SideInput("h0", state_axis), SideInput("c0", state_axis))
    assert unit.target_outputs == (0, 1, 2) and (unit.input_axis, unit.output_axes) == ((0, (0, 0, 0)) if layout else (1, (2, 1, 1)))


def test_lstm_tuning_trains_on_whole_sequences_and_lowers_its_loss(crnn: dict) -> None:
    """The LSTM's training rows are its batch (axis 1 of X, 2 of Y), not its time steps: AdaQuant
    lowers its loss (drawn along time, 100 steps made it 4-7x worse and it was reverted)."""
    assert find_units(lift_model(quantize_model(crnn["path"], "MX4", crnn["calibration"]).model), ("LSTM",))[0].output_axes == (2,)
    config = {"preset": "MX4", "fast_finetune": {"iterations": 200, "algorithm": "adaquant", "batch_size": 4}}
    result = quantize_and_finetune(crnn["path"], config, crnn["calibration"])
    (lstm,) = [unit for unit in result.report["units"] if unit["op_type"] == "LSTM"]
    assert lstm["status"] == "kept" and lstm["loss_after"] < 0.8 * lstm["loss_before"]


def test_a_recurrent_layer_keeps_its_own_unit_among_blocks(crnn: dict) -> None:
    """Blocks draw rows of their entry value, which around an LSTM are time steps: its layers stay
    layer units, with a warning."""
    lifted = lift_model(quantize_model(crnn["path"], "MX4", crnn["calibration"]).model)
    warned = Warnings()
    units = find_units(lifted, ("Conv", "LSTM", "MatMul"), unit="block", warnings=warned)
    assert "LSTM" in [unit.op_type for unit in units]
    assert any("recurrent layer" in entry["reason"] for entry in warned)
