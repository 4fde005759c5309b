"""The activation cache's spill files: unlinked as soon as they are mapped, so a killed run leaves
no data, and the empty folders of dead runs are removed by the next one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from finetune.recon.cache import SPILL_PREFIX, ActivationCache, remove_stale_spills


def test_a_spilled_array_has_no_file_but_keeps_its_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with ActivationCache(budget=0) as cache:
        stored = cache.store(values, "x")
        (folder,) = tmp_path.iterdir()
        assert folder.name.startswith(f"{SPILL_PREFIX}{os.getpid()}_")
        assert list(folder.iterdir()) == []
        assert isinstance(stored, np.memmap) and np.array_equal(stored, values)
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
