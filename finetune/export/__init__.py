"""Lift's inverse: a lifted module's tuned weights (and learned quantizer scales) written back into a
copy of the QDQ graph it came from, in the graph's own form, so stock onnxruntime runs what torch
computed."""

from .weights import export_model

__all__ = ["export_model"]
