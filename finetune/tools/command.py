"""Running a tool's argument parser: logging set up, and the errors users can fix reported in
one line with exit status 2 instead of a traceback."""

from __future__ import annotations

import argparse
import logging

import onnx

from finetune.config import ConfigError

logger = logging.getLogger(__name__)
USER_ERRORS = (ValueError, ConfigError, FileNotFoundError, onnx.checker.ValidationError)


def tool_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """A parser for `python -m finetune.tools.NAME` with the common -v option."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv`, run `args.run(args)` and return the exit status (2 for a user error)."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        args.run(args)
    except USER_ERRORS as error:
        logger.error("%s", error)
        return 2
    return 0
