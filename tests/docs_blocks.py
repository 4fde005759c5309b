"""The runnable code blocks of the documentation, found and run as the docs test does.

Convention: a fenced block is runnable when the line right before it is `<!-- run -->`, optionally
with JSON options: `<!-- run {"sub": [["--iterations 500", "--iterations 20"]], "slow": true} -->`.

- `python` blocks run as a script in a subprocess; `bash` blocks run in bash (`set -euo pipefail`)
  where `finetune` is `python -m finetune.cli` and `python` is the interpreter running the tests.
- `yaml` blocks are configs: loaded with `finetune.config.load_config`, so they must validate.
- Options: `sub` (replacements made before running, to shrink iteration counts), `file` (write the
  block to this file instead of running it; a yaml block is still validated), `setup` (part of the
  workspace every page starts from, run once), `slow` (the page's test is marked slow), `fails`
  with `expect` (the block must exit non-zero and print that text).

The blocks of one page run in order in one folder, which starts as a copy of the workspace that the
`setup` blocks of getting-started.md build; `tests` there links to the repository's tests folder,
so paths written from the root of a clone (`tests/fixtures/...`) work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
MARKER = re.compile(r"^<!-- run(?: (\{.*\}))? -->\s*$")
FENCE = re.compile(r"^```(\w+)\s*$")
LANGUAGES = ("python", "bash", "yaml")
BLOCK_TIMEOUT = 600  # seconds: a hung block fails its test instead of hanging the suite


@dataclasses.dataclass(frozen=True)
class Block:
    """One runnable block: where it is, its language, its code and its options."""

    page: str
    line: int
    language: str
    code: str
    options: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def prepared(self) -> str:
        """The code with the block's replacements made; each must match, so none goes stale."""
        code = self.code
        for old, new in self.options.get("sub", []):
            if old not in code:
                raise AssertionError(f"{self.where}: replacement {old!r} matches nothing in the block")
            code = code.replace(old, new)
        return code


def blocks(path: Path) -> list[Block]:
    """The runnable blocks of a Markdown page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        marker = MARKER.match(line)
        if not marker:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not fence or fence.group(1) not in LANGUAGES:
            raise AssertionError(f"{path.name}:{i + 1}: a run marker must precede a ```python, ```bash or ```yaml block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        options = json.loads(marker.group(1)) if marker.group(1) else {}
        found.append(Block(path.name, i + 1, fence.group(1), "\n".join(lines[i + 2 : end]) + "\n", options))
    return found


def pages() -> list[Path]:
    """Every Markdown page of the site."""
    return sorted(p for p in DOCS.rglob("*.md") if "_gen" not in p.parts)


def environment(folder: Path) -> dict[str, str]:
    """The environment blocks run in: this repository's code first on the path, `finetune` and
    `python` commands that run it with this interpreter, one torch thread pair for repeatability."""
    bin_dir = folder / ".bin"
    bin_dir.mkdir(exist_ok=True)
    commands = {"finetune": f'exec "{sys.executable}" -m finetune.cli "$@"', "python": f'exec "{sys.executable}" "$@"'}
    for name, command in commands.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{command}\n")
        script.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "2")
    env["MPLBACKEND"] = "Agg"
    return env


def run(block: Block, folder: Path) -> str:
    """Run one block in `folder`; returns its output, raises AssertionError with it on failure."""
    code = block.prepared()
    if block.language == "yaml":
        _check_config(code, block)
    if "file" in block.options:
        (folder / block.options["file"]).write_text(code)
        return ""
    if block.language == "yaml":
        return ""
    command = [sys.executable, "-c", code] if block.language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    result = subprocess.run(command, cwd=folder, env=environment(folder), capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT, check=False)
    output = result.stdout + result.stderr
    if block.options.get("fails"):
        if result.returncode == 0 or block.options.get("expect", "") not in output:
            raise AssertionError(f"{block.where}: expected a failure printing {block.options.get('expect')!r}, got "
                                 f"exit status {result.returncode}:\n{output[-4000:]}")
    elif result.returncode != 0:
        raise AssertionError(f"{block.where} failed with exit status {result.returncode}:\n{output[-4000:]}")
    return output


def _check_config(text: str, block: Block) -> None:
    """A yaml block must be a config the validator accepts."""
    import yaml

    from finetune.config import load_config

    try:
        load_config(yaml.safe_load(text))
    except Exception as error:
        raise AssertionError(f"{block.where}: the config does not load: {error}") from error
