"""finetune: quantize ONNX models and recover their accuracy with AdaRound / AdaQuant."""

__version__ = "0.1.0"
