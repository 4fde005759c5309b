"""The activation cache's spill files: unlinked as soon as they are open, so a killed run leaves
no data, the empty folders of dead runs are removed by the next one, and reading spilled values
back leaves no pages in the resident set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.recon.data.cache import SPILL_PREFIX, ActivationCache, CachedValue, SavedWeights, SpilledArray, remove_stale_spills


def test_a_spilled_array_has_no_file_but_keeps_its_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with ActivationCache(budget=0) as cache:
        stored = cache.store(values, "x")
        (folder,) = tmp_path.iterdir()
        assert folder.name.startswith(f"{SPILL_PREFIX}{os.getpid()}_")
        assert list(folder.iterdir()) == []
        assert isinstance(stored, SpilledArray) and np.array_equal(np.asarray(stored), values)
        assert np.array_equal(stored[[1]], values[[1]]) and len(stored) == 2
        assert cache.on_disk == values.nbytes
        cache.drop(stored)
        assert cache.on_disk == 0
    assert list(tmp_path.iterdir()) == []


def test_folders_of_dead_runs_are_removed_and_live_or_foreign_ones_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead = tmp_path / f"{SPILL_PREFIX}{finished.stdout.strip()}_abc"
    live = tmp_path / f"{SPILL_PREFIX}{os.getpid()}_def"
    foreign = tmp_path / f"{SPILL_PREFIX}k2j4x9"  # no owner in the name (an older release's folder)
    for folder in (dead, live, foreign):
        folder.mkdir()
        (folder / "000001.npy").write_bytes(b"left behind")
    assert remove_stale_spills(tmp_path) == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([live, foreign])
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead.mkdir()
    with ActivationCache(budget=0) as cache:  # the first spill of a run cleans up first
        cache.store(np.zeros(4, np.float32), "x")
        assert not dead.exists()


def _resident_kib() -> int:
    """This process's resident set now (VmRSS of /proc/self/status)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def test_spilled_values_read_back_do_not_stay_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing 256 MiB of spills and gathering every row back twice raises the resident set by far
    less than the spilled size (through a plain memory map it rose by all of it)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    chunk = np.ones((64, 2**20 // 4), np.float32)  # 64 rows of 1 MiB
    with ActivationCache(budget=0) as cache:
        value = CachedValue(cache, "x")
        before = _resident_kib()
        for _ in range(4):
            value.append(torch.from_numpy(chunk))
        for _ in range(2):
            for start in range(0, value.rows, 16):
                rows = value.gather(np.arange(start, start + 16))
                assert float(rows.sum()) == rows.numel()
        grown = _resident_kib() - before
        assert cache.on_disk == 4 * chunk.nbytes
    # Half the spilled size: freed 16 MiB batches the C library keeps for reuse count too (after a tuning
    # run in the same process exactly 64 MiB of them stayed), while a plain memory map kept all 256 MiB.
    assert grown < 128 * 1024, f"resident memory grew by {grown} KiB while reading back 256 MiB of spills"


def test_a_units_weights_before_tuning_spill_past_the_budget_and_come_back_bit_for_bit() -> None:
    """SavedWeights keeps a tensor's copy in memory while the cache's budget holds it and writes it to a
    spill file otherwise (straight from the tensor); restoring gives the values back bit for bit, and
    leaving the block frees both."""
    with ActivationCache(budget=64) as cache:
        small, large = torch.arange(8, dtype=torch.float32), torch.randn(100, generator=torch.Generator().manual_seed(3))
        before = {"small": small.clone(), "large": large.clone()}
        with SavedWeights({"small": small, "large": large}, cache) as saved:
            assert (cache.in_memory, cache.spilled, cache.on_disk) == (32, 1, 400)
            small.add_(1.0)
            large.mul_(2.0)
            saved.restore({"small": small, "large": large})
            assert torch.equal(small, before["small"]) and torch.equal(large, before["large"])
        assert (cache.in_memory, cache.on_disk) == (0, 0)
