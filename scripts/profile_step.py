"""Where one fine-tuning step's time goes on the CPU (JSON on stdout): the digits CNN and
transformer are quantized (MX4 and MXFP4 with AdaQuant over blocks, XINT8 with AdaRound over
layers) and tuned; the steps of every unit are timed bare, then profiled by torch's profiler
(operators by their own time) and by cProfile (Python functions by their own time, which is where
the per-operator overhead of small steps shows). The quantization overhead is a tuning step's time
over the same step with every quantizer switched off (float forward, loss, backward, optimiser
step): measured in a run of its own whose steps alternate the two, so both see the same machine.

    python scripts/profile_step.py                                   # every case, 200 steps per unit
    python scripts/profile_step.py --cases digits:MX4 --iterations 500 --threads 2
    python scripts/profile_step.py --bare          # step times only: alternate two checkouts to compare them
    python scripts/profile_step.py --overhead --compile false        # step times and the overhead, eager kernels
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.config import FastFinetune
from finetune.lift.fake_quant import quantizers_disabled
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.data.batches import Batches
from finetune.recon.optimisation import Optimisation
from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

CASES = {"digits:MX4": ("digits", "MX4", "adaquant", "block"), "digits:MXFP4": ("digits", "MXFP4", "adaquant", "block"),
         "digits:XINT8": ("digits", "XINT8", "adaround", "layer"), "transformer:MX4": ("transformer", "MX4", "adaquant", "block")}
SHOWN = 15  # rows of each table


@contextlib.contextmanager
def timed_steps(seconds: list[float], around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
                ) -> Iterator[None]:
    """Time every step: the drawing of its batch (Batches.next) and Optimisation._step, each inside a
    fresh `around()`; one entry per step in `seconds`."""
    step, draw = Optimisation._step, Batches.next
    drawing: list[float] = []

    def timed(function: Any, into: list[float]) -> Any:
        def wrapped(*args: Any) -> Any:
            begin = time.perf_counter()
            with around():
                result = function(*args)
            into.append(time.perf_counter() - begin)
            return result
        return wrapped

    stepping: list[float] = []
    Optimisation._step, Batches.next = timed(step, stepping), timed(draw, drawing)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimisation._step, Batches.next = step, draw  # type: ignore[method-assign]
        seconds.extend(a + b for a, b in zip(drawing, stepping))


@contextlib.contextmanager
def alternating_steps(quantized: list[float], plain: list[float]) -> Iterator[None]:
    """Time every step (Optimisation._step), every other one a float step (see float_step): the quantized
    steps' seconds go to `quantized`, the others' to `plain`."""
    step = Optimisation._step

    def alternating(optimisation: Optimisation, model: torch.nn.Module, *args: Any) -> Any:
        off = len(quantized) > len(plain)
        begin = time.perf_counter()
        with float_step(model) if off else contextlib.nullcontext():
            result = step(optimisation, model, *args)
        (plain if off else quantized).append(time.perf_counter() - begin)
        return result

    Optimisation._step = alternating  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimisation._step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def float_step(model: torch.nn.Module) -> Iterator[None]:
    """The model's quantizers off and its frozen float weights given gradients (AdaRound trains only
    its rounding variables, which a float step lacks: without this its loss reaches no parameter),
    as they were after, their gradients dropped."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        with quantizers_disabled(model, keep_ranges=False):
            yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)
            parameter.grad = None


def quantization_overhead(run_tuning: Callable[[], object]) -> dict[str, Any]:
    """A tuning step's median time over the median of the same steps with every quantizer off, from
    one call of `run_tuning` whose steps alternate the two."""
    quantized: list[float] = []
    plain: list[float] = []
    with alternating_steps(quantized, plain):
        run_tuning()
    median_quantized, median_plain = float(np.median(quantized)), float(np.median(plain))
    return {"steps": len(quantized) + len(plain), "ms_per_step_quantized": round(1e3 * median_quantized, 3),
            "ms_per_step_quantizers_off": round(1e3 * median_plain, 3), "overhead": round(median_quantized / median_plain, 3)}


def prepare(model_name: str, preset: str, folder: Path) -> tuple[Any, list[dict[str, Any]]]:
    """The quantized model and its calibration feeds (256 digits samples, batches of 32)."""
    network = train_digits_cnn() if model_name == "digits" else train_digits_transformer()
    x_train, _, x_test, _ = digits_split()
    path = export_onnx(network, x_test[:2], folder / f"{model_name}.onnx", 17)
    feeds = [{"x": b.numpy()} for b in x_train[:256].split(32)]
    return quantize_model(path, preset, feeds).model, feeds


def operators(profile: torch.profiler.profile, steps: int) -> list[dict[str, Any]]:
    """The operators taking most of their own CPU time, in microseconds per step."""
    rows = sorted(profile.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:SHOWN]
    return [{"op": e.key, "us_per_step": round(e.self_cpu_time_total / steps, 1), "calls_per_step": round(e.count / steps, 1)}
            for e in rows]


def functions(profile: cProfile.Profile, steps: int) -> list[dict[str, Any]]:
    """The Python functions taking most of their own time (operators they call included, as cProfile
    cannot see into them), in microseconds per step."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:SHOWN]
    return [{"function": f"{Path(file).name}:{line} {name}", "us_per_step": round(1e6 * own / steps, 1),
             "calls_per_step": round(calls / steps, 1)} for (file, line, name), (_, calls, own, _, _) in rows]


def run(case: str, iterations: int, folder: Path, profiles: bool = True, compile_kernels: str | bool = "auto",
        overhead: bool = False, threads: int | str = "auto") -> dict[str, Any]:
    """One case: bare step times, then (with `overhead`) the quantization overhead and (with
    `profiles`) the two profiles, each over a run of its own."""
    model_name, preset, algorithm, unit = CASES[case]
    quantized, feeds = prepare(model_name, preset, folder)
    config = FastFinetune(algorithm=algorithm, unit=unit, iterations=iterations, seed=0, early_stop={"enabled": False},
                          compile=compile_kernels, threads=threads)
    bare: list[float] = []
    with timed_steps(bare):
        _, report = finetune_model(quantized, feeds, config)
    steps = len(bare)
    timing = {"case": case, "algorithm": algorithm, "unit": unit, "compile": compile_kernels, "steps": steps,
              "threads": threads, "thread_counts": report["threads"]["counts"],
              "ms_per_step": round(1e3 * sum(bare) / steps, 3), "ms_per_step_median": round(1e3 * sorted(bare)[steps // 2], 3)}
    if overhead:
        timing["quantization_overhead"] = quantization_overhead(lambda: finetune_model(quantized, feeds, config))
    if not profiles:
        return timing
    traced: list[float] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, timed_steps(traced):
        finetune_model(quantized, feeds, config)
    python = cProfile.Profile()
    python_steps: list[float] = []
    with timed_steps(python_steps, around=lambda: _enabled(python)):
        finetune_model(quantized, feeds, config)
    return {**timing, "operators": operators(profile, len(traced)), "python": functions(python, len(python_steps))}


@contextlib.contextmanager
def _enabled(profile: cProfile.Profile) -> Iterator[None]:
    """cProfile on for the duration of one step."""
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--iterations", type=int, default=200, help="steps per unit (default 200)")
    parser.add_argument("--threads", type=lambda text: text if text == "auto" else int(text), default="auto",
                        help="fast_finetune.threads: torch intra-op threads while tuning (default auto)")
    parser.add_argument("--bare", action="store_true", help="step times only, no profiles (for side-by-side timing)")
    parser.add_argument("--overhead", action="store_true",
                        help="also the quantization overhead: steps over the same steps with the quantizers off")
    parser.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                        help="fast_finetune.compile (default auto: compiled kernels where a compiler is at hand)")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases.split(","):
            print(f"case {case}", file=sys.stderr)
            setting = {"auto": "auto", "true": True, "false": False}[args.compile]
            results.append(run(case, args.iterations, Path(folder), profiles=not args.bare, compile_kernels=setting,
                               overhead=args.overhead, threads=args.threads))
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
