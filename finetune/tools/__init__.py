"""Command-line tools users know from AMD Quark for ONNX: FP32/FP16 -> BF16 conversion, inference
dumps and the evaluate tool; each module also runs as `python -m finetune.tools.NAME`."""
