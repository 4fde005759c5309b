"""FP32/FP16 -> BF16 model conversion in four formats.

Formats (the names users know from AMD Quark for ONNX):
- `with_cast`: every float tensor a node reads (weights included) and every graph output goes
  through Cast to bfloat16 and back to the original type; runs on any onnxruntime provider.
- `bf16`: the model itself in bfloat16 (weights and internal tensors), Casts only at the graph
  inputs and outputs. This format is for GPU execution providers: onnxruntime 1.31's CPU
  provider has bfloat16 kernels only for Cast, data movement (Reshape, Transpose, Concat, Split,
  Slice, Gather, ...), LayerNormalization, Sign, IsNaN and IsInf, none for MatMul, Gemm, Conv,
  Add or Relu; on a CPU-only machine the nodes lacking a kernel are listed.
- `simulate_bf16`: every weight rounded to bfloat16 and stored in the original type.
- `customqdq`: like `with_cast`, with bfloat16 quantize-dequantize pairs of the `com.finetune`
  domain (function bodies attached, so stock onnxruntime runs them).

Every format first folds constants and fuses parallel MatMuls, and saturates: a value beyond the
largest bfloat16 value that the original type can hold (3.3895e38 for float32, 65280 for
float16) clamps to it instead of becoming inf (a Clip before each cast that could overflow;
weights are clamped when converted). NaN stays NaN. A node input is converted only where the
op's schema (at opset 22) lets it be bfloat16, so shape-like inputs such as Resize's scales keep
their exact values.
"""

# The docstring above is the tools' --help description; this module owns their options and the
# entry point of `python -m finetune.tools.convert_fp{32,16}_to_bf16`.

from __future__ import annotations

import argparse
from pathlib import Path

from ..command import run_command, tool_parser
from .conversion import convert_file
from .formats import FORMATS
from .numerics import SOURCES

FORMAT_HELP = {
    "with_cast": "Cast to bfloat16 and back on every float tensor between nodes and on weights; "
                 "runs on onnxruntime CPU (default)",
    "bf16": "the model itself in bfloat16, Casts only at the graph inputs and outputs; for GPU execution providers: "
            "onnxruntime's CPU provider has no bfloat16 kernels for most ops (MatMul, Gemm, Conv, Add, Relu, ...) "
            "and the nodes lacking one are listed",
    "simulate_bf16": "every weight rounded to bfloat16 and stored in the original float type",
    "customqdq": "bfloat16 quantize-dequantize pairs (com.finetune ExtendedQuantizeLinear/ExtendedDequantizeLinear, "
                 "function bodies attached) on every float tensor between nodes and on weights",
}


def add_arguments(parser: argparse.ArgumentParser, choose_source: bool) -> None:
    """The conversion options users know (--input, --output, --format), and --from where the
    source type is not fixed by the tool's name."""
    parser.add_argument("--input", type=Path, required=True, help="the float model (never modified)")
    parser.add_argument("--output", type=Path, required=True, help="where to write the converted model")
    parser.add_argument("--format", choices=FORMATS, default="with_cast",
                        help="; ".join(f"{name}: {text}" for name, text in FORMAT_HELP.items()))
    if choose_source:
        parser.add_argument("--from", dest="source", choices=("auto", *SOURCES), default="auto",
                            help="the model's float type (default: detected)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    """Run the conversion on parsed arguments."""
    convert_file(args.input, args.output, args.format, args.source)


def main(source: str, argv: list[str] | None = None) -> int:
    """`python -m finetune.tools.convert_fp{32,16}_to_bf16`: the tool for one source type."""
    name = "fp32" if source == "float32" else "fp16"
    parser = tool_parser(f"python -m finetune.tools.convert_{name}_to_bf16", __doc__)
    add_arguments(parser, choose_source=False)
    parser.set_defaults(source=source)
    return run_command(parser, argv)
