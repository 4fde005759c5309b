"""Bias correction, measured (JSON lines on stdout, progress on stderr): for each model and preset,
the held-out accuracy of the quantized model untuned and tuned, each with fast_finetune.bias_correction
off and on. Untuned with the correction is `iterations: 0` (the correction alone). Data, models,
presets and algorithms as scripts/bench_finetune.py makes them (AdaRound over layers for INT presets,
AdaQuant over blocks for the others); W4A8 is its INT4W_INT8A.

    python scripts/bench_bias.py --models digits,transformer --presets A8W8,W4A8,BF16,BFP16,MX4,MX6,MXFP4,MXINT8 \\
        --iterations 300 > bias.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_finetune import AUTO_UNIT, INT_PRESETS, PRESETS, load_case_data, logits, prepare, scores  # a sibling script

from finetune.config import FastFinetune, load_config
from finetune.quantize import quantize_model
from finetune.recon import finetune_model

NAMES = {"W4A8": "INT4W_INT8A"}  # this script's preset names for bench_finetune's


def case(model: str, preset: str, directory: Path, iterations: int) -> dict[str, Any]:
    """One model and preset: accuracy untuned and tuned, bias correction off and on."""
    calibration, evaluation = load_case_data(directory)
    name = NAMES.get(preset, preset)
    config = load_config(PRESETS.get(name, name))
    quantized = quantize_model(directory / "float.onnx", config, calibration).model
    float_outputs = logits(directory / "float.onnx", evaluation["x"])

    def measured(onnx_model: Any) -> tuple[float, float]:
        """Held-out accuracy, and logit MSE against float (smoother than accuracy on 449 digits)."""
        found = scores(logits(onnx_model, evaluation["x"]), float_outputs, evaluation["y"])
        return found["metric"], found["logit_mse"]

    algorithm = "adaround" if name in INT_PRESETS else "adaquant"
    row: dict[str, Any] = {"model": model, "preset": preset, "algorithm": algorithm, "iterations": iterations,
                           "float": measured(directory / "float.onnx")[0]}
    row["untuned"], row["untuned_mse"] = measured(quantized)
    runs = {"untuned_bc": (0, True), "tuned": (iterations, False), "tuned_bc": (iterations, True)}
    for key, (steps, correct) in runs.items():
        tune = FastFinetune(algorithm=algorithm, iterations=steps, unit=AUTO_UNIT[algorithm], bias_correction=correct)
        start = time.perf_counter()
        tuned, report = finetune_model(quantized, calibration, tune)
        row[key], row[f"{key}_mse"] = measured(tuned)
        row[f"{key}_seconds"] = round(time.perf_counter() - start, 2)
        row[f"{key}_corrections_kept"] = sum(
            entry.get("status") == "kept" for u in report["units"] for entry in (u["bias_correction"] or {}).values()
            if isinstance(entry, dict))
        row[f"{key}_model_restored"] = bool(report["held_out"] and report["held_out"]["restored_untuned_weights"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="digits,transformer")
    parser.add_argument("--presets", default="A8W8,W4A8,BF16,BFP16,MX4,MX6,MXFP4,MXINT8")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", type=Path, help="keep each model's float model and data in DATA/<model> and reuse "
                        "them when there (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models.split(","):
            directory = (args.data or Path(folder)) / model
            if not (directory / "calibration.npz").is_file():
                prepare(model, directory, None)
            for preset in args.presets.split(","):
                print(json.dumps(case(model, preset, directory, args.iterations)), flush=True)
                print(f"{model} {preset} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
