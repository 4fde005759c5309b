"""If, Loop and Scan lift to torch modules that compute what onnxruntime computes; the weights
inside their bodies are parameters mapped to their initializers, which export writes back into
the graph they live in; a fine-tuning run names every op it cannot lift before calibrating; and
tuning reaches the layers inside an If."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from finetune.config import FastFinetune, load_config
from finetune.export import export_model
from finetune.lift import LiftError, check_liftable, lift_model
from finetune.lift.ops.control import If
from finetune.onnx.graphs import all_graphs, all_nodes
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model
from finetune.zoo import silero_vad_onnx_path, speech_like_audio, vad_windows
from tests.control_models import SAMPLE_RATE, constant_if, loop_model, network_in_if, scan_model, shared_weight_if
from tests.lift_helpers import FLOAT_ATOL, FLOAT_RTOL, assert_same, export_dynamo, float_sum_bound, randomized, run_ort, run_torch
from tests.subgraph_models import FEATURES, branch_inputs, if_reading_outer_names

BRANCH_WEIGHTS = {"W1", "W2", "W3", "else_scale"}  # read by the If's MatMul/Gemm layers, none at the top level


def quantized(model: onnx.ModelProto, preset: str | None, feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """The model itself (preset None) or quantized with the preset on the feeds."""
    return model if preset is None else quantize_model(model, preset, feeds).model


def tolerance(preset: str | None) -> dict[str, float]:
    """torch and onnxruntime order the branches' MatMul sums their own way (by the kernels each picks for
    the CPU), so float models agree within the float bound; quantized ones too: the quantizers after the
    sums see the same values but for their last bits, which cross a rounding boundary only where a value
    lies within an ulp of one (about one element in 1e5 at these scales), and none of these inputs does."""
    return {"atol": FLOAT_ATOL, "rtol": FLOAT_RTOL}


def tensors(model: onnx.ModelProto) -> dict[str, tuple[str, np.ndarray]]:
    """Every initializer and Constant tensor of every graph: value name → (graph name, value)."""
    found = {}
    for graph in all_graphs(model.graph):
        found.update((t.name, (graph.name, numpy_helper.to_array(t))) for t in graph.initializer)
        found.update((n.output[0], (graph.name, numpy_helper.to_array(n.attribute[0].t)))
                     for n in graph.node if n.op_type == "Constant" and n.attribute[0].name == "value")
    return found


@pytest.mark.parametrize("preset", [None, "XINT8", "MX6", "BF16"])
def test_an_if_whose_branches_read_outer_names_lifts_like_onnxruntime(preset: str | None) -> None:
    """Both branches agree with onnxruntime, and each weight a branch reads (an outer initializer,
    or the else branch's own Constant) is a parameter behind its quantizer inside the branch."""
    model = quantized(if_reading_outer_names(), preset, branch_inputs(8))
    module = lift_model(model)
    for feed in branch_inputs(4):  # alternating branches
        assert_same(model, module, [feed["x"]], **tolerance(preset))
    sources = {source.initializer: source for source in module.finetune_params.values()}
    assert BRANCH_WEIGHTS <= set(sources)
    assert set(module.finetune_params) == {name for name, _ in module.named_parameters()}
    for weight in BRANCH_WEIGHTS:
        branch = "branch.then_branch." if weight in ("W1", "W2") else "branch.else_branch."
        assert all(consumer.startswith(branch) for consumer in sources[weight].consumers)
        assert preset is None or sources[weight].quantizer.startswith(branch)


def test_a_weight_both_branches_read_is_one_parameter() -> None:
    model = shared_weight_if()
    module = lift_model(model)
    for sign in (1.0, -1.0):
        x = np.full((1, FEATURES), sign, np.float32)
        assert_same(model, module, [x], atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    (name, source), = module.finetune_params.items()
    assert source.consumers == ("branch.then_branch.then_matmul", "branch.else_branch.else_matmul")
    assert module.get_submodule("branch.else_branch.initializers").W is module.get_parameter(name)


@pytest.mark.parametrize("condition", ["initializer", "shape"])
def test_a_constant_condition_lifts_only_the_taken_branch(condition: str) -> None:
    model = constant_if(condition)
    module = lift_model(model)
    assert not any(isinstance(m, If) for m in module.modules())
    assert [s.initializer for s in module.finetune_params.values()] == ["W_then"]
    x = np.random.default_rng(0).standard_normal((1, FEATURES)).astype(np.float32)
    assert_same(model, module, [x], atol=float_sum_bound(run_ort(model, [x]), FEATURES))  # a FEATURES-term MatMul


class CondNet(nn.Module):
    """A data-dependent torch.cond between two Linear-activation paths, then a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cond(x.sum() > 0, lambda t: torch.relu(self.a(t)), lambda t: torch.tanh(self.b(t)), (x,))
        return self.head(y)


def test_a_torch_cond_exported_by_dynamo_lifts_like_onnxruntime(tmp_path: Path) -> None:
    model = export_dynamo(randomized(CondNet()), (2, 8), 18, tmp_path / "cond.onnx")
    assert any(node.op_type == "If" for node in model.graph.node)
    module = lift_model(model)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for sign in (1.0, -1.0):
        assert_same(model, module, [sign * (np.abs(x) + 0.1)], atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    assert {s.initializer for s in module.finetune_params.values()} >= {"a.weight", "b.weight", "head.weight"}


@pytest.mark.parametrize("preset", [None, "XINT8", "MX6"])
def test_a_whole_network_inside_a_top_level_if_lifts_like_onnxruntime(preset: str | None) -> None:
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32), "rate": np.array(SAMPLE_RATE if i % 2 else 8000)}
             for i in range(4)]
    model = quantized(network_in_if(), preset, feeds)
    module = lift_model(model)
    for feed in feeds:
        assert_same(model, module, [feed["x"], feed["rate"]], **tolerance(preset))
    assert {s.initializer for s in module.finetune_params.values()} >= {"C1", "C2", "G", "H"}


@pytest.mark.parametrize("steps", [0, 2, 6])
def test_a_loop_with_a_condition_and_scan_outputs_lifts_like_onnxruntime(steps: int) -> None:
    """The trip count, the body's condition (it stops after 4 iterations) and the stacked scan
    output, empty after no iteration, as onnxruntime gives them."""
    model = loop_model(stop_after=4)
    module = lift_model(model)
    x = np.random.default_rng(steps).standard_normal((2, 8)).astype(np.float32)
    assert_same(model, module, [x, np.array(steps, np.int64)], atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    assert [s.initializer for s in module.finetune_params.values()] == ["W", "b"]


class LoopNet(nn.Module):
    """A Linear-Tanh applied a data-given number of times (TorchScript turns the for into a Loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        for _ in range(int(steps)):
            x = torch.tanh(self.a(x))
        return x


def test_a_scripted_loop_exported_by_torchscript_lifts_like_onnxruntime(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(randomized(LoopNet()))
        torch.onnx.export(scripted, (torch.randn(2, 8), torch.tensor(3)), str(tmp_path / "loop.onnx"), dynamo=False,
                          opset_version=17, input_names=["x", "steps"])
    model = onnx.load(str(tmp_path / "loop.onnx"))
    assert any(node.op_type == "Loop" for node in model.graph.node)
    module = lift_model(model)
    for steps in (0, 1, 3):
        x = np.random.default_rng(steps).standard_normal((2, 8)).astype(np.float32)
        assert_same(model, module, [x, np.array(steps, np.int64)], atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    assert {s.initializer for s in module.finetune_params.values()} == {"a.weight", "a.bias"}


def test_a_backward_scan_lifts_like_onnxruntime() -> None:
    model = scan_model()
    module = lift_model(model)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 8)).astype(np.float32), rng.standard_normal((5, 1, 3)).astype(np.float32)]
    assert_same(model, module, inputs, atol=FLOAT_ATOL, rtol=FLOAT_RTOL)


def test_export_writes_weights_back_into_the_graph_they_live_in() -> None:
    """Changed parameters land in the outer initializers the branches read and in the else
    branch's Constant, and onnxruntime then computes what the changed module computes."""
    model = if_reading_outer_names()
    module = lift_model(model)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.125)
    exported = export_model(module, model)
    written, before = tensors(exported), tensors(model)
    for weight in BRANCH_WEIGHTS:
        assert written[weight][0] == before[weight][0]  # the same graph: main, or the else branch
        np.testing.assert_array_equal(written[weight][1], before[weight][1] + np.float32(0.125))
    assert written["else_scale"][0] == "else"
    for feed in branch_inputs(2):
        np.testing.assert_allclose(run_ort(exported, [feed["x"]])[0], run_torch(module, [feed["x"]])[0],
                                   atol=FLOAT_ATOL, rtol=FLOAT_RTOL)


def unliftable_model() -> onnx.ModelProto:
    """The If model with a custom-domain op at the top level and another inside the then branch."""
    model = if_reading_outer_names()
    model.graph.node[1].CopyFrom(helper.make_node("Total", ["x"], ["total"], name="custom_total", domain="com.example"))
    branch = next(a.g for a in model.graph.node[-1].attribute if a.name == "then_branch")
    branch.node[1].CopyFrom(helper.make_node("Mystery", ["then_hidden"], ["then_relu"], name="custom_relu", domain="com.example"))
    model.opset_import.append(helper.make_opsetid("com.example", 3))
    return model


def test_check_liftable_names_every_op_that_cannot_be_lifted_in_one_error() -> None:
    check_liftable(if_reading_outer_names())  # nothing to say
    with pytest.raises(LiftError) as refused:
        check_liftable(unliftable_model())
    message = str(refused.value)
    for expected in ("com.example::Total (opset 3)", "'custom_total'", "com.example::Mystery (opset 3)", "'custom_relu'"):
        assert expected in message


def test_a_finetune_run_refuses_an_unliftable_model_before_calibrating(monkeypatch: pytest.MonkeyPatch) -> None:
    def calibrating(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("calibration began")

    monkeypatch.setattr("finetune.pipeline.quantize_model", calibrating)
    config = load_config({"preset": "XINT8", "fast_finetune": {"iterations": 2}})
    with pytest.raises(LiftError, match="Mystery"):
        quantize_and_finetune(unliftable_model(), config, branch_inputs(2))
    from finetune.recon import finetune_model

    with pytest.raises(LiftError, match="Total"):
        finetune_model(unliftable_model(), branch_inputs(2), FastFinetune(iterations=2))


def test_tuning_changes_the_weights_inside_the_branches_and_writes_them_back() -> None:
    """AdaQuant through the If: one unit (the If, reached from the input its condition is computed
    from) holding the four branch layers; the tuned weights land in their own initializers (main
    graph and else branch), nothing else changes, and onnxruntime runs the result as torch does."""
    model = if_reading_outer_names()
    tuning = {"algorithm": "adaquant", "iterations": 20, "lr": 1e-3, "batch_size": 1}  # batch 1: the condition is per row
    config = load_config({"preset": "XINT8", "fast_finetune": tuning})
    result = quantize_and_finetune(model, config, branch_inputs(8))
    (unit,) = result.report["units"]
    assert unit["status"] == "kept" and unit["loss_after"] < unit["loss_before"]
    plain = quantize_model(model, "XINT8", branch_inputs(8)).model
    tuned, before = tensors(result.model), tensors(plain)
    changed = {name for name in before if not np.array_equal(tuned[name][1], before[name][1])}
    assert changed == BRANCH_WEIGHTS
    assert tuned["else_scale"][0] == before["else_scale"][0] == "else"
    module = lift_model(result.model)
    for feed in branch_inputs(4):
        assert_same(result.model, module, [feed["x"]], **tolerance("XINT8"))
        assert np.isfinite(inference_session(result.model).run(None, feed)[0]).all()


@pytest.mark.parametrize("preset", [None, "XINT8"])
def test_silero_vad_lifts_like_onnxruntime_at_both_rates(preset: str | None) -> None:
    """Silero's VAD v5: its network inside a top-level If on the rate, nested Ifs, an LSTM."""
    pytest.importorskip("finetune.lift.ops.rnn", reason="needs the LSTM converter")
    path = silero_vad_onnx_path()
    windows = vad_windows(speech_like_audio(1.0, seed=3))
    state = np.zeros((2, 1, 128), np.float32)
    calibration = [{"input": row[None], "state": state, "sr": np.array(SAMPLE_RATE)} for row in windows[::4]]
    model = quantized(onnx.load(str(path)), preset, calibration)
    module = lift_model(model)
    rng = np.random.default_rng(0)
    for rate, rows in ((SAMPLE_RATE, windows[:6]), (8000, windows[:6, :288])):
        feeds = [rows, (rng.standard_normal((2, len(rows), 128)) * 0.3).astype(np.float32), np.array(rate)]
        for expected, got in zip(run_ort(model, feeds), run_torch(module, feeds)):
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert sum(1 for node in all_nodes(model.graph) if node.op_type == "If") > 1
