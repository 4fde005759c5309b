"""finetune_model: recover a QDQ model's accuracy with AdaRound, AdaQuant or GPTQ, unit by unit, and
write the tuned weights back into a copy of the QDQ graph; a run killed part-way resumes from a
checkpoint of its finished units. `preflight` is what a run checks before any work."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from finetune.config import FastFinetune
from finetune.export.matmul_nbits import to_matmul_nbits
from finetune.formats.compiled import resolve_compile
from finetune.lift import check_liftable
from finetune.onnx import attach_custom_ops
from finetune.onnx.contrib import matmul_nbits_to_qdq
from finetune.onnx.io import has_external_data, load_model, save_model_atomic
from finetune.onnx.session import require_loads
from finetune.quantize.summary import peak_rss_kib

from .callbacks import builtin_callbacks
from .checkpoint import Checkpoint
from .device import resolve_device
from .hooks import check_callbacks
from .processes import launch, make_fabric
from .report import write_report
from .run import Job, tune_process

logger = logging.getLogger(__name__)


def finetune_model(
    qdq_model: str | Path | onnx.ModelProto,
    data: Any,
    config: FastFinetune,
    float_model: str | Path | onnx.ModelProto | None = None,
    output_dir: str | Path | None = None,
    name: str = "finetune",
    callbacks: Sequence[Any] = (),
    resume: bool = False,
    model_path: str | Path | None = None,
    attach_ops: bool = False,
    bf16_as_cast: bool = False,
    external_data: bool | None = None,
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The QDQ model with tuned weights, and the report. `data` is anything CalibrationData reads;
    the float targets come from `float_model` or, without one, from the QDQ model with its
    quantizers off. With `output_dir`, `<name>.json`, `<name>.png` and `<name>.logs/` go there,
    and `<name>.ckpt` holds the finished units while the run lasts: `resume` continues from it
    (the same model, data and settings give the bytes an uninterrupted run gives). With
    `model_path`, the tuned model is written there first, then the report, and only then is the
    checkpoint removed: a run that fails or is killed on the way leaves no report without a model
    and keeps its checkpoint. The tuned model keeps the input's form (see export_model); with
    `attach_ops`, AMD Quark's custom ops get function bodies too (checked before any tuning); with
    `bf16_as_cast`, bfloat16 quantize-dequantize pairs are written as Cast pairs. The model at
    `model_path` keeps its large tensors in a data file when it must, or `external_data` says so
    (None: when the `qdq_model` file does). The report's `peak_rss_kib` is measured once it is written.
    `callbacks` join the built-in ones in the Fabric that runs the units (the moments they hear:
    recon.hooks; each is checked here)."""
    begin = time.perf_counter()
    checkpoint = _checkpoint_path(output_dir, name, resume, config.processes)
    original, nbits = _as_qdq(qdq_model)
    keep_external = has_external_data(qdq_model) if external_data is None else external_data
    device = preflight(original, config)
    if attach_ops:
        attach_custom_ops(original)  # a node whose body cannot be written fails here, not after the tuning
    log_dir = Path(output_dir) / f"{name}.logs" if output_dir is not None else None
    saver = Checkpoint(checkpoint) if checkpoint is not None else None
    run_callbacks = list(check_callbacks([*([saver] if saver else []), *builtin_callbacks(config, log_dir), *callbacks]))
    fabric = make_fabric(config, device, run_callbacks)
    float_proto, float_folder = _float_source(float_model)
    job = Job(original, float_proto, data, config, saver, resume, run_callbacks, attach_ops, bf16_as_cast, float_folder)
    del original, float_proto  # the job's are the only references: tuning lets them go, or their bytes, as it can
    tuned, report = launch(fabric, tune_process, job)[0] if config.processes > 1 else tune_process(fabric, job)
    gc.collect()  # the lifted modules live in reference cycles (fx graphs): their weights go now, not after the load check
    if tuned is None:
        return None, report  # a process other than the first of a data-parallel run: the first one writes
    tuned = to_matmul_nbits(tuned, nbits)[0] if nbits else tuned  # back to the form it came in
    report["total_seconds"] = time.perf_counter() - begin
    require_loads(tuned, qdq_model, "fine-tuning")  # the input as given: `original` became the tuned model
    if model_path is not None:
        save_model_atomic(tuned, model_path, external_data=keep_external)
    report["peak_rss_kib"] = peak_rss_kib()
    if output_dir is not None:
        write_report(report, Path(output_dir), name)
    if saver is not None:
        saver.remove()  # the run is complete: nothing is left to resume
    return tuned, report


def _float_source(float_model: str | Path | onnx.ModelProto | None) -> tuple[onnx.ModelProto | None, Path | None]:
    """The float model and the folder its tensors are read from as they are lifted: a file is read
    once, its external data left in place; a proto is copied (the caller's stays as it is)."""
    if float_model is None:
        return None, None
    from_file = not isinstance(float_model, onnx.ModelProto)
    float_proto = load_model(float_model, external_values=not from_file)
    return float_proto, Path(float_model).parent if from_file and has_external_data(float_proto) else None  # type: ignore[arg-type]


def _as_qdq(model: str | Path | onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The model loaded, its 4-bit MatMulNBits (onnxruntime's) read as the QDQ they pack, and their
    accuracy levels by MatMul name (onnx.contrib.matmul_nbits_to_qdq) to pack them back with."""
    loaded = load_model(model)
    return loaded, matmul_nbits_to_qdq(loaded)


def preflight(model: str | Path | onnx.ModelProto, config: FastFinetune) -> torch.device:
    """What a tuning run checks before any work, each a one-line error: the device exists, `compile:
    true` has a compiler (`auto` warns once where none is), and every op of `model` can be lifted (all
    named at once). Returns the device."""
    device = resolve_device(config.device)
    resolve_compile(config.compile, device.type)
    check_liftable(model)
    return device


def _checkpoint_path(output_dir: str | Path | None, name: str, resume: bool, devices: int) -> Path | None:
    """Where the run checkpoints its finished units: `<name>.ckpt` in the output folder, if any
    (a data-parallel run keeps none: each process's fingerprint would name its own share of the data)."""
    if resume and devices > 1:
        raise ValueError("resume is not available with devices > 1: a data-parallel run keeps no checkpoint "
                         "(run on one device to keep one)")
    if output_dir is None:
        if resume:
            raise ValueError("resume needs output_dir: the checkpoint to resume from lives there, beside the report")
        return None
    if devices > 1:
        logger.warning("a data-parallel run (devices %d) keeps no checkpoint: a killed run starts again", devices)
        return None
    return Path(output_dir) / f"{name}.ckpt"
