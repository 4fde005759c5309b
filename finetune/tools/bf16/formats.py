"""The four output formats: how each stores weights, which form of a float tensor each node
input and graph output needs, and the nodes that turn one form into another (Casts, saturating
Clips, bfloat16 quantize-dequantize pairs); `FORMAT_TYPES` names them for the command line."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from finetune.onnx import attach_custom_ops
from finetune.onnx.fold import drop_unused_initializers

from .numerics import BF16_MAX, bf16_values
from .rewrite import BFLOAT16, ROUNDED, SOURCE, Chain, Format, Rewriter, Tensor
from .schemas import Schemas


class _WithCast(Format):
    """Cast to bfloat16 and back on every float tensor between nodes and on weights."""

    def convert(self, rewriter: Rewriter, tensor: Tensor, src: str, dst: str, form: str) -> list[onnx.NodeProto]:
        chain = Chain(rewriter, src)
        if not tensor.bounded:
            chain.saturate(self.source.bound, self.source.elem_type)
        chain.cast(TensorProto.BFLOAT16)
        chain.cast(self.source.elem_type)
        return chain.ending_in(dst)


class _CustomQDQ(Format):
    """bfloat16 ExtendedQuantizeLinear/ExtendedDequantizeLinear pairs of the com.finetune domain."""

    def convert(self, rewriter: Rewriter, tensor: Tensor, src: str, dst: str, form: str) -> list[onnx.NodeProto]:
        chain = Chain(rewriter, src)
        if not tensor.bounded and self.source.bound < BF16_MAX:  # the quantizer saturates at BF16_MAX itself
            chain.saturate(self.source.bound, self.source.elem_type)
        chain.qdq()
        if self.source.elem_type != TensorProto.FLOAT:  # the dequantizer yields float32
            chain.cast(self.source.elem_type)
        return chain.ending_in(dst)

    def finish(self, model: onnx.ModelProto) -> None:
        attach_custom_ops(model, in_place=True)


class _SimulateBF16(Format):
    """Weights rounded to bfloat16 values, stored in the original type; activations untouched."""

    weight_form = ROUNDED

    def weight(self, array: np.ndarray) -> np.ndarray:
        return bf16_values(array, self.source.bound).astype(self.source.dtype)

    def need(self, bf16_position: bool) -> str | None:
        return None

    def output_need(self) -> str | None:
        return None


class _DirectBF16(Format):
    """The model in bfloat16: weights converted, internal tensors retyped, Casts at the boundary."""

    def weight(self, array: np.ndarray) -> np.ndarray:
        return array  # the bfloat16 copy is made per use, the original serves float-only inputs

    def need(self, bf16_position: bool) -> str | None:
        return BFLOAT16 if bf16_position else SOURCE

    def output_need(self) -> str | None:
        return SOURCE

    def output_form(self, schemas: Schemas, node: onnx.NodeProto, index: int, bf16_params: set[str], retyped: bool) -> str:
        param = schemas.type_str(node, index, False)
        return BFLOAT16 if retyped or (param is not None and param in bf16_params) else SOURCE

    def retype(self, schemas: Schemas, node: onnx.NodeProto) -> bool:
        if not schemas.allows_bf16(node, 0, is_input=False):
            return False
        retyped = False
        for attribute in node.attribute:
            if attribute.name in ("to", "dtype") and attribute.type == onnx.AttributeProto.INT \
                    and attribute.i == self.source.elem_type:
                attribute.i = TensorProto.BFLOAT16
                retyped = True
            elif node.op_type == "ConstantOfShape" and attribute.name == "value" \
                    and attribute.t.data_type == self.source.elem_type:
                values = bf16_values(numpy_helper.to_array(attribute.t)).astype(ml_dtypes.bfloat16)
                attribute.t.CopyFrom(numpy_helper.from_array(values, attribute.t.name))
                retyped = True
        return retyped

    def convert(self, rewriter: Rewriter, tensor: Tensor, src: str, dst: str, form: str) -> list[onnx.NodeProto]:
        if form == BFLOAT16 and tensor.weight is not None:
            values = bf16_values(tensor.weight).astype(ml_dtypes.bfloat16)
            rewriter.graph.initializer.append(numpy_helper.from_array(values, dst))
            return []
        chain = Chain(rewriter, src)
        if form == BFLOAT16:
            chain.saturate(self.source.bound, self.source.elem_type)
            chain.cast(TensorProto.BFLOAT16)
        else:
            if self.source.bound < BF16_MAX:  # float16 cannot hold every bfloat16 value
                chain.saturate(self.source.bound, TensorProto.BFLOAT16)
            chain.cast(self.source.elem_type)
        return chain.ending_in(dst)

    def finish(self, model: onnx.ModelProto) -> None:
        drop_unused_initializers(model)


FORMAT_TYPES: dict[str, type[Format]] = {
    "with_cast": _WithCast, "bf16": _DirectBF16, "simulate_bf16": _SimulateBF16, "customqdq": _CustomQDQ,
}
FORMATS = tuple(FORMAT_TYPES)  # the format names, the command line's default first
