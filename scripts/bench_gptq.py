"""GPTQ against round to nearest and AdaQuant on the digits models (JSON on stdout, progress on
stderr): held-out accuracy and logit MSE against float of the untuned model (round to nearest),
GPTQ (natural column order and act_order), AdaQuant, and AdaQuant started from GPTQ (gptq_init),
with tuning seconds, for each preset. Calibration: the first --calibration training samples in
batches of 32; evaluation: the held-out split. Layer units throughout.

    python scripts/bench_gptq.py                                    # digits CNN, INT4 per channel and MX4
    python scripts/bench_gptq.py --models digits,transformer --iterations 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from finetune.config import GPTQ, FastFinetune
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

_INT8_TENSOR = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}
PRESETS: dict[str, Any] = {
    "INT4_CHANNEL": {"activation": _INT8_TENSOR, "weight": {**_INT8_TENSOR, "dtype": "int4", "granularity": "channel"}},
    "MX4": "MX4",
    "MXFP4": "MXFP4",
}


def methods(iterations: int) -> dict[str, FastFinetune | None]:
    """The compared methods by name (None: the untuned model, round to nearest)."""
    return {
        "round_to_nearest": None,
        "gptq": FastFinetune(algorithm="gptq"),
        "gptq_act_order": FastFinetune(algorithm="gptq", gptq=GPTQ(act_order=True)),
        "adaquant": FastFinetune(algorithm="adaquant", iterations=iterations, seed=0),
        "gptq_then_adaquant": FastFinetune(algorithm="adaquant", iterations=iterations, seed=0, gptq_init=True),
    }


def scores(model: onnx.ModelProto | Path, reference: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Held-out accuracy and logit MSE against the float model (onnxruntime, optimisations off)."""
    output = inference_session(model).run(None, {"x": x})[0]
    return {"accuracy": float((output.argmax(1) == y).mean()), "logit_mse": float(((output - reference) ** 2).mean())}


def case(float_path: Path, preset: Any, calibration: list[dict[str, np.ndarray]], x: np.ndarray, y: np.ndarray,
         iterations: int) -> dict[str, Any]:
    """Every method's scores on one quantized model."""
    quantized = quantize_model(float_path, preset, calibration).model
    reference = inference_session(float_path).run(None, {"x": x})[0]
    results: dict[str, Any] = {"float": scores(float_path, reference, x, y)}
    for name, config in methods(iterations).items():
        begin = time.perf_counter()
        tuned = quantized if config is None else finetune_model(quantized, calibration, config)[0]
        results[name] = {**scores(tuned, reference, x, y), "seconds": round(time.perf_counter() - begin, 2)}
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="digits", help="comma-separated subset of digits,transformer")
    parser.add_argument("--presets", default="INT4_CHANNEL,MX4", help=f"comma-separated subset of {','.join(PRESETS)}")
    parser.add_argument("--iterations", type=int, default=500, help="AdaQuant iterations per unit (default 500)")
    parser.add_argument("--calibration", type=int, default=512, help="calibration samples (default 512)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    x_train, _, x_test, y_test = digits_split()
    calibration = [{"x": b.numpy()} for b in x_train[:args.calibration].split(32)]
    report: dict[str, Any] = {"calibration": args.calibration, "evaluation": len(y_test), "iterations": args.iterations,
                              "cases": []}
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models.split(","):
            network = train_digits_cnn() if model == "digits" else train_digits_transformer()
            float_path = Path(folder) / f"{model}.onnx"
            export_onnx(network, x_test[:2], float_path, 17)
            for preset in args.presets.split(","):
                print(f"{model} {preset}", file=sys.stderr, flush=True)
                results = case(float_path, PRESETS[preset], calibration, x_test.numpy(), y_test.numpy(), args.iterations)
                report["cases"].append({"model": model, "preset": preset, **results})
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
