"""The `finetune` command: one subcommand per tool, each a thin layer over the library."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import onnx

from finetune.onnx import attach_custom_ops
from finetune.onnx.io import load_model, save_model_atomic


def attach_ops(args: argparse.Namespace) -> None:
    """Add function bodies for com.finetune / com.amd.quark nodes so stock onnxruntime runs them."""
    model = load_model(args.input)
    save_model_atomic(attach_custom_ops(model), args.output)
    logging.info("wrote %s", args.output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Quantize ONNX models and recover their accuracy.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True)
    attach = commands.add_parser(
        "attach-ops",
        help="make BFP/MX/extended Q-DQ custom-op nodes (com.finetune, com.amd.quark) run in stock onnxruntime",
    )
    attach.add_argument("input", type=Path, help="ONNX model with custom-op nodes")
    attach.add_argument("output", type=Path, help="where to write the model with function bodies attached")
    attach.set_defaults(run=attach_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, onnx.checker.ValidationError) as error:
        logging.error("%s", error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
