"""Files the library writes: atomic, with the umask's permissions, never over an input, and an
output that cannot be written refused before any work."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from finetune.files import check_output, write_atomic, write_text_atomic


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out" / "report.json"
    write_text_atomic(target, "first")
    write_text_atomic(target, "second")
    assert target.read_text() == "second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o666 & ~umask


def test_the_output_may_not_be_an_input_by_path_link_or_hard_link(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_text("model")
    (tmp_path / "soft.onnx").symlink_to(model)
    os.link(model, tmp_path / "hard.onnx")
    for output in (model, tmp_path / "soft.onnx", tmp_path / "hard.onnx", tmp_path / "sub" / ".." / "model.onnx"):
        with pytest.raises(ValueError, match=r"is the input .*model.onnx; inputs are never overwritten"):
            check_output(output, None, model)
    assert model.read_text() == "model"
    assert check_output(tmp_path / "new" / "out.onnx", model) == tmp_path / "new" / "out.onnx"


def test_a_folder_or_unwritable_output_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        check_output(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        check_output(tmp_path / "file" / "out.onnx")
    with pytest.raises(ValueError, match=r"cannot write /proc/finetune/out.onnx: /proc refuses new files"):
        check_output("/proc/finetune/out.onnx")
