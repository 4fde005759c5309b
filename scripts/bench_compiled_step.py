"""Whether a compiled training step pays on the CPU (JSON on stdout): the digits CNN and transformer,
quantized with a preset and lifted, take AdaQuant-like steps (forward, MSE loss, backward, Adam) on a
batch of 16, eager and through `torch.compile` (inductor) of the whole lifted model, the quantizers
inside the compiled graph. A whole model is the most a unit step could fuse, so its ratio bounds what
compiling unit steps would gain. Reported per case: median step milliseconds both ways, their ratio,
the first compile's seconds and the steps that compile would take to pay back, and whether the
compiled steps leave the weights bit-identical to the eager ones (the tuner promises the same bytes
compiled or not).

    python scripts/bench_compiled_step.py --presets MX4,XINT8 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_formats import median_time  # a sibling script: python puts scripts/ on the path

from finetune.lift import lift_model
from finetune.quantize import quantize_model
from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

BATCH = 16


def stepper(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[Callable[[], None], torch.nn.Module]:
    """One training step of `model` (its own Adam at lr 1e-4) and the module whose weights it moves."""
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(parameters, lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()
    return step, model


def median_ms(step: Callable[[], None], steps: int) -> float:
    """Median wall milliseconds of `steps` steps after 10 warm-up steps (bench_formats.median_time
    takes the last of them)."""
    for _ in range(9):
        step()
    return median_time(step, steps) * 1e3


def case(model_name: str, preset: str, directory: Path, steps: int) -> dict[str, Any]:
    """Eager against compiled steps of one quantized model."""
    network = train_digits_cnn() if model_name == "digits" else train_digits_transformer()
    x_train, _, x_test, _ = digits_split()
    export_onnx(network, x_test[:2], directory / f"{model_name}.onnx", 17)
    calibration = [{"x": b.numpy()} for b in x_train[:256].split(32)]
    lifted = lift_model(quantize_model(directory / f"{model_name}.onnx", preset, calibration).model)
    x, target = x_train[:BATCH].clone(), torch.randn(BATCH, 10, generator=torch.Generator().manual_seed(0))
    eager_step, eager = stepper(copy.deepcopy(lifted), x, target)
    compiled_module = copy.deepcopy(lifted)
    compiled_step, _ = stepper(torch.compile(compiled_module), x, target)
    check_steps = 5
    for _ in range(check_steps):
        eager_step()
    begin = time.perf_counter()
    compiled_step()
    compile_seconds = time.perf_counter() - begin
    for _ in range(check_steps - 1):
        compiled_step()
    identical = all(torch.equal(a, b) for a, b in zip(eager.parameters(), compiled_module.parameters()))
    eager_ms, compiled_ms = median_ms(eager_step, steps), median_ms(compiled_step, steps)
    saved = eager_ms - compiled_ms
    return {"model": model_name, "preset": preset, "eager_ms_per_step": eager_ms, "compiled_ms_per_step": compiled_ms,
            "eager_over_compiled": eager_ms / compiled_ms, "first_compile_seconds": compile_seconds,
            "steps_to_pay_back_compile": compile_seconds * 1e3 / saved if saved > 0 else None,
            f"weights_bit_identical_after_{check_steps}_steps": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="digits,transformer", help="comma-separated: digits (the CNN), transformer")
    parser.add_argument("--presets", default="MX4,XINT8", help="comma-separated quantize presets (default MX4,XINT8)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per side (default 300)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        rows = [case(model, preset, Path(scratch), args.steps)
                for model in args.models.split(",") for preset in args.presets.split(",")]
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "batch": BATCH, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
