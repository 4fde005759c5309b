"""The layout section of the Development page, generated from the code: the layers of the flow
(finetune.LAYERS) and, package by package, what each module holds (the first sentence of its
docstring), so the map cannot go stale."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from finetune import LAYERS

ROOT = Path(__file__).resolve().parents[2] / "finetune"


def first_sentence(path: Path) -> str:
    """A module's docstring up to its first full stop (line breaks joined)."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(docstring.split())
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)\.)(\s+[A-Z(`]|$)", text)
    return match.group(1) if match else text


def _package_rows(package: Path) -> list[str]:
    """One row per module of a package (sub-packages in their own sections)."""
    rows = []
    for path in sorted(package.glob("*.py")):
        if path.name != "__init__.py":
            rows.append(f"| `{path.name}` | {first_sentence(path)} |")
    return rows


def layout_reference() -> str:
    """Markdown: the layers, then a section per package with its modules."""
    lines = ["Layers, lowest first (a package imports only its own modules and lower layers'; "
             "`tests/test_layout.py` checks it):", ""]
    lines += [f"{k + 1}. " + ", ".join(f"`{name}`" for name in layer) for k, layer in enumerate(LAYERS)]
    for layer in LAYERS:
        for name in layer:
            path = ROOT.joinpath(*name.split("."))
            if path.is_dir():
                lines += ["", f"### `finetune/{name.replace('.', '/')}/`", "", " ".join(
                    (ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or "").split()), "",
                          "| module | holds |", "|---|---|", *_package_rows(path)]
                for child in sorted(p for p in path.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
                    dotted = f"{name}.{child.name}"
                    if not any(dotted in group for group in LAYERS):
                        lines += ["", f"#### `finetune/{dotted.replace('.', '/')}/`", "", first_sentence(child / "__init__.py"),
                                  "", "| module | holds |", "|---|---|", *_package_rows(child)]
            else:
                lines += ["", f"### `finetune/{name}.py`", "", first_sentence(path.with_suffix(".py"))]
    return "\n".join(lines) + "\n"
