"""AMD Quark's AutoMixprecision block translated. Quark quantizes the model with the config's types,
then moves the layers least sensitive to the target types (ActTargetQuantType, WeightTargetQuantType,
or TargetQuantType) one by one while the accuracy goal (L2Target, Top1AccTarget) holds, or moves
NumTarget of them. Here that is an auto_mixed_precision search over the two rungs [the target types,
the config's types], which the search takes cheapest first by bits per element: in Quark's documented
use (activations QInt16, target QInt8) the target types are the cheaper rung, and the search lowers
every layer the goal allows to them. Without a goal, every TargetOpType node simply takes the target
types (op_type_overrides)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .automp import choice_bits
from .formats import DEFAULT_OP_TYPES, FormatChoice
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
    """The target activation and weight formats (those Quark gives the layers it moves), and the bias there."""
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
    base_activation = t.choice(t.activation_type, "activation", None, "activation_type")
    base_weight = t.choice(t.weight_type, "weight", None, "weight_type")
    cheaper = _target_is_cheaper((activation, weight), (base_activation, base_weight))
    section: dict[str, Any] = {
        "ladder": {"activation": [activation, base_activation], "weight": [weight, base_weight]},
        "target_op_types": list(block.get("TargetOpType") or DEFAULT_OP_TYPES),
        "output_index": block.get("OutputIndex", 0),
        "finetune_in_loop": bool(block.get("AutoMixUseFastFT", False)),
        "keep_high": _moved_nodes(block, cheaper),
        "exclude": list(block.get("ExcludeIndices") or []),
    }
    section.update(_goal(block, goals[0], cheaper))
    t.origins["auto_mixed_precision"] = PATH
    return section


def _bits(pair: tuple[dict[str, Any], dict[str, Any]]) -> tuple[float, float]:
    """Bits per element of an (activation, weight) pair of format mappings."""
    return tuple(choice_bits(FormatChoice(**choice)) for choice in pair)  # type: ignore[return-value]


def _target_is_cheaper(target: tuple[dict[str, Any], dict[str, Any]], base: tuple[dict[str, Any], dict[str, Any]]) -> bool:
    """Whether the target types cost fewer bits per element than the config's (the search's bottom
    rung); refused when each is cheaper in one role, since the two rungs then have no order."""
    (target_a, target_w), (base_a, base_w) = _bits(target), _bits(base)
    if (target_a - base_a) * (target_w - base_w) < 0:
        raise ConfigError(PATH, "the target types are cheaper in one of activation and weight and costlier in the other: "
                          "the two rungs have no order by cost to search along")
    return target_a + target_w < base_a + base_w


def _moved_nodes(block: Mapping[str, Any], cheaper: bool) -> list[Any]:
    """TargetTensors / TargetIndices, the nodes Quark moves to the target types: held at the top rung
    when the target types are the costlier; refused when they are the cheaper (nothing holds a layer low)."""
    nodes = [*(block.get("TargetTensors") or []), *(block.get("TargetIndices") or [])]
    if nodes and cheaper:
        key = "TargetTensors" if block.get("TargetTensors") else "TargetIndices"
        raise ConfigError(f"{PATH}.{key}", "puts nodes at the target types, the cheaper rung here, which the search "
                          "cannot hold layers at: give them as node_overrides with those types instead")
    return nodes


def _goal(block: Mapping[str, Any], goal: str, cheaper: bool) -> dict[str, Any]:
    """The native goal of Quark's: L2Target a relative L2 target, Top1AccTarget a drop of a top-1
    metric, NumTarget how many layers take the target types (lowered, or kept high when those cost more)."""
    if goal == "L2Target":
        return {"metric": "l2", "target": block[goal]}
    if goal == "NumTarget":
        return {"lower" if cheaper else "keep_top": block[goal]}
    function = block.get("EvaluateFunction")
    if function is not None and not isinstance(function, str):
        raise ConfigError(f"{PATH}.EvaluateFunction", "give it as 'module:function' (outputs, float outputs, labels) -> "
                          "accuracy, or pass metric= to finetune.automp.auto_mixed_precision")
    return {"metric": function or "top1_accuracy", "max_drop": block[goal]}
