"""Converter look-up: newer op versions fall back to older converters only across type-only changes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import defs, helper
from onnx2torch.node_converters.registry import get_converter

from finetune.lift import lift_model
from finetune.lift.registry import SAFE_VERSIONS, candidate_versions, find_converter, schema_versions

from .lift_helpers import assert_same, onnx_model, random_input, tensor


def _signature(op_type: str, version: int) -> tuple:
    """What a version defines apart from element types: attributes, inputs and outputs."""
    schema = defs.get_schema(op_type, version, "")
    return (
        sorted((name, a.type, a.required) for name, a in schema.attributes.items()),
        [(i.name, i.option) for i in schema.inputs],
        [(o.name, o.option) for o in schema.outputs],
    )


def _types(op_type: str, version: int) -> dict[str, set[str]]:
    """Allowed element types per type parameter of a schema version."""
    return {c.type_param_str: set(c.allowed_type_strs) for c in defs.get_schema(op_type, version, "").type_constraints}


@pytest.mark.parametrize(("op_type", "version"), sorted((op, v) for op, vs in SAFE_VERSIONS.items() for v in vs))
def test_safe_versions_only_add_types(op_type: str, version: int) -> None:
    """Each listed version keeps the previous version's attributes, inputs and outputs and only
    widens the allowed element types."""
    previous = next(v for v in schema_versions("", op_type) if v < version)
    assert _signature(op_type, version) == _signature(op_type, previous)
    old, new = _types(op_type, previous), _types(op_type, version)
    assert all(old[name] <= new.get(name, set()) for name in old)


def test_candidate_versions_walk_back_over_safe_versions_only() -> None:
    """The walk stops at the first version that changed more than types."""
    assert candidate_versions("", "Squeeze", 25) == [25, 24, 23, 21]
    assert candidate_versions("", "Transpose", 22) == [21, 13]
    assert candidate_versions("", "ScatterND", 18) == [18]
    assert candidate_versions("com.finetune", "BFPQuantizeDequantize", 2) == [2, 1]


def test_find_converter_prefers_ours_and_refuses_unsafe_fallback() -> None:
    """Our converters replace onnx2torch's; a missing one names the versions tried."""
    assert find_converter("", "Conv", 11) is not get_converter("Conv", 11)
    assert find_converter("", "Relu", 14) is get_converter("Relu", 14)
    with pytest.raises(NotImplementedError, match=r"ai\.onnx::ScatterND \(versions tried: \[18\]\)"):
        find_converter("", "ScatterND", 18)


@pytest.mark.parametrize("opset", [23, 25])
def test_type_only_versions_lift(opset: int) -> None:
    """Squeeze / Transpose / Flatten at newer opsets lift through their older converters."""
    mk = helper.make_node
    nodes = [
        mk("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]),
        mk("Squeeze", ["t", "axes"], ["s"]),
        mk("Flatten", ["s"], ["y"], axis=1),
    ]
    model = onnx_model(nodes, [tensor("x", [2, 3, 1, 4])], [tensor("y", None)], {"axes": np.array([1], np.int64)}, opset)
    model.ir_version = 10
    assert_same(model, lift_model(model), [random_input((2, 3, 1, 4))])
