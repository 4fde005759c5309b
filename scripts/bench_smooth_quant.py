"""SmoothQuant's measured effect (the table in docs/configs.md): held-out accuracy of the digits
transformer and the digits CNN (trained here on scikit-learn's digits, as bench_finetune.py does:
256 calibration digits, 449 held out) at A8W8, XINT8, W4A8, MXFP4 and MX4, with smooth_quant off
and at each alpha, untuned and after a short AdaQuant (layer-wise; the float reference is the
smoothed float graph the quantizer worked from). One JSON line per case, appended to --out as it
finishes (progress on stderr).

    python scripts/bench_smooth_quant.py --out smooth.jsonl                      # everything
    python scripts/bench_smooth_quant.py --models digits --presets A8W8 --alphas off,0.5 --iterations 50
    python scripts/bench_smooth_quant.py --out silero.jsonl --silero    # silero VAD v6 and v5, A8W8 and XINT8, untuned

Silero's voice-activity detectors (scripts/conformance.py's cases: calibration and evaluation audio
made here, streamed with their states) are scored by agreement of the speech decisions and the
probability gap to the float model, with the smoothed float graph's own gap beside them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_finetune import load_case_data, logits, prepare, scores
from sweep_finetune import W4A8  # the W4A8 of the Fine-tuning page's curves

from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model

PRESETS: dict[str, dict[str, Any]] = {"A8W8": {"preset": "A8W8"}, "XINT8": {"preset": "XINT8"}, "W4A8": W4A8,
                                      "MXFP4": {"preset": "MXFP4"}, "MX4": {"preset": "MX4"}}
CALIBRATION = 256


def case(directory: Path, preset: str, alpha: float | None, iterations: int) -> dict[str, Any]:
    """Untuned and tuned held-out accuracy (%) of one preset at one alpha (None: off); tuned is
    None when `iterations` is 0."""
    calibration, evaluation = load_case_data(directory)
    config = {**PRESETS[preset], **({"smooth_quant": {"alpha": alpha}} if alpha is not None else {})}
    start = time.perf_counter()
    quantized = quantize_model(directory / "float.onnx", config, calibration)
    reference = logits(directory / "float.onnx", evaluation["x"])
    untuned = _scores(quantized.model, evaluation, reference)
    tuned: dict[str, float | None] = {"accuracy": None, "logit_mse": None}
    if iterations:
        tuning = {"algorithm": "adaquant", "iterations": iterations, "seed": 0}
        tuned = _scores(quantize_and_finetune(directory / "float.onnx", {**config, "fast_finetune": tuning}, calibration).model,
                        evaluation, reference)
    smooth = quantized.summary.get("smooth_quant")
    return {"preset": preset, "alpha": alpha, "float": _scores(directory / "float.onnx", evaluation, reference)["accuracy"],
            "untuned": untuned["accuracy"], "tuned": tuned["accuracy"], "untuned_logit_mse": untuned["logit_mse"],
            "tuned_logit_mse": tuned["logit_mse"], "iterations": iterations, "seconds": round(time.perf_counter() - start, 1),
            **({} if smooth is None else {key: smooth[key] for key in ("folded", "mul_inserted", "skipped",
                                                                        "float_output_relative_change")})}


def silero_rows() -> list[dict[str, Any]]:
    """Silero v6 (Convs at the top level) and v5 (everything inside an If) at A8W8 and XINT8,
    with smooth_quant off and at alpha 0.5."""
    from conformance import silero

    from finetune.zoo import silero_vad_lstm_onnx_path, silero_vad_onnx_path

    cases = {"silero_v6": lambda: silero(silero_vad_lstm_onnx_path(), {"h": (1, 1, 128), "c": (1, 1, 128)}, {}),
             "silero_v5": lambda: silero(silero_vad_onnx_path(), {"state": (2, 1, 128)}, {"sr": np.array(16000, np.int64)})}
    rows = []
    for name, build in cases.items():
        case = build()
        for preset in ("A8W8", "XINT8"):
            for alpha in (None, 0.5):
                result = quantize_model(case.path, {"preset": preset, "smooth_quant": alpha and {"alpha": alpha}}, case.calibration)
                smooth = result.summary.get("smooth_quant") or {}
                rows.append({"model": name, "preset": preset, "alpha": alpha, **case.metric(result.model),
                             **{key: smooth.get(key) for key in ("smoothed", "folded", "mul_inserted", "skipped")},
                             "smoothed_float_gap": case.metric(result.float_model)["max_probability_gap"]})
    return rows


def _scores(model: Any, evaluation: dict[str, np.ndarray], reference: np.ndarray) -> dict[str, float]:
    """Held-out accuracy (%) and the mean squared error of the logits against the float model's."""
    measured = scores(logits(model, evaluation["x"]), reference, evaluation["y"])
    return {"accuracy": round(measured["metric"], 2), "logit_mse": round(measured["logit_mse"], 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="transformer,digits")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--alphas", default="off,0.3,0.5,0.7")
    parser.add_argument("--iterations", type=int, default=300, help="AdaQuant iterations per unit; 0: untuned only")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_smooth_quant"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--silero", action="store_true", help="the silero cases instead of the digits models")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.silero:
        with args.out.open("a") as out:
            out.writelines(json.dumps(row) + "\n" for row in silero_rows())
        return
    for model in args.models.split(","):
        directory = args.work / model
        if not (directory / "float.onnx").exists():
            prepare(model, directory, CALIBRATION)
        for preset in args.presets.split(","):
            for alpha in args.alphas.split(","):
                row = {"model": model, **case(directory, preset, None if alpha == "off" else float(alpha), args.iterations)}
                print(json.dumps(row), file=sys.stderr)
                with args.out.open("a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
