"""The custom-op domains, op names and the opset and IR versions the function bodies depend on, in
one place that every other module of the package imports."""

from __future__ import annotations

CUSTOM_DOMAIN = "com.finetune"
QUARK_DOMAIN = "com.amd.quark"
DOMAINS = (CUSTOM_DOMAIN, QUARK_DOMAIN)
DOMAIN_VERSION = 1

BFP = "BFPQuantizeDequantize"
MX = "MXQuantizeDequantize"
QUANTIZE = "ExtendedQuantizeLinear"
DEQUANTIZE = "ExtendedDequantizeLinear"

MIN_OPSET = 13  # the oldest default-domain opset the bodies are written and tested for
CASTLIKE_OPSET = 15  # below it the float16 round trip needs the input's type at attach time
REDUCE_AXES_INPUT_OPSET = 18  # ReduceMax takes axes as an input from opset 18
RESHAPE_ALLOWZERO_OPSET = 14  # empty tensors need Reshape's allowzero
OVERLOAD_IR_VERSION = 10  # the IR version that introduced FunctionProto.overload
