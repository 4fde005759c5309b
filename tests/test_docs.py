"""The documentation stays true: the site builds with `mkdocs build --strict` (warnings, dead links
and missing API references fail), every block marked runnable runs on the bundled digits model
(tests/docs_blocks.py says how blocks are marked), the generated references cover every config key
and command-line option, and the README stays a front page whose links into docs/ exist."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_blocks import DOCS, REPO, Block, blocks, pages, run

README_MAX_LINES = 120
GETTING_STARTED = DOCS / "getting-started.md"


def _page_params() -> list:
    """One test per page with runnable blocks beyond the workspace set-up; slow if a block says so."""
    params = []
    for page in pages():
        found = [b for b in blocks(page) if not b.options.get("setup")]
        if found:
            marks = [pytest.mark.slow] if any(b.options.get("slow") for b in found) else []
            params.append(pytest.param(page, id=str(page.relative_to(DOCS)), marks=marks))
    return params


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every page's examples start from: the set-up blocks of Getting started run once
    (the digits model, calib/, heldout/, w4a8.yaml), and `tests` linked to this repository's."""
    folder = tmp_path_factory.mktemp("docs-workspace")
    (folder / "tests").symlink_to(REPO / "tests", target_is_directory=True)
    for block in blocks(GETTING_STARTED):
        if block.options.get("setup"):
            run(block, folder)
    return folder


def test_site_builds_strict(tmp_path: Path) -> None:
    """mkdocs build --strict: any warning (a dead link or anchor, an API object that does not
    resolve, a generated section that fails) fails the build."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": path}  # the banner of mkdocs-material 9.7+ is no warning
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
               "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "recon" / "index.html").read_text().count("finetune_model") > 0


@pytest.mark.parametrize("page", _page_params())
def test_page_examples_run(page: Path, workspace: Path, tmp_path: Path) -> None:
    """The page's runnable blocks, in order, in a copy of the workspace."""
    folder = tmp_path / "work"
    shutil.copytree(workspace, folder, symlinks=True)
    for block in blocks(page):
        if not block.options.get("setup"):
            run(block, folder)


def test_markers_are_well_formed() -> None:
    """Every run marker precedes a block of a runnable language and its replacements match, so a
    mistyped marker cannot silently leave an example untested."""
    found: list[Block] = [b for page in pages() for b in blocks(page)]
    assert len(found) >= 10
    for block in found:
        block.prepared()
    text = "\n".join(page.read_text() for page in pages())
    assert len(re.findall(r"^<!-- run", text, re.MULTILINE)) == len(found)


def _generators():
    sys.path.insert(0, str(DOCS / "_gen"))
    try:
        import cli_ref
        import config_ref
    finally:
        sys.path.pop(0)
    return cli_ref, config_ref


def test_config_reference_covers_every_key() -> None:
    """Every field of every config section appears in the generated reference, with its default."""
    _, config_ref = _generators()
    text = config_ref.config_reference()
    for section in config_ref.sections():
        assert f"### {section.__name__}" in text
        for field in dataclasses.fields(section):
            assert f"| `{field.name}` |" in text, f"{section.__name__}.{field.name} missing from the reference"
    assert "| `iterations` | int | `1000` | ≥ 0 |" in text


def test_cli_reference_covers_every_option() -> None:
    """Every subcommand and every option string of the parser appears in the generated CLI page."""
    cli_ref, _ = _generators()
    from finetune.cli import build_parser

    text = cli_ref.cli_reference()
    for name, _purpose, sub in cli_ref.subcommands(build_parser()):
        assert f"## finetune {name}" in text
        for action in sub._actions:
            for option in action.option_strings:
                assert option in text, f"{name} {option} missing from the CLI reference"


def test_readme_is_a_front_page() -> None:
    """The README fits on two screens, names the test command CI runs, and its links into docs/
    (and to other repository files) exist."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "bash scripts/test.sh" in readme
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (REPO / link).exists(), f"README links to {link}, which does not exist"
