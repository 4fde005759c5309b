"""Lift's inverse: a lifted module's tuned weights (and learned quantizer scales) written back into a
copy of the QDQ graph it came from, in the graph's own form, so stock onnxruntime runs what torch
computed. `export_model` is imported on first use: it needs the lifter (onnx2torch, torchvision),
seconds that the MatMulNBits writer beside it, which every command imports, must not pay."""

from __future__ import annotations

from typing import Any

__all__ = ["export_model"]


def __getattr__(name: str) -> Any:
    """`export_model` from .weights, imported when first asked for (PEP 562)."""
    if name == "export_model":
        from .weights import export_model

        return export_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
