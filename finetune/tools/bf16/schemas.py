"""Which node inputs and outputs may be bfloat16, read from the ONNX op schemas at the opset where
bfloat16 is widely allowed, so the conversion leaves shape-like inputs (Resize's scales) exact."""

from __future__ import annotations

import onnx
from onnx import defs

from finetune.onnx.domains import DEFAULT_DOMAINS

BF16_OPSET = 22  # the opset from which Conv, the pooling ops and most others accept bfloat16


class Schemas:
    """Type constraints of node inputs and outputs at the opset where bfloat16 is widely allowed."""

    def __init__(self, opset: int) -> None:
        self.opset = max(opset, BF16_OPSET)

    def schema(self, node: onnx.NodeProto) -> defs.OpSchema | None:
        """The default-domain schema of the node's op, None for other domains and unknown ops."""
        if node.domain not in DEFAULT_DOMAINS:
            return None
        try:
            return defs.get_schema(node.op_type, self.opset, "")
        except defs.SchemaError:
            return None

    def type_str(self, node: onnx.NodeProto, index: int, is_input: bool) -> str | None:
        """The formal type (a parameter like 'T' or a type like 'tensor(float)') of an input or output."""
        schema = self.schema(node)
        formals = [] if schema is None else schema.inputs if is_input else schema.outputs
        if index < len(formals):
            return formals[index].type_str
        variadic = formals and formals[-1].option == defs.OpSchema.FormalParameterOption.Variadic
        return formals[-1].type_str if variadic else None

    def allows_bf16(self, node: onnx.NodeProto, index: int, is_input: bool = True) -> bool:
        """Whether the schema lets this input (or output) be bfloat16."""
        type_str = self.type_str(node, index, is_input)
        if type_str is None:
            return False
        constraints = {c.type_param_str: set(c.allowed_type_strs) for c in self.schema(node).type_constraints}
        return "tensor(bfloat16)" in constraints.get(type_str, {type_str})
