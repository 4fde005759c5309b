"""SmoothQuant before quantizing (the config's smooth_quant section): the per-channel maxima of the
smoothed layers' inputs come from one calibration pass over the float model, the rewrite from
finetune.onnx.smooth. The smoothed float graph computes the float model's function (up to float
rounding, measured on the first calibration batch and put in the summary) and is the float
reference fine-tuning tunes towards: its layers see the inputs and hold the weights the quantized
model's layers do."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import onnx

from finetune.calibrate import CalibrationData, collect_statistics
from finetune.config import QuantConfig
from finetune.notices import Notice, warn
from finetune.onnx.graphs import all_nodes
from finetune.onnx.normalize import infer_shapes
from finetune.onnx.session import inference_session
from finetune.onnx.smooth import NO_WEIGHT, Group, Outcome, find_groups, smooth_graph

logger = logging.getLogger(__name__)


class ChannelAbsMax:
    """max |x| per channel on `axis` over every batch (NaN and infinities left out)."""

    def __init__(self, axis: int) -> None:
        self.axis = axis
        self.maximum: np.ndarray | None = None

    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        magnitude = np.abs(np.moveaxis(np.asarray(x, np.float32), self.axis, -1))
        batch = np.where(np.isfinite(magnitude), magnitude, 0).reshape(-1, magnitude.shape[-1]).max(axis=0)
        self.maximum = batch if self.maximum is None else np.maximum(self.maximum, batch)


def smooth_model(model: onnx.ModelProto, config: QuantConfig, data: Any, providers: list[str] | None,
                 notices: list[Notice]) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """A smoothed copy of the normalised float `model` (never modified) and the summary's
    smooth_quant entry: layers smoothed, folded and behind an inserted Mul, each layer's outcome,
    and the float output's largest change on the first calibration batch. Layers left alone are
    notices."""
    section = config.smooth_quant
    if data is None:
        raise ValueError("smooth_quant needs calibration data (the activations' channel maxima): pass --data")
    candidates, outcomes = _candidates(model, config)
    groups, skipped = find_groups(model.graph, candidates)
    outcomes += skipped
    feeds = CalibrationData(data, model)
    maxima = _activation_maxima(model, groups, feeds, providers)
    smoothed = onnx.ModelProto()
    smoothed.CopyFrom(model)
    outcomes += smooth_graph(smoothed.graph, _same_nodes(smoothed.graph, groups), maxima, section.alpha, section.fold)
    infer_shapes(smoothed, notices)
    warn(logger, notices, [Notice("node", o.node, f"smooth_quant: {o.detail}: not smoothed")
                           for o in outcomes if o.action == "skipped" and o.detail != NO_WEIGHT])  # x @ y: nothing to smooth
    summary = _summary(outcomes, section.alpha, _float_change(model, smoothed, feeds, providers))
    logger.info("smooth_quant: %d layer(s) smoothed (%d folded into their producer, %d behind an inserted Mul), %d skipped",
                summary["smoothed"], summary["folded"], summary["mul_inserted"], summary["skipped"])
    return smoothed, summary


def _candidates(model: onnx.ModelProto, config: QuantConfig) -> tuple[set[str], list[Outcome]]:
    """The names of the main graph's layers of the section's op types whose input and weight are
    quantized; those in subgraphs, or whose input stays float, as skipped outcomes (activations
    times activations, as attention's, are skipped without a notice: there is no weight to smooth)."""
    main = {node.name for node in model.graph.node}  # normalised: every node has a name of its own
    names, skipped = set(), []
    for node in all_nodes(model.graph):
        formats = config.node_formats(node.name, node.op_type) if node.op_type in config.smooth_quant.op_types else None
        if formats is None or formats.weight is None:
            continue
        if node.name not in main:
            skipped.append(Outcome(node.name, "skipped", "it lies inside an If/Loop/Scan body"))
        elif formats.activation is None:
            skipped.append(Outcome(node.name, "skipped", "its input stays float"))
        else:
            names.add(node.name)
    return names, skipped


def _activation_maxima(model: onnx.ModelProto, groups: list[Group], feeds: CalibrationData,
                       providers: list[str] | None) -> dict[str, np.ndarray]:
    """Each group's input channel maxima, from one pass over the calibration data."""
    if not groups:
        return {}
    observers = {group.value: ChannelAbsMax(group.axis) for group in groups}
    collect_statistics(model, feeds, observers, providers, progress=False)
    return {value: observer.maximum for value, observer in observers.items() if observer.maximum is not None}


def _same_nodes(graph: onnx.GraphProto, groups: list[Group]) -> list[Group]:
    """The groups with their layers taken from `graph` (a copy of the graph they were found in)."""
    by_name = {node.name: node for node in graph.node}
    return [Group(g.value, [by_name[layer.name] for layer in g.layers], g.axis, g.channels, g.rank) for g in groups]


def _float_change(model: onnx.ModelProto, smoothed: onnx.ModelProto, feeds: CalibrationData,
                  providers: list[str] | None) -> float | None:
    """The largest |smoothed - float| over the outputs on the first calibration batch, relative to
    the output's largest magnitude (None without a batch)."""
    feed = next(iter(feeds), None)
    if feed is None:
        return None
    before = inference_session(model, providers).run(None, feed)
    after = inference_session(smoothed, providers).run(None, feed)
    changes = [float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
               for a, b in zip(after, before) if np.issubdtype(np.asarray(b).dtype, np.floating) and np.size(b)]
    return max(changes, default=0.0)


def _summary(outcomes: list[Outcome], alpha: float, change: float | None) -> dict[str, Any]:
    counts = Counter(outcome.action for outcome in outcomes)
    return {
        "alpha": alpha, "smoothed": counts["folded"] + counts["mul"], "folded": counts["folded"],
        "mul_inserted": counts["mul"], "skipped": counts["skipped"],
        "float_output_relative_change": change,
        "layers": [{"node": o.node, "action": o.action, "detail": o.detail} for o in outcomes],
    }
