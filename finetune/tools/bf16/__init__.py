"""FP32/FP16 -> BF16 model conversion in four formats (with_cast, bf16, simulate_bf16, customqdq):
the package re-exports the conversion API and the command-line entry points."""

from .cli import add_arguments, main, run
from .convert import convert, convert_file, detect_source
from .formats import FORMATS
from .numerics import BF16_MAX, bf16_values

__all__ = [
    "BF16_MAX",
    "FORMATS",
    "add_arguments",
    "bf16_values",
    "convert",
    "convert_file",
    "detect_source",
    "main",
    "run",
]
