"""Benchmark automatic mixed precision: for each model and ladder, the search at several targets,
beside the uniform rungs of the same ladder, measured in one run. JSON on stdout (and --json PATH):
per model and ladder, the preparation (rungs quantized and lifted, sensitivity: shared by the
targets, so its seconds are stated once) and, per target, the choice and its search seconds. With
--finetune-iterations N (default 500; 0: none), one layer-wise fast finetune of the same model on
the same calibration data is timed too, and each target states search_over_finetune, (sensitivity
+ search seconds) / finetune seconds: the issue asks for at most 3 at 500 iterations.

Cases: the digits CNN and transformer (trained here on scikit-learn's digits; calibration on the
training split, judged by held-out top-1 accuracy with labels) on the MX ladder MX4/MX6/MX9, the
OCP ladder MXFP4/MXFP6_E2M3/MXFP8_E4M3 and the INT ladder INT4W8A/A8W8/A16W8; EfficientNet-Lite0
on MX4/MX6/MX9, calibrated on crops of four of the bundled photos and judged by top-1 agreement
with the float model on crops of the other three (never the same photo); magika on MX4/MX6/MX9,
calibrated on every other standard-library file and judged by top-1 accuracy against the type the
extension implies on the rest; PP-OCRv4's text detector (DBNet) on MX4/MX6/MX9, calibrated on 32
rendered pages and judged on 64 others by the IoU of its text mask with the float model's
(bench_finetune.mask_iou).

    python scripts/bench_automp.py --models digits,transformer                 # minutes
    python scripts/bench_automp.py --models efficientnet --targets 0.86,0.7,0.52 --eval-crops 64
    python scripts/bench_automp.py --models efficientnet --efficientnet-ladders mx-tensor --eval-crops 48 --finetune-iterations 0
    python scripts/bench_automp.py --models magika --ladders mx
    python scripts/bench_automp.py --models textdet --ladders mx --iou-targets 0.9 --finetune-iterations 0
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.automp import PreparedSearch, prepare_mixed_precision
from finetune.config import FastFinetune
from finetune.files import write_text_atomic
from finetune.quantize import quantize_model
from finetune.zoo import (digits_split, efficientnet_lite0, export_onnx, magika_config, magika_onnx_path, magika_samples, photo_crops,
                          text_detector_onnx_path, text_pages, train_digits_cnn, train_digits_transformer)

INT4W8A = {"activation": {"format": "int", "dtype": "int8", "symmetric": True, "calibration": "minmax"},
           "weight": {"format": "int", "dtype": "int4", "symmetric": True, "granularity": "channel", "calibration": "minmax"}}
MX = ["MX4", "MX6", "MX9"]
LADDERS = {"mx": MX, "mxfp": ["MXFP4", "MXFP6_E2M3", "MXFP8_E4M3"], "int": [INT4W8A, "A8W8", "A16W8"],
           "mx-tensor": {"activation": MX, "weight": MX}}  # each layer's activation and weight searched apart
CALIBRATION_PHOTOS, EVALUATION_PHOTOS = (0, 1, 2, 3), (4, 5, 6)


def digits_case(model: str, directory: Path) -> tuple[Path, list, list]:
    """The trained model, calibration batches and labelled evaluation batches."""
    x_train, _, x_test, y_test = digits_split()
    network = train_digits_cnn() if model == "digits" else train_digits_transformer()
    path = export_onnx(network, x_test[:2], directory / f"{model}.onnx")
    calibration = [{"x": b.numpy()} for b in x_train[:256].split(32)]
    evaluation = [(a.numpy(), b.numpy()) for a, b in zip(x_test.split(128), y_test.split(128))]
    return path, calibration, evaluation


def efficientnet_case(directory: Path, calibration_crops: int, evaluation_crops: int) -> tuple[Path, list, list]:
    path = export_onnx(efficientnet_lite0(), torch.zeros(1, 3, 224, 224), directory / "efficientnet.onnx", 13)
    calibration = [{"x": b.numpy()} for b in photo_crops(calibration_crops, seed=1, photos=CALIBRATION_PHOTOS).split(8)]
    evaluation = [{"x": b.numpy()} for b in photo_crops(evaluation_crops, seed=2, photos=EVALUATION_PHOTOS).split(16)]
    return path, calibration, evaluation


def magika_case() -> tuple[Path, list, list]:
    """magika, calibration on every other file, labelled evaluation batches of the rest."""
    features, names = magika_samples()
    space = magika_config()["target_labels_space"]
    labels = np.array([space.index(name) for name in names])
    calibration = [{"bytes": features[0::2][i:i + 32]} for i in range(0, len(features[0::2]), 32)]
    held, truth = features[1::2], labels[1::2]
    return magika_onnx_path(), calibration, [(held[i:i + 64], truth[i:i + 64]) for i in range(0, len(held), 64)]


def textdet_case() -> tuple[Path, list, list]:
    """PP-OCRv4's text detector, bench_finetune's calibration pages (in batches of 4) and 64 others."""
    from bench_finetune import PAGE_CALIBRATION, PAGE_EVALUATION  # a script beside this one

    calibration = [{"x": b} for b in np.split(text_pages(PAGE_CALIBRATION, seed=1), PAGE_CALIBRATION // 4)]
    evaluation = [{"x": b} for b in np.split(text_pages(PAGE_EVALUATION, seed=2), PAGE_EVALUATION // 16)]
    return text_detector_onnx_path(), calibration, evaluation


def prepare(path: Path, calibration: list, evaluation: list, ladder: list, metric: str, goal: dict[str, float]) -> PreparedSearch:
    """The measurements every target of the ladder shares (`goal`, any of them, only makes the config whole)."""
    granularity = "tensor" if isinstance(ladder, dict) else "layer"
    config = {"preset": _top_rung(ladder),
              "auto_mixed_precision": {"ladder": ladder, "granularity": granularity, "metric": metric, **goal}}
    return prepare_mixed_precision(path, config, calibration, evaluation_data=evaluation)


def choose(prepared: PreparedSearch, goal: dict[str, float], curve_points: int = 0) -> dict[str, Any]:
    """One target's search from the shared preparation; the numbers the closing note and the issue ask for."""
    start = time.perf_counter()
    report = prepared.choose(**goal, curve_points=curve_points).report
    chosen = report["chosen"]
    curve = [(p["average_bits"], p["metric"]) for p in report["trace"] if p["phase"] in ("curve", "search")]
    return {
        **goal, "target": report["target"], "float_metric": report["float_metric"],
        "average_bits": chosen["average_bits"], "weight_bits": chosen["weight_bits"], "activation_bits": chosen["activation_bits"],
        "fractions": chosen["fractions"], "onnxruntime_metric": chosen["onnxruntime_metric"], "met": chosen["met"],
        "repairs": chosen["repairs"], "evaluations": report["evaluations"], "uniform": report["uniform"],
        "curve": curve, "curve_above_uniform_line": all(m >= _uniform_line(report["uniform"], b) for b, m in curve),
        "seconds": {"search": report["seconds"]["search"], "finetune": report["seconds"]["finetune"],
                    "wall": time.perf_counter() - start},
    }


def finetune(path: Path, calibration: list, ladder_name: str, iterations: int) -> dict[str, Any]:
    """Wall seconds of one layer-wise fast finetune (finetune.recon.finetune_model; AdaRound on the
    INT ladder, AdaQuant on the block formats) of the model quantized at the ladder's top rung, on the
    calibration data the search uses: the issue's yardstick for the search's time."""
    from finetune.recon import finetune_model  # lightning takes seconds to import: not timed

    rung = _top_rung(LADDERS[ladder_name])
    algorithm = "adaround" if ladder_name == "int" else "adaquant"
    quantized = quantize_model(path, rung, calibration)
    settings = FastFinetune(algorithm=algorithm, iterations=iterations, early_stop={"enabled": False})  # all of them
    start = time.perf_counter()
    finetune_model(quantized.model, calibration, settings, quantized.float_model)
    return {"what": "one finetune.recon.finetune_model call (layer units, every iteration run: no early stop, default "
                    "settings otherwise) on the model quantized at the ladder's top rung, with the search's calibration data; "
                    "the quantizing before it is not timed",
            "rung": rung, "algorithm": algorithm, "iterations": iterations, "seconds": time.perf_counter() - start}


def ladder_results(case: tuple[Path, list, list], ladder_name: str, metric: str, goals: list[dict[str, float]],
                   curve_points: int, finetune_iterations: int) -> dict[str, Any]:
    """One preparation, then each goal chosen from it; the shared seconds stated once; with
    `finetune_iterations`, each target's search time over that of one fast finetune."""
    prepared = prepare(*case, LADDERS[ladder_name], metric, goals[0])
    targets = [choose_or_refusal(prepared, goal, curve_points) for goal in goals]
    uniforms = [target.pop("uniform") for target in targets if "uniform" in target]  # one preparation: all the same
    uniform = uniforms[0] if uniforms else None
    tuned = finetune(case[0], case[1], ladder_name, finetune_iterations) if finetune_iterations else None
    for target in targets:
        if "refused" not in target:
            searched = prepared.seconds["sensitivity"] + target["seconds"]["search"]
            target["search_over_finetune"] = searched / tuned["seconds"] if tuned else None
    return {"seconds": {"sensitivity_shared": prepared.seconds["sensitivity"], "prepare": prepared.seconds["prepare"]},
            "finetune": tuned, "uniform": uniform, "targets": targets}


def choose_or_refusal(prepared: PreparedSearch, goal: dict[str, float], curve_points: int) -> dict[str, Any]:
    """choose, or the goal with the search's one-line refusal (a target the top rung misses) in its place."""
    try:
        return choose(prepared, goal, curve_points)
    except ValueError as refusal:
        return {**goal, "refused": str(refusal)}


def _top_rung(ladder: list | dict[str, list]) -> str:
    """The preset of the ladder's top rung (the weight ladder's of a split one; A16W8 where that
    rung is written inline): the search's base config."""
    top = ladder["weight"][-1] if isinstance(ladder, dict) else ladder[-1]
    return top if isinstance(top, str) else "A16W8"


def _uniform_line(uniform: list[dict], bits: float) -> float:
    """The metric on the line joining the uniform rungs' points (metric against average bits) at `bits`."""
    points = sorted((p["average_bits"], p["metric"]) for p in uniform)
    return float(np.interp(bits, [b for b, _ in points], [m for _, m in points]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="digits,transformer", help="digits, transformer, efficientnet, magika, textdet")
    parser.add_argument("--ladders", default="mx,mxfp,int", help="for the digits models and magika: mx, mxfp, int, mx-tensor "
                        "(the MX ladder with each layer's activation and weight searched apart)")
    parser.add_argument("--efficientnet-ladders", default="mx", help="for EfficientNet-Lite0: mx, mx-tensor")
    parser.add_argument("--drops", default="0.005,0.01,0.02", help="digits, magika: allowed top-1 accuracy drops from float")
    parser.add_argument("--targets", default="0.86,0.7,0.52", help="EfficientNet-Lite0: top-1 agreement targets")
    parser.add_argument("--iou-targets", default="0.9", help="textdet: mask IoU targets")
    parser.add_argument("--calibration-crops", type=int, default=32)
    parser.add_argument("--eval-crops", type=int, default=64)
    parser.add_argument("--curve-points", type=int, default=4, help="prefixes of the search's move order measured for the curve")
    parser.add_argument("--finetune-iterations", type=int, default=500,
                        help="iterations of the fast finetune timed beside the search (0: none)")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    torch.set_num_threads(2)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models.split(","):
            if model == "efficientnet":
                case = efficientnet_case(Path(folder), args.calibration_crops, args.eval_crops)
                goals = [{"target": target} for target in map(float, args.targets.split(","))]
                cases = [(ladder, "top1_agreement", goals) for ladder in args.efficientnet_ladders.split(",")]
            elif model == "textdet":
                case = textdet_case()
                goals = [{"target": target} for target in map(float, args.iou_targets.split(","))]
                cases = [(ladder, "bench_finetune:mask_iou", goals) for ladder in args.ladders.split(",")]
            else:
                case = magika_case() if model == "magika" else digits_case(model, Path(folder))
                drops = [{"max_drop": drop} for drop in map(float, args.drops.split(","))]
                cases = [(ladder, "top1_accuracy", drops) for ladder in args.ladders.split(",")]
            for ladder, metric, goals in cases:
                results.append({"model": model, "ladder": ladder,
                                **ladder_results(case, ladder, metric, goals, args.curve_points, args.finetune_iterations)})
                print(json.dumps(results[-1]), file=sys.stderr)
    text = json.dumps({"torch_threads": 2, "results": results}, indent=1)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
