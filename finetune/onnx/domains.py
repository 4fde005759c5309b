"""Domains and versions every ONNX module agrees on: the default domain's two names, our custom-op
domains and op names, the oldest default-domain opset handled (the function bodies are written for
it, so normalisation upgrades older models to it) and the opset and IR versions the bodies need."""

from __future__ import annotations

DEFAULT_DOMAINS = ("", "ai.onnx")
CUSTOM_DOMAIN = "com.finetune"
QUARK_DOMAIN = "com.amd.quark"
DOMAINS = (CUSTOM_DOMAIN, QUARK_DOMAIN)
DOMAIN_VERSION = 1  # the version a model imports our domains at when we add them; any imported version is accepted
ONNXRUNTIME_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops (QuantizeLinear/DequantizeLinear among them)

BFP = "BFPQuantizeDequantize"
MX = "MXQuantizeDequantize"
QUANTIZE = "ExtendedQuantizeLinear"
DEQUANTIZE = "ExtendedDequantizeLinear"

MIN_OPSET = 13  # the oldest default-domain opset the bodies are written and tested for
CASTLIKE_OPSET = 15  # below it the float16 round trip needs the input's type at attach time
REDUCE_AXES_INPUT_OPSET = 18  # ReduceMax takes axes as an input from opset 18
RESHAPE_ALLOWZERO_OPSET = 14  # empty tensors need Reshape's allowzero
OVERLOAD_IR_VERSION = 10  # the IR version that introduced FunctionProto.overload
