"""The learning-rate measurements behind fast_finetune's default rate per (algorithm, format family)
(finetune/config/lr.py): AdaQuant (and AdaRound, briefly) over a range of rates on the digits CNN
and the digits transformer, one or two presets per family (INT, float, BFP/MX, OCP MX), scored by
accuracy on the held-out test digits (449, never calibrated on) and by the guard's output error on
the held-out calibration batches. 256 calibration digits in batches of 32, layer-wise units, the
defaults of fast_finetune otherwise. Writes JSON lines (one per run) to stdout as they finish.

    python scripts/sweep_lr.py --iterations 300 > lr.jsonl
    python scripts/sweep_lr.py --models digits --families ocp --presets MXFP4 --algorithms adaquant --lrs 1e-4,1e-3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_finetune import load_case_data, log, logits, prepare, scores  # a sibling script: python puts scripts/ on the path

from finetune.config import FastFinetune, load_config
from finetune.quantize import quantize_model
from finetune.recon import finetune_model

_FP8 = {"format": "float", "dtype": "float8_e4m3fn"}
FAMILIES: dict[str, dict[str, Any]] = {  # family -> preset name -> config
    "int": {"W4A8": {"preset": "A8W8", "weight": {"dtype": "int4", "granularity": "tensor"}}, "XINT8": {"preset": "XINT8"}},
    "float": {"BF16": {"preset": "BF16"}, "FP8": {"activation": _FP8, "weight": _FP8}},
    "bfp": {"BFP16": {"preset": "BFP16"}, "MX4": {"preset": "MX4"}, "MX6": {"preset": "MX6"}},
    "ocp": {"MXFP4": {"preset": "MXFP4"}, "MXINT8": {"preset": "MXINT8"}},
}
LRS = {"adaquant": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3), "adaround": (1e-2, 3e-2, 0.1, 0.3)}


def run_case(directory: Path, family: str, name: str, algorithms: list[str], lrs: dict[str, list[float]],
             iterations: int) -> None:
    """Every rate of every algorithm on one preset of one model; a JSON line per run."""
    calibration, evaluation = load_case_data(directory)
    float_outputs = logits(directory / "float.onnx", evaluation["x"])
    quantized = quantize_model(directory / "float.onnx", load_config(FAMILIES[family][name]), calibration)
    untuned = scores(logits(quantized.model, evaluation["x"]), float_outputs, evaluation["y"])["metric"]
    for algorithm in algorithms:
        for lr in lrs[algorithm]:
            config = FastFinetune(algorithm=algorithm, iterations=iterations, lr=lr, seed=0)
            start = time.perf_counter()
            tuned, report = finetune_model(quantized.model, calibration, config, quantized.float_model)
            seconds = time.perf_counter() - start
            metric = scores(logits(tuned, evaluation["x"]), float_outputs, evaluation["y"])["metric"]
            guard = report.get("held_out") or {}
            print(json.dumps({"model": directory.name, "family": family, "preset": name, "algorithm": algorithm, "lr": lr,
                              "iterations": iterations, "untuned": untuned, "tuned": metric,
                              "held_out_error_untuned": guard.get("output_error_untuned"),
                              "held_out_error_tuned": guard.get("output_error_tuned"),
                              "restored": guard.get("restored_untuned_weights"), "seconds": round(seconds, 2)}), flush=True)


def cases(families: list[str], presets: str | None) -> list[tuple[str, str]]:
    """(family, preset) of each run: every preset of the families, or those named, in the order named."""
    every = [(family, name) for family in families for name in FAMILIES[family]]
    if not presets:
        return every
    return [(family, name) for wanted in presets.split(",") for family, name in every if name == wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=300, help="iterations per unit (default 300)")
    parser.add_argument("--models", default="digits,transformer", help="comma-separated: digits (the CNN), transformer")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    parser.add_argument("--algorithms", default="adaquant,adaround", help="comma-separated: adaquant, adaround")
    parser.add_argument("--presets", help="comma-separated subset of the families' presets (default: all)")
    parser.add_argument("--lrs", help="comma-separated rates for every algorithm (default: LRS)")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    lrs = {a: [float(v) for v in args.lrs.split(",")] if args.lrs else list(LRS[a]) for a in algorithms}
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            directory = Path(scratch) / model
            prepare(model, directory, 256)
            evaluation = load_case_data(directory)[1]
            float_outputs = logits(directory / "float.onnx", evaluation["x"])
            log(f"{model}: float accuracy {scores(float_outputs, float_outputs, evaluation['y'])['metric']:.2f} %")
            for family, name in cases(args.families.split(","), args.presets):
                log(f"{model} {name}")
                run_case(directory, family, name, [a for a in algorithms if a == "adaquant" or family == "int"], lrs,
                         args.iterations)


if __name__ == "__main__":
    main()
