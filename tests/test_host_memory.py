"""Freed host memory goes back to the system where glibc keeps it: always when asked plainly, and with
`at_least` only where its heap holds that many free bytes (so small models' units never pay for it)."""

from __future__ import annotations

import types

import pytest

import finetune.host_memory
from finetune.host_memory import HEAP_SLACK, release_freed_host_memory


class FakeGlibc:
    """mallinfo2 reporting `free` heap bytes; malloc_trim counted."""

    def __init__(self, free: int) -> None:
        self.free, self.trims = free, 0

    def mallinfo2(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(fordblks=self.free)

    def malloc_trim(self, pad: int) -> int:
        assert pad == 0
        self.trims += 1
        return 1


@pytest.mark.parametrize("free,at_least,trims", [(0, 0, 1), (HEAP_SLACK - 1, HEAP_SLACK, 0), (HEAP_SLACK, HEAP_SLACK, 1)])
def test_the_heap_is_trimmed_where_it_holds_enough_free_memory(monkeypatch: pytest.MonkeyPatch, free: int, at_least: int,
                                                              trims: int) -> None:
    libc = FakeGlibc(free)
    monkeypatch.setattr(finetune.host_memory, "glibc", lambda: libc)
    release_freed_host_memory(at_least=at_least)
    assert libc.trims == trims


def test_elsewhere_nothing_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finetune.host_memory, "glibc", lambda: None)
    release_freed_host_memory(at_least=HEAP_SLACK)  # no C library to ask: nothing raises


def test_on_this_machine_the_calls_read_and_trim_glibcs_heap() -> None:
    """The real calls where the C library is glibc (this project's Linux machines): mallinfo2's struct
    reads as glibc lays it out (a heap in use and its size), and a trim runs."""
    libc = finetune.host_memory.glibc()
    if libc is None:
        pytest.skip("the C library is not glibc: nothing to read or trim")
    info = libc.mallinfo2()
    assert 0 < info.uordblks <= info.arena
    release_freed_host_memory()
