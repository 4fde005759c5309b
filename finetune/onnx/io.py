"""Reading and writing ONNX files: clear errors naming the file, atomic writes, and models over
protobuf's 2 GB kept as a model file plus one external data file, written and handed to onnx's
tools without a second copy of the weights in memory."""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, shape_inference, version_converter

from finetune.files import write_atomic

from .graphs import all_graphs

PROTOBUF_LIMIT = 2**31 - 1
# Models of this many serialized bytes or more are written (and handed to onnxruntime, shape
# inference and the checker) as a model file plus one data file; tests lower it to exercise that path.
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT
# A model of this many serialized bytes or more is handed on as a file with its tensors in a data file (to
# onnxruntime, and from the quantizer to tuning) rather than as a proto to copy or serialize: in memory it
# would be held two or three times at once (the proto, its copy or bytes, onnxruntime's parse).
BY_FILE_BYTES = 1 << 26
# Tensors smaller than this stay in the model file: scalars and shapes, which shape inference reads.
INLINE_TENSOR_BYTES = 1024
# Offsets of tensors in the data file are multiples of this (a page), so onnxruntime may map them.
DATA_ALIGNMENT = 4096
_SUB_BYTE_BITS = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.FLOAT4E2M1: 4}
_DATA_NAME = re.compile(r"\.[0-9a-f]{16}\.data")  # what follows the model's file name in its data file's name


def load_model(source: str | os.PathLike | onnx.ModelProto, external_values: bool = True) -> onnx.ModelProto:
    """A ModelProto from a path (external data read from beside it, the files untouched; with
    `external_values` False left as references, for a reader of the graph alone) or a copy of a
    given proto, so callers never modify what the user handed in."""
    if isinstance(source, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(source)
        return copy
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX model {path} does not exist")
    try:
        return onnx.load(str(path), load_external_data=external_values)
    except Exception as error:  # protobuf raises several unrelated types for a corrupt file, onnx others for missing data
        raise ValueError(f"{path} is not a readable ONNX model (with its external data): {error}") from error


def needs_external_data(model: onnx.ModelProto) -> bool:
    """Whether the model is too large (EXTERNAL_DATA_THRESHOLD) to be serialized as one protobuf."""
    return model_bytes(model) >= EXTERNAL_DATA_THRESHOLD


def goes_by_file(model: onnx.ModelProto) -> bool:
    """Whether the model is handed on as a file with a data file rather than in memory (BY_FILE_BYTES)."""
    return needs_external_data(model) or model_bytes(model) >= BY_FILE_BYTES


def model_bytes(model: onnx.ModelProto) -> int:
    """The model's serialized size (ByteSize's answer), without serializing its main graph's raw
    tensors: protobuf's ByteSize serializes the whole model to count, a transient copy of the weights."""
    header = copy_without_initializers(model)
    graph = header.graph.ByteSize()
    for tensor in model.graph.initializer:
        if tensor.HasField("raw_data"):
            graph += _field_size(_tensor_metadata(tensor).ByteSize() + _field_size(_raw_bytes(tensor)))
        else:
            graph += _field_size(tensor.ByteSize())
    return header.ByteSize() - _field_size(header.graph.ByteSize()) + _field_size(graph)


def _tensor_metadata(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """The tensor's fields but its data (a few bytes)."""
    metadata = onnx.TensorProto()
    _copy_fields(tensor, metadata, skip="raw_data")
    return metadata


def _raw_bytes(tensor: onnx.TensorProto) -> int:
    """The length of a tensor's raw_data, from its shape and type (reading raw_data would copy it)."""
    count = math.prod(tensor.dims)
    bits = _SUB_BYTE_BITS.get(tensor.data_type)
    if bits is not None:
        return (count * bits + 7) // 8
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def _field_size(length: int) -> int:
    """Bytes of a length-delimited protobuf field of `length` bytes: a one-byte tag, the varint length, the bytes."""
    return 1 + max(1, (length.bit_length() + 6) // 7) + length


def model_digest(model: onnx.ModelProto, folder: str | os.PathLike | None = None) -> str:
    """A short sha256 digest of the model (for a run's fingerprint), fed its header and then one
    initializer at a time: serializing the whole model would copy its weights, and past 2 GB fails.
    Equal models give equal digests, whether or not their tensors came from external data, and
    whether or not that data was loaded (`folder`: where a model loaded without it reads it)."""
    digest = hashlib.sha256(copy_without_initializers(model).SerializeToString())
    for tensor in model.graph.initializer:
        tensor = loaded_tensor(tensor, folder)
        metadata = _tensor_metadata(tensor)
        metadata.ClearField("data_location")  # onnx.load sets it on tensors read from a data file
        digest.update(metadata.SerializeToString())
        digest.update(tensor.raw_data)
    return digest.hexdigest()[:16]


def loaded_tensor(tensor: onnx.TensorProto, folder: str | os.PathLike | None) -> onnx.TensorProto:
    """The tensor itself, or where its values are still in its external data file (a model loaded
    without them) a copy with them read from `folder`, which the caller drops after use: the model's
    proto never holds the bytes, so a model over 2 GB is read one tensor at a time."""
    if not external_data_helper.uses_external_data(tensor) or tensor.HasField("raw_data"):
        return tensor
    if folder is None:
        raise ValueError(f"the values of tensor {tensor.name!r} are in an external data file that was not loaded, and no "
                         "folder to read it from was given")
    loaded = onnx.TensorProto()
    loaded.CopyFrom(tensor)
    external_data_helper.load_external_data_for_tensor(loaded, str(folder))
    loaded.data_location = onnx.TensorProto.DEFAULT
    del loaded.external_data[:]
    return loaded


def external_array(tensor: onnx.TensorProto, folder: str | os.PathLike) -> np.ndarray | None:
    """The values of a tensor whose raw bytes lie in a data file in `folder`, read straight into an
    array (one copy, where loaded_tensor makes a proto of them and to_array a view: the read bytes,
    the proto's and a caller's copy were 750 MiB at once for a 250 MiB LM head); None where that
    does not apply (sub-byte types, a location outside the folder, a big-endian host), for
    loaded_tensor to read."""
    place = {entry.key: entry.value for entry in tensor.external_data}
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    path = Path(folder) / place.get("location", "")
    if tensor.data_type in _SUB_BYTE_BITS or dtype.kind == "O" or sys.byteorder != "little" \
            or not path.resolve().is_relative_to(Path(folder).resolve()):
        return None
    count = math.prod(tensor.dims)
    if int(place.get("length", count * dtype.itemsize)) != count * dtype.itemsize:
        return None
    return np.fromfile(path, dtype, count=count, offset=int(place.get("offset", 0))).reshape(tuple(tensor.dims))


def has_external_data(source: str | os.PathLike | onnx.ModelProto) -> bool:
    """Whether a model file keeps tensors in external data (read without loading them), so what is
    written from it keeps them so too, whatever its size; a proto in memory holds its data."""
    model = source if isinstance(source, onnx.ModelProto) else onnx.load(str(source), load_external_data=False)
    return any(tensor.data_location == onnx.TensorProto.EXTERNAL for graph in all_graphs(model.graph) for tensor in graph.initializer)


def model_files(path: str | os.PathLike | None) -> list[Path]:
    """A model file and the external data files it reads (resolved beside it): what an output must
    not be (files.check_output's inputs). Just the path where it is no readable model (yet)."""
    if path is None:
        return []
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # missing or unreadable: loading it reports that, with the file's name
        return [path]
    return [path, *(path.parent / location for location in sorted(_data_locations(model)))]


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool = False) -> None:
    """Write a model so that `path` holds either the old model or the complete new one, never a
    partial write. Models needing it (needs_external_data), or any with `external_data`, keep their
    large tensors in one data file beside it, named after the model and its content: it is written
    (atomically) before the model file, whose rename commits the pair; then the data file the old
    model read is removed (docs/guarantees.md, "Models over 2 GB")."""
    path = Path(path)
    stale = _own_data_files(path)
    if not (external_data or needs_external_data(model)):
        write_atomic(path, lambda tmp: tmp.write_bytes(model.SerializeToString()))
    else:
        stale.discard(_save_pair(model, path))
    for name in stale:
        (path.parent / name).unlink(missing_ok=True)


def _save_pair(model: onnx.ModelProto, path: Path) -> str:
    """Write the data file under its final name, then the model file; returns the data file's
    name. A failure removes the new data file unless the old model reads it too (same content)."""
    digest = hashlib.blake2b(digest_size=8)
    external_header(model, "", digest.update)  # a first pass names the file after its content
    name = f"{path.name}.{digest.hexdigest()}.data"
    headers = []

    def write_data(tmp: Path) -> None:
        with open(tmp, "wb") as data:
            headers.append(external_header(model, name, data.write))

    write_atomic(path.parent / name, write_data)
    try:
        write_atomic(path, lambda tmp: tmp.write_bytes(headers[0].SerializeToString()))
    except BaseException:
        if name not in _own_data_files(path):
            (path.parent / name).unlink(missing_ok=True)
        raise
    return name


def external_header(model: onnx.ModelProto, location: str, sink: Callable[[bytes], object] | None) -> onnx.ModelProto:
    """The model with each large main-graph initializer (INLINE_TENSOR_BYTES or more, stored as
    raw bytes) replaced by a reference to `location`, its bytes handed to `sink` (a file's write)
    at page-aligned offsets; with `sink` None only the references are made (shape inference needs
    no values) and no bytes are read. One tensor's bytes are copied at a time; `model` is not modified."""
    header = copy_without_initializers(model)
    offset = 0
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data") or _raw_bytes(tensor) < INLINE_TENSOR_BYTES:
            header.graph.initializer.append(tensor)
            continue
        reference = header.graph.initializer.add()
        _copy_fields(tensor, reference, skip="raw_data")
        reference.data_location = onnx.TensorProto.EXTERNAL
        padding = -offset % DATA_ALIGNMENT
        length = _raw_bytes(tensor)
        if sink is not None:
            payload = tensor.raw_data
            length = len(payload)
            sink(bytes(padding))
            sink(payload)
        offset += padding
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            reference.external_data.add(key=key, value=value)
        offset += length
    return header


SET_ASIDE = "set-aside.data"  # the data file of set_aside's header in its folder


def set_aside(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """The model's header (see external_header) with its large tensors' bytes in a data file in `folder`,
    for a proto kept only to be written at the end of a long run: the caller drops `model` (protobuf
    frees a message's bytes only with the whole message) and calls put_back before writing it."""
    with open(folder / SET_ASIDE, "wb") as data:
        return external_header(model, SET_ASIDE, data.write)


def put_back(header: onnx.ModelProto, folder: Path, skip: Collection[str] = ()) -> onnx.ModelProto:
    """set_aside's header with its tensors' bytes read back from `folder`, in place: the model as it was
    (a data_location of DEFAULT left unset, which means the same). Tensors named in `skip` stay references
    for now (the caller replaces them whole, or puts them back later)."""
    for tensor in header.graph.initializer:
        place = {entry.key: entry.value for entry in tensor.external_data}
        if tensor.data_location != onnx.TensorProto.EXTERNAL or place.get("location") != SET_ASIDE or tensor.name in skip:
            continue
        external_data_helper.load_external_data_for_tensor(tensor, str(folder))
        tensor.ClearField("external_data")
        tensor.ClearField("data_location")
    return header


def write_with_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Write the model as `path` plus `path`.data (not atomically: for temporary folders)."""
    with open(path.with_name(path.name + ".data"), "wb") as data:
        header = external_header(model, path.name + ".data", data.write)
    path.write_bytes(header.SerializeToString())


def infer_shapes_of(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference (data propagation on) of the model, in place, through its header."""
    return through_header(model, lambda m: shape_inference.infer_shapes(m, strict_mode=False, data_prop=True))


def convert_version_of(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """onnx's version converter on the model, in place, through its header."""
    return through_header(model, lambda m: version_converter.convert_version(m, opset))


def through_header(model: onnx.ModelProto, transform: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
    """`transform` (an onnx tool that serializes its input and parses its output) run on the model's
    header, its large tensors as references (no values read: such tools read the small constants
    that shapes come from, which the header keeps), and its result, but for the tensors, put in
    place into the model (initializers it added join them); returns the model. On the whole model
    such a tool would hold four copies of the weights at once, and past 2 GB cannot run at all."""
    result = transform(external_header(model, "unused", None))
    kept = {tensor.name for tensor in model.graph.initializer}
    added = [tensor for tensor in result.graph.initializer if tensor.name not in kept]
    for field in [f for f, _ in model.ListFields() if f.name != "graph"]:
        model.ClearField(field.name)
    _copy_fields(result, model, skip="graph")
    for field in [f for f, _ in model.graph.ListFields() if f.name != "initializer"]:
        model.graph.ClearField(field.name)
    _copy_fields(result.graph, model.graph, skip="initializer")
    model.graph.initializer.extend(added)
    return model


def check_model(model: onnx.ModelProto) -> None:
    """onnx's checker on a model of any size: past the threshold on its header and a sparse data
    file of the right length (the checker checks a large tensor's type, shape and file, not its values)."""
    if not needs_external_data(model):
        onnx.checker.check_model(model)
        return
    with tempfile.TemporaryDirectory(prefix="finetune-check-") as folder:
        path = Path(folder) / "model.onnx"
        write_without_values(model, path)
        onnx.checker.check_model(str(path))


def write_without_values(model: onnx.ModelProto, path: Path) -> None:
    """Write the model as `path` plus `path`.data, a sparse file of zeros in place of the large
    tensors' values (no disk, no copy): for checks of what does not depend on them (types, shapes,
    kernels), in temporary folders."""
    data = path.with_name(path.name + ".data")
    header = external_header(model, data.name, None)
    places = [{e.key: e.value for e in tensor.external_data} for tensor in header.graph.initializer]
    with open(data, "wb") as file:
        file.truncate(max((int(p["offset"]) + int(p["length"]) for p in places if p), default=0))
    path.write_bytes(header.SerializeToString())


def copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model whose main graph has no initializers (subgraphs keep theirs): the start
    of a rewrite that adds back only the tensors it keeps, never copying the others."""
    copy = onnx.ModelProto()
    _copy_fields(model, copy, skip="graph")
    _copy_fields(model.graph, copy.graph, skip="initializer")
    return copy


def _copy_fields(source: object, target: object, skip: str) -> None:
    """Copy every set field of one protobuf message into another of its type, but `skip`."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _data_locations(model: onnx.ModelProto) -> set[str]:
    """The external data files the model's tensors (subgraphs' included) name, relative to it."""
    return {entry.value for graph in all_graphs(model.graph) for tensor in graph.initializer
            for entry in tensor.external_data if entry.key == "location"}


def _own_data_files(path: Path) -> set[str]:
    """The data files of the model now at `path` that this module wrote for it (named after it),
    which a new model there replaces; empty when there is none or it cannot be read. The model is
    parsed only when such a file lies beside it."""
    candidates = {f.name for f in path.parent.glob(f"{glob.escape(path.name)}.*.data")
                  if _DATA_NAME.fullmatch(f.name[len(path.name):])}
    if not candidates or not path.is_file():
        return set()
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # protobuf raises several unrelated types; a file that is no model has no data of ours
        return set()
    return candidates & _data_locations(model)
