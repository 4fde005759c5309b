"""What each process of a tuning run does: lift the QDQ model, find its units and let the run's
methods prepare them, cache its share of the calibration inputs, tune unit after unit while the
float and the quantized stream advance to each, and (the first process) write the tuned weights back
into a copy of the QDQ graph."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

import onnx
import torch
from lightning.fabric import Fabric

from finetune.calibrate import CalibrationData
from finetune.config import FastFinetune, to_dict
from finetune.export import export_model
from finetune.formats.compiled import compiled_kernels, resolve_compile
from finetune.host_memory import HEAP_SLACK, LARGE_RUN_BYTES, release_freed_host_memory
from finetune.lift import FakeQuantize, LiftedModule, check_lifted, lift_model
from finetune.lift.params import fold_computed_weights
from finetune.notices import Warnings
from finetune.onnx.io import goes_by_file, model_digest, put_back, set_aside

from .audit import nondeterministic_on_cuda, refuse_nondeterministic
from .checkpoint import Checkpoint, run_fingerprint
from .data.cache import ActivationCache
from .data.heldout import hold_out
from .data.reference import SELF_REFERENCE, choose_reference, float_starts
from .data.shards import sum_across
from .data.sharing import SharedWeights, coded_float_names, float_weights
from .data.smoothing import carry_smoothing
from .data.streams import FloatStream, QuantizedStream, cache_inputs
from .device import deterministic, device_name, host_memory_kept
from .methods import Method, run_methods
from .results import UnitResult
from .threads import ThreadPolicy, thread_policy
from .tuner import Tuner
from .units import Plan, Unit, cut, find_units

logger = logging.getLogger(__name__)


class Job:
    """What a tuning process needs (each process of a data-parallel run gets a copy): the QDQ model,
    the float model (None: the QDQ model with its quantizers off; a file with external data is loaded
    without it, each tensor read from `float_folder` as it is lifted), the calibration data, the settings,
    the checkpoint it keeps (None: none) and whether it resumes from it, the Fabric's callbacks (whose
    on_step_end hooks the tuner calls directly) and how the tuned model is written. A plain class:
    see processes.launch."""

    def __init__(self, original: onnx.ModelProto, float_model: onnx.ModelProto | None, data: Any, config: FastFinetune,
                 checkpoint: Checkpoint | None, resume: bool, callbacks: list[Any], attach_ops: bool, bf16_as_cast: bool,
                 float_folder: Path | None = None) -> None:
        self.original, self.float_model, self.data, self.config = original, float_model, data, config
        self.float_folder = float_folder  # where the float model's external data is read from, one tensor at a time
        self.checkpoint, self.resume, self.callbacks = checkpoint, resume, callbacks
        self.attach_ops, self.bf16_as_cast = attach_ops, bf16_as_cast


@dataclasses.dataclass
class _Run:
    """A process's lifted model with its units, the run's methods, its float reference and warnings,
    and the folder its QDQ model's tensors were set aside in (None: they stay in the proto)."""

    module: LiftedModule
    units: list[Unit]
    methods: list[Method]
    reference: LiftedModule
    warnings: Warnings
    aside: Path | None


def tune_process(fabric: Fabric, job: Job) -> tuple[onnx.ModelProto | None, dict[str, Any]]:
    """Lift, tune every unit and export, in this process (one of a data-parallel run's, or the
    only one). Only the first process exports: the others return no model."""
    config, device = job.config, fabric.device
    sources = {"model": model_digest(job.original),
               "float_model": model_digest(job.float_model, job.float_folder) if job.float_model is not None else None}
    with thread_policy(config.threads, device, fabric.world_size) as threads:
        return _tune_and_export(fabric, job, sources, threads)


def _tune_and_export(fabric: Fabric, job: Job, sources: dict[str, str | None],
                     threads: ThreadPolicy | None) -> tuple[onnx.ModelProto | None, dict[str, Any]]:
    """tune_process's work, under the run's thread policy. From its lift on, a QDQ model of
    BY_FILE_BYTES or more keeps its tensors' bytes in a temporary file (_set_aside)."""
    config, device = job.config, fabric.device
    with tempfile.TemporaryDirectory(prefix="finetune-aside-") as folder:
        run = _prepare(job, Path(folder))
        release_freed_host_memory()  # the lifts' temporaries
        with (deterministic(config.seed, config.deterministic, config.allow_tf32, device), host_memory_kept(device),
              ActivationCache(config.cache_budget_bytes) as cache,
              compiled_kernels(resolve_compile(config.compile, device.type), max(1, config.iterations)) as kernels):
            tuner, timing = _tune_units(run, job, fabric, cache, sources, threads)
            cache_stats = {"peak_bytes_in_memory": cache.peak_in_memory, "peak_bytes_on_disk": cache.peak_on_disk,
                           "spilled_arrays": cache.spilled}
        report = _report(config, device, run.reference is run.module, tuner, [*run.warnings, *tuner.warnings], timing,
                         cache_stats)
        report["kernels"] = kernels.summary()
        report["threads"] = threads.summary() if threads is not None else None
        for method in run.methods:
            report.update(method.report(run.module, run.units))
        if not fabric.is_global_zero:
            return None, report
        run.module.cpu()
        return _export(run, job), report


def _export(run: _Run, job: Job) -> onnx.ModelProto:
    """The tuned model, written into the job's own copy of the QDQ model. Where its tensors were set aside,
    they come back from there but the tuned ones, which the export replaces whole (their old codes would
    be read only to be dropped: 0.29 GiB at 2.5 GB), and then any it did not replace."""
    if run.aside is None:
        return export_model(run.module, job.original, job.attach_ops, job.bf16_as_cast, in_place=True)
    tuned = {source.initializer for source in run.module.finetune_params.values()}
    model = export_model(run.module, put_back(job.original, run.aside, skip=tuned), job.attach_ops, job.bf16_as_cast,
                         in_place=True)
    return put_back(model, run.aside)


def _prepare(job: Job, aside: Path) -> _Run:
    """The lifted QDQ model, its units as the run's methods prepared them, and the float reference."""
    config, original = job.config, job.original
    for change in fold_computed_weights(original):  # so a weight computed from constants is tuned too
        logger.info("weights computed from constants: %s", change)
    float_module, coded = None, {}
    if job.float_model is not None:
        for change in carry_smoothing(job.float_model, original, job.float_folder):  # SmoothQuant: the float model in the codes' coordinates
            logger.info("float model smoothed as the quantized one: %s", change)
        coded = coded_float_names(original, job.float_model)
    folder = _set_aside(job, aside)
    if job.float_model is not None:
        float_module = lift_model(job.float_model, owned=True, folder=job.float_folder)
        job.float_model = None  # its proto, a copy of the weights, is freed before the QDQ model is lifted
        release_freed_host_memory()  # and the float lift's temporaries
    module = lift_model(job.original, reuse=float_weights(float_module, coded), folder=folder)
    _check_tunable(module)
    warnings = Warnings()
    units = find_units(module, config.op_types, config.include_output_quant, config.unit, warnings)
    if not units:
        raise ValueError(f"the model has no {'/'.join(config.op_types)} layer with a trainable weight to tune")
    methods = run_methods(config)
    for method in methods:
        units = method.prepare(module, units, warnings)
    return _Run(module, units, methods, choose_reference(module, float_module, units, warnings), warnings, folder)


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


def _tune_units(run: _Run, job: Job, fabric: Fabric, cache: ActivationCache, sources: dict[str, str | None],
                threads: ThreadPolicy | None) -> tuple[Tuner, dict[str, Any]]:
    """Cache the inputs (this process's share of the calibration batches), then tune unit after
    unit, advancing the float and the quantized stream to each; units a resumed run finished
    earlier get their kept weights back where tuning would have left them, so both streams pass
    through them exactly as before. The checkpoint is saved before a user's callbacks hear of a
    unit's end."""
    device, config, module, reference, units = fabric.device, job.config, run.module, run.reference, run.units
    feeds = CalibrationData(job.data, job.original, limit=config.data_size)
    inputs = cache_inputs(feeds, [info.name for info in feeds.inputs], cache, fabric.global_rank, fabric.world_size)
    plan = cut(module, units)
    sample = [value.tensor(0, torch.device("cpu")) for value in inputs]
    trims = sum(p.numel() * p.element_size() for p in module.parameters()) >= LARGE_RUN_BYTES  # free heap back after each unit
    _check_before_any_work(run, job, plan, sample, device)
    if threads is not None:
        threads.begin(module, units, sample, config.batch_size)
    samples = int(sum_across(fabric, [inputs[0].rows])[0])
    _settings_warnings(run.warnings, config, fabric, samples)
    module.to(device)
    reference.to(device)
    held_out, guard = hold_out(module, reference, units, inputs, config, fabric, run.warnings)
    starts = float_starts(module, reference, units) if reference is not module else {}
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    floats = FloatStream(reference, units, inputs, cache, device, quantizers_off=reference is module)
    sharing = SharedWeights(module, reference, units, floats.segments) if reference is not module else None
    stream = QuantizedStream(plan, placeholders, inputs, cache, device)
    tuner = Tuner(config, fabric, units, job.callbacks, held_out, run.methods, cache)
    if job.checkpoint is not None:
        counts = threads.fingerprint() if threads is not None else torch.get_num_threads()
        job.checkpoint.fingerprint = run_fingerprint(sources, config, inputs, counts)
        job.checkpoint.start(tuner, job.resume)
    with tuner:
        for k, unit in enumerate(units):
            if threads is not None:
                threads.unit(k, unit)
            float_inputs, targets = floats.advance(k)
            unit_inputs = stream.before(k, unit)
            if sharing is not None:
                sharing.before_unit(k, unit)
            if k < tuner.resumed_units:
                tuner.restore(k, module, job.checkpoint.unit_weights(k))  # type: ignore[union-attr]  (resumed: one is kept)
            else:
                tuner.tune(k, module, plan.train[k], unit_inputs, float_inputs, targets, starts, stream.side_inputs(unit))
            for value in (float_inputs, *targets):
                cache.release(value.name)
            if sharing is not None:
                sharing.after_unit(k, starts)
            stream.after(k)
            if trims:
                release_freed_host_memory(at_least=HEAP_SLACK)
    checked = guard.check(run.warnings) if guard is not None else None
    if guard is not None:
        guard.release(cache)
    return tuner, {"float_pass_seconds": floats.seconds, "quantized_stream_seconds": stream.seconds, "samples": samples,
                   "held_out": checked, "weights_held_once": sharing.summary() if sharing is not None else None}


def _settings_warnings(warnings: Warnings, config: FastFinetune, fabric: Fabric, samples: int) -> None:
    """Warnings about settings that the data or the processes let the run honour only in part (it goes on)."""
    if samples < config.batch_size:
        warnings.add("fast_finetune.batch_size", f"{config.batch_size} is more than the {samples} calibration samples: "
                     f"every training batch holds all {samples} (lower batch_size, or give more data)", "config")
    if config.pieces % fabric.world_size:
        warnings.add("fast_finetune.gradient_pieces", f"{config.pieces} is not a multiple of the {fabric.world_size} "
                     f"processes: their steps are no one-process run's bit for bit (leave it auto, or set a multiple "
                     f"of {fabric.world_size}, to compare with a one-process run of that many pieces)", "config")


def _set_aside(job: Job, aside: Path) -> Path | None:
    """From BY_FILE_BYTES on, the QDQ model keeps its tensors' bytes in `aside` once its constants are
    folded: it is lifted one tensor at a time from there (no copy of the proto with its weights),
    onnxruntime's check reads them there, and they are read again only to be written (see _export).
    The folder, or None where the model stays in memory."""
    if not goes_by_file(job.original):
        return None
    job.original = set_aside(job.original, aside)
    release_freed_host_memory()
    return aside


def _check_before_any_work(run: _Run, job: Job, plan: Plan, sample: list[torch.Tensor], device: torch.device) -> None:
    """On the first calibration batch, on the CPU, before the streams start: the lifted module computes
    what onnxruntime computes (lift.check_lifted, from the set-aside data where the model was set
    aside), and no unit's step runs an op without a deterministic CUDA kernel where a CUDA run asks
    for determinism (see audit). onnxruntime's freed memory goes back to the system before the audit."""
    check_lifted(job.original, run.module, sample, run.aside)
    release_freed_host_memory()
    with compiled_kernels(False):
        backward = run.methods[0].optimising()  # type: ignore[attr-defined]  (the first method is the algorithm)
        found = nondeterministic_on_cuda(run.module, run.units, plan, sample, backward)
    refuse_nondeterministic(found, device, job.config.deterministic, run.warnings.add)


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
        "device": device_name(device),
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
        "weights_held_once": timing["weights_held_once"],
        "lr_search": dataclasses.asdict(tuner.rate_search) if tuner.rate_search else None,
    }
