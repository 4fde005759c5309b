"""Main job on the bundled defaults: quantize small real models with harsh settings, recover their
accuracy with fast finetune, and score float / quantized / recovered in onnxruntime, with wall
times.

The models are trained here, reproducibly and in seconds, on scikit-learn's real handwritten
digits and scored on the held-out split: a transformer classifier at MX4 (weights and activations)
tuned with AdaQuant, and a CNN with INT4 weights and INT8 activations (per tensor) tuned with
AdaRound. Everything each run writes goes to --out: the float, quantized and tuned ONNX models,
the run config, and the fine-tuning report (JSON and a PNG of the per-unit losses)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from finetune.config import load_config
from finetune.onnx.io import save_model_atomic
from finetune.pipeline import save_run_config, without_finetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.tools.session import make_session
from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

INT8_TENSOR = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}
CASES: dict[str, tuple[Callable[[], torch.nn.Module], str, dict[str, Any]]] = {
    "transformer_mx4": (train_digits_transformer, "MX4 + AdaQuant over blocks",
                        {"preset": "MX4", "fast_finetune": {"algorithm": "adaquant", "iterations": 500, "unit": "block"}}),
    "cnn_int4w_int8a": (train_digits_cnn, "INT4 weights, INT8 activations + AdaRound",
                        {"activation": INT8_TENSOR, "weight": {**INT8_TENSOR, "dtype": "int4"},
                         "fast_finetune": {"algorithm": "adaround", "iterations": 500}}),
}


def accuracy(model: onnx.ModelProto | Path, x: np.ndarray, labels: np.ndarray) -> float:
    """Held-out accuracy (%) of the model in onnxruntime on CPU."""
    session = make_session(model)
    logits = np.concatenate([session.run(None, {"x": x[i : i + 64]})[0] for i in range(0, len(x), 64)])
    return float(100 * (logits.argmax(1) == labels).mean())


def run_case(name: str, out: Path, iterations: int | None) -> dict[str, Any]:
    """Train, export, quantize, tune (with `iterations` per unit, if given) and score one case."""
    train, label, settings = CASES[name]
    if iterations is not None:
        settings = {**settings, "fast_finetune": {**settings["fast_finetune"], "iterations": iterations}}
    x_train, _, x_test, y_test = digits_split()
    x, y = x_test.numpy(), y_test.numpy()
    calibration = [{"x": batch.numpy()} for batch in x_train.split(32)]  # the whole training split
    start = time.perf_counter()
    float_path = export_onnx(train(), x_test[:2], out / f"{name}.float.onnx")
    train_seconds = time.perf_counter() - start
    config = load_config(settings)
    save_run_config(config, out / f"{name}.config.yaml")
    start = time.perf_counter()
    result = quantize_model(float_path, without_finetune(config), calibration)  # tuned below, timed apart
    quantize_seconds = time.perf_counter() - start
    quantized = result.model
    save_model_atomic(quantized, out / f"{name}.quantized.onnx")
    start = time.perf_counter()
    tuned, report = finetune_model(quantized, calibration, config.fast_finetune, result.float_model, output_dir=out,
                                   name=f"{name}.finetune")
    finetune_seconds = time.perf_counter() - start
    save_model_atomic(tuned, out / f"{name}.tuned.onnx")
    scores = {stage: accuracy(model, x, y) for stage, model in (("float", float_path), ("quantized", quantized), ("recovered", tuned))}
    lost = scores["float"] - scores["quantized"]
    return {
        "case": name, "settings": label, **scores,
        "recovered_share_of_loss": (scores["recovered"] - scores["quantized"]) / lost if lost > 0 else None,
        "units": len(report["units"]), "kept": report["kept"], "iterations_per_unit": config.fast_finetune.iterations,
        "train_seconds": train_seconds, "quantize_seconds": quantize_seconds, "finetune_seconds": finetune_seconds,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    """The cases as an aligned table."""
    print(f"\n{'case':<18}{'settings':<44}{'float %':>8}{'quant. %':>9}{'recov. %':>9}{'share':>7}{'quant. s':>9}{'tune s':>8}")
    for row in rows:
        share = row["recovered_share_of_loss"]
        print(f"{row['case']:<18}{row['settings']:<44}{row['float']:>8.2f}{row['quantized']:>9.2f}{row['recovered']:>9.2f}"
              f"{'-' if share is None else f'{share:.0%}':>7}{row['quantize_seconds']:>9.2f}{row['finetune_seconds']:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder (default ./demo_out)")
    parser.add_argument("--iterations", type=int, help="iterations per unit (default: 500)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = [run_case(name, args.out, args.iterations) for name in CASES]
    if args.json:
        print(json.dumps({"cases": rows, "total_seconds": time.perf_counter() - start}, indent=1))
        return
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; models, configs and reports in {args.out}/")


if __name__ == "__main__":
    main()
