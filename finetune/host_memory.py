"""The process's freed host memory: where the C library is glibc, handing what its heap keeps free back to
the system (malloc_trim) after work that freed many temporaries among live blocks. Its mallopt policy
for tuning runs is recon.device's."""

from __future__ import annotations

import ctypes
import functools
import platform

# Free heap bytes left in the process where work repeats (after each unit, each large tensor lifted) before
# they go back to the system: a large layer's work frees temporaries of up to 32 MiB, which glibc keeps
# (0.8 GiB by the first units of a 2.5 GB model); a small model's never add up to this.
HEAP_SLACK = 1 << 28

# Weights from which a tuning run hands free heap back after each unit: there the heap's growth is a large
# share of the machine (0.8 GiB at 2.5 GB); a smaller model's units keep glibc's reuse, their steps' pages
# faulted in once (recon.device's mallopt).
LARGE_RUN_BYTES = 1 << 30


class _MallocInfo(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (whose mallopt, mallinfo2 and malloc_trim this project calls), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL("libc.so.6")
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallocInfo
    return libc


def release_freed_host_memory(at_least: int = 0) -> None:
    """Hand the freed memory glibc holds back to the system (malloc_trim; nothing elsewhere), after work
    whose many temporaries of up to 32 MiB, freed among smaller live blocks, stay in the heap: lifting
    a 2.5 GB model of codes kept 0.98 GiB so. Milliseconds; the next allocations fault their pages in
    again, so with `at_least` only where the heap holds that many free bytes (mallinfo2's count, which
    includes free pages handed back already)."""
    libc = glibc()
    if libc is None:
        return
    if at_least and hasattr(libc, "mallinfo2") and libc.mallinfo2().fordblks < at_least:
        return
    libc.malloc_trim(0)
