"""MkDocs hook: pages hold markers such as `<!-- gen:config-reference -->`, which this hook replaces
with Markdown generated from the code (the config dataclasses, the argparse parser, the Quark option
tables, the presets), so the reference pages have one source. An unknown marker stops the build."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the generators beside this file

from cli_ref import cli_reference
from config_ref import config_reference, presets_table
from layout_ref import layout_reference
from quark_ref import quark_reference

GENERATORS: dict[str, Callable[[], str]] = {
    "config-reference": config_reference,
    "cli-reference": cli_reference,
    "quark-options": quark_reference,
    "presets": presets_table,
    "layout": layout_reference,
}
MARKER = re.compile(r"^<!-- gen:([\w-]+) -->$", re.MULTILINE)


def expand(markdown: str) -> str:
    """The page with every marker replaced by its generated Markdown."""
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **_: object) -> str:
    """MkDocs event: expand the page's markers."""
    return expand(markdown)
