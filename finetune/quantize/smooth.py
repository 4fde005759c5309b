"""Input rescaling before quantizing: the driver that SmoothQuant (the config's smooth_quant section,
here) and AWQ (finetune.quantize.awq) share. Each method gathers a per-channel statistic of the
rescaled layers' inputs in one calibration pass over the float model and turns it into one scale per
input channel; the rewrite is finetune.onnx.smooth's. The rescaled float graph computes the float
model's function (up to float rounding, measured on the first calibration batch and put in the
summary) and is the float reference fine-tuning tunes towards: its layers see the inputs and hold the
weights the quantized model's layers do."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import numpy_helper

from finetune.calibrate import CalibrationData, collect_statistics
from finetune.config import QuantConfig
from finetune.config.formats import NodeFormats
from finetune.notices import Notice, warn
from finetune.onnx.graphs import all_nodes
from finetune.onnx.normalize import infer_shapes
from finetune.onnx.session import inference_session
from finetune.onnx.smooth import NO_WEIGHT, Group, Outcome, find_groups, smooth_graph, smoothing_scales, weight_maxima

logger = logging.getLogger(__name__)


class Statistic(Protocol):
    """A per-channel statistic of one activation, fed every calibration batch."""

    def update(self, x: np.ndarray) -> None:
        """Take in one batch of the activation."""

    def channels(self) -> int | None:
        """How many channels it has seen (None: no batch computed the activation)."""


class Rescaling(Protocol):
    """What sets one rescaling method apart: its config section (and summary key), which layers it
    takes, its statistic, the scales it derives and what it adds to the summary."""

    section: str

    def refusal(self, node: onnx.NodeProto, formats: NodeFormats) -> str | None:
        """Why a main-graph layer of the section's op types with a quantized weight is not rescaled (None: it is)."""

    def statistic(self, group: Group) -> Statistic:
        """A fresh statistic of the group's input."""

    def scales(self, group: Group, statistic: Statistic, weights: list[np.ndarray]) -> np.ndarray:
        """One positive scale per input channel of the group, from its statistic and layers' weights."""

    def summary(self) -> dict[str, Any]:
        """The method's own entries of its summary (its settings, what it chose)."""


class ChannelAbsMax:
    """max |x| per channel on `axis` over every batch (NaN and infinities left out)."""

    def __init__(self, axis: int) -> None:
        self.axis = axis
        self.maximum: np.ndarray | None = None

    def update(self, x: np.ndarray) -> None:
        """Take in one batch's per-channel maxima."""
        if x.size == 0:
            return
        magnitude = np.abs(np.moveaxis(np.asarray(x, np.float32), self.axis, -1))
        batch = np.where(np.isfinite(magnitude), magnitude, 0).reshape(-1, magnitude.shape[-1]).max(axis=0)
        self.maximum = batch if self.maximum is None else np.maximum(self.maximum, batch)

    def channels(self) -> int | None:
        """The channels seen (None before any batch)."""
        return None if self.maximum is None else self.maximum.size


class SmoothQuantScales:
    """SmoothQuant: s = max|X|^alpha / max|W|^(1 - alpha) per channel, for layers whose input is quantized."""

    section = "smooth_quant"

    def __init__(self, config: QuantConfig) -> None:
        self.alpha = config.smooth_quant.alpha

    def refusal(self, node: onnx.NodeProto, formats: NodeFormats) -> str | None:
        """SmoothQuant moves range from quantized inputs: a layer whose input stays float is refused."""
        return "its input stays float" if formats.activation is None else None

    def statistic(self, group: Group) -> ChannelAbsMax:
        """The channel maxima of the group's input."""
        return ChannelAbsMax(group.axis)

    def scales(self, group: Group, statistic: ChannelAbsMax, weights: list[np.ndarray]) -> np.ndarray:
        """SmoothQuant's formula over the maxima of the input and of every layer's weight."""
        weight_max = np.max([weight_maxima(weight, layer) for weight, layer in zip(weights, group.layers)], axis=0)
        return smoothing_scales(statistic.maximum, weight_max, self.alpha)

    def summary(self) -> dict[str, Any]:
        """The alpha used."""
        return {"alpha": self.alpha}


def smooth_model(model: onnx.ModelProto, config: QuantConfig, data: Any, providers: list[str] | None,
                 notices: list[Notice]) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """A smoothed copy of the normalised float `model` (never modified) and the summary's
    smooth_quant entry (see rescale_model)."""
    return rescale_model(model, config, data, providers, notices, SmoothQuantScales(config))


def rescale_model(model: onnx.ModelProto, config: QuantConfig, data: Any, providers: list[str] | None,
                  notices: list[Notice], method: Rescaling) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """A copy of the normalised float `model` (never modified) with `method`'s scales, and its summary
    entry: layers rescaled, folded and behind an inserted Mul, each layer's outcome, and the float
    output's largest change on the first calibration batch. Layers left alone are notices."""
    section = getattr(config, method.section)
    if data is None:
        raise ValueError(f"{method.section} needs calibration data (its layers' input statistics): pass --data")
    candidates, outcomes = _candidates(model, config, section.op_types, method)
    groups, skipped = find_groups(model.graph, candidates)
    outcomes += skipped
    feeds = CalibrationData(data, model)
    statistics = {group.value: method.statistic(group) for group in groups}
    if statistics:
        collect_statistics(model, feeds, statistics, providers, progress=False)
    tensors = {t.name: t for t in model.graph.initializer}
    scales = {}
    for group in groups:
        channels = statistics[group.value].channels()
        if channels != group.channels:
            why = (f"no calibration sample computed {group.value}" if channels is None
                   else f"{group.value} has {channels} channels where its layers read {group.channels}")
            outcomes += [Outcome(layer.name, "skipped", why) for layer in group.layers]
            continue
        weights = [numpy_helper.to_array(tensors[layer.input[1]]) for layer in group.layers]
        scales[group.value] = method.scales(group, statistics[group.value], weights)
    rescaled = onnx.ModelProto()
    rescaled.CopyFrom(model)
    outcomes += smooth_graph(rescaled.graph, _same_nodes(rescaled.graph, [g for g in groups if g.value in scales]), scales,
                             section.fold)
    infer_shapes(rescaled, notices)
    warn(logger, notices, [Notice("node", o.node, f"{method.section}: {o.detail}: not rescaled")
                           for o in outcomes if o.action == "skipped" and o.detail != NO_WEIGHT])  # x @ y: nothing to rescale
    summary = {**method.summary(), **_summary(outcomes, _float_change(model, rescaled, feeds, providers))}
    logger.info("%s: %d layer(s) rescaled (%d folded into their producer, %d behind an inserted Mul), %d skipped",
                method.section, summary["smoothed"], summary["folded"], summary["mul_inserted"], summary["skipped"])
    return rescaled, summary


def _candidates(model: onnx.ModelProto, config: QuantConfig, op_types: tuple[str, ...],
                method: Rescaling) -> tuple[set[str], list[Outcome]]:
    """The names of the main graph's layers of `op_types` whose weight is quantized and that the
    method takes; those in subgraphs, or that it refuses, as skipped outcomes (activations times
    activations, as attention's, are skipped without a notice: there is no weight to rescale)."""
    main = {node.name for node in model.graph.node}  # normalised: every node has a name of its own
    names, skipped = set(), []
    for node in all_nodes(model.graph):
        formats = config.node_formats(node.name, node.op_type) if node.op_type in op_types else None
        if formats is None or formats.weight is None:
            continue
        refusal = "it lies inside an If/Loop/Scan body" if node.name not in main else method.refusal(node, formats)
        if refusal:
            skipped.append(Outcome(node.name, "skipped", refusal))
        else:
            names.add(node.name)
    return names, skipped


def _same_nodes(graph: onnx.GraphProto, groups: list[Group]) -> list[Group]:
    """The groups with their layers taken from `graph` (a copy of the graph they were found in)."""
    by_name = {node.name: node for node in graph.node}
    return [Group(g.value, [by_name[layer.name] for layer in g.layers], g.axis, g.channels, g.rank) for g in groups]


def _float_change(model: onnx.ModelProto, rescaled: onnx.ModelProto, feeds: CalibrationData,
                  providers: list[str] | None) -> float | None:
    """The largest |rescaled - float| over the outputs on the first calibration batch, relative to
    the output's largest magnitude (None without a batch)."""
    feed = next(iter(feeds), None)
    if feed is None:
        return None
    before = inference_session(model, providers).run(None, feed)
    after = inference_session(rescaled, providers).run(None, feed)
    changes = [float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
               for a, b in zip(after, before) if np.issubdtype(np.asarray(b).dtype, np.floating) and np.size(b)]
    return max(changes, default=0.0)


def _summary(outcomes: list[Outcome], change: float | None) -> dict[str, Any]:
    """The counts of layers by what happened to them, the float output's change, and each layer's outcome."""
    counts = Counter(outcome.action for outcome in outcomes)
    return {
        "smoothed": counts["folded"] + counts["mul"], "folded": counts["folded"],
        "mul_inserted": counts["mul"], "skipped": counts["skipped"],
        "float_output_relative_change": change,
        "layers": [{"node": o.node, "action": o.action, "detail": o.detail} for o in outcomes],
    }
