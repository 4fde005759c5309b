"""Fast finetune never degrades unseen: a unit whose tuned loss is NaN is reverted (never kept) and
reported; NaN or Inf in a weight, or in a unit's loss before tuning, is an error naming it; a model
with nothing to tune is refused; a float reference is accepted only where its weights quantize to
the stored codes, rounding ties aside (those are reported)."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from finetune.config import FastFinetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.optimizers import HostAdam
from finetune.zoo import export_onnx

from .lift_helpers import CNN_INPUT, ResidualCNN, randomized
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

INT8_TENSOR = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A residual CNN with random weights as float ONNX, and three calibration batches."""
    path = export_onnx(randomized(ResidualCNN()), torch.randn(*CNN_INPUT), tmp_path_factory.mktemp("cnn") / "cnn.onnx")
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, *CNN_INPUT[1:]), np.float32)} for i in range(3)]
    return {"path": path, "feeds": feeds}


def first_conv_weight(model: onnx.ModelProto) -> onnx.TensorProto:
    """The float initializer the first Conv's weight comes from (through its quantizers, if any)."""
    producers = {output: node for node in model.graph.node for output in node.output}
    initializers = {t.name: t for t in model.graph.initializer}
    name = next(node for node in model.graph.node if node.op_type == "Conv").input[1]
    while name not in initializers:
        name = producers[name].input[0]
    return initializers[name]


def overwrite(tensor: onnx.TensorProto, change: callable) -> None:
    """Replace an initializer's values by `change(values)` (a copy it may edit)."""
    values = numpy_helper.to_array(tensor).copy()
    tensor.CopyFrom(numpy_helper.from_array(change(values), tensor.name))


def test_a_unit_whose_tuned_loss_is_nan_is_reverted_and_reported(cnn: dict, caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimiser step that leaves NaN weights: a unit whose tuned loss is NaN is reverted with a
    status naming the NaN (it was "kept": NaN > loss is false), logged at WARNING and listed in the
    report; no unit is kept, and the model keeps its weights."""
    quantized = quantize_model(cnn["path"], "XINT8", cnn["feeds"]).model
    adam_step = HostAdam.step  # the Adam that tunes on the CPU

    def diverging_step(self: torch.optim.Adam, *args: object) -> None:
        adam_step(self, *args)
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.data.fill_(math.nan)

    monkeypatch.setattr(HostAdam, "step", diverging_step)
    with caplog.at_level(logging.WARNING):
        tuned, report = finetune_model(quantized, cnn["feeds"], FastFinetune(algorithm="adaquant", iterations=3))
    diverged = [u for u in report["units"] if u["status"] != "reverted"]
    names = [u["name"] for u in diverged]
    assert len(names) >= 3 and {u["status"] for u in diverged} == {"reverted: the tuned loss is nan"}
    assert report["kept"] == 0 and report["reverted"] == len(report["units"])
    assert all(u["loss_after"] == u["loss_before"] and u["rejected_loss"] is None for u in diverged)
    reverted = [w for w in report["warnings"] if "unit" in w]  # the others: weights stored as codes, no float model
    assert [w["unit"] for w in reverted] == names
    assert all(w["reason"].startswith("reverted: the tuned loss is nan") for w in reverted)
    assert sum("the tuned loss is nan" in r.message for r in caplog.records if r.levelno == logging.WARNING) == len(names)
    assert tuned.graph.initializer == quantized.graph.initializer


def test_a_loss_that_is_not_finite_before_tuning_is_an_error_naming_the_unit(cnn: dict) -> None:
    """A first layer whose float output overflows (weights near float32's maximum): its float
    targets are infinite, so its loss cannot be measured."""
    quantized = quantize_model(cnn["path"], "XINT8", cnn["feeds"]).model
    overwrite(first_conv_weight(quantized), lambda w: np.full_like(w, 3e38))
    with pytest.raises(ValueError, match=r"^unit 1/\d+ /stem/stem/0/Conv: its reconstruction loss before tuning is inf"):
        finetune_model(quantized, cnn["feeds"], FastFinetune(iterations=2))


def test_a_weight_holding_nan_is_refused_before_any_work(cnn: dict) -> None:
    quantized = quantize_model(cnn["path"], "XINT8", cnn["feeds"]).model
    weight = first_conv_weight(quantized)
    overwrite(weight, lambda w: np.where(np.arange(w.size).reshape(w.shape) == 5, np.nan, w).astype(w.dtype))
    with pytest.raises(ValueError, match=f"the weight {re.escape(repr(weight.name))} holds NaN or Inf"):
        finetune_model(quantized, cnn["feeds"], FastFinetune(iterations=2))


def test_a_model_with_nothing_to_tune_is_refused(cnn: dict) -> None:
    """A float model has no quantizers; AdaRound on a model with quantized activations only has no
    weight to round (before, every unit was skipped and the run reported success)."""
    with pytest.raises(ValueError, match="no quantizers.*nothing to tune: quantize it first"):
        finetune_model(cnn["path"], cnn["feeds"], FastFinetune(iterations=2))
    activations_only = quantize_model(cnn["path"], {"activation": INT8_TENSOR}, cnn["feeds"]).model
    with pytest.raises(ValueError, match="AdaRound has nothing to round: no weight of the 6 layer"):
        finetune_model(activations_only, cnn["feeds"], FastFinetune(iterations=2))


def test_a_float_reference_must_quantize_to_the_stored_codes_up_to_rounding_ties(cnn: dict) -> None:
    """Weights stored as codes (power-of-two scales): a float weight exactly halfway between two
    codes may have been stored as either, and is reported; one a whole step away from its stored
    code is refused, however few they are (a 5 % allowance let such models through)."""
    result = quantize_model(cnn["path"], {"preset": "XINT8", "weight_storage": "compact"}, cnn["feeds"])
    producers = {output: node for node in result.model.graph.node for output in node.output}
    stored = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    dequantize = producers[next(n for n in result.model.graph.node if n.op_type == "Conv").input[1]]
    codes, scale = stored[dequantize.input[0]].astype(np.float32), float(stored[dequantize.input[1]])
    odd = int(np.flatnonzero((codes.ravel() % 2 == 1) & (np.abs(codes.ravel()) < 100))[0])

    def reference(code_offset: float) -> onnx.ModelProto:
        model = onnx.load(cnn["path"])
        overwrite(first_conv_weight(model), lambda w: np.where(np.arange(w.size).reshape(w.shape) == odd,
                                                               (codes + code_offset) * scale, w).astype(np.float32))
        return model

    _, report = finetune_model(result.model, cnn["feeds"], FastFinetune(iterations=2), float_model=reference(0.5))
    reason = (f"1 of {codes.size} weight codes ({1 / codes.size:.3%}) differ from those the float model's weight quantizes to, "
              "each at a rounding tie (another tool's arithmetic); tuning starts from the float weights")
    assert [w for w in report["warnings"] if "unit" in w] == [{"unit": "/stem/stem/0/Conv", "reason": reason}]
    with pytest.raises(ValueError, match=rf"/stem/stem/0/Conv does not quantize to the codes .*\(1 of {codes.size} differ away "
                                         "from rounding ties\\)"):
        finetune_model(result.model, cnn["feeds"], FastFinetune(iterations=2), float_model=reference(1.0))


def test_what_tuning_cannot_do_as_asked_is_reported(cnn: dict) -> None:
    """Each case where tuning goes on other than configured is a warning in the report: a batch
    larger than the data, a validation share of one batch that holds none out, weights stored as
    codes tuned without their float model."""
    compact = quantize_model(cnn["path"], {"preset": "XINT8", "weight_storage": "compact"}, cnn["feeds"]).model
    _, report = finetune_model(compact, cnn["feeds"][:1], FastFinetune(iterations=1, batch_size=64))
    configs = [w for w in report["warnings"] if "config" in w]
    assert configs == [
        {"config": "fast_finetune.batch_size", "reason": "64 is more than the 4 calibration samples: "
         "every training batch holds all 4 (lower batch_size, or give more data)"},
        {"config": "fast_finetune.validation_share", "reason": "0.2 of the 1 calibration batch(es) is less than one, so "
         "none is held out: units are kept on their training loss and the tuned model is not checked on data it did not "
         "train on (give more batches, of fewer samples each)"}]
    assert report["held_out"] is None
    coded = [w for w in report["warnings"] if "tensor" in w]
    assert len(coded) == len(report["units"])
    assert all("stored as quantized codes and no float model was given" in w["reason"] for w in coded)


def test_an_adaround_unit_with_no_quantized_weight_is_reported(cnn: dict) -> None:
    """AdaRound has nothing to round in a layer whose weight is left float: the unit is skipped and
    the report says so (it was an INFO line)."""
    quantized = quantize_model(cnn["path"], {"preset": "XINT8", "node_overrides": {"/head/Gemm": {"weight": None}}},
                               cnn["feeds"]).model
    _, report = finetune_model(quantized, cnn["feeds"], FastFinetune(iterations=2, batch_size=4))
    skipped = "skipped: no weight of it is quantized (nothing to round)"
    assert [u["status"] for u in report["units"] if u["name"] == "/head/Gemm"] == [skipped]
    assert {"unit": "/head/Gemm", "reason": "not tuned: no weight of it is quantized (nothing to round)"} in report["warnings"]
