"""finetune_model: recover a QDQ model's accuracy with AdaRound or AdaQuant, unit by unit, and
write the tuned weights back into a copy of the QDQ graph; a run killed part-way resumes from a
checkpoint of its finished units."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.seed import seed_everything

from finetune.calibrate import CalibrationData
from finetune.config import FastFinetune, to_dict
from finetune.export import export_model
from finetune.formats.compiled import EAGER_FORMATS, compiled_kernels, resolve_compile
from finetune.lift import FakeQuantize, LiftedModule, check_liftable, lift_model
from finetune.lift.params import fold_computed_weights
from finetune.onnx import attach_custom_ops
from finetune.onnx.io import load_model, save_model_atomic
from finetune.onnx.session import require_loads

from .adaround import check_int_weights
from .cache import ActivationCache
from .callbacks import Checkpoint, builtin_callbacks, digest, run_fingerprint
from .device import host_memory_kept, resolve_device
from .heldout import hold_out
from .loop import Tuner, UnitResult
from .parallel import make_fabric, sum_across
from .partition import cut
from .prescale import check_pairs
from .reference import SELF_REFERENCE, choose_reference, float_starts
from .report import Warnings, write_report
from .scales import scale_changes, scale_snapshot, with_learned_scales
from .smoothing import carry_smoothing
from .stream import FloatStream, QuantizedStream, cache_inputs
from .units import Unit, find_units

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
    `bf16_as_cast`, bfloat16 quantize-dequantize pairs are written as Cast pairs.
    `callbacks` join the built-in ones in the Fabric that runs the units (hooks: see recon.callbacks)."""
    begin = time.perf_counter()
    device = resolve_device(config.device)
    resolve_compile(config.compile, device.type)  # compile: true without a compiler fails here, auto warns once
    checkpoint = _checkpoint_path(output_dir, name, resume, config.processes)
    original = load_model(qdq_model)
    check_liftable(original)  # every op that cannot be lifted, named at once, before any work
    if attach_ops:
        attach_custom_ops(original)  # a node whose body cannot be written fails here, not after the tuning
    float_proto = load_model(float_model) if float_model is not None else None
    log_dir = Path(output_dir) / f"{name}.logs" if output_dir is not None else None
    saver = Checkpoint(checkpoint) if checkpoint is not None else None
    run_callbacks = [*([saver] if saver else []), *builtin_callbacks(config, log_dir), *callbacks]
    fabric = make_fabric(config, device, run_callbacks)
    job = _Job(original, float_proto, data, config, _Resumption(saver, resume), run_callbacks, attach_ops, bf16_as_cast)
    tuned, report = _tune_data_parallel(fabric, job) if config.processes > 1 else _tune(fabric, job)
    if tuned is None:
        return None, report  # a process other than the first of a data-parallel run: the first one writes
    report["total_seconds"] = time.perf_counter() - begin
    require_loads(tuned, original, "fine-tuning")
    if model_path is not None:
        save_model_atomic(tuned, model_path)
    if output_dir is not None:
        write_report(report, Path(output_dir), name)
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)  # the run is complete: nothing is left to resume
    return tuned, report


class _Job:
    """What a tuning process needs (each process of a data-parallel run gets a copy). A plain class,
    not a dataclass: Fabric's process launcher rebuilds dataclass arguments field by field, which
    frozen ones (the config) refuse."""

    def __init__(self, original: onnx.ModelProto, float_model: onnx.ModelProto | None, data: Any, config: FastFinetune,
                 resumption: _Resumption, callbacks: list[Any], attach_ops: bool, bf16_as_cast: bool) -> None:
        self.original, self.float_model, self.data, self.config = original, float_model, data, config
        self.resumption = resumption
        self.callbacks = callbacks  # the Fabric's, whose on_step_end hooks the Tuner calls directly
        self.attach_ops, self.bf16_as_cast = attach_ops, bf16_as_cast
        self.result_file: Path | None = None  # where the first process of a data-parallel run leaves its results


def _tune_data_parallel(fabric: Fabric, job: _Job) -> tuple[onnx.ModelProto | None, dict[str, Any]]:
    """Launch the processes of a data-parallel run (Fabric's launcher: this process and others
    running this command again, or spawned ones) and take the first one's model and report. These
    come back through a file: a launcher hands results back through a pipe that it reads only after
    every process ended, and a result over the pipe's 64 KiB would block the first one forever."""
    with tempfile.TemporaryDirectory(prefix="finetune-result-") as folder:
        job.result_file = Path(folder) / "result.pt"
        returned = fabric.launch(_tune, job)
        if not job.result_file.is_file():
            return returned  # a process other than the first, which returned what it has
        model_bytes, report = torch.load(job.result_file, weights_only=False)
    return onnx.load_model_from_string(model_bytes), report


def _tune(fabric: Fabric, job: _Job) -> tuple[onnx.ModelProto | None, dict[str, Any]]:
    """Lift, tune every unit and export, in this process (one of a data-parallel run's, or the
    only one). Only the first process exports: the others return no model."""
    config, original, device = job.config, job.original, fabric.device
    sources = {"model": digest(original.SerializeToString()),
               "float_model": digest(job.float_model.SerializeToString()) if job.float_model is not None else None}
    for change in fold_computed_weights(original):  # so a weight computed from constants is tuned too
        logger.info("weights computed from constants: %s", change)
    module = lift_model(original)
    _check_tunable(module)
    warnings = Warnings()
    units = find_units(module, config.op_types, config.include_output_quant, config.unit, warnings)
    if not units:
        raise ValueError(f"the model has no {'/'.join(config.op_types)} layer with a trainable weight to tune")
    if config.algorithm == "adaround" and config.iterations:  # iterations 0: bias correction alone
        check_int_weights(module, units)
    units = with_learned_scales(module, units, config, warnings)
    check_pairs(module, units, config)
    untuned_scales = scale_snapshot(module, units)
    if job.float_model is not None:
        for change in carry_smoothing(job.float_model, original):  # SmoothQuant: the float model in the codes' coordinates
            logger.info("float model smoothed as the quantized one: %s", change)
    reference = choose_reference(module, job.float_model, units, warnings)
    with (_deterministic(config, device), host_memory_kept(device), ActivationCache(config.cache_budget_bytes) as cache,
          compiled_kernels(resolve_compile(config.compile, device.type), max(1, config.iterations)) as kernels):
        tuner, timing = _run(module, reference, units, original, job, fabric, cache, warnings, sources)
        cache_stats = {"peak_bytes_in_memory": cache.peak_in_memory, "peak_bytes_on_disk": cache.peak_on_disk,
                       "spilled_arrays": cache.spilled}
    report = _report(config, device, reference is module, tuner, [*warnings, *tuner.warnings], timing, cache_stats)
    report["kernels"] = kernels.summary()
    if config.learn_scales:  # learned scales quantize eager: the kernels carry no scale gradient
        report["learned_scales"] = scale_changes(module, units, untuned_scales, config)
        report["kernels"]["eager_formats"]["a learned scale"] = EAGER_FORMATS["a learned scale"]
    if not fabric.is_global_zero:
        return None, report
    module.cpu()
    tuned = export_model(module, original, job.attach_ops, job.bf16_as_cast)
    if job.result_file is None:
        return tuned, report
    torch.save((tuned.SerializeToString(), report), job.result_file)
    return None, report


@dataclasses.dataclass(frozen=True)
class _Resumption:
    """The checkpoint the run keeps (None: none) and whether it resumes from it."""

    checkpoint: Checkpoint | None
    resume: bool


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


def _check_tunable(module: LiftedModule) -> None:
    """Refuse, before any work, a model with nothing to tune (no quantizer: it is a float model) or
    a trainable weight holding NaN or Inf (its unit's loss could not be measured)."""
    if not any(isinstance(m, FakeQuantize) for m in module.modules()):
        raise ValueError("the model has no quantizers (QuantizeLinear/DequantizeLinear or BFP/MX quantize-dequantize "
                         "nodes), so there is nothing to tune: quantize it first (finetune quantize --finetune ...)")
    for name, source in module.finetune_params.items():
        if not torch.isfinite(module.get_parameter(name)).all():
            raise ValueError(f"the weight {source.initializer!r} holds NaN or Inf values: fix or retrain the model "
                             "before tuning it")


def _run(module: LiftedModule, reference: LiftedModule, units: list[Unit], original: onnx.ModelProto, job: _Job,
         fabric: Fabric, cache: ActivationCache, warnings: Warnings, sources: dict[str, str | None]) -> tuple[Tuner, dict[str, float]]:
    """Cache the inputs (this process's share of the calibration batches), then tune unit after
    unit, advancing the float and the quantized stream to each; units a resumed run finished
    earlier get their kept weights back where tuning would have left them, so both streams pass
    through them exactly as before. The checkpoint is saved before a user's callbacks hear of a
    unit's end."""
    device, config = fabric.device, job.config
    feeds = CalibrationData(job.data, original, limit=config.data_size)
    inputs = cache_inputs(feeds, [info.name for info in feeds.inputs], cache, fabric.global_rank, fabric.world_size)
    samples = int(sum_across(fabric, [inputs[0].rows])[0])
    if samples < config.batch_size:
        warnings.add("fast_finetune.batch_size", f"{config.batch_size} is more than the {samples} calibration samples: "
                     f"every training batch holds all {samples} (lower batch_size, or give more data)", "config")
    module.to(device)
    reference.to(device)
    held_out, guard = hold_out(module, reference, units, inputs, config, fabric, warnings)
    starts = float_starts(module, reference, units) if reference is not module else {}
    plan = cut(module, units)
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    floats = FloatStream(reference, units, inputs, cache, device, quantizers_off=reference is module)
    stream = QuantizedStream(plan, placeholders, inputs, cache, device)
    tuner = Tuner(config, fabric, units, job.callbacks, held_out)
    checkpoint = job.resumption.checkpoint
    finished_weights = {}
    if checkpoint is not None:
        checkpoint.fingerprint = run_fingerprint(sources, config, inputs)
        finished_weights = checkpoint.start(tuner, job.resumption.resume)
    with tuner:
        for k, unit in enumerate(units):
            float_inputs, targets = floats.advance(k)
            unit_inputs = stream.before(k, unit)
            if k < tuner.resumed_units:
                tuner.restore(k, module, finished_weights)
            else:
                tuner.tune(k, module, plan.train[k], unit_inputs, float_inputs, targets, starts, stream.side_inputs(unit))
            for value in (float_inputs, *targets):
                cache.release(value.name)
            stream.after(k)
    checked = guard.check(warnings) if guard is not None else None
    if guard is not None:
        guard.release(cache)
    return tuner, {"float_pass_seconds": floats.seconds, "quantized_stream_seconds": stream.seconds, "samples": samples,
                   "held_out": checked}


@contextlib.contextmanager
def _deterministic(config: FastFinetune, device: torch.device) -> Iterator[None]:
    """Seeded, deterministic algorithms (warn_only with `deterministic: warn`) and TF32 as the
    config says inside the block, the global settings restored after. cuBLAS reads its workspace
    setting when it starts, so it is set before any CUDA work. An op without a deterministic kernel
    becomes a one-line error naming it and the switch, not a traceback from inside backward. Torch's
    NaN filling of every new uninitialised tensor, which deterministic mode turns on, stays off: no
    kernel here reads memory it did not write (tuned bytes are equal either way), so the filling
    only costs a pass over each new tensor."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.utils.deterministic.fill_uninitialized_memory)
    seed_everything(config.seed, verbose=False)
    torch.use_deterministic_algorithms(True, warn_only=config.deterministic == "warn")
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.allow_tf32
    try:
        yield
    except RuntimeError as error:
        op, found, _ = str(error).partition(" does not have a deterministic implementation")
        if not found:
            raise
        raise ValueError(f"{op.strip()} has no deterministic kernel on {device}: set fast_finetune.deterministic: warn to run "
                         "it anyway (results may then differ from run to run), or tune on another device") from error
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous[2], previous[3]
        torch.utils.deterministic.fill_uninitialized_memory = previous[4]


def _report(config: FastFinetune, device: torch.device, self_reference: bool, tuner: Tuner, warnings: list[dict[str, str]],
            timing: dict[str, float], cache_stats: dict[str, int]) -> dict[str, Any]:
    """The run's numbers: settings, per-unit losses and status, timing and cache use, the units
    restored from a checkpoint, and the warnings (what was left out or undid, and why)."""
    results: list[UnitResult] = tuner.results
    iterations = sum(r.iterations for r in results)
    train_seconds = sum(r.seconds for r in results)
    return {
        "algorithm": config.algorithm,
        "config": to_dict(config),
        "device": str(device),
        "float_reference": SELF_REFERENCE if self_reference else "float model",
        "samples": timing["samples"],
        "units": [dataclasses.asdict(r) for r in results],
        "kept": sum(r.status == "kept" for r in results),
        "reverted": sum(r.status.startswith("reverted") for r in results),
        "resumed_units": tuner.resumed_units,
        "warnings": warnings,
        "iterations": iterations,
        "seconds_per_unit_iteration": train_seconds / iterations if iterations else None,
        "float_pass_seconds": timing["float_pass_seconds"],
        "quantized_stream_seconds": timing["quantized_stream_seconds"],
        "cache": cache_stats,
        "processes": tuner.fabric.world_size,
        "held_out": timing["held_out"],
        "lr_search": dataclasses.asdict(tuner.rate_search) if tuner.rate_search else None,
    }
