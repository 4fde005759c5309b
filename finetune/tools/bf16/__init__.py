"""FP32/FP16 -> BF16 model conversion in four formats (with_cast, bf16, simulate_bf16, customqdq).

`conversion` holds the entry points, `formats` the four formats, `rewrite` the graph walk they share,
`schemas` which node inputs may be bfloat16, `numerics` the source types, saturation bounds and
weight rounding, and `cli` the command line with the user-facing description of the formats."""

from .cli import add_arguments, main, run
from .conversion import convert, convert_file, detect_source
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
