"""Shared by the fast-finetune tests: the digits CNN as ONNX, a small residual CNN quantized to XINT8,
onnxruntime runs with exact numerics, a one-thread fixture, and the check that the quantized stream
reaches every unit's input exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from finetune.lift import LiftedModule
from finetune.recon import ActivationCache, Unit, cut
from finetune.recon.data.streams import QuantizedStream, cache_inputs, record_unit_input
from finetune.quantize import quantize_model
from finetune.zoo import export_onnx, train_digits_cnn

from .lift_helpers import CNN_INPUT, ResidualCNN, randomized


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the units are tiny, and on a shared 2-core machine thread wake-ups cost
    more than the arithmetic (measured 10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A residual CNN with random weights quantized to XINT8, and its three calibration batches."""
    path = export_onnx(randomized(ResidualCNN()), torch.randn(*CNN_INPUT), tmp_path_factory.mktemp("cnn") / "cnn.onnx")
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, *CNN_INPUT[1:]), np.float32)} for i in range(3)]
    return quantize_model(path, "XINT8", feeds).model, feeds


def export_digits_cnn(path: Path, example: torch.Tensor) -> Path:
    """The trained digits CNN exported to ONNX (opset 17, dynamic batch, input x)."""
    torch.onnx.export(train_digits_cnn(), (example,), str(path), opset_version=17, input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "n"}}, dynamo=False)
    return path


def run(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    """onnxruntime CPU with graph optimisations off (the simulated numerics stay exact)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def assert_stream_equals_full_model(module: LiftedModule, units: list[Unit], feeds: list[dict[str, np.ndarray]]) -> None:
    """Pushing the batches through the cut segments gives, at every unit's input, exactly what the
    whole quantized model computes there (seen by hooks on each unit's source); nothing stays
    cached at the end."""
    seen: dict[str, list[torch.Tensor]] = {u.name: [] for u in units}
    hooks = [record_unit_input(module.get_submodule(u.source), u.source_argument, seen[u.name].append) for u in units]
    with torch.no_grad():
        for feed in feeds:
            module(torch.from_numpy(feed["x"]))
    for hook in hooks:
        hook.remove()
    with ActivationCache(2**30) as cache:
        placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
        stream = QuantizedStream(cut(module, units), placeholders, cache_inputs(feeds, ["x"], cache), cache, torch.device("cpu"))
        for k, unit in enumerate(units):
            value = stream.before(k, unit)
            assert len(seen[unit.name]) == len(feeds)
            for chunk, expected in enumerate(seen[unit.name]):
                assert torch.equal(value.tensor(chunk, torch.device("cpu")), expected)
            stream.after(k)
        assert not stream.env and cache.in_memory == 0
