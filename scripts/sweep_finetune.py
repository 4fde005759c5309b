"""The measured curves of the Fine-tuning guide page: how iterations, learning rate and batch size
move the result, on the Getting-started setup (the digits CNN, 512 calibration digits, 449 held out).

AdaRound on int4 weights / int8 activations over a range of iterations and batch sizes, and
AdaQuant on MX4 over learning rates and iterations; each run reports the summed reconstruction
loss before and after, held-out accuracy in onnxruntime and tuning seconds. Writes JSON (stdout or
--json) and a PNG of the curves (--png); the defaults of fast_finetune apply otherwise (early
stopping on, seed 0, cpu).

    python scripts/sweep_finetune.py --json sweep.json --png sweep.png
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from finetune.config import FastFinetune, load_config
from finetune.quantize import quantize_model
from finetune.tools.session import make_session
from finetune.zoo import digits_split, export_onnx, train_digits_cnn

logger = logging.getLogger("sweep_finetune")
W4A8 = {"preset": "A8W8", "weight": {"dtype": "int4", "granularity": "tensor"}}
RUNS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    *(("adaround-iterations", W4A8, {"algorithm": "adaround", "iterations": n}) for n in (50, 100, 200, 500, 1000)),
    *(("adaround-batch", W4A8, {"algorithm": "adaround", "iterations": 500, "batch_size": b}) for b in (4, 64)),
    *(("adaquant-lr", {"preset": "MX4"}, {"algorithm": "adaquant", "iterations": n, "lr": lr})
      for lr in (1e-4, 1e-3, 1e-2) for n in (100, 500)),
]


def accuracy(model: Any, x: np.ndarray, labels: np.ndarray) -> float:
    """Held-out accuracy (%) in onnxruntime."""
    session = make_session(model)
    logits = np.concatenate([session.run(None, {"x": x[i : i + 64]})[0] for i in range(0, len(x), 64)])
    return float(100 * (logits.argmax(1) == labels).mean())


def sweep(folder: Path) -> dict[str, Any]:
    """Every run of RUNS on the tutorial's model and data; the quantized models are made once."""
    from finetune.recon import finetune_model

    x_train, _, x_test, y_test = digits_split()
    float_path = export_onnx(train_digits_cnn(), x_test[:2], folder / "digits.onnx")
    calibration = [{"x": batch.numpy()} for batch in x_train[:512].split(64)]
    x, y = x_test.numpy(), y_test.numpy()
    quantized: dict[str, Any] = {}
    rows = []
    for study, settings, tuning in RUNS:
        key = json.dumps(settings, sort_keys=True)
        if key not in quantized:
            quantized[key] = quantize_model(float_path, load_config(settings), calibration)
        result = quantized[key]
        start = time.perf_counter()
        tuned, report = finetune_model(result.model, calibration, FastFinetune(**tuning), result.float_model)
        units = report["units"]
        rows.append({
            "study": study, "config": settings, **tuning, "seconds": time.perf_counter() - start,
            "loss_before": sum(u["loss_before"] for u in units), "loss_after": sum(u["loss_after"] for u in units),
            "iterations_run": [u["iterations"] for u in units], "float_accuracy": accuracy(float_path, x, y),
            "quantized_accuracy": accuracy(result.model, x, y), "tuned_accuracy": accuracy(tuned, x, y),
        })
        logger.warning("%s %s: loss %.4g -> %.4g, accuracy %.2f -> %.2f", study, tuning, rows[-1]["loss_before"],
                        rows[-1]["loss_after"], rows[-1]["quantized_accuracy"], rows[-1]["tuned_accuracy"])
    return {"runs": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels: summed loss before and after tuning against iterations, per study and setting (a
    unit's loss before is measured on inputs from the tuned units ahead of it, so it moves too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    runs = result["runs"]
    curve = [r for r in runs if r["study"] == "adaround-iterations"]
    left.plot([r["iterations"] for r in curve], [r["loss_after"] for r in curve], "o-", label="after AdaRound")
    left.plot([r["iterations"] for r in curve], [r["loss_before"] for r in curve], "o--", color="grey", label="before")
    left.set(xscale="log", yscale="log", xlabel="iterations per unit", ylabel="summed reconstruction MSE",
             title="AdaRound, int4 weights / int8 activations")
    left.legend()
    for lr in sorted({r["lr"] for r in runs if r["study"] == "adaquant-lr"}):
        points = [r for r in runs if r["study"] == "adaquant-lr" and r["lr"] == lr]
        right.plot([r["iterations"] for r in points], [r["loss_after"] for r in points], "o-", label=f"lr {lr:g}")
        right.plot([r["iterations"] for r in points], [r["loss_before"] for r in points], "x:", color="grey")
    right.set(xscale="log", yscale="log", xlabel="iterations per unit", title="AdaQuant, MX4 (grey: before)")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the JSON here (default: stdout)")
    parser.add_argument("--png", type=Path, help="write the curves here")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only draw --png from an earlier run's JSON")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.png)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        result = sweep(Path(folder))
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    if args.png:
        plot(result, args.png)


if __name__ == "__main__":
    main()
