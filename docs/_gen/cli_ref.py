"""The command-line reference, generated from the parser the `finetune` command itself runs
(`finetune.cli.build_parser`): each subcommand's one-line purpose and its `--help` text, word for
word, so a flag added to the code is documented by the next build."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from finetune.cli import build_parser

HELP_WIDTH = "100"  # argparse wraps at $COLUMNS: fixed, so the page does not depend on the terminal


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the order `finetune --help` lists them."""
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def help_text(parser: argparse.ArgumentParser) -> str:
    """The parser's --help output at a fixed width."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        return parser.format_help()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def cli_reference() -> str:
    """`finetune --help`, then one section per subcommand."""
    parser = build_parser()
    parts = ["## finetune\n", "```text", help_text(parser).rstrip(), "```\n"]
    for name, purpose, sub in subcommands(parser):
        parts += [f"## finetune {name}\n", f"{purpose[:1].upper()}{purpose[1:]}.\n", "```text", help_text(sub).rstrip(), "```\n"]
    return "\n".join(parts)
