"""The body of MXQuantizeDequantize: OCP microscaling with an FP or int8 element type, bit for bit
as FORMATS.md."""

from __future__ import annotations

from onnx import TensorProto

from finetune.formats import MXElement, MXSpec

from .arithmetic import Body, pow2, round_significand, scaled_round
from .blocks import BlockBody, BlockView


class MXBody(BlockBody[MXSpec]):
    """MXQuantizeDequantize: OCP microscaling with an FP or int8 element type."""

    @property
    def overload(self) -> str:
        """A readable name that identifies the attribute set (rounding matters for int8 only)."""
        s = self.spec
        name = f"{s.element_dtype}_b{s.block_size}_ax{s.axis}"
        return name + (f"_rm{s.rounding_mode}" if s.element.is_int else "")

    @property
    def inner(self) -> list[int]:
        """One block."""
        return [self.spec.block_size]

    def quantize(self, b: Body, view: BlockView, ordinary: bool) -> str:
        """y at level 0 of `view`, following FORMATS.md: shared scale 2^(E-127-emax), no E8M0 clamp;
        int8 elements round to steps of that scale times 2^-mantissa_bits."""
        element = self.spec.element

        def scale_of(shared: str) -> str:
            scale = b.op("Mul", shared, b.const(pow2(-element.emax)))
            return b.op("Mul", scale, b.const(pow2(-element.mantissa_bits))) if element.is_int else scale

        def quantize(values: str, scale: str) -> str:
            if element.is_int:
                return scaled_round(b, values, scale, -128.0, 127.0, self.spec.rounding_mode)
            return b.op("Mul", self._element_round(b, b.op("Div", values, scale), element), scale)

        return self.shared_quantize(b, view, scale_of, quantize, ordinary)

    @staticmethod
    def _element_round(b: Body, v: str, element: MXElement) -> str:
        """v rounded to the element format (RNE, with its subnormals), saturated at its largest value.
        The subnormal or the normal rounding is picked by 0/1 factors, exact for the finite v of a
        block (the sign of a zero may differ from Where's; the body's last step makes every zero +0)."""
        subnormal_step = element.min_normal_exponent - element.mantissa_bits
        steps = b.op("Round", b.op("Mul", v, b.const(pow2(-subnormal_step))))
        subnormal = b.op("Mul", steps, b.const(pow2(subnormal_step)))
        normal = round_significand(b, v, element.mantissa_bits + 1)
        is_subnormal = b.op("Less", b.op("Abs", v), b.const(pow2(element.min_normal_exponent)))
        pick = b.op("Cast", is_subnormal, to=TensorProto.FLOAT)
        kept = b.op("Mul", normal, b.op("Sub", b.const(1.0), pick))
        rounded = b.op("Add", b.op("Mul", subnormal, pick), kept)
        return b.op("Clip", rounded, b.const(-element.max_value), b.const(element.max_value))
