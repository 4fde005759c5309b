"""The `finetune` command: one subcommand per tool, each a thin layer over the library."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from finetune.calibrate import CalibrationData, random_data
from finetune.config import DEVICE_HELP, EarlyStop, FastFinetune, QuantConfig, available_presets, load_config
from finetune.files import check_output, write_text_atomic
from finetune.onnx import attach_custom_ops
from finetune.onnx.io import copy_without_initializers, has_external_data, load_model, model_files, save_model_atomic
from finetune.pipeline import quantize_and_finetune, save_run_config, with_finetune, with_peak_memory
from finetune.quantize import format_summary
from finetune.tools import bf16, evaluate, infer
from finetune.tools.command import add_common_flags, run_command

logger = logging.getLogger(__name__)


def attach_ops(args: argparse.Namespace) -> None:
    """Add function bodies for com.finetune / com.amd.quark nodes so stock onnxruntime runs them."""
    check_output(args.output, *model_files(args.input))
    model = load_model(args.input)
    attached = attach_custom_ops(model)
    if copy_without_initializers(attached) == copy_without_initializers(model):  # attaching leaves the weights alone
        logger.warning("%s needs no function bodies (it has no com.finetune / com.amd.quark node without one): "
                       "the output is an unchanged copy", args.input)
    save_model_atomic(attached, args.output, external_data=has_external_data(args.input))
    logger.info("wrote %s", args.output)


def quantize(args: argparse.Namespace) -> None:
    """Quantize a float model with a preset or YAML config and calibration data."""
    check_output(args.output, *model_files(args.model), args.data, args.evaluation_data)
    overrides: dict = {"preset": args.config}
    if args.op_types:
        overrides["op_types"] = args.op_types
    if args.exclude_nodes:
        overrides["exclude_nodes"] = args.exclude_nodes
    if args.weight_storage:
        overrides["weight_storage"] = args.weight_storage
    if args.per_channel is not None:
        overrides["weight"] = {"granularity": "channel" if args.per_channel else "tensor"}
    if section := _auto_mp_overrides(args):
        overrides["auto_mixed_precision"] = section
    config = load_config(overrides)
    config = with_finetune(config, _finetune_overrides(args, config))
    if args.resume and config.fast_finetune is None:
        raise ValueError("--resume continues a fine-tuning run: add --finetune, or a config with a fast_finetune section")
    float_path = _float_model_path(args.output, args.model) if config.weight_storage != "float" else None
    data = _calibration_data(args)
    name = args.output.name if config.auto_mixed_precision is not None else _report_name(args.output)  # the search adds .automp
    result = quantize_and_finetune(args.model, config, data, args.output.parent, name, resume=args.resume, model_path=args.output)
    if result.model is None:
        return  # another process of a data-parallel run: the first one writes and reports
    if result.float_model is not None and float_path is not None:  # quantized only: tuning had it already
        save_model_atomic(result.float_model, float_path, external_data=has_external_data(args.model))
        logger.info("wrote %s, the float model the codes were made from (tune --float-model takes it)", float_path)
    summary_path = args.output.with_name(args.output.name + ".summary.json")
    write_text_atomic(summary_path, json.dumps(with_peak_memory(result.summary), indent=1))
    save_run_config(config, _config_path(args.output))
    print(format_summary(result.summary))
    if result.auto_mp_report is not None:
        from finetune.automp.report import summary_line

        chosen = args.output.with_name(args.output.name + ".automp.config.yaml")
        save_run_config(result.auto_mp_config, chosen)
        print(summary_line(result.auto_mp_report))
        logger.info("wrote the chosen precision per layer as a config: %s (--config it to quantize the same model again)", chosen)
    if result.report is not None:
        from finetune.recon.report import format_report  # lightning takes seconds to import: only after tuning

        print(format_report(result.report))
    logger.info("wrote %s, %s and %s", args.output, summary_path, _config_path(args.output))


def _float_model_path(output: Path, source: Path) -> Path:
    """Where `quantize` writes, with weights stored as codes, the float graph they were made from
    (normalised, batch norms folded, equalised, rotated, smoothed): what `tune --float-model` takes in a second
    step, as the codes alone lose the float values. Checked before any work, as the output is."""
    return check_output(output.with_name(output.name + ".float.onnx"), *model_files(source))


def tune(args: argparse.Namespace) -> None:
    """Recover the accuracy of an already quantized QDQ model (ours, onnxruntime's, AMD Quark's)."""
    from finetune.recon import finetune_model  # lightning takes seconds to import: only for this command
    from finetune.recon.report import format_report

    check_output(args.output, *model_files(args.model), *model_files(args.float_model), args.data)
    config = load_config(args.config) if args.config else QuantConfig()
    if config.fast_finetune is None:
        logger.info("no fast_finetune section in the config: starting from the defaults (AdaRound)")
        config = with_finetune(config, {"algorithm": "adaround"})
    config = with_finetune(config, _finetune_overrides(args, config))
    data = CalibrationData(args.data, load_model(args.model, external_values=False), limit=config.fast_finetune.data_size)
    tuned, report = finetune_model(args.model, data, config.fast_finetune, args.float_model, args.output.parent,
                                   _report_name(args.output), resume=args.resume, model_path=args.output, attach_ops=args.attach_ops)
    if tuned is None:
        return  # another process of a data-parallel run: the first one writes and reports
    save_run_config(config, _config_path(args.output))
    print(format_report(report))
    logger.info("wrote %s and %s", args.output, _config_path(args.output))


def _auto_mp_overrides(args: argparse.Namespace) -> dict:
    """The auto_mixed_precision keys the --auto-mp flags set, merged over the config's section."""
    flags = {"ladder": args.ladder, "target": args.target, "max_drop": args.max_drop, "metric": args.metric,
             "evaluation_data": str(args.evaluation_data) if args.evaluation_data else None}
    given = {key: value for key, value in flags.items() if value is not None}
    if given and not args.auto_mp:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in given)} set(s) the mixed-precision search: add --auto-mp")
    if not args.auto_mp:
        return {}
    if "target" in given or "max_drop" in given:  # the goal given here replaces the config's
        given = {"target": None, "max_drop": None, "keep_top": None, "lower": None, **given}
    return given


def _finetune_overrides(args: argparse.Namespace, config: QuantConfig) -> dict:
    """The fast_finetune keys the command-line flags set (None where a flag was not given);
    --data-size alone (a calibration limit too) does not turn fine-tuning on."""
    flags = {key: getattr(args, _dest(flag)) for flag, (key, _) in FINETUNE_FLAGS.items()}
    flags["early_stop"] = args.early_stop
    tuning = config.fast_finetune is not None or any(value is not None for value in flags.values())
    return {**flags, "data_size": args.data_size if tuning else None}


def _report_name(output: Path) -> str:
    """Report files sit beside the output: OUT.onnx.finetune.json, .png and .logs/."""
    return f"{output.name}.finetune"


def _config_path(output: Path) -> Path:
    return output.with_name(output.name + ".config.yaml")


def _calibration_data(args: argparse.Namespace) -> object:
    """The --data folder, random data when asked for explicitly, or None (no activation scales)."""
    if args.data and args.random_data:
        raise ValueError("give either --data or --random-data, not both")
    if args.random_data:
        return random_data(load_model(args.model, external_values=False), args.random_data, seed=0)
    if args.data:
        return CalibrationData(args.data, load_model(args.model, external_values=False), limit=args.data_size)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Quantize ONNX models and recover their accuracy.")
    add_common_flags(parser)
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
    q.add_argument("--weight-storage", choices=["float", "compact", "matmul_nbits"],
                   help="float initializers + QDQ, stored codes, or stored codes with 4-bit MatMul weights as MatMulNBits")
    q.add_argument("-o", "--output", type=Path, required=True, help="where to write the quantized model")
    amp = q.add_argument_group("automatic mixed precision (override the config's auto_mixed_precision section)")
    amp.add_argument("--auto-mp", action="store_true", help="search per-layer precision against a target")
    amp.add_argument("--ladder", nargs="+", metavar="PRESET", help="rungs, cheapest first (e.g. MX4 MX6 MX9)")
    amp.add_argument("--target", type=float, help="the metric the final model must reach")
    amp.add_argument("--max-drop", type=float, help="or: how far below the float model's metric it may fall")
    amp.add_argument("--metric", help="l2, cosine, top1_agreement, top1_accuracy (labels.npy), perplexity, next_token_agreement (token folders) or module:function")
    amp.add_argument("--evaluation-data", type=Path, help="folder to judge the target on (default: the calibration data)")
    _add_finetune_flags(q)
    q.set_defaults(run=quantize)
    t = commands.add_parser("tune", help="recover the accuracy of an already quantized QDQ model (AdaRound / AdaQuant)")
    t.add_argument("model", type=Path, help="QDQ ONNX model (ours, onnxruntime quantize_static, com.amd.quark BFP/MX), "
                   "or one with 4-bit MatMulNBits (onnxruntime-genai's int4: written back as MatMulNBits)")
    t.add_argument("--float-model", type=Path,
                   help="the float model it was made from (default: the QDQ model with its quantizers disabled)")
    t.add_argument("--data", type=Path, required=True, help="calibration folder: .npy or .npz files")
    t.add_argument("--config", help="preset or YAML file whose fast_finetune section to use (default: defaults)")
    t.add_argument("--data-size", type=int, help="use at most this many samples")
    t.add_argument("-o", "--output", type=Path, required=True, help="where to write the tuned model")
    t.add_argument("--attach-ops", action="store_true",
                   help="give AMD Quark's custom ops (com.amd.quark) function bodies, so stock onnxruntime runs the tuned "
                        "model (default: the model keeps its own form, for Quark's runtime and toolchain)")
    _add_finetune_flags(t)
    t.set_defaults(run=tune)
    convert = commands.add_parser(
        "convert-bf16", help="convert a float32/float16 model to bfloat16 (with_cast, bf16, simulate_bf16, customqdq)",
        description=bf16.cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bf16.add_arguments(convert, choose_source=True)
    infer.add_arguments(commands.add_parser(
        "infer", help="run a model over a data folder and save one .npy output per sample", description=infer.__doc__,
    ))
    evaluate.add_arguments(commands.add_parser(
        "evaluate", help="compare baseline and quantized results: cosine, L2, PSNR, SSIM", description=evaluate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ), positional=True)
    return parser


# The fast_finetune keys the command line sets: flag -> (key, what it does). Their types, choices and
# defaults are FastFinetune's (shown in each flag's help), so the two cannot disagree.
FINETUNE_FLAGS: dict[str, tuple[str, str]] = {
    "--finetune": ("algorithm", "algorithm (gptq: one pass per unit, no learning rate or iterations)"),
    "--iterations": ("iterations", "optimisation steps per unit"),
    "--lr": ("lr", "learning rate, or auto: a short search on the first unit (null: the algorithm's rate for each "
                   "weight's format family)"),
    "--batch-size": ("batch_size", "samples per optimisation step"),
    "--device": ("device", "where to tune"),
    "--devices": ("devices", "processes tuning data-parallel, each on its own device of that kind"),
    "--nodes": ("nodes", "machines of a data-parallel run (each starts the command: torchrun)"),
    "--strategy": ("strategy", "Lightning Fabric strategy for --devices (ddp: runs this command again per process; ddp_spawn)"),
    "--seed": ("seed", "random seed (same model, data, config, seed, device type and torch thread count: identical output)"),
    "--unit": ("unit", "reconstruction unit"),
    "--validation-share": ("validation_share", "share of the calibration batches held out of training, on which units "
                                               "are kept or reverted and the tuned model is checked against the untuned "
                                               "one (0: none)"),
    "--threads": ("threads", "torch threads while tuning on the CPU (auto: one for small steps, else the CPUs other "
                             "jobs leave free; a number pins it, and with it the last bits)"),
    "--compile": ("compile", "compile the quantize-dequantize kernels with torch.compile, same bits (auto: where a "
                             "compiler is at hand, a C++ compiler on the CPU, Triton on a GPU; true: fail without one)"),
}


def _add_finetune_flags(parser: argparse.ArgumentParser) -> None:
    """Flags that override the config's fast_finetune section (and add one when it has none)."""
    group = parser.add_argument_group("fast finetune (override the config's fast_finetune section)")
    hints = typing.get_type_hints(FastFinetune)
    defaults = {f.name: f.default for f in dataclasses.fields(FastFinetune)}
    for flag, (key, help_text) in FINETUNE_FLAGS.items():
        words, number = [_word(word) for word in _words(hints[key])], _number(hints[key])
        metavar = "{" + ",".join(words) + "}" if words and not number else key.upper()
        syntax = DEVICE_HELP if key == "device" else f"a number or {', '.join(words)}; " if words and number else ""
        shown = "null" if defaults[key] is None else _word(defaults[key])
        group.add_argument(flag, type=_parser(hints[key]), metavar=metavar,
                           help=f"{help_text} ({f'{syntax}; ' if key == 'device' else syntax}default: {shown})")
    group.add_argument("--early-stop", action=argparse.BooleanOptionalAction, default=None,
                       help="stop a unit when its reconstruction loss stops improving, after a tail that finishes "
                            f"its schedule (default: {'on' if EarlyStop().enabled else 'off'}; --no-early-stop runs every "
                            "iteration)")
    group.add_argument("--resume", action="store_true",
                       help="continue a killed run from its checkpoint folder beside the output (model.onnx.finetune.ckpt for "
                            "-o model.onnx); same model, data and settings give the bytes of an uninterrupted run")


def _words(hint: object) -> tuple[object, ...]:
    """The literal values a field's type admits (a Literal, or one inside a union), in order."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(word for arg in typing.get_args(hint) for word in _words(arg))


def _word(value: object) -> str:
    """A config value as the command line spells it (true and false in lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parser(hint: object) -> Callable[[str], object]:
    """A flag's text to the field's value: one of its literal words, else a number or text as its type says."""
    words, number = {_word(word): word for word in _words(hint)}, _number(hint)

    def parse(text: str) -> object:
        if text in words:
            return words[text]
        if number is not None:
            return number(text)
        if words:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(words)})")
        return text

    parse.__name__ = number.__name__ if number is not None else "choice"  # argparse names the type in its errors
    return parse


def _number(hint: object) -> type | None:
    """The numeric type a field takes (int or float, alone or in a union), None where it takes none."""
    return next((kind for kind in (int, float) if kind is hint or kind in typing.get_args(hint)), None)


def _dest(flag: str) -> str:
    """The argparse attribute of a flag."""
    return flag.lstrip("-").replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run_command(build_parser(), argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM (kill, a job scheduler's time limit) as SystemExit, so cleanup runs on the way out:
    the activation cache's spill files (tens of GB on image models) are removed, not left behind."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
