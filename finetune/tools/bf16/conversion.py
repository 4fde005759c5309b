"""The conversion entry points: check the model (source type, no subgraphs), normalise and
optimise it, apply the chosen format, and for the bf16 format name the nodes onnxruntime's CPU
provider cannot run."""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import onnx
import onnxruntime as ort
from onnx import TensorProto

from finetune.files import check_output
from finetune.onnx.domains import MIN_OPSET
from finetune.onnx.fold import tensor_types
from finetune.onnx.graphs import has_subgraphs
from finetune.onnx.io import has_external_data, load_model, model_files, save_model_atomic
from finetune.onnx.normalize import default_opset, normalize_model

from ..optimize import optimize
from ..session import describe_missing, missing_kernels
from .formats import FORMAT_TYPES, FORMATS
from .numerics import SOURCES, Source
from .schemas import BF16_OPSET

logger = logging.getLogger(__name__)


def convert_file(
    input_path: str | os.PathLike, output_path: str | os.PathLike, fmt: str = "with_cast", source: str = "auto",
) -> onnx.ModelProto:
    """Convert the model at `input_path` and write it atomically to `output_path` (never the input)."""
    output_path = check_output(output_path, *model_files(input_path))
    model = convert(load_model(input_path), fmt, source)
    save_model_atomic(model, output_path, external_data=has_external_data(input_path))
    logger.info("wrote %s (%s)", output_path, fmt)
    return model


def convert(model: onnx.ModelProto, fmt: str = "with_cast", source: str = "auto") -> onnx.ModelProto:
    """A `fmt` bfloat16 version of a float32 or float16 (`source`, or `auto` to detect) model; the input is untouched."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    _refuse_subgraphs(model)
    model, changes = normalize_model(model, BF16_OPSET if fmt == "bf16" else MIN_OPSET)
    if fmt == "bf16" and default_opset(model) < BF16_OPSET:
        raise ValueError(f"the bf16 format needs opset >= {BF16_OPSET} (bfloat16 Conv, pooling, ...): "
                         + "; ".join(changes))
    kind = SOURCES[detect_source(model) if source == "auto" else source]
    _check_source(model, kind)
    optimize(model)
    FORMAT_TYPES[fmt](kind).apply(model)
    if fmt == "bf16":
        _report_cpu_kernels(model)
    return model


def detect_source(model: onnx.ModelProto) -> str:
    """float16 if the model has more float16 than float32 tensors, else float32."""
    counts = _float_counts(model)
    return "float16" if counts[TensorProto.FLOAT16] > counts[TensorProto.FLOAT] else "float32"


def _float_counts(model: onnx.ModelProto) -> dict[int, int]:
    """How many declared tensors (inputs, outputs, value_info, initializers) have each element type."""
    counts: dict[int, int] = defaultdict(int)
    for tensor_type in tensor_types(model).values():
        counts[tensor_type.elem_type] += 1
    return counts


def _check_source(model: onnx.ModelProto, source: Source) -> None:
    """Refuse a model with no tensor of the source type, naming the tool that fits it."""
    if _float_counts(model)[source.elem_type]:
        return
    other = "float16" if source.name == "float32" else "float32"
    tool = f"convert_{'fp16' if other == 'float16' else 'fp32'}_to_bf16"
    raise ValueError(f"the model has no {source.name} tensors; for a {other} model use {tool} (or --from {other})")


def _refuse_subgraphs(model: onnx.ModelProto) -> None:
    """Control-flow bodies would keep their float tensors; refuse them by name rather than convert half a model."""
    nodes = [n.name or n.op_type for n in model.graph.node if has_subgraphs(n)]
    if nodes:
        raise ValueError(f"nodes with subgraphs (If/Loop/Scan) are not supported by the bf16 conversion: {nodes}")


def _report_cpu_kernels(model: onnx.ModelProto) -> None:
    """Without a GPU provider, log which nodes of a bf16 model onnxruntime's CPU provider cannot run."""
    gpu = [p for p in ort.get_available_providers() if p not in ("CPUExecutionProvider", "AzureExecutionProvider")]
    if gpu:
        return
    missing = missing_kernels(model, "CPUExecutionProvider")
    if missing:
        logger.warning("the bf16 model targets GPU execution providers; onnxruntime's CPU provider (the only one "
                       "here) lacks kernels for:\n%s", describe_missing(missing))
