"""Fast finetune on the digits CNN and small MatMul models: units, the graph cut and linear-cost
activation caching, AdaRound codes, accuracy recovery, reverts, reproducibility, disk spill and
devices."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from finetune.config import FastFinetune
from finetune.formats import IntSpec, broadcast_param
from finetune.lift import FakeQuantize, lift_model
from finetune.quantize import quantize_model
from finetune.recon import run as recon_run
from finetune.recon import (
    find_units,
    finetune_model,
    resolve_device,
)
from finetune.recon.data.batches import Batches
from finetune.recon.methods.adaround import BETA_END, BETA_START, Annealing, SoftRounding
from finetune.recon.methods.adaquant import CosineTail
from finetune.recon.device import _backend, float32_settings, legacy_float32_settings
from finetune.recon.optimizers import HostAdam
from finetune.zoo import digits_split

from .lift_helpers import assert_same
from .recon_helpers import (  # noqa: F401  (one_thread: autouse fixture)
    assert_stream_equals_full_model,
    export_digits_cnn,
    one_thread,
    run,
)

OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul")
INT8_TENSOR = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}
W4A8 = {"activation": INT8_TENSOR, "weight": {**INT8_TENSOR, "dtype": "int4"}}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN as ONNX, 512 calibration samples in 16 batches, and the held-out split."""
    x_train, _, x_test, y_test = digits_split()
    path = export_digits_cnn(tmp_path_factory.mktemp("digits") / "digits.onnx", x_test[:1])
    calibration = [{"x": x_train[i : i + 32].numpy()} for i in range(0, 512, 32)]
    return {"path": path, "calibration": calibration, "small": calibration[:4], "x": x_test.numpy(), "y": y_test.numpy()}


def accuracy(model: onnx.ModelProto | Path, digits: dict) -> float:
    return float((run(model, digits["x"]).argmax(1) == digits["y"]).mean())


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


class TwoLinear(nn.Module):
    """Transformer-style MatMuls on (batch, tokens, features): two Linear layers (the first with a
    bias, exported as MatMul + Add) with a ReLU, and a MatMul of two activations (not a unit: it
    has no constant weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(torch.relu(self.first(x)))
        return h @ h.transpose(1, 2)


@pytest.fixture(scope="module")
def matmul_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("matmul") / "matmul.onnx"
    torch.manual_seed(0)
    torch.onnx.export(TwoLinear(), (torch.randn(2, 5, 16),), str(path), opset_version=17, input_names=["x"],
                      dynamic_axes={"x": {0: "n"}}, dynamo=False)
    return path


# --- units and the cut ----------------------------------------------------------------------------


def test_units_of_the_digits_cnn(digits: dict) -> None:
    module = lift_model(quantize_model(digits["path"], "XINT8", digits["small"]).model)
    units = find_units(module, OP_TYPES)
    assert [u.op_type for u in units] == ["Conv", "Conv", "Conv", "Gemm", "Gemm"]
    assert all(len(u.layers) == 1 and u.layers[0].weight_quantizer and u.layers[0].bias for u in units)
    assert all(isinstance(module.get_submodule(u.layers[0].weight_quantizer), FakeQuantize) for u in units)
    inputs = dict(module.named_modules())
    assert all(isinstance(inputs[next(n for n in module.graph.nodes if n.name == u.input).target], FakeQuantize) for u in units)
    kinds = [[type(module.get_submodule(next(n for n in module.graph.nodes if n.name == name).target)).__name__
              for name in u.nodes] for u in units]
    assert kinds == [["Conv", "ReLU"]] * 3 + [["OnnxGemm", "ReLU"], ["OnnxGemm"]]  # the activation is in the unit
    assert all(u.target_module.endswith("Relu") for u in units[:4])
    with_tail = find_units(module, OP_TYPES, include_output_quant=True)
    kinds = [[type(module.get_submodule(next(n for n in module.graph.nodes if n.name == name).target)).__name__
              for name in u.nodes] for u in with_tail]
    assert kinds[0] == ["Conv", "ReLU", "FakeQuantize"]  # Conv -> Relu -> the next layer's input quantizer
    assert kinds[1] == ["Conv", "ReLU"]  # a MaxPool follows the Relu, so no quantizer joins
    assert kinds[4] == ["OnnxGemm"]
    assert with_tail[0].target_module.endswith("Relu")
    assert [u.op_type for u in find_units(module, ("Gemm",))] == ["Gemm", "Gemm"]


def test_units_of_a_matmul_model(matmul_model: Path) -> None:
    module = lift_model(quantize_model(matmul_model, "MXFP4", None).model)
    units = find_units(module, OP_TYPES)
    assert [u.op_type for u in units] == ["MatMul", "MatMul"]
    assert [u.layers[0].input_index for u in units] == [0, 0]
    assert units[0].layers[0].bias == "initializers.first/bias" and units[1].layers[0].bias is None  # the bias Add joins the MatMul's unit
    kinds = [[type(module.get_submodule(next(n for n in module.graph.nodes if n.name == name).target)).__name__
              for name in u.nodes] for u in units]
    assert kinds == [["OnnxMatMul", "OnnxBinaryMathOperation", "ReLU"], ["OnnxMatMul"]]


def test_the_quantized_stream_equals_the_full_model(matmul_model: Path, digits: dict) -> None:
    """Pushing the calibration batches through the cut segments gives, at every unit input, exactly
    what the whole quantized model computes there; nothing stays cached at the end."""
    for path, preset, feeds in [(matmul_model, "MX4", [{"x": np.random.default_rng(i).standard_normal((3, 5, 16), np.float32)}
                                                       for i in range(3)]), (digits["path"], "XINT8", digits["small"])]:
        module = lift_model(quantize_model(path, preset, feeds).model)
        assert_stream_equals_full_model(module, find_units(module, OP_TYPES, include_output_quant=True), feeds)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_activation_caching_is_linear_in_depth(digits: dict, monkeypatch: pytest.MonkeyPatch, bias_correction: bool) -> None:
    """Every op between units runs once per batch in the float pass and once in the quantized
    stream; each layer (and the activation in its unit) additionally twice for its loss
    before/after plus once per piece of each iteration (here 2 gradient_pieces, each present where
    the step's rows fall in it: recon.data.shards), and with bias correction five times more: its float
    means, and per correction (start, after tuning) its quantized means and the loss after it, the
    loss before the second replacing the loss after tuning; and every op once more on the sample the
    lifted module is checked against onnxruntime on before any work (lift.check_lifted), and once more
    on the sample the audit of CUDA-deterministic kernels pushes through the segments (recon.audit),
    a unit's ops then also in its step, and once more on it while each unit's work is counted
    (recon.threads). Nothing runs more often for deeper units."""
    calls: Counter = Counter()

    def counted_lift(model: object, **options: object) -> nn.Module:
        module = lift_model(model, **options)
        for name, sub in module.named_modules():
            if name and name != "initializers":
                sub.register_forward_hook(lambda *_, name=name: calls.update([name]))
        return module

    pieces: dict[Batches, int] = {}  # per unit's batches (held, so no two share an id), the pieces its steps ran
    draw = Batches.next

    def counted_draw(batches: Batches) -> object:
        batch = draw(batches)
        pieces[batches] = pieces.get(batches, 0) + len(batches.pieces)
        return batch

    monkeypatch.setattr(recon_run, "lift_model", counted_lift)
    monkeypatch.setattr(Batches, "next", counted_draw)
    iterations, chunks = 7, len(digits["small"])
    finetune_model(quantize_model(digits["path"], "XINT8", digits["small"]).model, digits["small"],
                   FastFinetune(iterations=iterations, bias_correction=bias_correction, gradient_pieces=2))
    layers = {name for name in calls if name.endswith(("Conv", "Gemm"))}
    activations = {name for name in calls if name.endswith("Relu")}  # each follows a layer: part of its unit
    assert len(layers) == 5 and len(activations) == 4 and len(pieces) == 5 and min(pieces.values()) > iterations
    base = (9 if bias_correction else 4) * chunks + 1 + 2 + 1
    assert sorted(calls[name] - base for name in layers) == sorted(pieces.values())
    for name, count in calls.items():
        if name in layers | activations or "weight" in name or "bias" in name:
            assert count - base in pieces.values(), name
        else:
            assert count == 2 * chunks + 1 + 1 + 1, name


def test_cached_activations_do_not_grow_with_depth(tmp_path: Path) -> None:
    """The float reference advances with the units, so the cache holds five activations at most (a
    unit's float input, target and quantized input, the next unit's float input, and the float
    value later ops read), not every unit's: an MLP three times deeper peaks at the same bytes
    (capturing every unit up front peaked at 26 and 74 activations here)."""
    feeds = [{"x": np.random.default_rng(i).standard_normal((32, 64), np.float32)} for i in range(4)]
    peaks = []
    for depth in (12, 36):
        torch.manual_seed(0)
        mlp = nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(64, 64), nn.ReLU())])
        path = tmp_path / f"mlp{depth}.onnx"
        torch.onnx.export(mlp, (torch.zeros(1, 64),), str(path), opset_version=17, input_names=["x"],
                          dynamic_axes={"x": {0: "n"}}, dynamo=False)
        _, report = finetune_model(quantize_model(path, "XINT8", feeds).model, feeds, FastFinetune(iterations=1))
        assert len(report["units"]) == depth
        peaks.append(report["cache"]["peak_bytes_in_memory"])
    value_bytes = 4 * 32 * 64 * 4  # one activation over the calibration set
    assert peaks == [5 * value_bytes] * 2


# --- algorithms -----------------------------------------------------------------------------------


def test_soft_rounding_starts_at_the_fraction_and_hardens_to_codes() -> None:
    weight = torch.tensor([0.26, -0.74, 0.5, 1.01])
    quantizer = FakeQuantize(IntSpec("int8"), torch.tensor(0.5))
    rounding = SoftRounding(quantizer, weight)
    assert torch.allclose(rounding.h(), torch.tensor([0.52, 0.52, 0.0, 0.02]), atol=1e-6)
    with rounding:
        assert torch.allclose(quantizer(weight), weight, atol=1e-6)  # soft rounding reproduces the weight
    assert torch.equal(rounding.hardened(weight), torch.tensor([0.5, -0.5, 0.5, 1.0]))


def test_adaround_codes_are_floor_or_ceil(digits: dict) -> None:
    """Every tuned weight is float32(code * scale) with code = floor or ceil of w / s; AdaRound
    changes some codes away from round-to-nearest and lowers every unit's loss."""
    quantized = quantize_model(digits["path"], W4A8, digits["small"]).model
    tuned, report = finetune_model(quantized, digits["small"], FastFinetune(iterations=60))
    module, before, after = lift_model(quantized), initializers(quantized), initializers(tuned)
    changed = 0
    for unit in find_units(module, OP_TYPES):
        source = module.finetune_params[unit.layers[0].weight]
        quantizer = module.get_submodule(unit.layers[0].weight_quantizer)
        w0, w1 = (torch.tensor(m[source.initializer]) for m in (before, after))
        scale = broadcast_param(quantizer.scale, w0, quantizer.spec.axis, quantizer.spec.block_size)
        codes = torch.round(w1 / scale)  # what QuantizeLinear stores
        assert torch.equal(codes * scale, w1) and torch.allclose(w1 / scale, codes, rtol=1e-6, atol=0)
        assert bool(((codes == torch.floor(w0 / scale)) | (codes == torch.ceil(w0 / scale))).all())
        changed += int((codes != torch.round(w0 / scale)).sum())
    assert changed > 0
    assert all(u["status"] == "kept" and u["loss_after"] < u["loss_before"] for u in report["units"])


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["adaround", "adaquant"])
def test_finetune_recovers_held_out_accuracy(digits: dict, algorithm: str) -> None:
    """INT4 weights with INT8 activations move the digits CNN's logits away from the float model's;
    both algorithms with their default learning rates bring them at least twice as close (measured:
    3x for both, training on the 13 of 16 calibration batches not held out; 3x and 4x on all 16) and
    keep held-out accuracy within two digits of float (here AdaQuant 3 above and AdaRound 1 below float on
    all 16; 2 below and equal with 3 held out). Accuracy itself is no check that holds on any CPU: the
    trained CNN depends on the CPU's float kernels, and its quantized form scored 6 digits below float
    on one, 1 below on another, 2 above on a third."""
    quantized = quantize_model(digits["path"], W4A8, digits["calibration"]).model
    tuned, report = finetune_model(quantized, digits["calibration"], FastFinetune(algorithm=algorithm, iterations=400))
    float_logits = run(digits["path"], digits["x"])
    float_accuracy, after = accuracy(digits["path"], digits), accuracy(tuned, digits)
    assert after >= float_accuracy - 2 / len(digits["y"]) - 1e-9
    error = {name: float(((run(m, digits["x"]) - float_logits) ** 2).mean()) for name, m in [("q", quantized), ("t", tuned)]}
    assert error["t"] <= 0.5 * error["q"]
    assert report["kept"] >= 4 and all(u["loss_after"] <= u["loss_before"] for u in report["units"])


def test_adaquant_on_a_block_format_runs_in_onnxruntime_like_torch(digits: dict) -> None:
    """MX4 with AdaQuant: the tuned model runs in stock onnxruntime, equal to its torch lifting up to
    float32 summation order (as the quantizer's own tests bound it)."""
    quantized = quantize_model(digits["path"], "MX4", None).model
    tuned, report = finetune_model(quantized, digits["small"], FastFinetune(algorithm="adaquant", iterations=30, lr=1e-3))
    assert report["kept"] >= 1
    expected = run(tuned, digits["x"])
    with torch.no_grad():
        simulated = lift_model(tuned)(torch.from_numpy(digits["x"])).numpy()
    assert np.abs(simulated - expected).max() <= 0.1
    assert {f.name for f in tuned.functions} == {f.name for f in quantized.functions}


def test_onnxruntime_equals_torch_exactly_with_power_of_two_scales(digits: dict) -> None:
    """With power-of-two scales every Conv/Gemm sum of the tuned model adds integer multiples of one power
    of two short of 2**24 of them (assert_same checks it on the data), so it is exact in any order: the
    lifted module gives onnxruntime's bits on any CPU."""
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    tuned, _ = finetune_model(quantized, digits["small"], FastFinetune(iterations=30))
    assert_same(tuned, lift_model(tuned), [digits["x"]])


def test_adaround_refuses_non_integer_weights(digits: dict) -> None:
    with pytest.raises(ValueError, match="AdaRound needs INT weights.*adaquant"):
        finetune_model(quantize_model(digits["path"], "MX4", None).model, digits["small"], FastFinetune())


def test_a_unit_that_gets_worse_keeps_its_weights(digits: dict) -> None:
    """A learning rate of 1 wrecks every unit; each is reverted, so the weights are the input's."""
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    tuned, report = finetune_model(quantized, digits["small"], FastFinetune(algorithm="adaquant", iterations=20, lr=1.0))
    assert [u["status"] for u in report["units"]] == ["reverted"] * 5
    assert all(u["rejected_loss"] > u["loss_before"] == u["loss_after"] for u in report["units"])
    assert initializers(tuned).keys() == initializers(quantized).keys()
    assert all(np.array_equal(initializers(tuned)[k], v) for k, v in initializers(quantized).items())


def test_early_stopping_ends_units_before_the_iteration_budget(digits: dict) -> None:
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    config = FastFinetune(algorithm="adaquant", iterations=400, early_stop={"enabled": True, "patience": 5, "warmup": 10})
    _, report = finetune_model(quantized, digits["small"], config)
    assert all(15 <= u["iterations"] < 400 for u in report["units"])


def test_an_early_stop_in_warm_up_starts_the_annealing_and_one_later_changes_nothing() -> None:
    """Stopped in warm-up, annealing starts at BETA_START at once and takes the steps a budget whose
    warm-up ended there would (four times the warm-up), or the tail if longer, never past the
    budget; stopped while annealing (where the loss rises by design), the schedule runs on as it was."""
    warming = Annealing(1000)
    assert warming.finish_from(50, 40) == 250
    assert warming.exponent(49) is None and warming.exponent(50) == BETA_START
    assert warming.exponent(150) == pytest.approx((BETA_START + BETA_END) / 2)
    assert warming.exponent(250) == pytest.approx(BETA_END)
    assert Annealing(1000).finish_from(10, 100) == 110 and Annealing(1000).finish_from(190, 40) == 950
    assert Annealing(100).finish_from(19, 5) == 95
    annealing, untouched = Annealing(1000), Annealing(1000)
    assert annealing.finish_from(600, 40) == 1000
    assert [annealing.exponent(s) for s in range(1000)] == [untouched.exponent(s) for s in range(1000)]


def test_a_cosine_tail_brings_the_learning_rate_from_where_it_stood_to_zero() -> None:
    optimizer = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.4)
    tail = CosineTail(optimizer, 4)
    rates = []
    for _ in range(4):
        tail.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.4 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(1, 5)])
    assert rates[-1] == pytest.approx(0)


# --- reproducibility, caching, devices, reports ---------------------------------------------------


def test_reruns_are_byte_identical_and_spill_to_disk(digits: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same config, seed and data: the same bytes, also when every activation goes to memory-mapped
    files (budget of 1 byte), whose directory is removed afterwards; another seed differs."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    quantized = quantize_model(digits["path"], W4A8, digits["small"]).model
    config = FastFinetune(iterations=40, seed=3)
    first, report = finetune_model(quantized, digits["small"], config)
    second, _ = finetune_model(quantized, digits["small"], config)
    spilled, spill_report = finetune_model(quantized, digits["small"], FastFinetune(iterations=40, seed=3, cache_budget_bytes=1))
    other, _ = finetune_model(quantized, digits["small"], FastFinetune(iterations=40, seed=4))
    assert first.SerializeToString() == second.SerializeToString() == spilled.SerializeToString()
    assert other.SerializeToString() != first.SerializeToString()
    assert report["cache"]["spilled_arrays"] == 0 and report["cache"]["peak_bytes_in_memory"] > 0
    assert spill_report["cache"]["spilled_arrays"] > 0 and spill_report["cache"]["peak_bytes_in_memory"] == 0
    assert spill_report["cache"]["peak_bytes_on_disk"] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_spill_the_disk_cannot_hold_is_refused(digits: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With too little free disk the run stops with an error that names the value, the directory and
    what to change (a memory map written past a full disk would kill the process instead), and the
    spill directory is removed."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("finetune.recon.data.cache.shutil.disk_usage", lambda path: SimpleNamespace(free=2**29))
    quantized = quantize_model(digits["path"], W4A8, digits["small"]).model
    refusal = (r"cannot spill input:x \(\d+ bytes\) to .*finetune-activations-\w+: 512.0 MiB free there, 0 bytes already spilled; "
               r"lower fast_finetune.data_size, raise cache_budget_bytes .* or point TMPDIR at a larger disk")
    with pytest.raises(OSError, match=refusal):
        finetune_model(quantized, digits["small"], FastFinetune(iterations=1, cache_budget_bytes=1))
    assert list(tmp_path.iterdir()) == []


def test_report_files_and_logs(digits: dict, tmp_path: Path) -> None:
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    _, report = finetune_model(quantized, digits["small"], FastFinetune(iterations=25), output_dir=tmp_path, name="run")
    assert (tmp_path / "run.png").read_bytes().startswith(b"\x89PNG")
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved == report and saved["samples"] == 128 and saved["float_reference"].startswith("quantized model")
    assert set(saved["units"][0]) >= {"name", "loss_before", "loss_after", "status", "iterations", "seconds"}
    rows = (tmp_path / "run.logs" / "metrics.csv").read_text().splitlines()
    assert set(rows[0].split(",")) == {"loss", "loss_before", "loss_after", "step", "unit"}
    assert len(rows) == 1 + 5 * (3 + 1)  # every 10th of 25 iterations, and the losses before and after


def test_compact_weights_with_the_float_model_as_reference(digits: dict) -> None:
    """Weights stored as int codes: with the float model given, units start from its float weights
    (AdaRound can then round either way) and the report names the reference."""
    config = {"preset": "XINT8", "weight": {"dtype": "int4"}, "weight_storage": "compact"}
    quantized = quantize_model(digits["path"], config, digits["small"]).model
    tuned, report = finetune_model(quantized, digits["small"], FastFinetune(iterations=40), float_model=digits["path"])
    assert report["float_reference"] == "float model" and report["kept"] >= 1
    assert {t.data_type for t in tuned.graph.initializer if len(t.dims) > 1} == {onnx.TensorProto.INT4}
    assert not np.array_equal(run(tuned, digits["x"]), run(quantized, digits["x"]))


def transposed_weights_model() -> onnx.ModelProto:
    """A QDQ model of two MatMuls as some exporters write them: y = relu(x @ Transpose(W1)) @ Transpose(DQ(codes)).
    The first weight is transposed ahead of its quantizers, the second after its dequantization."""
    rng = np.random.default_rng(0)
    h = onnx.helper
    weights = rng.standard_normal((8, 16)).astype(np.float32)
    codes = rng.integers(-127, 128, (4, 8), dtype=np.int8)
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in [
        (weights, "w1"), (np.float32(0.05), "sx"), (np.float32(0.02), "sw"), (np.int8(0), "zero"), (codes, "codes"),
        (np.float32(0.01), "sc"), (np.float32(0.04), "sh")]]
    nodes = [
        h.make_node("QuantizeLinear", ["x", "sx", "zero"], ["xq"]), h.make_node("DequantizeLinear", ["xq", "sx", "zero"], ["xd"]),
        h.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0], name="transpose_w1"),
        h.make_node("QuantizeLinear", ["w1t", "sw", "zero"], ["w1q"]), h.make_node("DequantizeLinear", ["w1q", "sw", "zero"], ["w1d"]),
        h.make_node("MatMul", ["xd", "w1d"], ["m1"], name="first"), h.make_node("Relu", ["m1"], ["r1"]),
        h.make_node("QuantizeLinear", ["r1", "sh", "zero"], ["rq"]), h.make_node("DequantizeLinear", ["rq", "sh", "zero"], ["rd"]),
        h.make_node("DequantizeLinear", ["codes", "sc", "zero"], ["w2"]),
        h.make_node("Transpose", ["w2"], ["w2t"], perm=[1, 0], name="transpose_w2"),
        h.make_node("MatMul", ["rd", "w2t"], ["y"], name="second"),
    ]
    graph = h.make_graph(nodes, "transposed", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 16])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


def test_a_weight_transposed_ahead_of_its_quantizers_is_folded_and_tuned(caplog: pytest.LogCaptureFixture) -> None:
    """Transpose(W) before the quantizers is folded into one initializer, which is tuned and written
    back; a weight transposed after its dequantization cannot be trained and the log says so. The
    input model is left as it was."""
    model = transposed_weights_model()
    given = model.SerializeToString()
    x = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    with caplog.at_level("INFO"):
        tuned, report = finetune_model(model, [{"x": x[i : i + 16]} for i in range(0, 64, 16)],
                                       FastFinetune(algorithm="adaquant", iterations=30, unit="layer", validation_share=0))
    assert model.SerializeToString() == given
    assert [(u["name"], u["status"]) for u in report["units"]] == [("first", "kept")]
    assert report["units"][0]["loss_after"] < report["units"][0]["loss_before"]
    assert "second: not tuned: ops other than quantize/dequantize compute its weight" in caplog.text
    assert [w["unit"] for w in report["warnings"]] == ["second"]
    assert "weights computed from constants: folded 1 constant node(s) into initializers" in caplog.text
    assert [n.name for n in tuned.graph.node if n.op_type == "Transpose"] == ["transpose_w2"]
    folded = next(t for t in tuned.graph.initializer if t.name == "w1t")
    assert folded.dims == [16, 8] and not np.array_equal(onnx.numpy_helper.to_array(folded), initializers(model)["w1"].T)
    assert not np.array_equal(run(tuned, x), run(model, x))


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:3", "hip:0"):
        if torch.cuda.is_available() and name == "cuda":
            continue
        with pytest.raises(ValueError, match=f"device '{name}' is not available.*available: cpu"):
            resolve_device(name)
    with pytest.raises(ValueError, match="not one of"):
        resolve_device("tpu")


FAULTS_PER_STEP = """
import resource, sys, torch
from finetune.recon.device import keep_freed_host_memory

def step():  # tensors of megabytes allocated and freed, as in a CPU training step
    a = torch.ones(4 << 20); b = torch.ones(6 << 20); c = a + 1; del a; d = torch.ones(2 << 20); del b, c, d

def faults_per_step():
    step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 10

before = faults_per_step()
print(keep_freed_host_memory(), before, faults_per_step())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_a_cpu_run_keeps_freed_host_memory_for_reuse() -> None:
    """Once kept (as every CPU fine-tuning run does), freed memory is reused instead of being
    faulted in from the system again at every step (a fresh process, so the default is measured)."""
    result = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP], capture_output=True, text=True, check=True)
    kept, before, after = result.stdout.split()
    assert kept == "True"
    assert float(after) < float(before) / 2


def test_hip_devices_map_to_the_cuda_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("hip:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="'hip:2' is not available.*cpu, hip:0, hip:1"):
        resolve_device("hip:2")


def test_an_unavailable_device_fails_before_any_work(digits: dict) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="'cuda:1' is not available"):
        finetune_model(digits["path"], digits["small"], FastFinetune(device="cuda:1"))


def global_settings() -> tuple[bool, bool, str, bool, bool, bool]:
    """Deterministic algorithms, their warn_only, the float32 matmul precision, TF32 for CUDA's matmul and
    for cuDNN (readable through either API while a run holds them), and torch's NaN filling of new tensors."""
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.utils.deterministic.fill_uninitialized_memory)


class SettingsSeen:
    """A callback noting the global settings in force while a unit tunes."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool, str, bool, bool, bool]] = []

    def on_unit_start(self) -> None:
        self.seen.append(global_settings())


@pytest.mark.parametrize(("settings", "expected"), [({}, (True, False, "highest", False, False, False)),
                                                    ({"deterministic": "warn", "allow_tf32": True},
                                                     (True, True, "high", True, True, False))])
def test_determinism_and_tf32_hold_while_tuning_and_are_restored(digits: dict, settings: dict, expected: tuple) -> None:
    """Deterministic algorithms (warn_only with `deterministic: warn`) and TF32 off unless asked,
    while the run lasts, without torch's NaN filling of new tensors; the caller's settings come back afterwards."""
    before = (global_settings(), float32_settings())
    seen = SettingsSeen()
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    finetune_model(quantized, digits["small"], FastFinetune(iterations=1, **settings), callbacks=[seen])
    assert set(seen.seen) == {expected}
    assert (global_settings(), float32_settings()) == before


# How a user may have set float32 precision before a run: torch's legacy flags, its fp32_precision API (which
# torch's docs now advise, and after which reading a legacy flag raises "a mix of the legacy and new APIs"), or both.
USER_FLOAT32 = {
    "legacy TF32 on": lambda b: (setattr(b.cuda.matmul, "allow_tf32", True), setattr(b.cudnn, "allow_tf32", True)),
    "legacy TF32 off": lambda b: (setattr(b.cuda.matmul, "allow_tf32", False), setattr(b.cudnn, "allow_tf32", False)),
    "legacy medium (bfloat16 on the CPU)": lambda b: torch.set_float32_matmul_precision("medium"),
    "new cuDNN conv ieee": lambda b: setattr(b.cudnn.conv, "fp32_precision", "ieee"),
    "new everything tf32": lambda b: [setattr(o, "fp32_precision", "tf32") for o in (b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn)],
    "new matmul tf32, legacy cuDNN off": lambda b: (setattr(b.cuda.matmul, "fp32_precision", "tf32"),
                                                    setattr(b.cudnn, "allow_tf32", False)),
}


@pytest.mark.parametrize("user", list(USER_FLOAT32))
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_a_run_tunes_whatever_api_set_the_precision_before_it_and_gives_it_back(digits: dict, user: str,
                                                                                allow_tf32: bool) -> None:
    """A run after the user set the float32 precision through either API (or a mix, where torch raises on
    reading a legacy flag) tunes in full float32 on the CPU with TF32 on CUDA as its config says, in a
    state both APIs read, and leaves every setting as it found it."""
    pristine = (legacy_float32_settings(), float32_settings())
    try:
        USER_FLOAT32[user](torch.backends)
        before = (legacy_float32_settings(), float32_settings())
        seen = SettingsSeen()
        quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
        finetune_model(quantized, digits["small"], FastFinetune(iterations=1, allow_tf32=allow_tf32), callbacks=[seen])
        assert {settings[2:5] for settings in seen.seen} == {("high", True, True) if allow_tf32 else ("highest", False, False)}
        after = (legacy_float32_settings(), float32_settings())
        assert after[1] == before[1]  # every fp32_precision setting
        assert after[0] == before[0] or before[0] is None  # the legacy flags, readable where they were
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = pristine[0][1], pristine[0][2]
        torch.set_float32_matmul_precision(pristine[0][0])
        for path, value in pristine[1].items():
            _backend(path).fp32_precision = value


class FillNewTensorsWithNaN:
    """A callback turning torch's NaN filling of new uninitialised tensors back on as each unit starts."""

    def on_unit_start(self) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = True


@pytest.mark.parametrize(("preset", "settings"), [("XINT8", {"algorithm": "adaround"}),
                                                  ("MX4", {"algorithm": "adaquant", "unit": "block", "adaquant": {"update_bias": True}})])
def test_no_kernel_reads_memory_it_did_not_write(digits: dict, preset: str, settings: dict) -> None:
    """Tuning leaves torch's NaN filling of new tensors off for speed; with it on, any read of
    memory nobody wrote would turn into NaN and change the tuned weights. They are byte-identical."""
    quantized = quantize_model(digits["path"], preset, digits["small"]).model
    config = FastFinetune(iterations=12, batch_size=8, **settings)
    plain, _ = finetune_model(quantized, digits["small"], config)
    filled, _ = finetune_model(quantized, digits["small"], config, callbacks=[FillNewTensorsWithNaN()])
    assert plain.SerializeToString() == filled.SerializeToString()


def test_an_op_without_a_deterministic_kernel_is_one_error_naming_it_and_the_switch(digits: dict,
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch raises from inside backward on CUDA (faked here on CPU) becomes one line."""
    def no_deterministic_kernel(*_: object) -> None:
        raise RuntimeError("adaptive_max_pool2d_backward_cuda does not have a deterministic implementation, but you set "
                           "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation")

    monkeypatch.setattr(HostAdam, "step", no_deterministic_kernel)
    quantized = quantize_model(digits["path"], "XINT8", digits["small"]).model
    with pytest.raises(ValueError, match=r"^adaptive_max_pool2d_backward_cuda has no deterministic kernel on cpu: set "
                                         r"fast_finetune.deterministic: warn to run it anyway"):
        finetune_model(quantized, digits["small"], FastFinetune(iterations=1))
