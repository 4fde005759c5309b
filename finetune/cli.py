"""The `finetune` command: one subcommand per tool, each a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import onnx

from finetune.calibrate import CalibrationData, random_data
from finetune.config import ConfigError, available_presets, load_config
from finetune.onnx import attach_custom_ops
from finetune.onnx.io import load_model, save_model_atomic
from finetune.quantize import format_summary, quantize_model


def attach_ops(args: argparse.Namespace) -> None:
    """Add function bodies for com.finetune / com.amd.quark nodes so stock onnxruntime runs them."""
    model = load_model(args.input)
    save_model_atomic(attach_custom_ops(model), args.output)
    logging.info("wrote %s", args.output)


def quantize(args: argparse.Namespace) -> None:
    """Quantize a float model with a preset or YAML config and calibration data."""
    overrides: dict = {"preset": args.config}
    if args.op_types:
        overrides["op_types"] = args.op_types
    if args.exclude_nodes:
        overrides["exclude_nodes"] = args.exclude_nodes
    if args.weight_storage:
        overrides["weight_storage"] = args.weight_storage
    if args.per_channel is not None:
        overrides["weight"] = {"granularity": "channel" if args.per_channel else "tensor"}
    config = load_config(overrides)
    data = _calibration_data(args)
    result = quantize_model(args.model, config, data)
    save_model_atomic(result.model, args.output)
    summary_path = args.output.with_name(args.output.name + ".summary.json")
    _write_text_atomic(summary_path, json.dumps(result.summary, indent=1))
    print(format_summary(result.summary))
    logging.info("wrote %s and %s", args.output, summary_path)


def _calibration_data(args: argparse.Namespace) -> object:
    """The --data folder, random data when asked for explicitly, or None (no activation scales)."""
    if args.data and args.random_data:
        raise ValueError("give either --data or --random-data, not both")
    if args.random_data:
        return random_data(load_model(args.model), args.random_data, seed=0)
    if args.data:
        return CalibrationData(args.data, load_model(args.model), limit=args.data_size)
    return None


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


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
    q = commands.add_parser("quantize", help="quantize a float ONNX model to a QDQ model that stock onnxruntime runs")
    q.add_argument("model", type=Path, help="float32 ONNX model (never modified)")
    q.add_argument("--config", required=True, help=f"preset name ({', '.join(available_presets())}) or YAML file")
    q.add_argument("--data", type=Path, help="calibration folder: .npy files (one input) or .npz files (keys = input names)")
    q.add_argument("--data-size", type=int, help="use at most this many calibration samples")
    q.add_argument("--random-data", type=int, metavar="N", help="calibrate on N random inputs (a warning: only for smoke tests)")
    q.add_argument("--op-types", nargs="+", help="op types to quantize (default: the config's, e.g. Conv ConvTranspose Gemm MatMul)")
    q.add_argument("--exclude-nodes", nargs="+", help="node names or full-match regular expressions to leave in float")
    q.add_argument("--per-channel", action=argparse.BooleanOptionalAction, default=None, help="INT weights per channel")
    q.add_argument("--weight-storage", choices=["float", "compact"], help="float initializers + QDQ, or stored codes")
    q.add_argument("-o", "--output", type=Path, required=True, help="where to write the quantized model")
    q.set_defaults(run=quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        args.run(args)
    except (ValueError, ConfigError, FileNotFoundError, onnx.checker.ValidationError) as error:
        logging.error("%s", error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
