"""AMD Quark's 4-bit MatMul path translated: extra_options.UseMatMulNBits with MatMulNBitsParams is
weight-only int4 (Symmetric) or uint4 (with zero points) in groups of GroupSize along each MatMul
weight's reduction axis, written as onnxruntime's MatMulNBits (weight_storage matmul_nbits).

Quark then quantizes MatMul weights only and leaves activations float, whatever activation_type and
weight_type say (named at WARNING here). Its Algorithm DEFAULT is round-to-nearest, GPTQ is GPTQ
with GPTQParams (which finetune runs on the same grid), HQQ has no equivalent. Scales come from
finetune's min/max calibration, so codes may differ from Quark's RTN where its scales differ."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from .formats import AUTO
from .schema import ConfigError

log = logging.getLogger(__name__)
PATH = "extra_options.MatMulNBitsParams"
# MatMulNBitsParams key -> Quark's default (the values Quark takes when a key is absent)
DEFAULTS: dict[str, Any] = {"GroupSize": 128, "Symmetric": True, "Bits": 4, "AccuracyLevel": 0, "Algorithm": "DEFAULT"}
BITS = (4,)  # what export.matmul_nbits packs
FLOAT32_ACCURACY_LEVELS = (0, 1)  # unset (float32 on the CPU) and float32: the accumulation finetune's nodes ask for
MIN_GROUP = 16  # MatMulNBits' smallest block, a power of two
ALGORITHMS = ("DEFAULT", "GPTQ")


class Translation(Protocol):
    """What this module needs of quark._Translation."""

    extra: Mapping[str, Any]
    options: Mapping[str, Any]
    origins: dict[str, str]

    def check(self, options: Mapping[str, Any], mapped: tuple[str, ...], no_effect: tuple[str, ...],
              accepted_only: Mapping[str, tuple[Any, ...]], path: str) -> None: ...
    def switched_on(self, flag: str, path: str, given: bool) -> bool: ...


def params(t: Translation) -> dict[str, Any] | None:
    """MatMulNBitsParams with Quark's defaults filled in when UseMatMulNBits is on (checked: every
    value finetune cannot honour is a ConfigError naming it), else None (the params then have no
    effect, as in Quark, said at WARNING)."""
    if not t.switched_on("UseMatMulNBits", PATH, "MatMulNBitsParams" in t.extra):
        return None
    given = t.extra.get("MatMulNBitsParams") or {}
    if not isinstance(given, Mapping):
        raise ConfigError(PATH, f"expected a mapping, got {given!r}")
    t.check(given, tuple(DEFAULTS), (), {}, PATH)
    chosen = {**DEFAULTS, **{key: value for key, value in given.items() if key in DEFAULTS}}
    _check(chosen)
    for key in ("activation_type", "weight_type"):
        if key in t.options:
            log.warning("%s: %s has no effect with UseMatMulNBits, as in Quark: MatMul weights become 4-bit "
                        "MatMulNBits and activations stay float", key, t.options[key])
    return chosen


def _check(chosen: Mapping[str, Any]) -> None:
    """A ConfigError for the first MatMulNBits parameter finetune cannot honour."""
    group = chosen["GroupSize"]
    if not isinstance(group, int) or isinstance(group, bool) or group < MIN_GROUP or group & (group - 1):
        raise ConfigError(f"{PATH}.GroupSize", f"must be a power of two of at least {MIN_GROUP} (MatMulNBits' "
                          f"blocks), got {group!r}")
    if not isinstance(chosen["Symmetric"], bool):
        raise ConfigError(f"{PATH}.Symmetric", f"expected true or false, got {chosen['Symmetric']!r}")
    if chosen["Bits"] not in BITS:
        raise ConfigError(f"{PATH}.Bits", f"{chosen['Bits']!r}: finetune writes 4-bit MatMulNBits only (Bits 4)")
    if chosen["AccuracyLevel"] not in FLOAT32_ACCURACY_LEVELS:
        raise ConfigError(f"{PATH}.AccuracyLevel", f"{chosen['AccuracyLevel']!r} has no equivalent: finetune's "
                          "MatMulNBits accumulate in float32 (accuracy_level 0; 1 means the same)")
    if chosen["Algorithm"] not in ALGORITHMS:
        raise ConfigError(f"{PATH}.Algorithm", f"{chosen['Algorithm']!r} has no equivalent here; DEFAULT (round to "
                          "nearest) or GPTQ")


def weight(chosen: Mapping[str, Any], t: Translation) -> dict[str, Any]:
    """The weight format MatMulNBitsParams describe: int4 symmetric or uint4 with zero points, one
    scale per group along the op's reduction axis (auto), min/max calibrated."""
    t.origins.update({"weight": PATH, "weight.block_size": f"{PATH}.GroupSize", "weight.symmetric": f"{PATH}.Symmetric"})
    symmetric = chosen["Symmetric"]
    return {"format": "int", "dtype": "int4" if symmetric else "uint4", "symmetric": symmetric,
            "granularity": "block", "block_size": chosen["GroupSize"], "axis": AUTO, "calibration": "minmax"}
