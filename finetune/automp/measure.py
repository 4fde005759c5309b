"""What the search measures with: the evaluation set (read once, with the float model's outputs),
the switchable torch model filled from the model quantized at each rung, and the metric, relative
L2 and average bits of an assignment there or of a model in onnxruntime."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from finetune.calibrate import CalibrationData, data_labels, model_inputs
from finetune.calibrate.tokens import next_token_targets
from finetune.config import QuantConfig
from finetune.config.automp import AutoMixedPrecision
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model

from .ladder import Item, Rung, assigned_config
from .metrics import Metric, check_outputs, relative_l2
from .parallel import Processes
from .resume import candidate_outputs, cut_tails
from .switch import SwitchableModel, SwitchSource

logger = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """The evaluation set: torch batches in graph-input order, float outputs, labels."""

    feeds: list[dict[str, np.ndarray]]
    batches: list[tuple[torch.Tensor, ...]]
    float_outputs: np.ndarray
    labels: np.ndarray | None
    source: str


def evaluation_set(float_model: onnx.ModelProto, source: Any, data: Any, labels: np.ndarray | None,
                   settings: AutoMixedPrecision, metric: Metric) -> Evaluation:
    """Read the evaluation data once, run the float model on it in onnxruntime, and check the
    metric can be computed (labels, score outputs) before any search."""
    own = source is not None
    source = source if own else data
    if source is None:
        raise ValueError("auto mixed precision needs data: pass --data (or data= in Python)")
    feeds = list(CalibrationData(source, float_model))
    labels = labels if labels is not None else data_labels(source, float_model)
    if metric.needs_tokens:
        labels = next_token_targets(feeds)
    session = inference_session(float_model)
    outputs = session.get_outputs()
    if settings.output_index >= len(outputs):
        raise ValueError(f"auto_mixed_precision.output_index {settings.output_index}: the model has {len(outputs)} output(s)")
    float_outputs = _onnxruntime_outputs(session, feeds, settings.output_index)
    check_outputs(metric, float_outputs, None if labels is None else np.asarray(labels), settings.output_index)
    names = [info.name for info in model_inputs(float_model)]
    batches = [tuple(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in names) for feed in feeds]
    described = str(source) if isinstance(source, (str, Path)) else type(source).__name__
    return Evaluation(feeds, batches, float_outputs, labels, described if own else f"the calibration data ({described})")


def switch_source(model: Any, base: QuantConfig, base_model: onnx.ModelProto, items: list[Item],
                  rungs: dict[str, list[Rung]], data: Any) -> SwitchSource:
    """What the switchable model is lifted from: the base model, and the model quantized at each rung."""
    quantized = {}
    for key, config in _uniform_configs(base, items, rungs).items():
        logger.info("quantizing every searched layer at rung %s", key)
        quantized[key] = quantize_model(model, config, data).model
    return SwitchSource(base_model, quantized, tuple(dict.fromkeys((item.node, item.op_type) for item in items)))


def _uniform_configs(base: QuantConfig, items: list[Item], rungs: dict[str, list[Rung]]) -> dict[str, QuantConfig]:
    """One config per model key: every searched layer at that rung (for a split ladder, that
    rung of one role and the top rung of the other)."""
    layers = [Item(node, op_type, "layer", "layer") for node, op_type in dict.fromkeys((i.node, i.op_type) for i in items)]
    if "layer" in rungs:
        return {f"layer{r}": assigned_config(base, layers, [r] * len(layers), rungs) for r in range(len(rungs["layer"]))}
    configs = {}
    top = {role: rungs[role][-1] for role in ("activation", "weight")}
    for role, other in (("activation", "weight"), ("weight", "activation")):
        for r, rung in enumerate(rungs[role]):
            mixed = {role: rung, other: top[other]}
            ladder = {"layer": [Rung(rung.name, mixed["activation"].activation, mixed["weight"].weight)]}
            configs[f"{role}{r}"] = assigned_config(base, layers, [0] * len(layers), ladder)
    return configs


def ladder_key(item: Item) -> str:
    """The ladder whose length is an item's rung count (a layer item of a split ladder: the activation
    one, both being of one length)."""
    return "activation" if item.ladder == "split" else item.ladder


def _keys(items: list[Item], assignment: tuple[int, ...]) -> dict[str, dict[str, str]]:
    """Per node, the model key each role's slots take their modules from."""
    keys: dict[str, dict[str, str]] = {}
    for item, rung in zip(items, assignment, strict=True):
        node = keys.setdefault(item.node, {})
        if item.ladder == "layer":
            node.update(activation=f"layer{rung}", weight=f"layer{rung}")
        elif item.role == "layer":
            node.update(activation=f"activation{rung}", weight=f"weight{rung}")
        else:
            node[item.role] = f"{item.role}{rung}"
    return keys


def torch_metric(switch: SwitchableModel, items: list[Item], assignment: tuple[int, ...], evaluation: Evaluation,
                 settings: AutoMixedPrecision, metric: Metric) -> tuple[float, float]:
    """(metric, relative L2) of the switchable model with `assignment` on the evaluation set."""
    for node, keys in _keys(items, assignment).items():
        switch.set(node, keys)
    outputs = switch.outputs(evaluation.batches, settings.output_index)
    return metric(outputs, evaluation.float_outputs, evaluation.labels), relative_l2(outputs, evaluation.float_outputs)


def _progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 10) == 0:
        logger.info("sensitivity: %d of %d evaluation batches measured", done, total)


def sensitivity(switch: SwitchableModel, items: list[Item], top: tuple[int, ...], assignments: list[tuple[int, ...]],
                evaluation: Evaluation, settings: AutoMixedPrecision, metric: Metric,
                processes: Processes | None = None) -> list[tuple[float, float]]:
    """(metric, relative L2) of each assignment lowering one item alone from `top`, each forward
    resumed at that item's layer (resume.py): the numbers full forwards give, at a fraction of the
    cost; with `processes`, the evaluation batches are split over them (parallel.py)."""
    base = _keys(items, top)
    for node, keys in base.items():
        switch.set(node, keys)
    candidates = []
    for assignment in assignments:
        node = next(item.node for item, rung, high in zip(items, assignment, top, strict=True) if rung != high)
        candidates.append((node, _keys(items, assignment)[node]))
    if processes is None:
        outputs = candidate_outputs(switch, cut_tails(switch, settings.output_index), evaluation.batches, candidates, base,
                                    _progress)
    else:
        outputs = processes.candidate_outputs(settings.output_index, evaluation.batches, candidates, base)
    return [(metric(out, evaluation.float_outputs, evaluation.labels), relative_l2(out, evaluation.float_outputs)) for out in outputs]


def average_bits(switch: SwitchableModel, items: list[Item], assignment: tuple[int, ...],
                 settings: AutoMixedPrecision) -> tuple[float, float, float]:
    """Average bits per element of the searched layers (all, weights, activations), each element
    weighted by `costs` of its node or op type."""
    ops = {item.node: item.op_type for item in items}
    totals = {"all": [0.0, 0.0], "weight": [0.0, 0.0], "activation": [0.0, 0.0]}
    for node, keys in _keys(items, assignment).items():
        weight = settings.costs.get(node, settings.costs.get(ops[node], 1.0))
        for slot in switch.slots[node]:
            bits = slot.bits(keys[slot.role if slot.role != "bias" else "weight"])
            for group in ("all", "activation" if slot.role == "activation" else "weight"):
                totals[group][0] += weight * slot.elements * bits
                totals[group][1] += weight * slot.elements
    return tuple(total / count if count else 0.0 for total, count in totals.values())  # type: ignore[return-value]


def _onnxruntime_outputs(session: Any, feeds: list[dict[str, np.ndarray]], output_index: int) -> np.ndarray:
    """Output `output_index` of a session over all feeds, concatenated along samples."""
    return np.concatenate([session.run(None, feed)[output_index] for feed in feeds])


def onnxruntime_metric(model: onnx.ModelProto, evaluation: Evaluation, metric: Metric, output_index: int) -> tuple[float, float]:
    """(metric, relative L2) of a model in onnxruntime (exact session options) on the evaluation set."""
    outputs = _onnxruntime_outputs(inference_session(model), evaluation.feeds, output_index)
    return metric(outputs, evaluation.float_outputs, evaluation.labels), relative_l2(outputs, evaluation.float_outputs)
