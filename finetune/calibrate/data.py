"""Calibration data in every form users have (onnxruntime CalibrationDataReader, iterables of dicts,
torch DataLoaders, folders of .npy/.npz files, explicit random data), normalised to feeds checked
against the model's inputs, with a fresh pass on every iteration."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from .decoder_inputs import IDS, fillable_inputs, filled

logger = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
Items = Callable[[], Iterator[tuple[str, Any]]]  # one pass over (label for errors, raw item)
ModelLike = onnx.ModelProto | str | os.PathLike | Sequence["InputInfo"]

DATA_SUFFIXES = (".npy", ".npz")
LABELS_FILE = "labels.npy"  # in a data folder: one label per sample, in file order (not an input)
RANDOM_INT_HIGH = 16  # random integer inputs are drawn from [0, RANDOM_INT_HIGH)


@dataclass(frozen=True)
class InputInfo:
    """A model input as feeds must match it: name, element type (None if the model leaves it
    undefined) and shape (None for an unknown rank; None entries for dynamic dimensions)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | None, ...] | None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def dynamic_batch(self) -> bool:
        """Whether the leading dimension may take any size, so a feed may be cut along it."""
        return self.shape is None or (len(self.shape) > 0 and self.shape[0] is None)


def model_inputs(model: onnx.ModelProto | str | os.PathLike) -> list[InputInfo]:
    """The inputs a feed must provide: graph inputs that are not initializers, in graph order."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    initializers = {tensor.name for tensor in model.graph.initializer}
    return [_input_info(value) for value in model.graph.input if value.name not in initializers]


def _input_info(value: onnx.ValueInfoProto) -> InputInfo:
    if value.type.WhichOneof("value") != "tensor_type":
        raise ValueError(f"model input {value.name!r} is not a tensor; calibration feeds tensors only")
    tensor = value.type.tensor_type
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)) if tensor.elem_type else None
    if not tensor.HasField("shape"):
        return InputInfo(value.name, dtype, None)
    shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor.shape.dim)
    return InputInfo(value.name, dtype, shape)


class CalibrationData:
    """Feeds for a model from any supported source; each iteration is a fresh pass, checked against
    the model inputs, stopping after `limit` samples (counted along the leading dimension).

    Sources: a path to a folder of .npy (single-input models) or .npz files (keys are input names),
    one sample or batch per file, read in name order; an object with `get_next()` (onnxruntime's
    CalibrationDataReader protocol), rewound with `rewind()` before every pass, so a reader without
    `rewind()` allows one pass only; a re-iterable of dicts, tuples/lists (input names in graph
    order; extra trailing items such as labels are ignored with a warning) or arrays/tensors (single
    input), e.g. a list or a torch DataLoader; a one-shot iterator (one pass only); a single dict.
    Data are never cached: memory stays at one batch."""

    def __init__(self, source: Any, model: ModelLike, limit: int | None = None) -> None:
        if isinstance(model, (str, os.PathLike)):  # read once, for the inputs and the decoder inputs that may be filled
            model = onnx.load(str(model), load_external_data=False)
        self.inputs = _inputs_of(model)
        self._fillable = fillable_inputs(model) if isinstance(model, onnx.ModelProto) else {}
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be a positive number of samples, got {limit}")
        self.limit = limit
        self.source = source
        self._items = _open_source(source)
        self._warned_extra = False
        self._said_filled = False

    def __iter__(self) -> Iterator[Feed]:
        """A pass that starts at the first feed asked for, not at `iter()`: a progress bar that calls
        `iter()` before it iterates must not use up the one pass of a reader without `rewind()`."""
        feeds = (self._feed(raw, label) for label, raw in self._items())
        yield from feeds if self.limit is None else self._limited(feeds, self.limit)

    def _feed(self, raw: Any, label: str) -> Feed:
        """One raw item as a checked feed."""
        named = self._named(raw, label)
        by_name = {info.name: info for info in self.inputs}
        left_out = [name for name in by_name if name not in named]
        if left_out and IDS in named and all(name in self._fillable for name in left_out):
            named.update(filled(named, left_out, self._fillable, {name: by_name[name].dtype for name in left_out}))
            self._say_filled(left_out)
        problems = []
        if unknown := sorted(set(named) - set(by_name)):
            problems.append(f"unknown input names {unknown}")
        if missing := [name for name in by_name if name not in named]:
            problems.append(f"missing inputs {missing}")
        if problems:
            raise ValueError(f"{label}: {'; '.join(problems)} (the model's inputs are {list(by_name)})")
        return {name: _as_array(named[name], by_name[name], label) for name in by_name}

    def _say_filled(self, names: list[str]) -> None:
        """Log once which inputs the data left out and how they are fed."""
        if not self._said_filled:
            logger.info("the data gives no %s: fed as for no past tokens (a mask of ones, positions from 0, empty "
                        "caches)", ", ".join(names))
            self._said_filled = True

    def _named(self, raw: Any, label: str) -> dict[str, Any]:
        """Map a raw item (dict, tuple/list in graph order, or one array: a decoder's input_ids where
        every other input can be filled) to input names."""
        if isinstance(raw, Mapping):
            return dict(raw)
        values = list(raw) if isinstance(raw, (tuple, list)) else [raw]
        names = [info.name for info in self.inputs]
        if len(values) == 1 and names[:1] == [IDS] and all(name in self._fillable for name in names[1:]):
            return {IDS: values[0]}
        if len(values) < len(names):
            kind = "one array" if not isinstance(raw, (tuple, list)) else f"{len(values)} items"
            raise ValueError(
                f"{label} holds {kind} but the model has inputs {names}; give a dict keyed by input name "
                "(an .npz file for a folder) or one item per input in graph order"
            )
        if len(values) > len(names) and not self._warned_extra:
            logger.warning(
                "%s holds %d items for the model's %d inputs %s: using the first %d in graph order and ignoring the "
                "rest (labels?)", label, len(values), len(names), names, len(names),
            )
            self._warned_extra = True
        return dict(zip(names, values))

    def _limited(self, feeds: Iterator[Feed], limit: int) -> Iterator[Feed]:
        """Feeds up to `limit` samples; the last one is cut along a dynamic leading dimension."""
        remaining = limit
        for feed in feeds:
            count = sample_count(feed)
            if count > remaining:
                feed = self._cut(feed, remaining)
            yield feed
            remaining -= count
            if remaining <= 0:
                return

    def _cut(self, feed: Feed, samples: int) -> Feed:
        """The first `samples` samples of a feed, if every input's batch dimension is dynamic."""
        if not all(info.dynamic_batch for info in self.inputs):
            logger.info("the last feed is used whole: the model's batch dimension is fixed, so it cannot be cut")
            return feed
        return {name: array[:samples] if array.ndim else array for name, array in feed.items()}


def random_data(model: ModelLike, n: int, seed: int = 0, batch: int = 1) -> CalibrationData:
    """n random feeds (normal floats, integers in [0, 16), random booleans), identical on every
    pass; dynamic leading dimensions take `batch`, other dynamic dimensions 1. Only on request:
    scales calibrated on random data do not reflect real inputs."""
    inputs = _inputs_of(model)
    if n < 1 or batch < 1:
        raise ValueError(f"random data needs n >= 1 and batch >= 1, got n={n}, batch={batch}")
    for info in inputs:
        if info.shape is None or info.dtype is None:
            raise ValueError(f"model input {info.name!r} has no shape or type; random data needs both")
    logger.warning("calibrating on %d random feeds (seed %d): scales will not reflect real inputs", n, seed)
    return CalibrationData(_RandomFeeds(tuple(inputs), n, seed, batch), inputs)


@dataclass(frozen=True)
class _RandomFeeds:
    """A re-iterable of reproducible random feeds."""

    inputs: tuple[InputInfo, ...]
    n: int
    seed: int
    batch: int

    def __iter__(self) -> Iterator[Feed]:
        rng = np.random.default_rng(self.seed)
        for _ in range(self.n):
            yield {info.name: _random_array(info, self.batch, rng) for info in self.inputs}


def _random_array(info: InputInfo, batch: int, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(batch if d is None and k == 0 else (d or 1) for k, d in enumerate(info.shape))
    if info.dtype.kind == "f":
        return rng.standard_normal(shape).astype(info.dtype)
    if info.dtype.kind in "iu":
        return rng.integers(0, RANDOM_INT_HIGH, shape).astype(info.dtype)
    if info.dtype.kind == "b":
        return rng.random(shape) < 0.5
    raise ValueError(f"cannot make random data for input {info.name!r} of type {info.dtype}")


def _inputs_of(model: ModelLike) -> tuple[InputInfo, ...]:
    if isinstance(model, (onnx.ModelProto, str, os.PathLike)):
        return tuple(model_inputs(model))
    return tuple(model)


def _open_source(source: Any) -> Items:
    """A function starting one pass over (label, raw item) for any supported source."""
    if isinstance(source, (str, os.PathLike)):
        return _folder_items(Path(source))
    if callable(getattr(source, "get_next", None)):
        return _reader_items(source)
    if isinstance(source, Mapping):
        return lambda: iter([("the feed", source)])
    if isinstance(source, Iterator):
        message = (
            f"the calibration data is a one-shot iterator ({type(source).__name__}) that was already read once; "
            "give a re-iterable (a list, a DataLoader, a folder) so calibration and fine-tuning can each make a pass"
        )
        return _first_pass_only(lambda: _enumerated(source), message)
    if isinstance(source, Iterable):
        return lambda: _enumerated(source)
    raise TypeError(
        f"unsupported calibration data {type(source).__name__}: give a folder of .npy/.npz files, a "
        "CalibrationDataReader, an iterable of dicts/tuples/arrays or a torch DataLoader"
    )


def _enumerated(items: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    return ((f"calibration item {index}", raw) for index, raw in enumerate(items))


def _reader_items(reader: Any) -> Items:
    """Passes over a CalibrationDataReader: `rewind()` before each one when the reader has it."""
    name = type(reader).__name__
    rewind = getattr(reader, "rewind", None)

    def items() -> Iterator[tuple[str, Any]]:
        if callable(rewind):
            rewind()
        index = 0
        while (raw := reader.get_next()) is not None:
            yield f"{name}.get_next() result {index}", raw
            index += 1

    if callable(rewind):
        return items
    message = (
        f"{name} has no rewind(): a second pass over the data (calibration, then fine-tuning) needs "
        "rewind() on the reader, or a source that can be re-read (a list of dicts, a DataLoader, a folder)"
    )
    return _first_pass_only(items, message)


def _first_pass_only(items: Items, message: str) -> Items:
    """`items` for the first pass; later passes raise `message` instead of silently yielding nothing."""
    passes = 0

    def guarded() -> Iterator[tuple[str, Any]]:
        nonlocal passes
        passes += 1
        if passes > 1:
            raise RuntimeError(message)
        return items()

    return guarded


def _folder_items(folder: Path) -> Items:
    """Passes over the .npy/.npz files of a folder, in name order."""
    if not folder.is_dir():
        raise FileNotFoundError(f"calibration data folder {folder} does not exist or is not a folder")
    files = sorted((p for p in folder.iterdir() if p.suffix in DATA_SUFFIXES and p.is_file() and p.name != LABELS_FILE),
                   key=lambda p: p.name)
    if not files:
        raise ValueError(f"calibration data folder {folder} holds no .npy or .npz files")
    return lambda: ((str(path), _load_file(path)) for path in files)


def data_labels(source: Any, model: ModelLike) -> np.ndarray | None:
    """The labels a data source carries, one per sample in order: `labels.npy` in a data folder, or
    the item after the inputs of every tuple a re-iterable yields (a DataLoader's (x, y)); None
    when it carries none."""
    if isinstance(source, CalibrationData):
        labels = data_labels(source.source, model)
        return labels if labels is None or source.limit is None else labels[: source.limit]
    if isinstance(source, (str, os.PathLike)):
        path = Path(source) / LABELS_FILE
        return np.load(path, allow_pickle=False).reshape(-1) if path.is_file() else None
    if isinstance(source, (Mapping, Iterator)) or callable(getattr(source, "get_next", None)) or not isinstance(source, Iterable):
        return None
    count = len(_inputs_of(model))
    labels = []
    for raw in source:
        if not isinstance(raw, (tuple, list)) or len(raw) != count + 1:
            return None
        label = raw[-1]
        labels.append(np.asarray(label.detach().cpu() if isinstance(label, torch.Tensor) else label).reshape(-1))
    return np.concatenate(labels) if labels else None


def _load_file(path: Path) -> np.ndarray | dict[str, np.ndarray]:
    """One array (.npy) or a dict of input name to array (.npz)."""
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable {path.suffix} file: {error}") from error


def _as_array(value: Any, info: InputInfo, label: str) -> np.ndarray:
    """A value as a contiguous array of the input's type and rank."""
    array = _to_numpy(value, info, label)
    if info.dtype is not None:
        array = _cast(array, info, label)
    _check_finite(array, info, label)
    return np.require(_fit_rank(array, info, label), requirements="C")  # ascontiguousarray would make a scalar 1-d


def _check_finite(array: np.ndarray, info: InputInfo, label: str) -> None:
    """NaN or Inf in calibration data would become NaN scales or losses downstream: refuse it here."""
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        bad = int(array.size - np.isfinite(array).sum())
        raise ValueError(f"{label}: input {info.name!r} holds {bad} NaN or Inf values; calibration data must be finite")


def _to_numpy(value: Any, info: InputInfo, label: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{label}: input {info.name!r} holds {array.dtype} data, not numbers")
    return array


def _cast(array: np.ndarray, info: InputInfo, label: str) -> np.ndarray:
    """Cast within a kind (float to float; integers when every value fits); across kinds is an error."""
    src, dst = array.dtype, info.dtype
    if src == dst:
        return array
    if src.kind == dst.kind == "f":
        return array.astype(dst)
    if src.kind in "iu" and dst.kind in "iu":
        limits = np.iinfo(dst)
        if array.size and (array.min() < limits.min or array.max() > limits.max):
            raise ValueError(
                f"{label}: input {info.name!r} holds {src} values in [{array.min()}, {array.max()}] that do not fit "
                f"the model's {dst}"
            )
        return array.astype(dst)
    raise ValueError(
        f"{label}: input {info.name!r} is {src} but the model expects {dst}; integer, float and boolean data are "
        "not converted into each other"
    )


def _fit_rank(array: np.ndarray, info: InputInfo, label: str) -> np.ndarray:
    """Add a missing batch dimension; a wrong rank or a wrong fixed dimension is an error."""
    if info.shape is None:
        return array
    if array.ndim == len(info.shape) - 1:
        array = array[np.newaxis]
    if array.ndim != len(info.shape):
        raise ValueError(
            f"{label}: input {info.name!r} has rank {array.ndim} (shape {list(array.shape)}) but the model expects "
            f"rank {len(info.shape)} ({_shape_text(info.shape)}), or one less for a single sample"
        )
    if any(d is not None and d != n for d, n in zip(info.shape, array.shape)):
        raise ValueError(
            f"{label}: input {info.name!r} has shape {list(array.shape)} but the model expects "
            f"{_shape_text(info.shape)}"
        )
    return array


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def sample_count(feed: Feed) -> int:
    """Samples in a feed: the leading dimension of its first input of rank >= 1 (1 for scalars)."""
    return next((array.shape[0] for array in feed.values() if array.ndim), 1)
