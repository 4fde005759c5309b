"""The device a fine-tuning run uses: cpu, cuda, cuda:N, or hip:N on ROCm builds of torch (which
expose HIP devices through the cuda API); an unavailable device is an error naming what exists.
On the CPU, how freed host memory is kept for reuse."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import platform
import re
from collections.abc import Iterator

import torch

from finetune.config import DEVICE_HELP, DEVICE_PATTERN


def resolve_device(name: str) -> torch.device:
    """The torch device for a config's device string, checked against this machine."""
    match = re.fullmatch(DEVICE_PATTERN, name)
    if match is None:
        raise ValueError(f"device {name!r} is not one of {DEVICE_HELP}")
    if match["kind"] is None:
        return torch.device("cpu")
    kind, index = match["kind"], int(match["index"] or 0)
    if kind == "hip" and torch.version.hip is None:
        raise ValueError(f"device {name!r} is not available: this torch {torch.__version__} is not a ROCm build; "
                         f"available: {', '.join(available_devices())}")
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} is not available (torch {torch.__version__}); available: {', '.join(available_devices())}")
    return torch.device("cuda", index)


def available_devices() -> list[str]:
    """The devices this machine offers, as config strings."""
    kind = "hip" if torch.version.hip is not None else "cuda"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"{kind}:{i}" for i in range(count))]


# glibc's mallopt parameters, and the values a CPU run sets: blocks up to 32 MiB (glibc's largest
# mmap threshold) come from the heap, and up to 1 GiB of freed heap stays in the process.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
HOST_MEMORY_SETTINGS = {M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20, M_MMAP_THRESHOLD: 32 << 20}

logger = logging.getLogger(__name__)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (whose mallopt and malloc_trim the settings below use), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")


@functools.cache
def keep_freed_host_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the system after each
    step (once per process; False where the C library is not glibc). A CPU step allocates and frees
    tensors of megabytes; by default each comes fresh from the system and is paid for again in page
    faults: on the text recogniser that was 4-7x more faults and about 10 s per run (8 % of a run at
    20-60 iterations per unit, noise at 300).
    The process's memory then falls back only when a run ends (see `host_memory_kept`)."""
    libc = _glibc()
    if libc is None:
        return False
    if not all(libc.mallopt(parameter, value) for parameter, value in HOST_MEMORY_SETTINGS.items()):
        logger.warning("glibc refused a mallopt setting: freed host memory may go back to the system after each step")
        return False
    logger.info("host memory: glibc keeps up to 1 GiB of freed memory for reuse (mallopt)")
    return True


@contextlib.contextmanager
def host_memory_kept(device: torch.device) -> Iterator[None]:
    """Inside the block, a CPU run keeps freed host memory for reuse (`keep_freed_host_memory`);
    after it, what glibc kept goes back to the system."""
    kept = device.type == "cpu" and keep_freed_host_memory()
    try:
        yield
    finally:
        if kept:
            _glibc().malloc_trim(0)  # type: ignore[union-attr]  (kept: glibc is there)
