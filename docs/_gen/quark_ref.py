"""The table of AMD Quark for ONNX option names, generated from `finetune.config.quark_options`: at
every level of a Quark config, each option the translator knows, whether it is translated, accepted
without effect, or accepted only at one value (with that value and, where the code says it, why).
An option added to those tables appears here at once; its translation note lives in QUARK_NOTES."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from descriptions import QUARK_NBITS_NOTES, QUARK_NOTES

from finetune.config import quark_nbits
from finetune.config import quark_options as q

# (heading, mapped, no effect, accepted only at some values); FastFinetune's and GPTQParams' mapped keys say their own target.
LEVELS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], Mapping[str, tuple[Any, ...]]], ...] = (
    ("Top level (`QuantizationConfig`)", q.TOP_MAPPED, q.TOP_NO_EFFECT, q.TOP_ACCEPTED_ONLY),
    ("`extra_options`", q.EXTRA_MAPPED, q.EXTRA_NO_EFFECT, q.EXTRA_ACCEPTED_ONLY),
    ("`extra_options.FastFinetune`", q.FAST_FT_MAPPED, q.FAST_FT_NO_EFFECT, q.FAST_FT_ACCEPTED_ONLY),
    ("`extra_options.GPTQParams`", (*q.GPTQ_KEYS, *q.GPTQ_GRID), (), q.GPTQ_ACCEPTED_ONLY),
    ("`extra_options.MatMulNBitsParams`", tuple(quark_nbits.DEFAULTS), (), {}),
    ("`extra_options.AutoMixprecision`", q.AUTO_MP_MAPPED, q.AUTO_MP_NO_EFFECT, q.AUTO_MP_ACCEPTED_ONLY),
    ("`extra_options.TensorQuantOverrides` entries", q.TENSOR_OVERRIDE_KEYS, (), q.TENSOR_OVERRIDE_ACCEPTED_ONLY),
)
NO_EFFECT = ("accepted, no effect",
             "steers logging, execution providers, memory or a feature that is off; named in the log at INFO")


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple, dict, str)) and not value:
        return "empty"
    return f"`{value!r}`"


def _accepted(values: tuple[Any, ...]) -> str:
    return " or ".join(dict.fromkeys(_value(v) for v in values))


def _mapped_note(heading: str, option: str) -> str:
    if "FastFinetune" in heading and option in q.FAST_FT_KEYS:
        return f"`fast_finetune.{q.FAST_FT_KEYS[option]}`" + (f"; {QUARK_NOTES[option]}" if option in QUARK_NOTES else "")
    if "MatMulNBitsParams" in heading:
        return QUARK_NBITS_NOTES[option]
    if "GPTQParams" in heading and option in q.GPTQ_KEYS:
        return f"`fast_finetune.gptq.{q.GPTQ_KEYS[option]}`"
    if "GPTQParams" in heading:
        return "checked: must describe the weight format (weight_type, per_channel, WeightSymmetric), which GPTQ rounds to here"
    return QUARK_NOTES.get(option, "translated (see `finetune/config/quark.py`)")


def _refusal_note(option: str, values: tuple[Any, ...]) -> str:
    """Why only this value: the code's own statement, the guide's note, or the general reason."""
    if option in q.FINETUNE_DOES:
        return q.FINETUNE_DOES[option]
    if option in QUARK_NOTES:
        return QUARK_NOTES[option]
    if all(v is False or v is None for v in values):
        return "a Quark feature finetune does not implement: only its off value is accepted"
    return "finetune has no equivalent setting: only the value that matches what it does is accepted"


def level_table(heading: str, mapped: tuple[str, ...], no_effect: tuple[str, ...],
                accepted_only: Mapping[str, tuple[Any, ...]]) -> str:
    """One level of a Quark config as a Markdown table."""
    rows = [f"#### {heading}\n", "| Quark option | here | translation, or why not |", "|---|---|---|"]
    rows += [f"| `{o}` | translated | {_mapped_note(heading, o)} |" for o in mapped]
    rows += [f"| `{o}` | {NO_EFFECT[0]} | {NO_EFFECT[1]} |" for o in no_effect]
    rows += [f"| `{o}` | only {_accepted(v)}; other values refused | {_refusal_note(o, v)} |"
             for o, v in accepted_only.items()]
    return "\n".join(rows) + "\n"


def enum_table() -> str:
    """Quark's quant types, calibration methods and quant formats with what each becomes here."""
    rows = ["| Quark value | here |", "|---|---|"]
    members = {name.split(".")[1]: value for name, value in q.QUANT_TYPES.items()}  # any of Quark's type enums
    for member, (fmt, dtype) in members.items():
        rows.append(f"| `{member}` | format `{fmt}`" + (f", dtype `{dtype}`" if dtype else ", attributes from "
                    f"`{'BFPAttributes' if fmt == 'bfp' else 'MXAttributes'}`") + " |")
    for method, ours in q.CALIBRATE_METHODS.items():
        scales = ", power-of-two scales" if ours and ours[1] else ""
        text = "refused: no equivalent" if ours is None else f"calibration `{ours[0]}`{scales}"
        rows.append(f"| `{method}` | {text} |")
    for fmt, forced in q.QUANT_FORMATS.items():
        text = "refused: no equivalent (quantize in QDQ format)" if forced is None else (
            f"forces `{forced}` on activations and weights" if forced else "QDQ (the only form written)")
        rows.append(f"| `{fmt}` | {text} |")
    return "\n".join(rows) + "\n"


def quark_reference() -> str:
    """Every level's table, then the enum-like values."""
    tables = "\n".join(level_table(*level) for level in LEVELS)
    return f"{tables}\n#### Values of quant types, methods and formats\n\n{enum_table()}"
