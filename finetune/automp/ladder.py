"""The ladder of a mixed-precision search resolved to formats: which items are searched (a layer, or
its activation and weight apart), the rungs each item may take, and the configs that put every
searched layer on one rung (quantized once each) or on its chosen rungs (the final model)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import onnx

from finetune.config import FormatChoice, Override, QuantConfig, load_config
from finetune.config.automp import AutoMixedPrecision, SplitLadder, choice_bits
from finetune.onnx.domains import DEFAULT_DOMAINS

logger = logging.getLogger(__name__)

ROLES = ("activation", "weight")


@dataclass(frozen=True)
class Rung:
    """One rung: a name for reports and the formats a layer (or one of its roles) takes there."""

    name: str
    activation: FormatChoice | None
    weight: FormatChoice | None
    bias: str = "auto"


@dataclass(frozen=True)
class Item:
    """What the search assigns a rung to: a layer (`role` layer) or one role of it."""

    node: str
    op_type: str
    role: str  # layer | activation | weight
    ladder: str  # the ladder key its rungs come from: layer, activation or weight

    @property
    def label(self) -> str:
        return self.node if self.role == "layer" else f"{self.node} ({self.role})"


def ladders(settings: AutoMixedPrecision) -> dict[str, list[Rung]]:
    """The rungs by ladder key, cheapest first by bits per element whatever order the config gives
    them in: `layer` for one ladder, `activation` and `weight` for a split ladder (sorted apart for
    granularity tensor, as pairs for granularity layer)."""
    if not isinstance(settings.ladder, SplitLadder):
        rungs = [_layer_rung(rung, f"ladder[{i}]") for i, rung in enumerate(settings.ladder)]
        return {"layer": [rungs[i] for i in _cost_order(rungs, "ladder")]}
    resolved = {role: [_tensor_rung(rung, role, f"ladder.{role}[{i}]") for i, rung in enumerate(getattr(settings.ladder, role))]
                for role in ROLES}
    if settings.granularity == "tensor":
        return {role: [rungs[i] for i in _cost_order(rungs, f"ladder.{role}")] for role, rungs in resolved.items()}
    pairs = [Rung(f"{a.name}+{w.name}", a.activation, w.weight) for a, w in zip(*resolved.values(), strict=True)]
    order = _cost_order(pairs, "ladder")
    return {role: [rungs[i] for i in order] for role, rungs in resolved.items()}


def rung_cost(rung: Rung) -> tuple[float, float]:
    """(activation, weight) bits per element of a rung (a role it leaves unset or float costs 32)."""
    return choice_bits(rung.activation), choice_bits(rung.weight)


def _cost_order(rungs: list[Rung], where: str) -> list[int]:
    """The rungs' indices cheapest first (ties keep their given order), logged when that is not the
    given order; two rungs each cheaper in one role have no order and are refused in one line."""
    order = sorted(range(len(rungs)), key=lambda i: rung_cost(rungs[i]))
    for low, high in itertools.pairwise(order):
        if rung_cost(rungs[low])[1] > rung_cost(rungs[high])[1]:
            raise ValueError(f"auto_mixed_precision.{where}: rungs {rungs[low].name} and {rungs[high].name} have no order "
                             f"by cost ({rungs[low].name} has the cheaper activations, {rungs[high].name} the cheaper "
                             "weights): give a split ladder with granularity tensor")
    if order != sorted(order):
        logger.info("auto_mixed_precision.%s taken cheapest first by bits per element: %s", where,
                    ", ".join(rungs[i].name for i in order))
    return order


def _layer_rung(rung: str | Override, where: str) -> Rung:
    if isinstance(rung, str):
        config = _preset(rung, where)
        return Rung(rung, config.activation, config.weight, config.bias)
    activation, weight, bias = rung.apply(None, None, "auto")
    return Rung(_describe(activation, weight), activation, weight, bias)


def _tensor_rung(rung: str | FormatChoice, role: str, where: str) -> Rung:
    choice = getattr(_preset(rung, where), role) if isinstance(rung, str) else rung
    name = rung if isinstance(rung, str) else _describe(choice)
    return Rung(name, choice if role == "activation" else None, choice if role == "weight" else None)


def _preset(name: str, where: str) -> QuantConfig:
    try:
        return load_config(name)
    except (OSError, ValueError) as error:
        raise ValueError(f"auto_mixed_precision.{where}: {error}") from None


def _describe(*choices: FormatChoice | None) -> str:
    """A short name of an inline rung: each format's dtype (int8, bfloat16), or the format with its
    element type or width (mx:fp4_e2m1, bfp:16b)."""
    parts = []
    for choice in choices:
        if choice is None:
            parts.append("float")
        elif choice.dtype:
            parts.append(choice.dtype)
        else:
            detail = choice.element_dtype or (f"{choice.bit_width}b" if choice.bit_width else "")
            parts.append(f"{choice.format}:{detail}" if detail else choice.format)
    return "/".join(parts)


def search_items(float_model: onnx.ModelProto, config: QuantConfig, settings: AutoMixedPrecision) -> tuple[list[Item], frozenset[int]]:
    """The searched items in graph order (each node of a target op type that neither the config
    nor `settings.exclude` excludes, as one layer item or as its two roles), and the indices of
    the items `settings.keep_high` holds at the top rung."""
    targets = [node for node in float_model.graph.node if node.domain in DEFAULT_DOMAINS and node.op_type in settings.target_op_types]
    excluded = _named_nodes(settings.exclude, targets, "exclude")
    high = _named_nodes(settings.keep_high, targets, "keep_high")
    nodes = [node for node in targets if not config.excludes(node.name) and node.name not in excluded]
    if isinstance(settings.ladder, SplitLadder) and settings.granularity == "tensor":
        items = [Item(node.name, node.op_type, role, role) for node in nodes for role in ROLES]
    else:
        key = "layer" if not isinstance(settings.ladder, SplitLadder) else "split"
        items = [Item(node.name, node.op_type, "layer", key) for node in nodes]
    return items, frozenset(i for i, item in enumerate(items) if item.node in high)


def _named_nodes(entries: tuple[str | int, ...], targets: list[onnx.NodeProto], key: str) -> set[str]:
    """The target nodes that entries name: by node name, by a tensor they read, or by index."""
    names = set()
    for entry in entries:
        if isinstance(entry, int):
            if not 0 <= entry < len(targets):
                raise ValueError(f"auto_mixed_precision.{key}: index {entry} is out of range (the model has {len(targets)} "
                                 "nodes of the target op types)")
            names.add(targets[entry].name)
            continue
        found = [node.name for node in targets if entry in (node.name, *node.input)]
        if not found:
            raise ValueError(f"auto_mixed_precision.{key}: {entry!r} is neither a node of the target op types nor a tensor "
                             "one of them reads")
        names.update(found)
    return names


def rung_formats(item: Item, rung: int, rungs: dict[str, list[Rung]]) -> dict[str, Any]:
    """The override keys an item sets at `rung` (a layer item with a split ladder takes the rung
    of both ladders)."""
    if item.ladder == "split":
        return {"activation": rungs["activation"][rung].activation, "weight": rungs["weight"][rung].weight}
    chosen = rungs[item.ladder][rung]
    if item.role == "layer":
        return {"activation": chosen.activation, "weight": chosen.weight, "bias": chosen.bias}
    return {item.role: getattr(chosen, item.role)}


def assigned_config(base: QuantConfig, items: list[Item], assignment: list[int], rungs: dict[str, list[Rung]]) -> QuantConfig:
    """The base config with each item's formats at its assigned rung as node overrides (a bias the
    rung does not set follows its activation and weight: int32 when both are INT)."""
    overrides: dict[str, dict[str, Any]] = {}
    for item, rung in zip(items, assignment, strict=True):
        overrides.setdefault(item.node, {}).update(rung_formats(item, rung, rungs))
    node_overrides = dict(base.node_overrides)
    for node, formats in overrides.items():
        formats.setdefault("bias", "auto")
        node_overrides[node] = Override(**formats)
    return dataclasses.replace(base, node_overrides=node_overrides, weight_storage="float", auto_mixed_precision=None,
                               fast_finetune=None, bf16_as_cast=False)

