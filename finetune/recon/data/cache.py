"""Cached activations, one array per calibration batch ("chunk"): in memory up to a byte budget,
beyond it in files in a temporary directory. Each spill file is unlinked as soon as it is open, so a
run killed outright (kill -9, the out-of-memory killer) leaves no data behind, only an empty folder
named after its process, which the next run removes.

The budget bounds resident memory, not only anonymous memory: a spill is written with write(), not
through a mapping, and the read-only mapping it is read back from gives its pages back after each
read (MADV_DONTNEED), so spilled values live in the kernel's page cache, which the kernel may
reclaim, and never stay in the process's resident set (at 2,048 EfficientNet crops, mapped pages
once took a run to 24 GB RSS)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

logger = logging.getLogger(__name__)

DISK_RESERVE = 2**30  # bytes a spill leaves free for the output model and everything else on the disk
SPILL_PREFIX = "finetune-activations-"  # then the owning process id, "_", and mkdtemp's random part


class ActivationCache:
    """Stores chunks of named values; `in_memory` bytes never exceed `budget`, the rest spills."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.in_memory = 0
        self.on_disk = 0
        self.peak_in_memory = 0
        self.peak_on_disk = 0
        self.spilled = 0
        self.values: dict[str, CachedValue] = {}
        self._directory: Path | None = None
        self._files = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def value(self, name: str) -> CachedValue:
        """The cached value of that name, created empty on first use."""
        if name not in self.values:
            self.values[name] = CachedValue(self, name)
        return self.values[name]

    def release(self, name: str) -> None:
        """Drop one holder of a value; the last one out (or anyone, when none holds it) frees its
        memory and deletes its files."""
        value = self.values.get(name)
        if value is None:
            return
        value.holders -= 1
        if value.holders <= 0:
            del self.values[name]
            value.clear()

    def close(self) -> None:
        """Free everything and remove the spill directory."""
        for value in self.values.values():
            value.clear()
        self.values = {}
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def store(self, array: np.ndarray, name: str) -> np.ndarray | SpilledArray:
        """The array kept in memory if it fits the budget, else written to a spill file."""
        if self.in_memory + array.nbytes <= self.budget:
            self.in_memory += array.nbytes
            self.peak_in_memory = max(self.peak_in_memory, self.in_memory)
            return array
        if self._directory is None:
            self._directory = _spill_directory()
            logger.info("activation cache over its budget of %d bytes: spilling to %s", self.budget, self._directory)
        self._check_disk(array.nbytes, name)
        self._files += 1
        spilled = SpilledArray.write(array, self._directory / f"{self._files:06d}.bin")
        self.on_disk += array.nbytes
        self.peak_on_disk = max(self.peak_on_disk, self.on_disk)
        self.spilled += 1
        return spilled

    def _check_disk(self, nbytes: int, name: str) -> None:
        """Refuse a spill the disk cannot hold, before writing it, with what to do about it (and a
        reserve left for the output model)."""
        free = shutil.disk_usage(self._directory).free
        if nbytes + DISK_RESERVE > free:
            raise OSError(errno.ENOSPC, f"the activation cache cannot spill {name} ({_size(nbytes)}) to {self._directory}: "
                          f"{_size(free)} free there, {_size(self.on_disk)} already spilled; lower "
                          "fast_finetune.data_size, raise cache_budget_bytes if memory allows, or point TMPDIR at a larger disk")

    def drop(self, array: np.ndarray | SpilledArray) -> None:
        """Account for a stored array going away (a spilled one's file is already unlinked; its
        disk space returns when its mapping closes)."""
        if isinstance(array, SpilledArray):
            array.close()
            self.on_disk -= array.nbytes
        else:
            self.in_memory -= array.nbytes


class SavedWeights:
    """A unit's tensors as they were before tuning, to put back where it is reverted: a CPU tensor as
    the activation cache stores arrays (a copy in memory within its budget, else written to a spill
    file straight from the tensor: a 2.5 GB decoder's LM head was a 250 MiB copy held beside it while
    it was tuned), others as clones. A `with` block frees them."""

    def __init__(self, tensors: dict[str, torch.Tensor], cache: ActivationCache | None) -> None:
        self.cache = cache
        self.saved: dict[str, Any] = {name: self._saved(name, tensor.detach()) for name, tensor in tensors.items()}

    def _saved(self, name: str, tensor: torch.Tensor) -> Any:
        """One tensor's copy: in the cache where it can hold it (a CPU tensor numpy can view), else a clone."""
        if self.cache is None or tensor.device.type != "cpu" or tensor.dtype == torch.bfloat16 or not tensor.is_contiguous():
            return tensor.clone()
        view = tensor.numpy()
        fits = self.cache.in_memory + view.nbytes <= self.cache.budget
        return self.cache.store(view.copy() if fits else view, f"{name} before tuning")

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put the saved values back into `tensors` (by name)."""
        for name, value in self.saved.items():
            tensors[name].data.copy_(value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value)))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        for value in self.saved.values():
            if not isinstance(value, torch.Tensor):
                self.cache.drop(value)  # type: ignore[union-attr]  (only a cache stores arrays)
        self.saved = {}


class SpilledArray:
    """An array in an unlinked file, read back through a read-only mapping whose pages are handed
    back after every read, so reading it costs page cache, not resident memory."""

    def __init__(self, mapping: mmap.mmap, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self._mapping = mapping
        self._array = np.frombuffer(mapping, dtype, count=int(np.prod(shape))).reshape(shape)
        self.dtype = self._array.dtype
        self.shape = self._array.shape
        self.nbytes = self._array.nbytes

    @classmethod
    def write(cls, array: np.ndarray, path: Path) -> SpilledArray:
        """Write the array to a new file at `path` with write() (no dirty mapped pages), unlink the
        file, and keep it mapped for reading."""
        with open(path, "x+b") as file:
            path.unlink()  # the open file keeps the data; the disk space returns when the mapping goes
            np.ascontiguousarray(array).tofile(file)
            file.flush()
            return cls(mmap.mmap(file.fileno(), array.nbytes, access=mmap.ACCESS_READ), array.dtype, array.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        """A copy of the indexed values (an index array or a slice along the leading axis)."""
        values = np.array(self._array[index])
        self._mapping.madvise(mmap.MADV_DONTNEED)
        return values

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """A copy of the whole array, for numpy functions."""
        values = self[...]
        return values if dtype is None else values.astype(dtype)

    def close(self) -> None:
        """Unmap (the file's space returns to the disk)."""
        self._array = None
        self._mapping.close()


def _spill_directory() -> Path:
    """A new spill folder named after this process, once the folders of dead runs are removed."""
    root = Path(tempfile.gettempdir())
    remove_stale_spills(root)
    return Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}_", dir=root))


def remove_stale_spills(root: Path) -> list[Path]:
    """Remove the spill folders in `root` whose process is gone (killed before it could clean up);
    folders of live processes, and any whose owner cannot be read from the name, stay."""
    removed = []
    for folder in root.glob(f"{SPILL_PREFIX}*"):
        owner = folder.name[len(SPILL_PREFIX):].split("_", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            logger.info("removed %s, left by process %s that no longer runs", folder, owner)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(nbytes: int) -> str:
    """A byte count as people read it."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


class CachedValue:
    """One value over the calibration set, chunk by chunk; tensors are stored as numpy arrays
    (counted against the budget), anything else (rare: tuples of shapes) as it is."""

    def __init__(self, cache: ActivationCache, name: str) -> None:
        self.cache = cache
        self.name = name
        self.chunks: list[Any] = []
        self.holders = 0  # readers sharing the value (the streams, for the model inputs); see ActivationCache.release
        self._offsets: np.ndarray | None = None

    def append(self, value: Any) -> None:
        """Add the next chunk's value."""
        if isinstance(value, torch.Tensor):
            value = self.cache.store(value.detach().cpu().numpy(), self.name)
        self.chunks.append(value)
        self._offsets = None

    def tensor(self, chunk: int, device: torch.device) -> Any:
        """A chunk as a tensor on `device` (other values as stored)."""
        value = self.chunks[chunk]
        return torch.from_numpy(np.array(value)).to(device) if isinstance(value, np.ndarray | SpilledArray) else value

    @property
    def rows(self) -> int:
        """Rows along the leading axis over all chunks."""
        return int(self.offsets[-1])

    @property
    def offsets(self) -> np.ndarray:
        """Start row of each chunk, and the total at the end."""
        if self._offsets is None:
            self._offsets = np.cumsum([0, *(len(c) for c in self.chunks)])
        return self._offsets

    def gather(self, rows: np.ndarray) -> torch.Tensor:
        """The given rows (sorted ascending) along the leading axis, as one CPU tensor (none: the
        first chunk's shape with no rows, as a process of a data-parallel run may hold none of a batch)."""
        if not len(rows):
            return torch.from_numpy(np.array(self.chunks[0][:0]))
        chunk_of = np.searchsorted(self.offsets, rows, side="right") - 1
        parts = [self.chunks[c][rows[chunk_of == c] - self.offsets[c]] for c in np.unique(chunk_of)]
        return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0])

    def rows_along(self, axis: int) -> CachedValue:
        """A view of this value whose rows are its slices along `axis` (a recurrent layer's batch),
        moved first without copying in-memory chunks; the original keeps and releases the memory."""
        view = CachedValue(self.cache, self.name)
        view.chunks = [np.moveaxis(np.asarray(chunk), axis, 0) for chunk in self.chunks]
        return view

    def clear(self) -> None:
        """Drop every chunk."""
        for chunk in self.chunks:
            if isinstance(chunk, np.ndarray | SpilledArray):
                self.cache.drop(chunk)
        self.chunks = []
        self._offsets = None
