"""AMD Quark's AutoMixprecision block translated: with an accuracy goal (L2Target, Top1AccTarget or
NumTarget) it becomes an auto_mixed_precision search over the two-rung ladder [the config's types,
the target types] (Quark starts high and lowers the least sensitive layers while the target holds);
without one, every TargetOpType node simply takes the target types (op_type_overrides)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .formats import DEFAULT_OP_TYPES
from .quark_options import AUTO_MP_ACCEPTED_ONLY, AUTO_MP_MAPPED, AUTO_MP_NO_EFFECT, QUANT_TYPES, enum_value
from .schema import ConfigError

PATH = "extra_options.AutoMixprecision"
GOALS = ("L2Target", "Top1AccTarget", "NumTarget")


class Translation(Protocol):
    """What this module needs of quark._Translation."""

    extra: Mapping[str, Any]
    activation_type: Any
    weight_type: Any
    origins: dict[str, str]

    def check(self, options: Mapping[str, Any], mapped: tuple[str, ...], no_effect: tuple[str, ...],
              accepted_only: Mapping[str, tuple[Any, ...]], path: str) -> None: ...
    def switched_on(self, flag: str, path: str, given: bool) -> bool: ...
    def choice(self, quant_type: Any, role: str, at: str | None, path: str) -> dict[str, Any]: ...
    def bias(self, weight: dict[str, Any] | None) -> str: ...


def _block(t: Translation) -> Mapping[str, Any] | None:
    """The AutoMixprecision block when include_auto_mp is on, checked; None otherwise."""
    block = t.extra.get("AutoMixprecision") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(PATH, f"expected a mapping, got {block!r}")
    t.check(block, AUTO_MP_MAPPED, AUTO_MP_NO_EFFECT, AUTO_MP_ACCEPTED_ONLY, PATH)
    return block if t.switched_on("include_auto_mp", PATH, bool(block)) else None


def _target_types(t: Translation, block: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The target (higher) activation and weight formats, and the bias there."""
    act, weight = block.get("ActTargetQuantType"), block.get("WeightTargetQuantType")
    if act is None and weight is None:
        if block.get("TargetQuantType") is None:
            raise ConfigError(f"{PATH}.TargetQuantType", "required with include_auto_mp (or ActTargetQuantType / WeightTargetQuantType)")
        act = weight = block["TargetQuantType"]
    activation = t.choice(act or t.activation_type, "activation", None, f"{PATH}.ActTargetQuantType")
    weight_choice = t.choice(weight or t.weight_type, "weight", None, f"{PATH}.WeightTargetQuantType")
    return activation, weight_choice, _target_bias(t, block, weight_choice)


def _target_bias(t: Translation, block: Mapping[str, Any], weight: dict[str, Any]) -> str:
    if block.get("BiasTargetQuantType") is None:
        return t.bias(weight)
    path = f"{PATH}.BiasTargetQuantType"
    fmt, dtype = enum_value(block["BiasTargetQuantType"], QUANT_TYPES, path)
    if (fmt, dtype) == ("int", "int32"):
        return "int32"
    if weight["format"] != "int" and (fmt, dtype) == (weight["format"], weight.get("dtype")):
        return "auto"
    raise ConfigError(path, "has no equivalent here: a bias is int32, float, or in its weight's float format")


def translate(t: Translation) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(op_type_overrides, auto_mixed_precision section) of the block: the first without an
    accuracy goal, the second with one."""
    block = _block(t)
    if block is None:
        return {}, None
    if any(block.get(goal) is not None for goal in GOALS):
        return {}, search_section(t, block)
    return op_type_overrides(t, block), None


def op_type_overrides(t: Translation, block: Mapping[str, Any]) -> dict[str, Any]:
    """Without an accuracy goal, Quark puts every TargetOpType node into the target types."""
    activation, weight, bias = _target_types(t, block)
    t.origins["op_type_overrides"] = PATH
    return {op_type: {"activation": activation, "weight": weight, "bias": bias}
            for op_type in block.get("TargetOpType") or DEFAULT_OP_TYPES}


def search_section(t: Translation, block: Mapping[str, Any]) -> dict[str, Any]:
    """With an accuracy goal, the auto_mixed_precision section Quark's search corresponds to."""
    goals = [goal for goal in GOALS if block.get(goal) is not None]
    if len(goals) > 1:
        raise ConfigError(PATH, f"give one of {', '.join(GOALS)}, not {' and '.join(goals)}")
    activation, weight, _ = _target_types(t, block)
    low_activation = t.choice(t.activation_type, "activation", None, "activation_type")
    low_weight = t.choice(t.weight_type, "weight", None, "weight_type")
    section: dict[str, Any] = {
        "ladder": {"activation": [low_activation, activation], "weight": [low_weight, weight]},
        "target_op_types": list(block.get("TargetOpType") or DEFAULT_OP_TYPES),
        "output_index": block.get("OutputIndex", 0),
        "finetune_in_loop": bool(block.get("AutoMixUseFastFT", False)),
        "keep_high": [*(block.get("TargetTensors") or []), *(block.get("TargetIndices") or [])],
        "exclude": list(block.get("ExcludeIndices") or []),
    }
    goal = goals[0]
    if goal == "L2Target":
        section.update(metric="l2", target=block[goal])
    elif goal == "NumTarget":
        section.update(keep_top=block[goal])
    else:
        function = block.get("EvaluateFunction")
        if function is not None and not isinstance(function, str):
            raise ConfigError(f"{PATH}.EvaluateFunction", "give it as 'module:function' (outputs, float outputs, labels) -> "
                              "accuracy, or pass metric= to finetune.automp.auto_mixed_precision")
        section.update(metric=function or "top1_accuracy", max_drop=block[goal])
    t.origins["auto_mixed_precision"] = PATH
    return section
