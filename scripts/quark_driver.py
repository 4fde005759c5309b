"""Run one fast-finetune case through AMD Quark for ONNX, for bench_finetune.py --compare-quark.
It runs in the Python of an environment where the user installed Quark (`amd-quark`), never in
ours, and imports nothing of finetune: the float model and calibration batches come as files
(bench_finetune's `prepare`), the quantized and tuned model goes to a file, and one JSON line
with the wall time of Quark's quantize-and-tune call is printed.

    QUARK_PYTHON scripts/quark_driver.py FLOAT.onnx CALIBRATION.npz CONFIG ITERATIONS BATCH OUT.onnx [--early-stop]"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


class Batches:
    """onnxruntime's CalibrationDataReader protocol over the saved calibration batches."""

    def __init__(self, path: str) -> None:
        with np.load(path) as stored:
            self.feeds = iter([{"x": stored[f"arr_{i}"]} for i in range(len(stored.files))])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("float_model", "calibration", "config"):
        parser.add_argument(name)
    parser.add_argument("iterations", type=int)
    parser.add_argument("batch_size", type=int)
    parser.add_argument("output")
    parser.add_argument("--early-stop", action="store_true", help="keep Quark's default early stopping (off: every iteration runs)")
    args = parser.parse_args()
    float_model, calibration, output = (str(Path(path).resolve()) for path in (args.float_model, args.calibration, args.output))
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)  # Quark writes scratch files (*.data, quantized_info.csv) into the working folder
        print(json.dumps(quantize(float_model, calibration, output, args)))


def quantize(float_model: str, calibration: str, output: str, args: argparse.Namespace) -> dict:
    """Quark's quantize (and fast finetune, when the config has one) with the given budget; its wall time."""
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.config import Config
    from quark.onnx.quantization.config.custom_config import get_default_config

    config = copy.deepcopy(get_default_config(args.config))
    with np.load(calibration) as stored:
        samples = sum(len(stored[name]) for name in stored.files)
    if "FastFinetune" in config.extra_options:  # a config without it (XINT8, MX4, ...) only quantizes
        config.extra_options["FastFinetune"] = {**config.extra_options["FastFinetune"], "NumIterations": args.iterations,
                                                "BatchSize": args.batch_size, "DataSize": samples, "EarlyStop": args.early_stop}
    start = time.perf_counter()
    ModelQuantizer(Config(global_quant_config=config)).quantize_model(float_model, output, Batches(calibration))
    return {"quark_seconds": time.perf_counter() - start, "config": args.config,
            "fast_finetune": config.extra_options.get("FastFinetune")}


if __name__ == "__main__":
    main()
