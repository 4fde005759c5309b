"""Running a tool's argument parser: logging set up, and the errors users can fix (bad input, a
disk that refuses the output, an op we cannot lift, Ctrl-C) reported in one line with a non-zero
exit status instead of a traceback; `--debug` shows the traceback too."""

from __future__ import annotations

import argparse
import logging

import onnx

from finetune.config import ConfigError

logger = logging.getLogger(__name__)
# OSError covers a missing file, a permission error and a full or read-only disk; NotImplementedError
# an op, attribute or option we do not implement (named in the message).
USER_ERRORS = (ValueError, ConfigError, OSError, NotImplementedError, onnx.checker.ValidationError)
USER_ERROR_STATUS = 2
INTERRUPTED_STATUS = 130  # 128 + SIGINT, as shells report it


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """-v/--verbose and --debug, which every command takes."""
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its one line")


def tool_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """A parser for `python -m finetune.tools.NAME` with the common flags."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv`, run `args.run(args)` and return the exit status (2 for a user error, 130 for Ctrl-C)."""
    args = parser.parse_args(argv)
    debug = args.debug or args.verbose
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(levelname)s %(message)s")
    try:
        args.run(args)
    except USER_ERRORS as error:
        logger.error("%s", error, exc_info=args.debug)
        return USER_ERROR_STATUS
    except KeyboardInterrupt:
        logger.error("interrupted: the output was not written", exc_info=args.debug)
        return INTERRUPTED_STATUS
    return 0
