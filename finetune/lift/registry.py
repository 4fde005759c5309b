"""Converter registration and look-up on top of onnx2torch's registry.

onnx2torch looks a converter up by the op's `since_version` only, so a model at a newer opset
fails as soon as an op got a new version, even one that only added element types. Here a
look-up walks back from the model's version to older ones while every step in between is listed
in SAFE_VERSIONS (a type-only change), and our own converters can replace onnx2torch's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache

from onnx import defs
from onnx2torch.node_converters.registry import OperationDescription, TConverter, add_converter, get_converter

# Op versions whose only change over the previous version is new element types (bfloat16,
# float8, int4, float4, float8e8m0, int2), so the previous version's converter lifts them unchanged.
# tests/test_lift_registry.py checks that attributes, inputs and outputs are indeed unchanged.
SAFE_VERSIONS: dict[str, frozenset[int]] = {
    op: frozenset(versions)
    for op, versions in {
        "Acos": (22,), "Asin": (22,), "Atan": (22,), "Cos": (22,), "Sin": (22,), "Tan": (22,),
        "Elu": (22,), "Selu": (22,), "HardSigmoid": (22,), "HardSwish": (22,), "Softplus": (22,),
        "Softsign": (22,), "EyeLike": (22,), "InstanceNormalization": (22,), "RoiAlign": (22,),
        "Round": (22,), "GlobalAveragePool": (22,), "GreaterOrEqual": (16,), "LessOrEqual": (16,),
        "Equal": (19,), "IsInf": (20,), "IsNaN": (20,),
        "Constant": (19, 21, 23, 24, 25), "ConstantOfShape": (20, 21, 23, 24, 25),
        "Identity": (19, 21, 23, 24, 25), "Shape": (19, 21, 23, 24, 25),
        "Flatten": (21, 23, 24, 25), "Transpose": (21, 23, 24, 25), "Unsqueeze": (21, 23, 24, 25),
        "Squeeze": (23, 24, 25),
    }.items()
}

_OVERRIDES: dict[OperationDescription, TConverter] = {}


def register(op_type: str, versions: Iterable[int], domain: str = "") -> Callable[[TConverter], TConverter]:
    """Register a converter for each version: with onnx2torch's `add_converter` where onnx2torch
    has none, as a replacement where it has one that we do better."""

    def decorate(converter: TConverter) -> TConverter:
        """Register `converter` for every version and return it unchanged."""
        for version in versions:
            if _onnx2torch_converter(domain, op_type, version) is None:
                add_converter(op_type, version, domain)(converter)
            else:
                _OVERRIDES[OperationDescription(domain, op_type, version)] = converter
        return converter

    return decorate


def find_converter(domain: str, op_type: str, opset: int) -> TConverter:
    """The converter for `op_type` in a model importing `domain` at `opset`; NotImplementedError
    names the versions tried when there is none."""
    tried = candidate_versions(domain, op_type, opset)
    for version in tried:
        converter = _OVERRIDES.get(OperationDescription(domain, op_type, version)) or _onnx2torch_converter(
            domain, op_type, version
        )
        if converter is not None:
            return converter
    raise NotImplementedError(f"no converter for {domain or 'ai.onnx'}::{op_type} (versions tried: {tried or 'none'})")


def candidate_versions(domain: str, op_type: str, opset: int) -> list[int]:
    """Versions whose converter is valid for the model, newest first: the op's version at `opset`,
    then older ones as long as each newer version is a safe (type-only) change. Ops without an
    ONNX schema (custom domains) accept any registered version up to `opset`."""
    history = [v for v in schema_versions(domain, op_type) if v <= opset]
    if not history:
        return list(range(opset, 0, -1))
    candidates = []
    for version in history:
        candidates.append(version)
        if version not in SAFE_VERSIONS.get(op_type, ()):
            break
    return candidates


@cache
def schema_versions(domain: str, op_type: str) -> tuple[int, ...]:
    """Every since_version of an op's ONNX schema, newest first (empty for unknown ops)."""
    return tuple(
        sorted(
            {s.since_version for s in defs.get_all_schemas_with_history() if s.name == op_type and s.domain == domain},
            reverse=True,
        )
    )


def _onnx2torch_converter(domain: str, op_type: str, version: int) -> TConverter | None:
    """onnx2torch's converter registered for exactly this version, or None."""
    if schema_versions(domain, op_type) and version not in schema_versions(domain, op_type):
        return None
    try:
        return get_converter(op_type, version, domain)
    except NotImplementedError:
        return None
