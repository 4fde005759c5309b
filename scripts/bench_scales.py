"""Learned scales (fast_finetune.learn_scales) off and on, measured: the digits CNN and the digits
transformer (trained here, scikit-learn's digits, the whole training split as calibration, held-out
accuracy in onnxruntime), INT presets, AdaQuant over layers or blocks. JSON rows on stdout, progress
on stderr; the tables of docs/fine-tuning.md come from it.

    python scripts/bench_scales.py --iterations 300 --scale-lrs 1e-3,1e-2 > scales.json
    python scripts/bench_scales.py --unit block --learn weights,activations,all --scale-lrs 1e-3 > blocks.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_finetune import load_case_data, log, logits, prepare, scores

from finetune.config import FastFinetune, load_config
from finetune.quantize import quantize_model
from finetune.recon import finetune_model

_INT8 = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}
PRESETS: dict[str, Any] = {
    "W4A8 per tensor": {"activation": _INT8, "weight": {**_INT8, "dtype": "int4"}},
    "W4A8 per channel": {"activation": _INT8, "weight": {**_INT8, "dtype": "int4", "granularity": "channel"}},
    "W4A4 per channel": {"activation": {**_INT8, "dtype": "int4"}, "weight": {**_INT8, "dtype": "int4", "granularity": "channel"}},
    "A8W8": "A8W8",
    "XINT8": "XINT8",
}


def case(directory: Path, preset: str, iterations: int, unit: str, learn: str, scale_lr: float | None) -> dict[str, Any]:
    """One run: held-out accuracy of the float, quantized and tuned model (scale_lr None: scales off)."""
    calibration, evaluation = load_case_data(directory)
    float_outputs = logits(directory / "float.onnx", evaluation["x"])
    quantized = quantize_model(directory / "float.onnx", load_config(PRESETS[preset]), calibration).model
    learning = {"learn_scales": learn, "scale_lr": scale_lr} if scale_lr is not None else {}
    start = time.perf_counter()
    config = FastFinetune(algorithm="adaquant", iterations=iterations, unit=unit, **learning)
    tuned, report = finetune_model(quantized, calibration, config)
    seconds = time.perf_counter() - start
    ratios = [r["ratio_mean"] for r in report.get("learned_scales", [])]
    measured = {name: scores(logits(model, evaluation["x"]), float_outputs, evaluation["y"])
                for name, model in (("float", directory / "float.onnx"), ("before", quantized), ("after", tuned))}
    row = {name: numbers["metric"] for name, numbers in measured.items()}
    return {**row, "logit_mse_before": measured["before"]["logit_mse"], "logit_mse_after": measured["after"]["logit_mse"], "preset": preset, "iterations": iterations, "unit": unit,
            "learn_scales": learn if scale_lr is not None else False, "scale_lr": scale_lr, "seconds": seconds,
            "kept": report["kept"], "units": len(report["units"]),
            "restored_untuned": (report["held_out"] or {}).get("restored_untuned_weights"),
            "scale_ratio_min": min(ratios, default=None), "scale_ratio_max": max(ratios, default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="digits,transformer")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated subset of the presets")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--scale-lrs", default="1e-3,1e-2", help="scale learning rates to try beside learn_scales off")
    parser.add_argument("--learn", default="weights", help="comma-separated learn_scales values to try at each rate")
    parser.add_argument("--unit", choices=("layer", "block"), default="layer")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [("off", None), *((learn, float(lr)) for learn in args.learn.split(",") for lr in args.scale_lrs.split(","))]
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models.split(","):
            directory = Path(folder) / model
            prepare(model, directory, None)
            for preset in args.presets.split(","):
                for learn, lr in runs:
                    row = {"model": model, **case(directory, preset, args.iterations, args.unit, learn, lr)}
                    log(f"{model} {preset} learn_scales={learn} scale_lr={lr}: {row['before']:.2f} -> {row['after']:.2f}, logit MSE "
                        f"{row['logit_mse_before']:.4g} -> {row['logit_mse_after']:.4g} ({row['seconds']:.0f} s)")
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
