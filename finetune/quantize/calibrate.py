"""Calibration of the planned formats that need scales (INT, FP8): weights from their values,
activations from one onnxruntime pass that feeds every observer of a tensor, int32 biases from
their input and weight scales."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from finetune.calibrate import CalibrationData, Observer, collect_statistics, make_observer
from finetune.formats import FloatSpec, FormatSpec, IntSpec, quantize_dequantize
from finetune.notices import Notice, warn

from .plan import Use, with_producer_formats

logger = logging.getLogger(__name__)

QParams = dict[tuple[str, FormatSpec], tuple[np.ndarray, np.ndarray]]
UNREACHED = ("stays float: no calibration sample computed it (it lies in an If branch the data never took); "
             "calibrate on data that takes every branch to quantize it")


def calibrate(model: onnx.ModelProto, uses: list[Use], data: Any, providers: list[str] | None,
              notices: list[Notice]) -> QParams:
    """Scale and zero point of every (tensor, format) that needs them: weights from their values,
    activations from one streamed onnxruntime pass over the data, int32 biases from s_in * s_w.
    An activation that held NaN or Inf (left out of its range) is a notice."""
    initializers = {t.name: t for t in model.graph.initializer}
    observers: dict[tuple[str, FormatSpec], Observer] = {}
    for use in with_producer_formats(uses):
        if _needs_calibration(use) and (use.tensor, use.spec) not in observers:
            observers[(use.tensor, use.spec)] = _observer(use)
    weights = {key: obs for key, obs in observers.items() if key[0] in initializers}
    for (tensor, _), observer in weights.items():
        observer.update(numpy_helper.to_array(initializers[tensor]))
    activations = {key: obs for key, obs in observers.items() if key[0] not in initializers}
    if activations:
        if data is None:
            raise ValueError(
                f"{len(activations)} activation tensors need calibration data (INT/FP8 formats); pass --data, "
                "or --random-data to calibrate on random inputs"
            )
        _collect(model, data, activations, providers)
        warn(logger, notices, [Notice("tensor", tensor, f"{observer.non_finite} NaN or Inf values in the calibration pass "
                                      "were left out of its range (an overflow in the float model?)")
                               for (tensor, _), observer in activations.items() if observer.non_finite])
        warn(logger, notices, [Notice("tensor", tensor, UNREACHED) for (tensor, _), observer in activations.items()
                                if not observer.observed])
    elif data is not None:
        _check_unneeded_data(model, data)
    qparams = {key: observer.scale_zero_point() for key, observer in observers.items() if observer.observed}
    qparams.update(int32_bias_qparams(uses, qparams))
    return qparams


def calibrated_uses(uses: list[Use], qparams: QParams) -> list[Use]:
    """The uses whose formats have the scales they need: an INT/FP8 tensor calibration never saw,
    and the int32 bias of its node, stay float (as the tensor's notice says)."""
    return [use for use in uses if _ready(use, qparams) and (use.before is None or _ready(use.before, qparams))]


def _ready(use: Use, qparams: QParams) -> bool:
    """Whether a use needs no scale or has one."""
    return not (_needs_calibration(use) or use.choice == "int32") or (use.tensor, use.spec) in qparams


def _check_unneeded_data(model: onnx.ModelProto, data: Any) -> None:
    """Data the formats do not need (block formats, BF16) is still checked against the model's
    inputs on its first sample, so wrong data fails here and not in a later run that reads it; a
    source that gives one pass only is left for that run and the log says it was not read."""
    if isinstance(data, Iterator) or (hasattr(data, "get_next") and not hasattr(data, "rewind")):
        logger.info("the calibration data was not read: no tensor's format needs calibration (block formats, BF16), "
                    "and the source gives one pass only")
        return
    next(iter(CalibrationData(data, model)), None)
    logger.info("the calibration data was not needed (no tensor's format needs calibration: block formats, BF16); "
                "its first sample matches the model's inputs")


def quantize_weight(use: Use, weight: np.ndarray) -> np.ndarray:
    """A weight's values after the quantize-dequantize of its planned format, with the scale and
    zero point calibrate gives it from these values: what the quantized model computes with (for
    searches that try rescaled weights before the plan is final, as AWQ's)."""
    scale = zero_point = None
    if _needs_calibration(use):
        observer = _observer(use)
        observer.update(weight)
        scale, zero_point = (torch.from_numpy(np.asarray(q)) for q in observer.scale_zero_point())
    values = torch.from_numpy(np.ascontiguousarray(weight, np.float32))
    return quantize_dequantize(values, use.spec, scale, zero_point).numpy()


def _needs_calibration(use: Use) -> bool:
    """INT and FP8 formats need scales; int32 biases derive theirs, block formats and BF16/FP16 none."""
    if use.choice == "int32":
        return False
    return isinstance(use.spec, IntSpec) or (isinstance(use.spec, FloatSpec) and use.spec.dtype.startswith("float8"))


def _observer(use: Use) -> Observer:
    options = {"percentile": use.choice.percentile} if use.choice.calibration == "percentile" else {}
    return make_observer(use.choice.calibration, use.spec, **options)


def _collect(model: onnx.ModelProto, data: Any, observers: dict[tuple[str, FormatSpec], Observer], providers: list[str] | None) -> None:
    """One pass over the data; a tensor observed in several formats is exposed once."""
    by_tensor: dict[str, list[Observer]] = defaultdict(list)
    for (tensor, _), observer in observers.items():
        by_tensor[tensor].append(observer)
    fan_out = {tensor: _FanOut(group) for tensor, group in by_tensor.items()}
    feeds = data if isinstance(data, CalibrationData) else CalibrationData(data, model)
    logger.info("calibrating %d activation tensors", len(fan_out))
    collect_statistics(model, feeds, fan_out, providers)


class _FanOut:
    """Feeds one tensor's batches to every observer that wants it."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers

    def update(self, x: np.ndarray) -> None:
        for observer in self.observers:
            observer.update(x)


def int32_bias_qparams(uses: list[Use], qparams: QParams) -> QParams:
    """Bias scale = input scale * weight scale (per output channel when the weight is), zero point 0."""
    result: QParams = {}
    by_node: dict[str, dict[str, Use]] = defaultdict(dict)
    for use in uses:
        by_node[use.node][use.role] = use
    for node, roles in by_node.items():
        bias = roles.get("bias")
        if bias is None or bias.choice != "int32":
            continue
        activation, weight = roles.get("activation"), roles.get("weight")
        if activation is None or weight is None:
            raise ValueError(f"node {node!r}: an int32 bias needs a quantized input and weight")
        if (activation.tensor, activation.spec) not in qparams:
            continue  # an input calibration never saw: the node's bias stays float with it (calibrated_uses)
        s_in, _ = qparams[(activation.tensor, activation.spec)]
        s_w, _ = qparams[(weight.tensor, weight.spec)]
        scale = (s_in * s_w).astype(np.float32)
        result[(bias.tensor, bias.spec)] = (scale, np.zeros_like(scale))
    return result
