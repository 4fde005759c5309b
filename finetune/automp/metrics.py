"""The metrics a mixed-precision search judges a candidate by: each compares the candidate's
outputs with the float model's (and the labels, for accuracy) over the whole evaluation set.
Language-model metrics (perplexity, next-token agreement; calibrate.tokens) read a decoder's
logits and take as labels the next-token targets of the token folder."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from finetune.calibrate.tokens import IGNORED, next_token_agreement, perplexity

MetricFn = Callable[[np.ndarray, np.ndarray, "np.ndarray | None"], float]  # (outputs, float outputs, labels)


@dataclass(frozen=True)
class Metric:
    """A named metric; `higher_is_better` says which way the target bounds it."""

    name: str
    compute: MetricFn
    higher_is_better: bool = True
    needs_labels: bool = False
    needs_scores: bool = False  # top-1 metrics: the output must be a batch of score vectors
    needs_tokens: bool = False  # language-model metrics: the logits output, next-token targets as labels

    def __call__(self, outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None) -> float:
        """The metric's value; NaN is an error (a target cannot be judged against it)."""
        value = float(self.compute(outputs, float_outputs, labels))
        if math.isnan(value):
            raise ValueError(f"metric {self.name} returned NaN: check the model's outputs and the metric")
        return value

    def meets(self, value: float, target: float) -> bool:
        """Whether `value` reaches `target` in this metric's direction."""
        return value >= target if self.higher_is_better else value <= target

    def target_from_drop(self, float_value: float, drop: float) -> float:
        """The target `drop` away from the float model's value, in the worse direction."""
        return float_value - drop if self.higher_is_better else float_value + drop


def relative_l2(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None = None) -> float:
    """||outputs - float|| / ||float|| over the whole set (0 when both are zero)."""
    reference = float_outputs.astype(np.float64)
    norm = float(np.linalg.norm(reference))
    error = float(np.linalg.norm(outputs.astype(np.float64) - reference))
    return error / norm if norm else (0.0 if error == 0 else math.inf)


def mean_cosine(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None = None) -> float:
    """Mean over samples of the cosine similarity of each sample's output with the float one."""
    a = outputs.reshape(len(outputs), -1).astype(np.float64)
    b = float_outputs.reshape(len(float_outputs), -1).astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (norms == 0) & ~a.any(axis=1) & ~b.any(axis=1)
    cosine = np.where(norms > 0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1), np.where(both_zero, 1.0, 0.0))
    return float(cosine.mean())


def top1_agreement(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None = None) -> float:
    """Share of samples whose top-1 class is the float model's."""
    return float((outputs.argmax(axis=-1) == float_outputs.argmax(axis=-1)).mean())


def top1_accuracy(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None) -> float:
    """Share of samples whose top-1 class is their label."""
    if labels is None:
        raise ValueError("top1_accuracy needs labels")
    return float((outputs.argmax(axis=-1) == labels).mean())


METRICS = {
    "l2": Metric("l2", relative_l2, higher_is_better=False),
    "cosine": Metric("cosine", mean_cosine),
    "top1_agreement": Metric("top1_agreement", top1_agreement, needs_scores=True),
    "top1_accuracy": Metric("top1_accuracy", top1_accuracy, needs_labels=True, needs_scores=True),
    "perplexity": Metric("perplexity", perplexity, higher_is_better=False, needs_tokens=True),
    "next_token_agreement": Metric("next_token_agreement", next_token_agreement, needs_tokens=True),
}


def resolve_metric(metric: str | MetricFn | Metric) -> Metric:
    """A Metric from a built-in name, 'module:function' or a callable (outputs, float outputs,
    labels) -> float where higher is better."""
    if isinstance(metric, Metric):
        return metric
    if callable(metric):
        return Metric(getattr(metric, "__name__", "custom"), metric)
    if metric in METRICS:
        return METRICS[metric]
    module_name, _, function = metric.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"metric {metric!r} is neither {', '.join(METRICS)} nor an importable 'module:function' "
                         f"({error})") from None
    return Metric(metric, found)


def check_outputs(metric: Metric, float_outputs: np.ndarray, labels: np.ndarray | None, output_index: int) -> None:
    """Refuse, before any search, a metric the outputs or labels cannot serve."""
    if metric.needs_tokens and (float_outputs.ndim != 3 or labels is None or labels.shape != float_outputs.shape[:2]):
        raise ValueError(f"metric {metric.name} needs output {output_index} to be logits [samples, positions, vocabulary] "
                         f"matching the token inputs, but it has shape {list(float_outputs.shape)}")
    if metric.needs_tokens and not (labels != IGNORED).any():
        raise ValueError(f"metric {metric.name}: no position predicts a next token (sequences of one token or all masked)")
    if metric.needs_scores and (float_outputs.ndim != 2 or float_outputs.shape[1] < 2):
        raise ValueError(f"metric {metric.name} needs output {output_index} to be a batch of class scores (samples x "
                         f"classes), but it has shape {list(float_outputs.shape)}: use l2 or cosine")
    if metric.needs_labels and labels is None:
        raise ValueError(f"metric {metric.name} needs labels: put labels.npy (one label per sample, in file order) in "
                         "the data folder, yield (inputs, label) from the data, or pass labels=")
    if labels is not None and len(labels) != len(float_outputs):
        raise ValueError(f"labels hold {len(labels)} entries but the evaluation data hold {len(float_outputs)} samples: "
                         "give one label per sample, in order")
