"""Learned equalisation between layer pairs (fast_finetune.adaquant.learn_equalization, recon.methods.equalization):
which pairs qualify, that the scales leave the float function unchanged when folded, and a tuned
model that onnxruntime runs as torch does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from finetune.config import ConfigError, FastFinetune
from finetune.lift import lift_model
from finetune.lift.fake_quant import quantizers_disabled
from finetune.quantize import quantize_model
from finetune.recon import find_units, finetune_model
from finetune.recon.methods.equalization import LearnedPrescales, pairs_of
from finetune.zoo import digits_split

from .recon_helpers import export_digits_cnn, one_thread, run  # noqa: F401  (one_thread: autouse fixture)

OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul")
EQUALIZE = {"algorithm": "adaquant", "iterations": 30, "unit": "block", "adaquant": {"learn_equalization": True, "scale_lr": 0.05}}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN (Conv-ReLU-MaxPool-Conv, then Gemm-ReLU-Gemm) at MX4, calibration and inputs."""
    x_train, _, x_test, _ = digits_split()
    path = export_digits_cnn(tmp_path_factory.mktemp("digits") / "digits.onnx", x_test[:1])
    small = [{"x": x_train[i : i + 32].numpy()} for i in range(0, 128, 32)]
    return {"quantized": quantize_model(path, "MX4", small).model, "small": small, "x": x_test[:64].numpy()}


def test_pairs_are_layers_joined_by_relu_pooling_and_quantizers_only(digits: dict) -> None:
    """Conv -> ReLU -> MaxPool -> quantizer -> Conv and Gemm -> ReLU -> quantizer -> Gemm pair up;
    the Conv feeding Flatten does not (a reshape moves channels)."""
    module = lift_model(digits["quantized"])
    pairs = [pair for unit in find_units(module, OP_TYPES, unit="block") for pair in pairs_of(module, unit)]
    assert [(p.producer.op_type, p.consumer.op_type, p.out_axis, p.in_axis) for p in pairs] == [
        ("Conv", "Conv", 0, 1), ("Gemm", "Gemm", 0, 1)]
    assert all(p.bias_reader == (p.producer.name, 2) for p in pairs)  # each bias enters its own layer


def test_folded_scales_keep_the_float_function(digits: dict) -> None:
    """With scales far from 1, the unit computes in float what it computed before (quantizers off),
    both while the hooks apply them and after they are folded into the weights and biases."""
    module = lift_model(digits["quantized"])
    unit = next(u for u in find_units(module, OP_TYPES, unit="block") if pairs_of(module, u))
    x = torch.from_numpy(digits["x"])
    with torch.no_grad(), quantizers_disabled(module):
        before = module(x)
        prescales = LearnedPrescales(unit, module, EQUALIZE["adaquant"]["scale_lr"])
        for log in prescales.logs:
            log.copy_(torch.linspace(-1.0, 1.0, log.numel()))
        with prescales:
            hooked = module(x)
        folded = module(x)
    assert prescales.ratios and prescales.ratios[0]["scale_max"] == pytest.approx(np.e, rel=1e-6)
    for value in (hooked, folded):
        torch.testing.assert_close(value, before, rtol=1e-5, atol=1e-5)
    assert not torch.equal(folded, before)  # the weights did change


def test_a_tuned_model_with_learned_equalization_runs_in_onnxruntime(digits: dict) -> None:
    """AdaQuant over blocks with learned scales between the pairs: the report lists them, they
    moved, and onnxruntime gives the lifted tuned model's outputs (the bound of the learned-scale tests)."""
    tuned, report = finetune_model(digits["quantized"], digits["small"], FastFinetune(**EQUALIZE))
    records = [r for unit in report["units"] for r in (unit["equalization"] or [])]
    assert len(records) == 2 and any(r["scale_min"] < 1 < r["scale_max"] for r in records)
    with torch.no_grad():
        simulated = lift_model(tuned)(torch.from_numpy(digits["x"])).numpy()
    difference = np.abs(simulated - run(tuned, digits["x"]))
    assert np.mean(difference > 1e-5) <= 0.05 and difference.max() <= 0.05 * np.abs(simulated).max()


def test_learned_equalization_needs_adaquant_and_a_pair(digits: dict) -> None:
    """AdaQuant only; and a run where no unit holds a pair (layer units hold one layer each) is
    refused before any work rather than left unchanged in silence."""
    with pytest.raises(ConfigError, match="learn_equalization: applies to algorithm adaquant only"):
        FastFinetune(adaquant={"learn_equalization": True})
    with pytest.raises(ValueError, match="learn_equalization: no unit holds two layers"):
        finetune_model(digits["quantized"], digits["small"], FastFinetune(**{**EQUALIZE, "unit": "layer"}))
