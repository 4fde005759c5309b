"""AMD Quark's fine-tuning options translated into the fast_finetune section: the FastFinetune block
(Quark runs it only with include_fast_ft), GPTQ (extra_options.UseGPTQ with GPTQParams) and bias
correction (extra_options.BiasCorrection).

Quark's GPTQ rounds the weights of MatMul nodes on its own integer grid (GPTQParams.Bits,
PerChannel, WeightSymmetric) and leaves activations float. Here GPTQ rounds to the config's weight
format, so those grid options must describe that format (an error names the one that does not);
activations stay float as in Quark, and with include_fast_ft AdaRound / AdaQuant start from GPTQ's
weights (gptq_init), as Quark tunes the model its GPTQ wrote."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Protocol

from .finetune import DEVICE_HELP, DEVICE_PATTERN
from .quark_options import (
    FAST_FT_ACCEPTED_ONLY,
    FAST_FT_KEYS,
    FAST_FT_MAPPED,
    FAST_FT_NO_EFFECT,
    GPTQ_ACCEPTED_ONLY,
    GPTQ_GRID,
    GPTQ_KEYS,
    QUARK_FAST_FT_BATCH_SIZE,
    QUARK_GPTQ_OP_TYPES,
)
from .schema import ConfigError

log = logging.getLogger(__name__)
FAST_FT_PATH = "extra_options.FastFinetune"
GPTQ_PATH = "extra_options.GPTQParams"


class Translation(Protocol):
    """What this module needs of quark._Translation."""

    extra: Mapping[str, Any]
    origins: dict[str, str]

    def check(self, options: Mapping[str, Any], mapped: tuple[str, ...], no_effect: tuple[str, ...],
              accepted_only: Mapping[str, tuple[Any, ...]], path: str) -> None: ...
    def switched_on(self, flag: str, path: str, given: bool) -> bool: ...
    def flag(self, name: str, default: bool) -> bool: ...


def uses_gptq(t: Translation) -> bool:
    """Whether extra_options.UseGPTQ is on (GPTQParams without it have no effect, as in Quark)."""
    return t.switched_on("UseGPTQ", GPTQ_PATH, "GPTQParams" in t.extra)


def translate(t: Translation, weight: Mapping[str, Any] | None, gptq_on: bool) -> dict[str, Any] | None:
    """The fast_finetune mapping: the FastFinetune block with include_fast_ft (BatchSize defaulting
    to Quark's 1), GPTQ alone with UseGPTQ only (`gptq_on`), both (gptq_init) with both, the bias
    correction alone with only BiasCorrection, else None."""
    tuning = _fast_finetune(t)
    correction = _bias_correction(t)
    if gptq_on:
        gptq = _gptq_settings(t, weight)
        if tuning is None:
            t.origins["fast_finetune"] = "extra_options.UseGPTQ"
            tuning = {"algorithm": "gptq", "op_types": list(QUARK_GPTQ_OP_TYPES), "gptq": gptq}
        else:
            tuning = {**tuning, "gptq_init": True, "gptq": gptq}
    if tuning is None:
        return {"iterations": 0, "bias_correction": True} if correction else None
    return tuning if correction is None else {**tuning, "bias_correction": correction}


def _bias_correction(t: Translation) -> bool | None:
    """extra_options.BiasCorrection (None: not given) is fast_finetune.bias_correction: Quark corrects
    before its fast finetune, finetune before and after tuning; true without any tuning is the
    correction alone (iterations 0), as Quark runs it."""
    if "BiasCorrection" not in t.extra:
        return None
    t.origins["fast_finetune.bias_correction"] = "extra_options.BiasCorrection"
    return t.flag("BiasCorrection", False)


def _fast_finetune(t: Translation) -> dict[str, Any] | None:
    block = t.extra.get("FastFinetune") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(FAST_FT_PATH, f"expected a mapping, got {block!r}")
    t.check(block, FAST_FT_MAPPED, FAST_FT_NO_EFFECT, FAST_FT_ACCEPTED_ONLY, FAST_FT_PATH)
    if not t.switched_on("include_fast_ft", FAST_FT_PATH, bool(block)):
        return None
    out: dict[str, Any] = {"batch_size": QUARK_FAST_FT_BATCH_SIZE}
    for theirs, ours in FAST_FT_KEYS.items():
        if block.get(theirs) is not None:
            value = block[theirs]
            *sections, key = ours.split(".")
            target = out
            for section in sections:
                target = target.setdefault(section, {})
            target[key] = value.lower() if theirs == "OptimAlgorithm" and isinstance(value, str) else value
            t.origins[f"fast_finetune.{ours}"] = f"{FAST_FT_PATH}.{theirs}"
    if "EarlyStop" in block:
        t.origins["fast_finetune.early_stop"] = f"{FAST_FT_PATH}.EarlyStop"
        out["early_stop"] = {"enabled": block["EarlyStop"]}
    _check_infer_device(block.get("InferDevice"), out.get("device", "cpu"), f"{FAST_FT_PATH}.InferDevice")
    return out


def _gptq_settings(t: Translation, weight: Mapping[str, Any] | None) -> dict[str, Any]:
    """The gptq section from GPTQParams, whose grid options must describe the weight format."""
    params = t.extra.get("GPTQParams") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(GPTQ_PATH, f"expected a mapping, got {params!r}")
    t.check(params, (*GPTQ_KEYS, *GPTQ_GRID), (), GPTQ_ACCEPTED_ONLY, GPTQ_PATH)
    if weight is None:
        raise ConfigError("extra_options.UseGPTQ", "GPTQ rounds quantized weights; this config leaves them float")
    for key in GPTQ_GRID:
        if key in params and params[key] != (grid := _weight_grid(t, weight, key)):
            raise ConfigError(f"{GPTQ_PATH}.{key}", f"{params[key]!r} differs from the weight format's {grid!r}: GPTQ "
                              "here rounds to the weight format (weight_type, per_channel, WeightSymmetric)")
    t.origins.update({f"fast_finetune.gptq.{ours}": f"{GPTQ_PATH}.{theirs}" for theirs, ours in GPTQ_KEYS.items()})
    return {ours: params[theirs] for theirs, ours in GPTQ_KEYS.items() if params.get(theirs) is not None}


def _weight_grid(t: Translation, weight: Mapping[str, Any], key: str) -> Any:
    """What the weight format says for one of Quark's GPTQ grid options (None: it has no such grid)."""
    if weight["format"] != "int":
        return None
    if key == "Bits":
        return int(re.search(r"\d+", weight["dtype"]).group())
    if key == "PerChannel":
        return t.flag("per_channel", False)
    return weight["symmetric"]


def _check_infer_device(value: Any, device: Any, path: str) -> None:
    """InferDevice is where Quark runs onnxruntime during fine-tuning; here unit inputs come from
    torch on the one fast_finetune device, so a different InferDevice is noted, not used."""
    if value is None:
        return
    if not isinstance(value, str) or not re.fullmatch(DEVICE_PATTERN, value):
        raise ConfigError(path, f"must be {DEVICE_HELP}; got {value!r}")
    if value != device:
        log.warning("%s=%s: unit inputs are computed by torch on the fast_finetune device %s", path, value, device)
