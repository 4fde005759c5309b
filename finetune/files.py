"""Files the library writes: each appears whole or not at all (written beside its target, then
renamed over it), with the permissions the user's umask gives any new file, and never over an input."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

NEW_FILE_MODE = 0o666  # what open() asks for; the umask takes away from it


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it over `path`: a reader,
    or a run killed half-way, sees the old file or the complete new one, and no temporary is left."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise _cannot_write(path, error) from error
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        # after writing: mkstemp makes 0600, and so does a writer that replaces tmp (Lightning's save);
        # a model is no more private than its report
        os.chmod(tmp, NEW_FILE_MODE & ~_umask())
        os.replace(tmp, path)
    except OSError as error:
        raise _cannot_write(path, error) from error
    finally:
        tmp.unlink(missing_ok=True)


def _cannot_write(path: Path, error: OSError) -> OSError:
    """The error naming the user's file, not the temporary or folder the system call named."""
    return OSError(error.errno, f"cannot write {path}: {error.strerror or error}")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a UTF-8 text file atomically."""
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def check_output(output: str | os.PathLike, *inputs: str | os.PathLike | None) -> Path:
    """Refuse, before any work, an output the run could not write or must not write: one of its
    inputs (the same path, or the same file through a link), a folder, or a place without write
    permission. Returns the output as a Path."""
    output = Path(output)
    for source in inputs:
        if source is not None and _same_file(output, Path(source)):
            raise ValueError(f"the output {output} is the input {source}; inputs are never overwritten: choose another -o")
    if output.is_dir():
        raise ValueError(f"the output {output} is a folder; give a file name (for example {output / 'model.onnx'})")
    folder = _nearest_existing(output.parent)
    if not folder.is_dir():
        raise ValueError(f"cannot write {output}: {folder} is not a folder")
    try:  # a real probe: permissions, read-only file systems and /proc all answer it, root or not
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"cannot write {output}: {folder} refuses new files ({error.strerror})") from error
    return output


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: equal once resolved, or the same inode (hard links)."""
    if a.resolve() == b.resolve():
        return True
    return a.exists() and b.exists() and os.path.samefile(a, b)


def _nearest_existing(folder: Path) -> Path:
    """The folder itself, or its closest ancestor that exists (the run creates the rest)."""
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _umask() -> int:
    """The process's umask (reading it means setting it; set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
