"""Evidence for the quantizer: for real models (the digits CNN, EfficientNet-Lite0, magika) and
every preset quantize_model takes (not those that add a fast_finetune section), the metric of the
float model and of the quantized model run in onnxruntime, and the quantize wall time. Prints JSON.

Metrics: digits top-1 accuracy on the held-out split; EfficientNet-Lite0 top-1 agreement with the
float model on crops of the sample photos (calibrated on a disjoint quarter of the crops);
magika accuracy of the predicted type against the file extension on standard-library files
(calibrated on every other file)."""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model, quantizer_presets
from finetune.zoo import (
    digits_split,
    efficientnet_lite0,
    export_onnx,
    magika_config,
    magika_onnx_path,
    magika_samples,
    photo_crops,
    train_digits_cnn,
)

logger = logging.getLogger(__name__)

Metric = Callable[[np.ndarray], float]


def session_outputs(model: object, feeds: dict[str, np.ndarray], batch: int = 32) -> np.ndarray:
    """The first output over the feeds in batches, at ORT_DISABLE_ALL (exact simulated numerics)."""
    session = inference_session(model)
    (name, values), = feeds.items()
    return np.concatenate([session.run(None, {name: values[i : i + batch]})[0] for i in range(0, len(values), batch)])


def digits_case(workdir: Path) -> tuple[Path, list[dict], dict, Metric]:
    x_train, _, x_test, y_test = digits_split()
    path = export_onnx(train_digits_cnn(), x_test[:1], workdir / "digits.onnx")
    calibration = [{"x": x_train[i : i + 32].numpy()} for i in range(0, 256, 32)]
    return path, calibration, {"x": x_test.numpy()}, lambda logits: float((logits.argmax(1) == y_test.numpy()).mean())


def efficientnet_case(workdir: Path) -> tuple[Path, list[dict], dict, Metric]:
    crops = photo_crops(160, seed=2)
    calibrate_on = torch.arange(len(crops)) % 4 == 0
    path = export_onnx(efficientnet_lite0(), crops[:1], workdir / "efficientnet_lite0.onnx", opset=13)
    evaluate = {"x": crops[~calibrate_on].numpy()}
    reference = session_outputs(path, evaluate).argmax(1)
    calibration = [{"x": chunk.numpy()} for chunk in crops[calibrate_on].split(16)]
    return path, calibration, evaluate, lambda logits: float((logits.argmax(1) == reference).mean())


def magika_case(workdir: Path) -> tuple[Path, list[dict], dict, Metric]:
    features, labels = magika_samples()
    space = magika_config()["target_labels_space"]
    truth = np.array([space.index(label) for label in labels])
    calibration = [{"bytes": features[i : i + 32]} for i in range(0, len(features), 64)]
    return magika_onnx_path(), calibration, {"bytes": features}, lambda scores: float((scores.argmax(1) == truth).mean())


CASES = {"digits": digits_case, "efficientnet_lite0": efficientnet_case, "magika": magika_case}


def evaluate(models: list[str], presets: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            path, calibration, feeds, metric = CASES[name](Path(tmp))
            float_metric = metric(session_outputs(path, feeds))
            for preset in presets:
                start = time.perf_counter()
                quantized = quantize_model(path, preset, calibration).model
                seconds = time.perf_counter() - start
                rows.append({"model": name, "preset": preset, "float_metric": round(float_metric, 4),
                             "quantized_metric": round(metric(session_outputs(quantized, feeds)), 4),
                             "quantize_seconds": round(seconds, 2)})
                logger.info("%s", rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--presets", nargs="+", default=quantizer_presets())
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("finetune", "onnx2torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print(json.dumps({"benchmark": "eval_quantize", "results": evaluate(args.models, args.presets)}, indent=1))


if __name__ == "__main__":
    main()
