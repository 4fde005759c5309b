"""Automatic mixed precision: per-layer precision search against an accuracy target. Sensitivity is
measured in the lifted torch model by switching each layer's fake-quant modules between rungs;
bisection over the layers ordered by noise per bit saved finds the cheapest assignment that meets
the target; the result is exported, optionally fine-tuned, and re-measured in onnxruntime.
`prepare_mixed_precision` does the measuring once, so several targets can be chosen from it."""

from .api import AutoMPResult, PreparedSearch, auto_mixed_precision, prepare_mixed_precision
from .metrics import METRICS, Metric, resolve_metric

__all__ = ["METRICS", "AutoMPResult", "Metric", "PreparedSearch", "auto_mixed_precision", "prepare_mixed_precision",
           "resolve_metric"]
