"""Shared by the fast-finetune tests: the digits CNN as ONNX, onnxruntime runs with exact
numerics, and a one-thread fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from finetune.zoo import train_digits_cnn


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the units are tiny, and on a shared 2-core machine thread wake-ups cost
    more than the arithmetic (measured 10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
