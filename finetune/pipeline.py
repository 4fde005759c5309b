"""Quantize, then recover accuracy: the orchestration the `finetune` command runs, above both the
quantizer and the fine-tuning stage (neither imports the other), and the saved record of a run."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import onnx
import onnxruntime
import torch

from finetune.config import QuantConfig, load_config, save_config, to_dict
from finetune.export.matmul_nbits import to_matmul_nbits
from finetune.onnx.io import goes_by_file, has_external_data, save_model_atomic, write_with_external_data
from finetune.quantize import QuantizeResult, quantize_model
from finetune.quantize.summary import peak_rss_kib


@dataclass
class PipelineResult:
    """The final model, the quantizer's summary and the fine-tuning report (None if not run)."""

    model: onnx.ModelProto
    summary: dict[str, Any]
    report: dict[str, Any] | None
    auto_mp_report: dict[str, Any] | None = None
    auto_mp_config: QuantConfig | None = None  # the config the search chose (node overrides): quantizes to `model` again
    float_model: onnx.ModelProto | None = None  # the float graph the quantizer built from (quantize_model alone)


def quantize_and_finetune(
    model: str | Path | onnx.ModelProto, config: QuantConfig | str | dict, data: Any,
    output_dir: str | Path | None = None, name: str = "finetune", callbacks: Sequence[Any] = (), resume: bool = False,
    model_path: str | Path | None = None,
) -> PipelineResult:
    """Quantize `model` with `config`; when the config has a fast_finetune section, tune the result
    on the same data (`callbacks` join the tuning's Fabric: see finetune_model). The float reference
    is the float model the quantizer worked from (equalised, if asked): weights or int32 biases stored
    as codes have their true float values only there; bf16_as_cast applies to the tuned model (the
    pairs are what tuning reads). A config with an auto_mixed_precision section runs the search
    (finetune.automp), whose report is `auto_mp_report`. With `model_path` the final model is written
    there (atomically; when tuning, before the report: see finetune_model)."""
    config = load_config(config)
    if config.auto_mixed_precision is not None:
        from finetune.automp import auto_mixed_precision

        if resume:
            raise ValueError("--resume continues a fine-tuning run; an auto mixed precision run starts afresh")
        result = auto_mixed_precision(model, config, data, output_dir=output_dir, name=f"{name}.automp" if output_dir else name,
                                      model_path=model_path)
        final = runtime_form(result.model, config, result.summary, model_path, has_external_data(model))
        return PipelineResult(final, with_peak_memory(result.summary), result.finetune_report, result.report, result.config)
    if config.fast_finetune is None:
        quantized = quantize_model(model, config, data)
        final = runtime_form(quantized.model, config, quantized.summary, None, False)
        if model_path is not None:
            save_model_atomic(final, model_path, external_data=has_external_data(model))
        return PipelineResult(final, with_peak_memory(quantized.summary), None, float_model=quantized.float_model)
    from finetune.recon import finetune_model, preflight  # lightning takes seconds to import: only when tuning

    if data is None:  # what tuning needs is checked before the quantizer's calibration pass
        raise ValueError("fast finetune needs calibration data: pass --data (or data= in Python)")
    preflight(model, config.fast_finetune)
    quantized = quantize_model(model, dataclasses.replace(without_finetune(config), bf16_as_cast=False), data)
    with tempfile.TemporaryDirectory(prefix="finetune-float-") as folder:
        qdq_model, float_model = handed_over(quantized, Path(folder))
        tuned, report = finetune_model(qdq_model, data, config.fast_finetune, float_model, output_dir, name, callbacks,
                                       resume, model_path, bf16_as_cast=config.bf16_as_cast, external_data=has_external_data(model))
    final = runtime_form(tuned, config, quantized.summary, model_path, has_external_data(model))
    return PipelineResult(final, with_peak_memory(quantized.summary), report)


def runtime_form(model: onnx.ModelProto, config: QuantConfig, summary: dict[str, Any] | None,
                 model_path: str | Path | None, external_data: bool) -> onnx.ModelProto:
    """The final model in the form the config asks onnxruntime to run: with weight_storage
    matmul_nbits, its 4-bit MatMul weights as MatMulNBits (export.matmul_nbits; the weights left QDQ
    listed in the summary's `matmul_nbits_kept_qdq`), rewritten to `model_path` where the search or
    the tuning already wrote the QDQ form there."""
    if config.weight_storage != "matmul_nbits":
        return model
    packed, kept = to_matmul_nbits(model)
    if summary is not None:
        summary["matmul_nbits_kept_qdq"] = kept
    if model_path is not None:
        save_model_atomic(packed, model_path, external_data=external_data)
    return packed


def handed_over(quantized: QuantizeResult, folder: Path) -> tuple[onnx.ModelProto | Path, onnx.ModelProto | Path]:
    """The quantized and the float model for tuning, which copies a proto it is given: each of
    onnx.io.BY_FILE_BYTES or more is written to `folder` (written once, ~1 s per GB) and dropped from
    `quantized`, so tuning (which would copy a proto while the result still holds it) holds the
    only copy of its weights (and reads a float model file one tensor at a time)."""
    return _handed(quantized, "model", folder), _handed(quantized, "float_model", folder)


def _handed(quantized: QuantizeResult, field: str, folder: Path) -> onnx.ModelProto | Path:
    """One of handed_over's models: `quantized`'s `field`, or from BY_FILE_BYTES on its file in `folder`."""
    model = getattr(quantized, field)
    if not goes_by_file(model):
        return model
    path = folder / f"{field}.onnx"
    write_with_external_data(model, path)
    setattr(quantized, field, None)
    return path


def with_peak_memory(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with `peak_rss_kib` brought up to now (the writes and tuning after quantizing count)."""
    if summary is not None:
        summary["peak_rss_kib"] = peak_rss_kib()
    return summary


def without_finetune(config: QuantConfig) -> QuantConfig:
    """The config without its fast_finetune section: what quantize_model takes."""
    return dataclasses.replace(config, fast_finetune=None)


def with_finetune(config: QuantConfig, overrides: Mapping[str, Any]) -> QuantConfig:
    """The config with its fast_finetune section updated by the given (non-None) keys, added with
    defaults when absent; a changed algorithm without an lr takes that algorithm's default lr."""
    overrides = {key: value for key, value in overrides.items() if value is not None}
    if not overrides:
        return config
    section = to_dict(config.fast_finetune) if config.fast_finetune is not None else {}
    if "algorithm" in overrides and overrides["algorithm"] != section.get("algorithm") and "lr" not in overrides:
        section.pop("lr", None)
    early_stop = overrides.pop("early_stop", None)
    section.update(overrides)
    if early_stop is not None:
        section["early_stop"] = {**section.get("early_stop", {}), "enabled": early_stop}
    return load_config({**to_dict(config), "fast_finetune": section})


def save_run_config(config: QuantConfig, path: str | Path) -> None:
    """Write the run's complete config as YAML, headed by the command and the library versions."""
    header = (
        f"# finetune {_installed_version('finetune')}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"onnx {onnx.__version__}, lightning {version('lightning')}\n"
        f"# command: {' '.join(sys.argv)}\n"
    )
    save_config(config, path, header)


def _installed_version(package: str) -> str:
    """The installed version of `package`, or a note that it runs from a source tree not installed
    (PYTHONPATH pointing at a checkout), which is no reason to fail a run."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"
