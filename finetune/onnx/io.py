"""Reading and writing ONNX files: clear errors naming the file, atomic writes, external data."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from finetune.files import write_atomic

PROTOBUF_LIMIT = 2**31 - 1


def load_model(source: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """A ModelProto from a path (external data loaded from beside it) or a copy of a given proto,
    so callers never modify what the user handed in."""
    if isinstance(source, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(source)
        return copy
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX model {path} does not exist")
    try:
        return onnx.load(str(path))
    except Exception as error:  # protobuf raises several unrelated types for a corrupt file
        raise ValueError(f"{path} is not a readable ONNX model: {error}") from error


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write a model so that `path` holds either the old file or the complete new one, never a
    partial write; models over 2 GB store their tensors as external data beside it."""
    path = Path(path)
    external = model.ByteSize() >= PROTOBUF_LIMIT
    write_atomic(path, lambda tmp: onnx.save_model(
        model, str(tmp), save_as_external_data=external, all_tensors_to_one_file=True,
        location=f"{path.name}.data" if external else None,
    ))
