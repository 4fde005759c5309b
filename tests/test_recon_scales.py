"""Learned INT weight and activation scales (fast_finetune.adaquant.learn_scales, recon.methods.scales): LSQ's
gradient, power-of-two scales, export of the learned scales with their re-quantized int32 biases,
compact codes re-encoded, refusals, and reproducibility."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from finetune.config import FastFinetune
from finetune.config.schema import ConfigError
from finetune.formats import IntSpec, int_quantize_dequantize
from finetune.lift import FakeQuantize, lift_model
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.methods.scales import LearnedScale, _learned_fn, lsq_quantize_dequantize
from finetune.zoo import digits_split

from .lift_helpers import assert_same
from .recon_helpers import export_digits_cnn, one_thread, run  # noqa: F401  (one_thread: autouse fixture)
from .test_recon_callbacks import stopped_run
from .test_recon_parallel import _assert_same_tuning

INT8 = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}
W4A8_CHANNEL = {"activation": INT8, "weight": {**INT8, "dtype": "int4", "granularity": "channel"}}
W4A4_CHANNEL = {**W4A8_CHANNEL, "activation": {**INT8, "dtype": "int4"}}
UINT8_ASYMMETRIC = {**INT8, "dtype": "uint8", "symmetric": False}
SCALES = {"learn_scales": "weights", "scale_lr": 0.05}
LEARN = {"algorithm": "adaquant", "iterations": 30, "adaquant": SCALES}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN as ONNX, 128 calibration samples in 4 batches, and held-out inputs."""
    x_train, _, x_test, _ = digits_split()
    path = export_digits_cnn(tmp_path_factory.mktemp("digits") / "digits.onnx", x_test[:1])
    return {"path": path, "small": [{"x": x_train[i : i + 32].numpy()} for i in range(0, 128, 32)], "x": x_test[:64].numpy()}


def lsq_scale_gradient(x: np.ndarray, s: np.ndarray, upstream: np.ndarray, qmin: float, qmax: float) -> np.ndarray:
    """dL/ds per output channel (axis 0) as Esser et al. 2019 write it, for zero point 0."""
    v = (x / s[:, None]).astype(np.float32)
    inner = np.round(v) - v
    local = np.where(v <= qmin, qmin, np.where(v >= qmax, qmax, inner)).astype(np.float64)
    return (local * upstream).sum(axis=1)


def test_the_scale_gradient_is_lsqs() -> None:
    """Per channel int4: the values are QuantizeLinear's bit for bit, and the gradient reaching the
    log-scale is LSQ's dL/ds times s (the log's chain rule) times 1 / sqrt(elements per scale * qmax)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 20, generator=generator) * torch.tensor([[1.0], [0.3], [3.0]])
    spec = IntSpec("int4", axis=0)
    s = x.abs().amax(1) / 6  # some weights clip, at either end
    quantizer = FakeQuantize(spec, s)
    learned = LearnedScale(quantizer, x.numel())
    upstream = torch.randn(3, 20, generator=generator)
    y = lsq_quantize_dequantize(x, learned.value(), learned.zero_point(), spec)
    assert torch.equal(y, int_quantize_dequantize(x, s, torch.zeros(3), spec))
    (y * upstream).sum().backward()
    expected = lsq_scale_gradient(x.numpy(), s.numpy(), upstream.numpy(), spec.qmin, spec.qmax) * s.numpy() / np.sqrt(20 * 7)
    np.testing.assert_allclose(learned.t.grad.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_an_asymmetric_zero_point_gets_lsq_plus_gradient_and_stays_an_integer() -> None:
    """uint8 with zero point 100: dL/dzp is -s on the clamped elements, 0 inside; the zero point
    is an integer in the code range for any offset."""
    x = torch.tensor([[-5.0, -0.1, 0.2, 9.0]])
    spec = IntSpec("uint8", symmetric=False)
    learned = LearnedScale(FakeQuantize(spec, torch.tensor(0.02), torch.tensor(100.0)), x.numel())
    y = lsq_quantize_dequantize(x, learned.value(), learned.zero_point(), spec)
    y.sum().backward()
    assert learned.zp.grad.item() == pytest.approx(-2 * 0.02 / np.sqrt(4 * 255))
    learned.zp.data.fill_(200.7)
    assert learned.zero_point().item() == 255.0


def test_an_activation_scale_gradient_is_lsqs_scaled_by_the_row_size() -> None:
    """An activation's learned scale takes LSQ's gradient scaled by 1 / sqrt(elements of one row *
    qmax), the row size read from its first call; its values are QuantizeLinear's."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 5, generator=generator) * 3
    spec = IntSpec("int8")
    learned = LearnedScale(FakeQuantize(spec, torch.tensor(0.02)), None)
    y = _learned_fn(learned, activation=True)(x)
    assert torch.equal(y, int_quantize_dequantize(x, torch.tensor(0.02), torch.tensor(0.0), spec))
    upstream = torch.randn(4, 3, 5, generator=generator)
    (y * upstream).sum().backward()
    v = (x / 0.02).numpy()
    local = np.where(v <= spec.qmin, spec.qmin, np.where(v >= spec.qmax, spec.qmax, np.round(v) - v)).astype(np.float64)
    expected = (local * upstream.numpy()).sum() * 0.02 / np.sqrt(15 * spec.qmax)
    assert learned.t.grad.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("activation", [W4A4_CHANNEL["activation"], UINT8_ASYMMETRIC], ids=["int4", "uint8 asymmetric"])
def test_learned_activation_scales_go_into_the_graph_with_their_biases(digits: dict, activation: dict) -> None:
    """Blocks learning every scale (learn_scales: all): the activation quantizers inside each block
    learn theirs; the tuned graph holds them, each Conv's int32 bias scale is its input scale times
    its weight scale with codes re-encoded, and onnxruntime gives the lifted tuned model's outputs."""
    quantized = quantize_model(digits["path"], {**W4A8_CHANNEL, "activation": activation}, digits["small"]).model
    tuned, report = finetune_model(quantized, digits["small"], FastFinetune(**{**LEARN, "adaquant": {**SCALES, "learn_scales": "all"}}, unit="block"))
    rows = [row for row in report["learned_scales"] if row["of"] == "activation"]
    assert rows and any(row["ratio_min"] != 1.0 for row in rows)
    assert any(row["bias_requantized"] for row in rows)
    module = lift_model(tuned)
    moved = 0
    for conv in (n.name for n in tuned.graph.node if n.op_type == "Conv"):
        names = _conv_qdq(tuned, conv)
        moved += not np.array_equal(_initializer(quantized, names["input"]), _initializer(tuned, names["input"]))
        bias_scale = _initializer(tuned, names["bias"])
        assert np.array_equal(bias_scale, (_initializer(tuned, names["input"]) * _initializer(tuned, names["weight"])).astype(np.float32))
        codes = _initializer(tuned, names["bias_codes"])
        bias = next(module.get_parameter(n) for n, s in module.finetune_params.items() if s.initializer == names["bias_codes"])
        assert np.array_equal(codes, np.round(bias.detach().numpy() / bias_scale))
    assert moved
    with torch.no_grad():
        simulated = module(torch.from_numpy(digits["x"])).numpy()
    difference = np.abs(simulated - run(tuned, digits["x"]))  # the bound of the weight-scale test below
    assert np.mean(difference > 1e-5) <= 0.05 and difference.max() <= 0.05 * np.abs(simulated).max()


def test_a_layer_unit_learns_the_activation_scale_it_outputs_with_include_output_quant(digits: dict) -> None:
    """A layer unit's input quantizer lies outside it: learning activation scales layer by layer
    needs include_output_quant (each layer learns the quantizer of its output), else it is an error."""
    quantized = quantize_model(digits["path"], W4A4_CHANNEL, digits["small"]).model
    config = {**LEARN, "adaquant": {**SCALES, "learn_scales": "activations"}}
    with pytest.raises(ValueError, match="learn_scales: activations: no unit has an INT activation quantizer"):
        finetune_model(quantized, digits["small"], FastFinetune(**config))
    _, report = finetune_model(quantized, digits["small"], FastFinetune(**config, include_output_quant=True))
    assert {row["of"] for row in report["learned_scales"]} == {"activation"}
    assert any(row["ratio_min"] != 1.0 for row in report["learned_scales"])


def _shrink_weight_scales(model: onnx.ModelProto, factor: float) -> None:
    """Multiply the scale of every Conv/Gemm weight quantizer by `factor`, in place."""
    producers = {o: n for n in model.graph.node for o in n.output}
    names = {producers[n.input[1]].input[1] for n in model.graph.node if n.op_type in ("Conv", "Gemm")}
    for tensor in model.graph.initializer:
        if tensor.name in names:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), tensor.name))


def test_power_of_two_scales_stay_powers_of_two_and_run_exactly_in_onnxruntime(digits: dict) -> None:
    """XINT8 whose weight scales were cut to 1/8 (most weights clip): the learned scales grow, each
    an exact power of two, and onnxruntime gives the lifted tuned model's outputs bit for bit (the
    biases, no longer on s_input * s_weight, keep their own grid)."""
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    _shrink_weight_scales(quantized, 1 / 8)
    tuned, report = finetune_model(quantized, digits["small"], FastFinetune(**LEARN))
    assert any(r["ratio_max"] > 1 for r in report["learned_scales"])
    assert not any(r["bias_requantized"] for r in report["learned_scales"])
    module = lift_model(tuned)
    for quantizer in (m for m in module.modules() if isinstance(m, FakeQuantize) and m.spec.dtype == "int8"):
        mantissa, _ = torch.frexp(quantizer.scale)
        assert torch.all(mantissa == 0.5) and quantizer.spec.power_of_two
    assert_same(tuned, module, [digits["x"]])  # every sum exact: integer multiples of one power of two


def _initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _conv_qdq(model: onnx.ModelProto, conv: str) -> dict[str, str]:
    """The scale initializers behind a Conv's input, weight and bias dequantizers, and its bias codes."""
    producers = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == conv)
    inputs = [producers[v] for v in node.input]
    return {"input": inputs[0].input[1], "weight": inputs[1].input[1], "bias": inputs[2].input[1],
            "bias_codes": inputs[2].input[0]}


@pytest.mark.parametrize(("storage", "bias_correction"), [("float", False), ("compact", False), ("float", True)])
def test_export_writes_the_learned_scale_and_requantized_int32_bias(digits: dict, storage: str, bias_correction: bool) -> None:
    """Per-channel int4 weights (stored float behind Q/DQ, or as int4 codes): the tuned graph holds
    the learned weight scales, the bias scale s_input * s_weight with int32 codes re-encoded to
    it, and onnxruntime gives the lifted tuned model's outputs (up to the float sums' order). With
    bias correction too, whose corrections land on the int32 grid the learned scale leaves."""
    quantized = quantize_model(digits["path"], {**W4A8_CHANNEL, "weight_storage": storage}, digits["small"]).model
    float_model = digits["path"] if storage == "compact" else None  # codes alone are their own float reference
    config = FastFinetune(**LEARN, bias_correction=bias_correction)
    tuned, report = finetune_model(quantized, digits["small"], config, float_model=float_model)
    finals = [u["bias_correction"]["final"]["status"] for u in report["units"] if u.get("bias_correction")]
    assert ("kept" in finals) == bias_correction  # the correction after tuning, on the learned scale's grid
    module = lift_model(tuned)
    changed = 0
    for conv in (n.name for n in tuned.graph.node if n.op_type == "Conv"):
        names = _conv_qdq(tuned, conv)
        old, new = _initializer(quantized, names["weight"]), _initializer(tuned, names["weight"])
        changed += not np.array_equal(old, new)
        bias_scale = _initializer(tuned, names["bias"])
        assert np.array_equal(bias_scale, (_initializer(tuned, names["input"]) * new).astype(np.float32))
        codes = _initializer(tuned, names["bias_codes"])
        bias = next(module.get_parameter(n) for n, s in module.finetune_params.items() if s.initializer == names["bias_codes"])
        assert codes.dtype == np.int32 and np.array_equal(codes, np.round(bias.detach().numpy() / bias_scale))
    assert changed and all(r["scales"] > 1 for r in report["learned_scales"])  # one per output channel
    if storage == "compact":
        weight = next(t for t in tuned.graph.initializer if t.name.startswith("features.0.weight"))
        assert weight.data_type == onnx.TensorProto.INT4
    with torch.no_grad():
        simulated = module(torch.from_numpy(digits["x"])).numpy()
    # torch and onnxruntime sum Conv products in different orders: a last-bit difference can move an
    # activation across a rounding boundary by one step, carried to the logits (seen: 1 of 64 digits,
    # 0.05 of a logit range near 40). So most elements agree exactly and the rest within a bound.
    difference = np.abs(simulated - run(tuned, digits["x"]))
    assert np.mean(difference > 1e-5) <= 0.05 and difference.max() <= 0.05 * np.abs(simulated).max()


def test_learning_scales_needs_adaquant_and_an_int_weight(digits: dict) -> None:
    with pytest.raises(ConfigError, match="learn_scales: applies to algorithm adaquant only"):
        FastFinetune(adaquant={"learn_scales": "weights"})
    quantized = quantize_model(digits["path"], "MX4", None).model
    with pytest.raises(ValueError, match="learn_scales: weights: no unit has an INT weight quantizer"):
        finetune_model(quantized, digits["small"], FastFinetune(**LEARN))


def test_same_seed_same_bytes(digits: dict) -> None:
    quantized = quantize_model(digits["path"], W4A8_CHANNEL, digits["small"]).model
    first, _ = finetune_model(quantized, digits["small"], FastFinetune(**LEARN))
    second, _ = finetune_model(quantized, digits["small"], FastFinetune(**LEARN))
    assert first.SerializeToString() == second.SerializeToString()


@pytest.mark.slow
def test_two_gloo_processes_learn_the_scales_of_one(digits: dict) -> None:
    """The scale gradients are added from the same pieces as the weights' (recon.data.shards): two
    CPU processes learn the scales one process with gradient_pieces 2 learns and tune to its
    bytes (see test_recon_parallel._assert_same_tuning)."""
    calibration = [{"x": batch["x"][:30]} for batch in digits["small"]] * 2
    quantized = quantize_model(digits["path"], W4A8_CHANNEL, calibration).model
    one, one_report = finetune_model(quantized, calibration, FastFinetune(**LEARN, gradient_pieces=2))
    two, two_report = finetune_model(quantized, calibration, FastFinetune(**LEARN, devices=2, strategy="ddp_spawn"))
    assert one_report["learned_scales"][0]["ratio_min"] != 1.0
    assert two_report["learned_scales"] == one_report["learned_scales"]
    _assert_same_tuning(one, one_report, two, two_report)


def test_a_resumed_run_restores_the_learned_scales(digits: dict, tmp_path: Path) -> None:
    """Stopped after the second unit and resumed: the checkpoint holds the learned scales (and the
    biases re-quantized to them), so the result is the uninterrupted run's, byte for byte."""
    quantized = quantize_model(digits["path"], W4A8_CHANNEL, digits["small"]).model
    config = FastFinetune(**LEARN)
    whole, whole_report = finetune_model(quantized, digits["small"], config)
    stopped_run(quantized, digits["small"], config, tmp_path)
    resumed, report = finetune_model(quantized, digits["small"], config, output_dir=tmp_path, name="run", resume=True)
    assert report["resumed_units"] == 2 and report["learned_scales"] == whole_report["learned_scales"]
    assert any(row["ratio_min"] != 1.0 for row in report["learned_scales"][:2])
    assert resumed.SerializeToString() == whole.SerializeToString()
