"""AMD Quark's own models against our fine-tuning of them (JSON on stdout, progress on stderr): for
each Quark default config on the digits CNN and transformer, the held-out accuracy of Quark's
quantized model, of Quark's own fast finetune (its `<CONFIG>_ADAROUND` / `_ADAQUANT` config), and
of `finetune_model` on Quark's quantized model, same calibration data, iterations and batch size.
Quark runs in its own environment (scripts/quark_driver.py in the Python given), never in ours;
its models are scored in stock onnxruntime with our function bodies (bit-exact to Quark's runtime:
tests/test_third_party.py).

    python scripts/bench_third_party.py --quark /path/to/quark-venv/bin/python --iterations 1000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx
from bench_finetune import load_case_data, log, logits, prepare, scores  # a sibling script: python puts scripts/ on the path

from finetune.config import FastFinetune
from finetune.onnx import attach_custom_ops
from finetune.recon import finetune_model

# Quark's config, its fast-finetune variant, and our algorithm for tuning its model (AdaRound for INT).
CONFIGS = {
    "XINT8": ("XINT8_ADAROUND", "adaround"), "A8W8": ("A8W8_ADAROUND", "adaround"), "A16W8": ("A16W8_ADAROUND", "adaround"),
    "BF16": ("BF16_ADAQUANT", "adaquant"), "BFP16": ("BFP16_ADAQUANT", "adaquant"), "MX9": ("MX9_ADAQUANT", "adaquant"),
    "MX6": ("MX6_ADAQUANT", "adaquant"), "MX4": ("MX4_ADAQUANT", "adaquant"), "MXINT8": ("MXINT8_ADAQUANT", "adaquant"),
    "MXFP8E4M3": ("MXFP8E4M3_ADAQUANT", "adaquant"), "MXFP6E2M3": ("MXFP6E2M3_ADAQUANT", "adaquant"),
    "MXFP4E2M1": ("MXFP4E2M1_ADAQUANT", "adaquant"),
}


def quark(python: str, directory: Path, config: str, iterations: int, output: Path) -> float:
    """Quark's quantize (and tune, for a fast-finetune config) of the float model; its wall seconds."""
    command = [python, str(Path(__file__).with_name("quark_driver.py")), str(directory / "float.onnx"),
               str(directory / "calibration.npz"), config, str(iterations), "16", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"AMD Quark failed on {config}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["quark_seconds"]


def accuracy(model: onnx.ModelProto, directory: Path) -> float:
    """Held-out accuracy (%) in stock onnxruntime; Quark's value_info (which fixes the calibration
    batch size in attention shapes) is dropped."""
    _, evaluation = load_case_data(directory)
    runnable = attach_custom_ops(model)
    del runnable.graph.value_info[:]
    float_outputs = logits(directory / "float.onnx", evaluation["x"])
    return scores(logits(runnable, evaluation["x"]), float_outputs, evaluation["y"])["metric"]


def run_case(python: str, directory: Path, name: str, iterations: int, quark_finetune: bool = True) -> dict[str, Any]:
    """One config on one model: Quark's model, Quark's fast finetune (unless told not to: it is
    deterministic, so an earlier run's number stands), our tuning of Quark's model."""
    tuned_config, algorithm = CONFIGS[name]
    quark_model, quark_tuned = directory / f"quark.{name}.onnx", directory / f"quark.{tuned_config}.onnx"
    quark(python, directory, name, iterations, quark_model)
    quark_ft_seconds = quark(python, directory, tuned_config, iterations, quark_tuned) if quark_finetune else None
    calibration, _ = load_case_data(directory)
    config = FastFinetune(algorithm=algorithm, iterations=iterations, batch_size=16, seed=0)
    start = time.perf_counter()
    try:
        ours, report = finetune_model(onnx.load(quark_model), calibration, config, directory / "float.onnx")
    except ValueError as error:  # Quark equalised the weights first (its INT configs on Conv pairs)
        if "does not quantize to the codes" not in str(error):
            raise
        ours, report = finetune_model(onnx.load(quark_model), calibration, config)
    return {"config": name, "quark": accuracy(onnx.load(quark_model), directory),
            "quark_fast_finetune": accuracy(onnx.load(quark_tuned), directory) if quark_finetune else None,
            "quark_fast_finetune_seconds": quark_ft_seconds,
            "finetune_on_quark_model": accuracy(ours, directory), "finetune_seconds": time.perf_counter() - start,
            "algorithm": algorithm, "float_reference": report["float_reference"], "kept": report["kept"],
            "units": len(report["units"]), "unit_lrs": sorted({u["lr"] for u in report["units"] if u["lr"] is not None}),
            "best_iterations": [u["best_iteration"] for u in report["units"]], "held_out": report["held_out"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quark", required=True, metavar="PYTHON", help="the Python of an environment with amd-quark")
    parser.add_argument("--iterations", type=int, default=1000, help="iterations per unit, both tools (default 1000)")
    parser.add_argument("--calibration", type=int, default=256, help="calibration samples (default 256)")
    parser.add_argument("--models", default="digits,transformer", help="comma-separated: digits (the CNN), transformer")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--no-quark-finetune", action="store_true", help="skip Quark's own fast finetune (ours only)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            directory = Path(scratch) / model
            prepare(model, directory, args.calibration)
            float_accuracy = accuracy(onnx.load(directory / "float.onnx"), directory)
            for name in args.configs.split(","):
                log(f"{model} {name}")
                rows.append({"model": model, "float": float_accuracy, **run_case(args.quark, directory, name, args.iterations,
                                                                                   not args.no_quark_finetune)})
                log(json.dumps(rows[-1]))
    print(json.dumps({"iterations": args.iterations, "calibration": args.calibration, "batch_size": 16, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
