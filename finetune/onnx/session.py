"""onnxruntime sessions, made in one place: from memory, or for models of onnx.io.BY_FILE_BYTES or more
(those over protobuf's 2 GB among them) from a temporary model file and data file written tensor by
tensor (no copy of the proto, no serialized bytes); by default at ORT_DISABLE_ALL, the level that keeps a QDQ
model's simulated numerics exact (above it, DequantizeLinear -> MatMul fuses into kernels that
quantize activations: DESIGN decision 5)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import onnx
import onnxruntime as ort

from .io import external_header, goes_by_file, has_external_data, load_model, write_with_external_data, write_without_values

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
OPTIMIZATION = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
EXACT = "disable"


def session_options(optimization: str = EXACT) -> ort.SessionOptions:
    """Session options at one of the OPTIMIZATION levels (default: the exact one), nodes run in
    onnxruntime's priority-based order: its default runs every node that reads only initializers
    first, so a QDQ model's dequantized weights were all held at once, one more copy of the weights
    (issue 44; each node computes what it computed, only the order of independent nodes changes)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION[optimization]
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return options


def inference_session(
    model: str | os.PathLike | onnx.ModelProto, providers: Sequence[str] | None = None, optimization: str = EXACT,
) -> ort.InferenceSession:
    """A session for a model path or proto on `providers` (CPU by default)."""
    options = session_options(optimization)
    providers = list(providers or DEFAULT_PROVIDERS)
    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), options, providers=providers)
    if not goes_by_file(model):
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    # Through files rather than SessionOptions.add_external_initializers: that needs every large tensor
    # as a numpy array, a second copy of the weights in memory beside the proto's, while onnxruntime
    # reads (or maps) a data file per tensor; the file costs disk and time, not memory.
    with tempfile.TemporaryDirectory(prefix="finetune-session-") as folder:  # onnxruntime has read it when it returns
        path = Path(folder) / SESSION_FILE
        write_with_external_data(model, path)
        return ort.InferenceSession(str(path), options, providers=providers)


SESSION_FILE = "model.onnx"  # a session's model file in its temporary folder, with SESSION_FILE.data beside it


def copy_for_session(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """A copy of the model to rewrite (outputs added, say) before `session_of_copy(copy, folder)`:
    from BY_FILE_BYTES on, its large tensors are written once to a data file in `folder` and the copy
    refers to them, so no second copy of the weights is held in memory."""
    if not goes_by_file(model):
        return load_model(model)
    with open(folder / f"{SESSION_FILE}.data", "wb") as data:
        return external_header(model, f"{SESSION_FILE}.data", data.write)


@contextlib.contextmanager
def session_folder(data_folder: Path | None = None) -> Iterator[Path]:
    """The folder for copy_for_session and session_of_copy: a temporary one, or `data_folder` for a
    model whose tensors are already in a data file there (onnx.io.set_aside's header), so the session
    reads them from it and no copy of the weights is made; the session's own files are removed after."""
    if data_folder is None:
        with tempfile.TemporaryDirectory(prefix="finetune-session-") as folder:
            yield Path(folder)
        return
    try:
        yield data_folder
    finally:
        for name in (SESSION_FILE, f"{SESSION_FILE}.data"):
            (data_folder / name).unlink(missing_ok=True)


def session_of_copy(
    copy: onnx.ModelProto, folder: Path, providers: Sequence[str] | None = None, optimization: str = EXACT,
) -> ort.InferenceSession:
    """A session for a copy made by copy_for_session in `folder`."""
    if not has_external_data(copy):
        return inference_session(copy, providers, optimization)
    path = folder / SESSION_FILE
    path.write_bytes(copy.SerializeToString())
    return inference_session(path, providers, optimization)


def load_failure(model: str | os.PathLike | onnx.ModelProto) -> str | None:
    """onnxruntime's reason, on one line, for refusing to load the model; None when it loads. A
    proto is loaded with zeros for its large tensors' values, read from a sparse file: whether a
    model loads does not depend on them, and no copy of the weights is made."""
    try:
        if isinstance(model, onnx.ModelProto):
            with tempfile.TemporaryDirectory(prefix="finetune-load-") as folder:
                path = Path(folder) / SESSION_FILE
                write_without_values(model, path)
                inference_session(path)
        else:
            inference_session(model)
    except Exception as error:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
        return " ".join(str(error).split())
    return None


def require_loads(model: onnx.ModelProto, original: str | os.PathLike | onnx.ModelProto, what: str) -> None:
    """Refuse to hand back a model that stock onnxruntime cannot load when it loaded `original`
    (a ValueError naming onnxruntime's reason, which names the node), so no run writes one."""
    failure = load_failure(model)
    if failure is None or load_failure(original) is not None:
        return
    raise ValueError(f"{what}: onnxruntime refuses the model this run made, although it loads the input ({failure}); "
                     "nothing was written: please report this with the model")
