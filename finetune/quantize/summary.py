"""What a quantization did, for people: short labels of formats (also used in node names), the
summary dict (tensors per format and role, model sizes, normalisation changes, and the warnings:
what was not done as configured, with the reason) and its table."""

from __future__ import annotations

import dataclasses
import resource
from collections import Counter
from typing import Any

import onnx

from finetune.formats import NAMED_BLOCK_FORMATS, BFPSpec, FloatSpec, FormatSpec, IntSpec, MXSpec
from finetune.notices import Notice, describe
from finetune.onnx.io import model_bytes

from .plan import Use, with_producer_formats


def format_label(spec: FormatSpec) -> str:
    """A short readable name of a format for node and tensor names."""
    if isinstance(spec, (IntSpec, FloatSpec)):
        return spec.dtype
    if isinstance(spec, MXSpec):
        return f"mx_{spec.element_dtype}"
    return f"{spec.bfp_method}{spec.bit_width}"


def display_name(spec: FormatSpec) -> str:
    """The format's name for people: a block format's preset name (MX6, not to_bfp_prime13) where
    one matches, else its short label."""
    if isinstance(spec, (BFPSpec, MXSpec)):
        return next((name for name, named in NAMED_BLOCK_FORMATS.items()
                     if dataclasses.replace(named, axis=spec.axis) == spec), format_label(spec))
    return format_label(spec)


def format_attributes(spec: FormatSpec) -> str:
    """A block format's node attributes other than the axis (what sets e.g. MX6 apart), else ''."""
    if not isinstance(spec, (BFPSpec, MXSpec)):
        return ""
    return " ".join(f"{field.name}={getattr(spec, field.name)}" for field in dataclasses.fields(spec) if field.name != "axis")


def summarize(
    bytes_before: int, quantized: onnx.ModelProto, uses: list[Use], changes: list[str], notices: list[Notice],
    seconds: float, alignments: list[dict[str, Any]] | None = None, rescaling: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Tensors per format and role, model sizes (`bytes_before`: the input's), what normalisation (and equalisation) changed,
    the warnings ({"tensor" | "node" | "model" | "config": name, "reason": ...} each), with
    npu_cnn the scales and formats its alignments changed (finetune.quantize.npu) and with
    rotation, smooth_quant or awq (`rescaling`, by section) what it did to each layer (finetune.quantize.smooth, .awq)."""
    distinct = {(u.tensor, u.spec): u for u in with_producer_formats(uses)}.values()
    per_format = Counter((use.role, display_name(use.spec), format_attributes(use.spec)) for use in distinct)
    summary = {
        "tensors_per_format": [{"role": r, "format": f, "tensors": n, **({"attributes": a} if a else {})}
                               for (r, f, a), n in sorted(per_format.items())],
        "quantized_nodes": len({u.node for u in uses}),
        "model_bytes_before": bytes_before,
        "model_bytes_after": model_bytes(quantized),
        "normalization": changes,
        "warnings": [notice.as_dict() for notice in notices],
        "seconds": round(seconds, 3),
        "peak_rss_kib": peak_rss_kib(),
    }
    if alignments is not None:
        summary["npu_cnn_alignments"] = alignments
    summary.update(rescaling or {})
    return summary


def peak_rss_kib() -> int:
    """The most resident memory this process has used so far, in KiB (ru_maxrss, KiB on Linux):
    the `peak_rss_kib` of every summary, measured when it is written."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the table the CLI prints."""
    lines = [f"{'role':<12}{'format':<18}{'tensors':>8}"]
    lines += [f"{row['role']:<12}{row['format']:<18}{row['tensors']:>8}  {row.get('attributes', '')}".rstrip()
              for row in summary["tensors_per_format"]]
    before, after = summary["model_bytes_before"], summary["model_bytes_after"]
    lines.append(f"quantized nodes: {summary['quantized_nodes']}; model size {before:,} -> {after:,} bytes "
                 f"({after / before:.2f}x); {summary['seconds']:.2f} s; peak memory {summary['peak_rss_kib'] / 2**20:.2f} GiB")
    if "npu_cnn_alignments" in summary:
        lines.append(f"npu_cnn: {len(summary['npu_cnn_alignments'])} scale or format alignment(s)")
    if "rotation" in summary:
        rotation = summary["rotation"]
        lines.append(f"rotation ({rotation['kind']}, seed {rotation['seed']}): residual stream of width {rotation['width']}, "
                     f"{rotation['layers_reading']} layer(s) reading it, {rotation['layers_writing']} writing into it, "
                     f"{rotation['gains_folded']} norm gain(s) folded"
                     + (f", {len(rotation['online'])} layer input(s) rotated online" if rotation["online"] else "")
                     + (f", the values of {len(rotation['heads'])} attention(s) rotated per head of {rotation['head_width']}"
                        if rotation.get("heads") else ""))
    if "smooth_quant" in summary:
        smooth = summary["smooth_quant"]
        lines.append(_rescaling_line(f"smooth_quant (alpha {smooth['alpha']:g})", "smoothed", smooth))
    if "awq" in summary:
        awq = summary["awq"]
        ratio = "" if awq["loss_over_rtn"] is None else f"; calibration loss {awq['loss_over_rtn']:.3f} of rounding to nearest's"
        lines.append(_rescaling_line(f"awq (grid {awq['grid']})", "scaled", awq) + ratio)
    lines += [f"warning: {line}" for line in describe(summary["warnings"])]
    return "\n".join(lines)


def _rescaling_line(label: str, verb: str, entry: dict[str, Any]) -> str:
    """The CLI line of a rescaling's summary entry (smooth_quant's or awq's): what happened to its layers."""
    return (f"{label}: {entry['smoothed']} layer(s) {verb}, {entry['folded']} folded into their producer, "
            f"{entry['mul_inserted']} behind an inserted Mul, {entry['skipped']} skipped")
