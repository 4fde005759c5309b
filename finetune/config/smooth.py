"""The smooth_quant section of a config: SmoothQuant (AMD Quark's include_sq with SmoothAlpha),
run by the quantizer before it plans (finetune.quantize.smooth)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .schema import ConfigError, Section

SMOOTHABLE_OP_TYPES = ("MatMul", "Gemm", "Conv")
DEFAULT_ALPHA = 0.5  # Quark's SmoothAlpha default, and the SmoothQuant paper's


@dataclass(frozen=True)
class SmoothQuant(Section):
    """Move activation range into the weights of the quantized MatMul / Gemm / Conv layers of
    `op_types`: s = max|X|^alpha / max|W|^(1 - alpha) per input channel, weights times s, inputs
    divided by s, folded into the producer where `fold` allows and that is exact, else by a Mul."""

    alpha: float = field(default=DEFAULT_ALPHA, metadata={"min": 0, "max": 1})
    op_types: tuple[str, ...] = SMOOTHABLE_OP_TYPES
    fold: bool = True

    def _check(self) -> None:
        if not math.isfinite(self.alpha):
            raise ConfigError("alpha", f"must be a number from 0 to 1; got {self.alpha!r}")
        if not self.op_types:
            raise ConfigError("op_types", f"name at least one of {', '.join(SMOOTHABLE_OP_TYPES)}")
        for i, op_type in enumerate(self.op_types):
            if op_type not in SMOOTHABLE_OP_TYPES:
                raise ConfigError(f"op_types[{i}]", f"must be one of {', '.join(SMOOTHABLE_OP_TYPES)}; got {op_type!r}")
