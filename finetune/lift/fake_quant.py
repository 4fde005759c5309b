"""The fake-quant module every ONNX quantize-dequantize pattern is lifted to."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from finetune.formats import FormatSpec, IntSpec, RoundFn, int_quantize_dequantize, int_range_clamp, quantize_dequantize
from finetune.formats.compiled import kernels_enabled, quantize_dequantize_compiled, record_eager


class FakeQuantize(nn.Module):
    """Quantize-dequantize in one format with the scale and zero point of the ONNX node(s) it came
    from; disabled it is the identity (the float reference), except that an integer quantizer of an
    activation told to `keep_range` still clamps to its range: a quantizer may stand in for a Relu or
    Clip that was removed because its clamp does the same (onnxruntime does so with asymmetric
    activations), and the reference must keep that activation. `rounding` replaces the integer
    rounding (AdaRound). `on_parameter` marks a quantizer of a weight or bias (set by the lifter).
    Within formats.compiled.compiled_kernels(True) it runs compiled kernels (on tensors of at least
    MIN_COMPILED_ELEMENTS). While its scale is learned (recon.methods.scales), `learned` computes it
    instead, eager, with the scale's gradient."""

    scale: torch.Tensor | None
    zero_point: torch.Tensor | None

    def __init__(
        self,
        spec: FormatSpec,
        scale: torch.Tensor | None = None,
        zero_point: torch.Tensor | None = None,
        source: tuple[str, ...] = (),
        on_parameter: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(spec, IntSpec):
            if scale is None:
                raise ValueError("an integer format needs a scale")
            zero_point = torch.zeros_like(scale) if zero_point is None else zero_point
        self.spec = spec
        self.source = source
        self.enabled = True
        self.keep_range = False
        self.on_parameter = on_parameter
        self.rounding: RoundFn | None = None
        self.learned: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.register_buffer("scale", None if scale is None else scale.to(torch.float32))
        self.register_buffer("zero_point", None if zero_point is None else zero_point.to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x quantized and dequantized, or x itself when disabled."""
        if not self.enabled:
            if self.keep_range and isinstance(self.spec, IntSpec) and not self.on_parameter:
                return int_range_clamp(x, self.scale, self.zero_point, self.spec)
            return x
        if self.learned is not None:
            if kernels_enabled(x):
                record_eager("a learned scale")
            return self.learned(x)
        if self.rounding is not None and not isinstance(self.spec, IntSpec):
            raise ValueError(f"a rounding hook applies to integer formats only, not {self.spec}")
        if kernels_enabled(x):
            return quantize_dequantize_compiled(x, self.spec, self.scale, self.zero_point, self.rounding)
        if isinstance(self.spec, IntSpec):
            return int_quantize_dequantize(x, self.scale, self.zero_point, self.spec, self.rounding)
        return quantize_dequantize(x, self.spec, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        """Format, source nodes and state, for printing the module."""
        return f"{self.spec}, source={self.source}, enabled={self.enabled}"


@contextlib.contextmanager
def quantizers_disabled(module: nn.Module, keep_ranges: bool = True) -> Iterator[None]:
    """Every fake quantizer of `module` off inside the block, as it was after: the float reference a
    quantized model gives of itself. With `keep_ranges` integer activation quantizers still clamp to
    their range (FakeQuantize.keep_range: the Relu/Clip a quantizer stands in for); without, every
    quantizer is the identity (the float work of a step, for profiling)."""
    quantizers = [m for m in module.modules() if isinstance(m, FakeQuantize)]
    states = [(q.enabled, q.keep_range) for q in quantizers]
    for quantizer in quantizers:
        quantizer.enabled, quantizer.keep_range = False, keep_ranges
    try:
        yield
    finally:
        for quantizer, (enabled, keep_range) in zip(quantizers, states):
            quantizer.enabled, quantizer.keep_range = enabled, keep_range
