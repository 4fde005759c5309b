"""Automatic mixed precision: quantize the model once per rung, lift each, and measure every target
layer's sensitivity in the switchable torch model (prepare_mixed_precision, shared by every target);
then, per target, search the assignment (search.Search), write the chosen configuration as a real
QDQ model, fine-tune it if the config asks, and re-measure the metric in onnxruntime (PreparedSearch.choose):
the number the report states, which must meet the target."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from finetune.calibrate.tokens import logits_output_index
from finetune.config import ConfigError, QuantConfig, load_config
from finetune.config.automp import AutoMixedPrecision
from finetune.onnx.io import has_external_data, load_model, save_model_atomic
from finetune.quantize import quantize_model

from .ladder import Item, Rung, assigned_config, ladders, search_items
from .measure import (
    Evaluation,
    average_bits,
    evaluation_set,
    ladder_key,
    onnxruntime_metric,
    sensitivity,
    switch_source,
    torch_metric,
)
from .metrics import Metric, MetricFn, resolve_metric
from .parallel import Processes
from .report import build_report, held, summary_line, write_report
from .search import Point, Search
from .switch import SwitchableModel

logger = logging.getLogger(__name__)

MAX_REPAIRS = 64  # raises of one layer after onnxruntime missed the target, before giving up


@dataclass
class AutoMPResult:
    """The final model, the config that makes it (node overrides per searched layer) and the report."""

    model: onnx.ModelProto
    config: QuantConfig
    report: dict[str, Any]
    summary: dict[str, Any]  # the quantizer's summary of the final model
    finetune_report: dict[str, Any] | None


@dataclass
class PreparedSearch:
    """A model quantized at every rung, lifted, and measured: each searched layer alone at each lower
    rung and the uniform rungs. Every target's choice starts from these measurements, the search's
    costly part, so several targets pay for them once (`choose`)."""

    model: str | Path | onnx.ModelProto
    config: QuantConfig
    data: Any
    metric: Metric
    rungs: dict[str, list[Rung]]
    base: QuantConfig  # the config without the search, tuning or storage options: what the candidates are quantized with
    items: list[Item]
    evaluation: Evaluation
    float_value: float
    switch: SwitchableModel
    search: Search  # its trace ends with the uniform points; each choice goes on from a copy
    uniform: list[Point]
    seconds: dict[str, float]  # "sensitivity" (lifting the rungs included) and "prepare" (all of it)
    choices_made: int = 0

    def choose(self, target: float | None = None, *, max_drop: float | None = None, keep_top: int | None = None,
               lower: int | None = None, output_dir: str | Path | None = None, name: str = "automp", model_path: str | Path | None = None,
               curve_points: int = 0) -> AutoMPResult:
        """The final model for one goal (at most one of `target`, `max_drop`, `keep_top`, `lower`; none:
        the config's), as a fresh auto_mixed_precision with that goal gives it. With `output_dir`,
        `<name>.json` and `<name>.png` go there; with `model_path`, the model is written there
        (atomically) before the report."""
        begin = time.perf_counter()
        config = _with_goal(self.config, {"target": target, "max_drop": max_drop, "keep_top": keep_top, "lower": lower})
        settings = config.auto_mixed_precision
        goal = _target(settings, self.metric, self.float_value)
        search, assignment = self._search(config, goal, curve_points)
        search_seconds = time.perf_counter() - begin
        final, summary, assignment, measured, repairs, finetune_report = _final_model(
            self.model, config, self.base, self.items, assignment, self.rungs, self.data, self.evaluation, self.metric, goal,
            search)
        final_config = dataclasses.replace(assigned_config(config, self.items, list(assignment), self.rungs),
                                           weight_storage=config.weight_storage, bf16_as_cast=config.bf16_as_cast,
                                           fast_finetune=config.fast_finetune)
        report = build_report(
            settings=settings, metric=self.metric, target=goal, float_value=self.float_value, items=self.items,
            rungs=self.rungs, search=search, switch=self.switch, assignment=assignment, uniform=self.uniform,
            onnxruntime_metric=measured, repairs=repairs, evaluation_source=self.evaluation.source,
            samples=len(self.evaluation.float_outputs), finetune=finetune_report,
            bits=average_bits(self.switch, self.items, assignment, settings),
            seconds=self._seconds(search_seconds, finetune_report, time.perf_counter() - begin))
        self.choices_made += 1
        if model_path is not None:
            save_model_atomic(final, model_path, external_data=has_external_data(self.model))
        if output_dir is not None:
            write_report(report, Path(output_dir), name)
        logger.info(summary_line(report))
        return AutoMPResult(final, final_config, report, summary, finetune_report)

    def _search(self, config: QuantConfig, goal: float, curve_points: int) -> tuple[Search, tuple[int, ...]]:
        """A copy of the prepared search taken on to the assignment meeting `goal` (or keeping the
        config's keep_top layers high), then over `curve_points` prefixes; the copy and the assignment."""
        settings = config.auto_mixed_precision
        search = self.search.copy()
        if settings.finetune_in_loop:
            search.evaluate = lambda a: _measure_tuned(self.model, self.base, config, self.items, a, self.rungs, self.data,
                                                       self.evaluation, self.metric)
        if settings.keep_top is not None:
            assignment = search.keep_top(settings.keep_top)
        elif settings.lower is not None:
            assignment = search.lower(settings.lower)
        else:
            assignment = search.run(goal)
        search.curve(curve_points)
        return search, assignment

    def _seconds(self, search: float, finetune_report: dict | None, choice: float) -> dict[str, float]:
        """The report's wall times: the preparation's sensitivity, this choice's search and tuning, and
        a total of the two (what a fresh run takes); after the first choice, `sensitivity_shared`
        says the sensitivity was measured for an earlier one."""
        seconds = {"sensitivity": self.seconds["sensitivity"], "search": search,
                   "finetune": finetune_report["total_seconds"] if finetune_report else 0.0,
                   "total": self.seconds["prepare"] + choice}
        return {**seconds, "sensitivity_shared": True} if self.choices_made else seconds


def prepare_mixed_precision(
    model: str | Path | onnx.ModelProto, config: QuantConfig | str | dict, data: Any,
    metric: str | MetricFn | Metric | None = None, labels: np.ndarray | None = None, evaluation_data: Any = None,
) -> PreparedSearch:
    """Everything a search for `config`'s auto_mixed_precision section shares across targets: the
    model quantized on `data` (calibration; also the evaluation set unless `evaluation_data` or the
    section's evaluation_data names another) at every rung and lifted, and the sensitivity of each
    searched layer judged by `metric` (default the section's). Bad input is refused before the long work."""
    begin = time.perf_counter()
    config = _search_config(config)
    settings = config.auto_mixed_precision
    chosen_metric = resolve_metric(metric if metric is not None else settings.metric)
    rungs = ladders(settings)
    base = dataclasses.replace(config, auto_mixed_precision=None, fast_finetune=None, weight_storage="float", bf16_as_cast=False)
    base_quantized = quantize_model(model, base, data)
    if chosen_metric.needs_tokens:  # language-model metrics judge the logits, whichever output index the section names
        settings = dataclasses.replace(settings, output_index=logits_output_index(base_quantized.float_model))
        config = dataclasses.replace(config, auto_mixed_precision=settings)
    items, fixed = search_items(base_quantized.float_model, base, settings)
    if not items:
        raise ValueError(f"auto_mixed_precision: the model has no node of the target op types {list(settings.target_op_types)} "
                         "to search (or all are excluded)")
    evaluation = evaluation_set(base_quantized.float_model, evaluation_data or settings.evaluation_data, data, labels, settings,
                                chosen_metric)
    float_value = chosen_metric(evaluation.float_outputs, evaluation.float_outputs, evaluation.labels)
    started = time.perf_counter()
    source = switch_source(model, base, base_quantized.model, items, rungs, data)
    switch = source.build()
    switch.measure_activations(evaluation.batches[0])
    search, uniform = _measured_search(switch, items, fixed, rungs, evaluation, settings, chosen_metric,
                                       Processes.of(config.fast_finetune, source))
    seconds = {"sensitivity": time.perf_counter() - started, "prepare": time.perf_counter() - begin}
    return PreparedSearch(model, config, data, chosen_metric, rungs, base, items, evaluation, float_value, switch, search,
                          uniform, seconds)


def _search_config(config: QuantConfig | str | dict) -> QuantConfig:
    """The config loaded, refused in one line without an auto_mixed_precision section, or when it
    tunes in the loop without a fast_finetune section to tune with."""
    config = load_config(config)
    settings = config.auto_mixed_precision
    if settings is None:
        raise ValueError("the config has no auto_mixed_precision section")
    if settings.finetune_in_loop and config.fast_finetune is None:
        raise ValueError("auto_mixed_precision.finetune_in_loop tunes each candidate with the config's fast_finetune section "
                         "(loop_iterations each): add one, e.g. fast_finetune: {algorithm: adaquant}")
    return config


def _measured_search(switch: SwitchableModel, items: list[Item], fixed: frozenset[int], rungs: dict[str, list[Rung]],
                     evaluation: Evaluation, settings: AutoMixedPrecision, metric: Metric,
                     processes: Processes | None) -> tuple[Search, list[Point]]:
    """A search over the switchable model with the top, each item alone at each lower rung (the
    sensitivity, split over `processes` if any) and the uniform rungs measured; the search and the
    uniform points."""
    search = Search([len(rungs[ladder_key(item)]) for item in items],
                    lambda a: torch_metric(switch, items, a, evaluation, settings, metric),
                    lambda a: average_bits(switch, items, a, settings)[0], metric, fixed, lambda a: held(items, rungs, a))
    search.measure_sensitivity(lambda assignments: sensitivity(switch, items, search.top, assignments, evaluation, settings,
                                                               metric, processes))
    uniform = [search.measure(tuple(min(r, count - 1) for count in search.rungs), "uniform")
               for r in range(max(search.rungs) - 1)]
    return search, uniform


def auto_mixed_precision(
    model: str | Path | onnx.ModelProto, config: QuantConfig | str | dict, data: Any,
    metric: str | MetricFn | Metric | None = None, labels: np.ndarray | None = None, evaluation_data: Any = None,
    output_dir: str | Path | None = None, name: str = "automp", model_path: str | Path | None = None, curve_points: int = 0,
) -> AutoMPResult:
    """Search per-layer precision for `config`'s auto_mixed_precision section: `prepare_mixed_precision`,
    then the choice for the section's goal (see both for the arguments)."""
    prepared = prepare_mixed_precision(model, config, data, metric=metric, labels=labels, evaluation_data=evaluation_data)
    return prepared.choose(output_dir=output_dir, name=name, model_path=model_path, curve_points=curve_points)


def _with_goal(config: QuantConfig, goal: dict[str, float | int | None]) -> QuantConfig:
    """The config with the goal given (one value per key of GOALS) in place of its section's
    (unchanged when none is given); the section's checks refuse two goals or a target out of the
    metric's range."""
    if all(value is None for value in goal.values()):
        return config
    try:
        settings = dataclasses.replace(config.auto_mixed_precision, **goal)
    except ConfigError as error:
        raise error.under("auto_mixed_precision") from None
    return dataclasses.replace(config, auto_mixed_precision=settings)


def _target(settings: AutoMixedPrecision, metric: Metric, float_value: float) -> float:
    """The target the final model must meet: given, or `max_drop` from the float model's value
    (for keep_top and lower, which have none, the float value: reported only)."""
    if settings.target is not None:
        return settings.target
    if settings.max_drop is not None:
        return metric.target_from_drop(float_value, settings.max_drop)
    return float_value


def _tune(quantized: Any, config: QuantConfig, data: Any, iterations: int | None = None) -> tuple[onnx.ModelProto, dict]:
    from finetune.recon import finetune_model  # lightning takes seconds to import: only when tuning

    settings = config.fast_finetune if iterations is None else dataclasses.replace(config.fast_finetune, iterations=iterations)
    return finetune_model(quantized.model, data, settings, quantized.float_model, bf16_as_cast=config.bf16_as_cast)


def _measure_tuned(model: Any, base: QuantConfig, config: QuantConfig, items: list[Item], assignment: tuple[int, ...],
                   rungs: dict[str, list[Rung]], data: Any, evaluation: Evaluation, metric: Metric) -> tuple[float, float]:
    """(metric, relative L2) in onnxruntime of the assignment quantized and fine-tuned with the
    config's fast_finetune at the loop's iteration budget (finetune_in_loop)."""
    quantized = quantize_model(model, assigned_config(base, items, list(assignment), rungs), data)
    tuned, _ = _tune(quantized, config, data, config.auto_mixed_precision.loop_iterations)
    return onnxruntime_metric(tuned, evaluation, metric, config.auto_mixed_precision.output_index)


def _final_model(model: Any, config: QuantConfig, base: QuantConfig, items: list[Item], assignment: tuple[int, ...],
                 rungs: dict[str, list[Rung]], data: Any, evaluation: Evaluation, metric: Metric, target: float,
                 search: Search) -> tuple[onnx.ModelProto, dict, tuple[int, ...], float, int, dict | None]:
    """The chosen assignment as a QDQ model, measured in onnxruntime; while it misses the target,
    the lowered layer adding the most noise per bit is raised one rung (a repair, logged); then
    the config's fast finetune, after which the target must still be met."""
    settings = config.auto_mixed_precision
    judged = settings.keep_top is None and settings.lower is None
    final_config = lambda a: dataclasses.replace(assigned_config(base, items, list(a), rungs),
                                                 weight_storage=config.weight_storage)
    quantized = quantize_model(model, final_config(assignment), data)
    measured, _ = onnxruntime_metric(quantized.model, evaluation, metric, settings.output_index)
    repairs = 0
    while judged and not metric.meets(measured, target):
        if repairs == MAX_REPAIRS:
            raise ValueError(f"{metric.name} in onnxruntime is {measured:.6g}, missing the target {target:g} after "
                             f"{repairs} repairs: torch and onnxruntime disagree on this model")
        logger.warning("%s in onnxruntime is %.6g, missing the target %g that torch measured as met: raising one layer",
                       metric.name, measured, target)
        assignment = search.raise_one(assignment)
        quantized = quantize_model(model, final_config(assignment), data)
        measured, l2 = onnxruntime_metric(quantized.model, evaluation, metric, settings.output_index)
        search.record(assignment, measured, l2, "repair")
        repairs += 1
    final = quantized.model
    finetune_report = None
    if config.fast_finetune is not None:
        final, finetune_report = _tune(quantized, config, data)
        measured, _ = onnxruntime_metric(final, evaluation, metric, settings.output_index)
        if judged and not metric.meets(measured, target):
            raise ValueError(f"after fast finetune, {metric.name} in onnxruntime is {measured:.6g}, missing the target "
                             f"{target:g} it met before tuning: run without fast_finetune or with fewer iterations")
    elif config.bf16_as_cast:
        from finetune.onnx.qdq import bf16_pairs_to_casts

        bf16_pairs_to_casts(final)
    return load_model(final), quantized.summary, assignment, measured, repairs, finetune_report
