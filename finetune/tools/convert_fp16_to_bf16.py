"""`python -m finetune.tools.convert_fp16_to_bf16 --input IN.onnx --output OUT.onnx --format FMT`:
a float16 ONNX model to bfloat16 in one of four formats (see finetune.tools.bf16)."""

from __future__ import annotations

import sys

from .bf16 import main as convert_main


def main(argv: list[str] | None = None) -> int:
    return convert_main("float16", argv)


if __name__ == "__main__":
    sys.exit(main())
