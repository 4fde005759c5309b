"""Post-training quantization: a float ONNX model, a config and calibration data in, a QDQ ONNX
model out that stock onnxruntime runs."""

from .api import QuantizeResult, quantize_model
from .calibrate import QParams, calibrate
from .insert import insert_qdq
from .plan import Use, format_summary, plan

__all__ = ["QParams", "QuantizeResult", "Use", "calibrate", "format_summary", "insert_qdq", "plan", "quantize_model"]
