"""The quantizer's entry point: load and normalise the float model, then plan, calibrate and
insert the quantize-dequantize nodes, and report what was done."""

from __future__ import annotations

import dataclasses
import logging
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from finetune.config import QuantConfig, available_presets, load_config
from finetune.host_memory import release_freed_host_memory
from finetune.notices import Notice, warn
from finetune.onnx import attach_custom_ops
from finetune.onnx.batchnorm import fold_batch_norms
from finetune.onnx.equalize import equalize_model
from finetune.onnx.fold import fold_constants
from finetune.onnx.io import goes_by_file, load_model, model_bytes, put_back, set_aside
from finetune.onnx.normalize import normalize_model
from finetune.onnx.qdq import bf16_pairs_to_casts
from finetune.onnx.session import require_loads

from .awq import awq_model
from .calibrate import calibrate, calibrated_uses
from .checks import check_plan
from .insert import insert_qdq
from .npu import align_eltwise_formats, align_scales
from .plan import plan, upgrade_opset
from .rotate import rotate_model
from .smooth import smooth_model
from .summary import summarize

logger = logging.getLogger(__name__)


@dataclass
class QuantizeResult:
    """The quantized model and what was done to it (the summary the CLI prints and writes as JSON)."""

    model: onnx.ModelProto
    summary: dict[str, Any]
    float_model: onnx.ModelProto  # the float graph the QDQ model was built from (normalised, folded, equalised, rescaled)


def quantize_model(
    model: str | onnx.ModelProto, config: QuantConfig | str | dict, data: Any, providers: list[str] | None = None,
) -> QuantizeResult:
    """Quantize `model` (path or proto, never modified) with `config` (a QuantConfig, preset name,
    YAML path or mapping), calibrating INT/FP8 scales on `data` (anything CalibrationData takes).
    A config with a fast_finetune section is refused: finetune.pipeline.quantize_and_finetune runs it."""
    start = time.perf_counter()
    config = load_config(config)
    if config.fast_finetune is not None:
        raise ValueError("the config has a fast_finetune section, which quantize_model does not run: call "
                         "finetune.pipeline.quantize_and_finetune to quantize and tune, or drop the section")
    notices: list[Notice] = []
    normalized, bytes_before, changes, rescaling = _prepared(model, config, notices)
    if rescaling.get("rotation", {}).get("inserted_nodes"):  # the online rotations' products stay float
        names = tuple(re.escape(name) for name in rescaling["rotation"]["inserted_nodes"])
        config = dataclasses.replace(config, exclude_nodes=(*config.exclude_nodes, *names))
    if config.smooth_quant is not None:
        normalized, rescaling["smooth_quant"] = smooth_model(normalized, config, data, providers, notices)
    if config.awq is not None:  # the config refuses both
        normalized, rescaling["awq"] = awq_model(normalized, config, data, providers, notices)
    float_model = normalized
    uses = plan(normalized, config, notices)
    alignments = None
    if config.npu_cnn:
        uses, alignments = align_eltwise_formats(normalized, config, uses)
    if not uses:
        op_types = "all" if config.op_types == "all" else ", ".join(config.op_types)
        warn(logger, notices, [Notice("model", normalized.graph.name or "model", f"nothing was quantized: no node of the "
                                      f"config's op types ({op_types}) has a tensor the config quantizes, so the output "
                                      "computes what the input does")])
    normalized = upgrade_opset(normalized, uses, changes, notices)
    check_plan(normalized, config, uses, changes, notices)
    qparams = calibrate(normalized, uses, data, providers, notices)
    uses = calibrated_uses(uses, qparams)
    if alignments is not None:
        alignments += align_scales(normalized, config, uses, qparams, notices)
    quantized = attach_custom_ops(insert_qdq(normalized, uses, qparams, config.weight_storage), in_place=True)
    release_freed_host_memory()  # calibration's and the codes' slices, which glibc keeps
    if config.bf16_as_cast:
        changes.append(f"bf16_as_cast: {bf16_pairs_to_casts(quantized)} bfloat16 quantize-dequantize pair(s) written as Cast pairs")
    require_loads(quantized, model, "quantize")
    summary = summarize(bytes_before, quantized, uses, changes, notices, time.perf_counter() - start, alignments, rescaling)
    return QuantizeResult(quantized, summary, float_model)


def _prepared(model: str | onnx.ModelProto, config: QuantConfig,
              notices: list[Notice]) -> tuple[onnx.ModelProto, int, list[str], dict[str, dict[str, Any]]]:
    """Our own copy of the float model (one copy of the weights: normalised, folded, equalised and
    rotated in place), the input's size, what normalising changed and the rotation's summary entry.
    protobuf keeps a rewritten tensor's old bytes until the whole proto is dropped, so a large model
    is set aside in a data file after the rewrites (the loaded proto and its garbage dropped), rotated
    from it and read back."""
    normalized = load_model(model)
    bytes_before = model_bytes(normalized)
    normalized, changes = normalize_model(normalized, notices=notices, in_place=True)
    for change in fold_constants(normalized, notices=notices):  # a weight computed from constants (Transpose(W)) becomes one to quantize and tune
        logger.info(change)
        changes.append(change)
    if config.fold_batch_norm:
        normalized, folded = fold_batch_norms(normalized, notices)
        changes += folded
    if config.cross_layer_equalization:
        normalized, equalized = equalize_model(normalized, notices)
        changes += equalized
    rescaling = {}
    if not goes_by_file(normalized):
        if config.rotation is not None:  # first: smoothing and AWQ then fold into the rotated layers' norms
            rescaling["rotation"] = rotate_model(normalized, config.rotation)
        return normalized, bytes_before, changes, rescaling
    with tempfile.TemporaryDirectory(prefix="finetune-") as name:
        normalized = set_aside(normalized, Path(name))  # rebound: the loaded proto is dropped
        if config.rotation is not None:
            rescaling["rotation"] = rotate_model(normalized, config.rotation, Path(name))
        return put_back(normalized, Path(name)), bytes_before, changes, rescaling


def quantizer_presets() -> list[str]:
    """The presets quantize_model takes: those without a fast_finetune section (the others are
    for finetune.pipeline.quantize_and_finetune)."""
    return [name for name in available_presets() if load_config(name).fast_finetune is None]
