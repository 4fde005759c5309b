"""The `com.finetune` and `com.amd.quark` custom ops as model-local ONNX functions built from standard ops."""

from ..domains import BFP, CUSTOM_DOMAIN, DEQUANTIZE, DOMAINS, MX, QUANTIZE, QUARK_DOMAIN
from .attach import attach_custom_ops

__all__ = ["BFP", "CUSTOM_DOMAIN", "DEQUANTIZE", "DOMAINS", "MX", "QUANTIZE", "QUARK_DOMAIN", "attach_custom_ops"]
