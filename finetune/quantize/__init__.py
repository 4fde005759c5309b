"""Post-training quantization: a float ONNX model, a config and calibration data in, a QDQ ONNX
model out that stock onnxruntime runs. plan (which tensor gets which format) -> checks (what
cannot work, and what works other than configured) -> calibrate (scales of INT/FP8 tensors) ->
insert (the quantize-dequantize nodes); api runs them in turn and summary reports what they did."""

from .api import QuantizeResult, quantize_model, quantizer_presets
from .summary import format_summary

__all__ = ["QuantizeResult", "format_summary", "quantize_model", "quantizer_presets"]  # the steps stay in their modules: quantize.plan is the module
