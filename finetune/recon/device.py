"""The device a fine-tuning run uses: cpu, cuda, cuda:N, or hip:N on ROCm builds of torch (which
expose HIP devices through the cuda API); an unavailable device is an error naming what exists.
On the CPU, how freed host memory is kept for reuse; everywhere, the deterministic settings and the
float32 precision a run holds while it tunes."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator

import torch
from lightning.fabric.utilities.seed import seed_everything

from finetune.config import DEVICE_HELP, DEVICE_PATTERN
from finetune.host_memory import glibc, release_freed_host_memory


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
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(device_name(torch.device("cuda", i)) for i in range(count))]


def accelerator_kind() -> str:
    """The config's name for this build's accelerators: hip on ROCm builds of torch, else cuda."""
    return "hip" if torch.version.hip is not None else "cuda"


def device_name(device: torch.device) -> str:
    """A device as a config string names it, for reports and messages: torch calls a ROCm build's GPUs
    cuda:N, this library's configs and messages hip:N."""
    if device.type != "cuda":
        return str(device)
    return f"{accelerator_kind()}:{device.index or 0}"


# The BLAS workspace size deterministic runs ask for (torch's deterministic check on CUDA requires it or
# ":16:8"), and by build the variable a run sets and every variable torch reads it from (first found wins):
# a ROCm build reads CUBLAS_WORKSPACE_CONFIG before its own two, so setting that one there would hide a
# user's HIPBLAS_WORKSPACE_CONFIG.
DETERMINISTIC_WORKSPACE = ":4096:8"
WORKSPACE_VARIABLES = {"cuda": ("CUBLAS_WORKSPACE_CONFIG", ("CUBLAS_WORKSPACE_CONFIG",)),
                       "hip": ("HIPBLAS_WORKSPACE_CONFIG",
                               ("CUBLAS_WORKSPACE_CONFIG", "HIPBLAS_WORKSPACE_CONFIG", "ROCBLAS_WORKSPACE_CONFIG"))}


def set_blas_workspace() -> None:
    """The deterministic BLAS workspace through the build's own variable (HIPBLAS_WORKSPACE_CONFIG on
    ROCm), unless the user set a variable the build reads it from."""
    own, read = WORKSPACE_VARIABLES[accelerator_kind()]
    if not any(name in os.environ for name in read):
        os.environ[own] = DETERMINISTIC_WORKSPACE


# glibc's mallopt parameters, and the values a CPU run sets: blocks up to 32 MiB (glibc's largest
# mmap threshold) come from the heap, and up to 1 GiB of freed heap stays in the process.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
HOST_MEMORY_SETTINGS = {M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20, M_MMAP_THRESHOLD: 32 << 20}

logger = logging.getLogger(__name__)


@functools.cache
def keep_freed_host_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the system after each
    step (once per process; False where the C library is not glibc). A CPU step allocates and frees
    tensors of megabytes; by default each comes fresh from the system and is paid for again in page
    faults: on the text recogniser that was 4-7x more faults and about 10 s per run (8 % of a run at
    20-60 iterations per unit, noise at 300).
    The process's memory then falls back only when a run ends (see `host_memory_kept`)."""
    libc = glibc()
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
            release_freed_host_memory()


# Every float32-precision setting of torch's fp32_precision API, by its path under torch.backends
# ("" the global one). Reading them never raises; reading a legacy flag (allow_tf32,
# get_float32_matmul_precision) raises once a user mixed the two APIs, and setting one changes several.
FLOAT32_SETTINGS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str) -> object:
    """The torch.backends object holding one fp32_precision setting."""
    found: object = torch.backends
    for name in filter(None, path.split(".")):
        found = getattr(found, name)
    return found


def float32_settings() -> dict[str, str]:
    """Every fp32_precision setting now, by path."""
    return {path: _backend(path).fp32_precision for path in FLOAT32_SETTINGS}


def legacy_float32_settings() -> tuple[str, bool, bool] | None:
    """The legacy flags (matmul precision, CUDA matmul and cuDNN TF32), or None where a user's mix of
    the two APIs makes torch refuse to read them."""
    backends = torch.backends
    try:
        return torch.get_float32_matmul_precision(), backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
    except RuntimeError:
        return None


@contextlib.contextmanager
def float32_precision(allow_tf32: bool) -> Iterator[None]:
    """Inside the block, float32 matrix products in full float32 on every backend (the CPU's oneDNN
    included: a user's `medium` would have it use bfloat16), except CUDA's matrix products and cuDNN,
    which run in TF32 where `allow_tf32`; set with the legacy setters, so the state is one both APIs
    read (Lightning reads get_float32_matmul_precision on CUDA). Every setting comes back after, in the
    API the user set it with: the legacy flags where they were readable, then each fp32_precision."""
    backends = torch.backends
    legacy, settings = legacy_float32_settings(), float32_settings()
    torch.set_float32_matmul_precision("highest")
    backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        if legacy is not None:
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = legacy[1], legacy[2]
            torch.set_float32_matmul_precision(legacy[0])
        for path, value in settings.items():
            if _backend(path).fp32_precision != value:
                _backend(path).fp32_precision = value


@contextlib.contextmanager
def deterministic(seed: int, mode: bool | str, allow_tf32: bool, device: torch.device) -> Iterator[None]:
    """Seeded, deterministic algorithms (warn_only with mode `warn`) and TF32 as `allow_tf32` says
    inside the block, the global settings restored after. cuBLAS and hipBLAS read their workspace
    setting when they start, so it is set before any GPU work. An op without a deterministic kernel becomes a one-line
    error naming it and the switch, not a traceback from inside backward. Torch's NaN filling of every
    new uninitialised tensor, which deterministic mode turns on, stays off: no kernel here reads memory
    it did not write (tuned bytes are equal either way), so the filling only costs a pass over each."""
    if device.type == "cuda":
        set_blas_workspace()
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory)
    seed_everything(seed, verbose=False)
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        with float32_precision(allow_tf32):
            yield
    except RuntimeError as error:
        op, found, _ = str(error).partition(" does not have a deterministic implementation")
        if not found:
            raise
        raise ValueError(f"{op.strip()} has no deterministic kernel on {device_name(device)}: set fast_finetune.deterministic: warn to run "
                         "it anyway (results may then differ from run to run), or tune on another device") from error
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = previous[2]
