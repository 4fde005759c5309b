"""finetune infer: one .npy output per sample over a data folder, custom ops attached
automatically, output and provider choice, and clear errors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from finetune import cli
from finetune.onnx import attach_custom_ops
from finetune.tools.bf16 import convert
from finetune.tools.infer import run_inference

from .tools_models import mk, run

W = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)


def two_output_model() -> onnx.ModelProto:
    """x[n,16] -> MatMul -> y (first output) and Relu(y) -> r (second output)."""
    nodes = [mk("MatMul", ["x", "w"], ["y"], name="fc"), mk("Relu", ["y"], ["r"], name="relu")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]), helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 4])],
        [onnx.numpy_helper.from_array(W, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A folder with one single sample and one batch of three: four samples in name order."""
    samples = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    folder = tmp_path / "data"
    folder.mkdir()
    np.save(folder / "a.npy", samples[0])
    np.save(folder / "b.npy", samples[1:])
    return folder, samples


def saved(folder: Path) -> list[np.ndarray]:
    return [np.load(p) for p in sorted(folder.glob("*.npy"))]


def test_one_file_per_sample_of_the_first_output(tmp_path: Path, data: tuple[Path, np.ndarray]) -> None:
    folder, samples = data
    model_path = tmp_path / "m.onnx"
    onnx.save(two_output_model(), model_path)
    written = run_inference(model_path, folder, tmp_path / "out")
    assert [p.name for p in written] == ["000000.npy", "000001.npy", "000002.npy", "000003.npy"]
    outputs = saved(tmp_path / "out")
    assert all(o.shape == (4,) for o in outputs)
    np.testing.assert_allclose(np.stack(outputs), samples @ W, rtol=1e-5, atol=1e-6)


def test_cli_chooses_the_output_and_providers(tmp_path: Path, data: tuple[Path, np.ndarray]) -> None:
    folder, samples = data
    onnx.save(two_output_model(), tmp_path / "m.onnx")
    args = ["infer", str(tmp_path / "m.onnx"), "--data", str(folder), "--out", str(tmp_path / "out"),
            "--output", "r", "--providers", "CPUExecutionProvider", "--optimization", "all"]
    assert cli.main(args) == 0
    np.testing.assert_allclose(np.stack(saved(tmp_path / "out")), np.maximum(samples @ W, 0), rtol=1e-5, atol=1e-6)


def test_custom_ops_are_attached_automatically(tmp_path: Path, data: tuple[Path, np.ndarray]) -> None:
    """A customqdq model stored without its function bodies runs, with the outputs of the model
    with bodies; they are bfloat16 values."""
    folder, samples = data
    model = convert(two_output_model(), "customqdq", "float32")
    del model.functions[:]
    run_inference(model, folder, tmp_path / "out", output="y")
    outputs = np.stack(saved(tmp_path / "out"))
    np.testing.assert_array_equal(outputs, run(attach_custom_ops(model), samples, optimize=False))
    np.testing.assert_array_equal(outputs, outputs.astype("bfloat16").astype(np.float32))


def test_npz_feeds_for_several_inputs(tmp_path: Path) -> None:
    nodes = [mk("Sub", ["a", "b"], ["d"], name="sub")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in "ab"],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, ["n", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    (tmp_path / "data").mkdir()
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    np.savez(tmp_path / "data" / "0.npz", a=a, b=b)
    run_inference(model, tmp_path / "data", tmp_path / "out")
    np.testing.assert_array_equal(np.stack(saved(tmp_path / "out")), a - b)


def test_errors_name_the_problem(tmp_path: Path, data: tuple[Path, np.ndarray], caplog: pytest.LogCaptureFixture) -> None:
    folder, _ = data
    onnx.save(two_output_model(), tmp_path / "m.onnx")
    base = ["infer", str(tmp_path / "m.onnx"), "--data", str(folder), "--out", str(tmp_path / "out")]
    with caplog.at_level(logging.ERROR):
        assert cli.main([*base, "--output", "logits"]) == 2
    assert "no output 'logits'" in caplog.text and "['y', 'r']" in caplog.text
    onnx.save(convert(two_output_model(), "bf16", "float32"), tmp_path / "bf16.onnx")
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert cli.main(["infer", str(tmp_path / "bf16.onnx"), "--data", str(folder), "--out", str(tmp_path / "o")]) == 2
    assert "MatMul(bfloat16, bfloat16): 1 node(s): fc" in caplog.text and "Relu(bfloat16): 1 node(s): relu" in caplog.text
