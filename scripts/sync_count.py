"""Host synchronisations per fine-tuning step (JSON on stdout): the digits CNN and transformer are
quantized (MX4 with AdaQuant over blocks, XINT8 with AdaRound over layers) and tuned for a few
dozen steps while every synchronisation inside a step (batch drawing, forward, backward, optimizer)
is counted with the Python line that caused it.

On a CUDA device torch's own sync debug mode reports them (`torch.cuda.set_sync_debug_mode`); on
the CPU, which has nothing to wait for, the count is of the calls that would synchronise with a GPU
(reading a tensor's value into Python: item, bool, int, float, tolist, numpy), the same proxy.
The step callbacks' reading of the losses, once per READ_EVERY steps on an accelerator, counts.

    python scripts/sync_count.py                    # cpu
    python scripts/sync_count.py --device cuda:0
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from finetune.config import FastFinetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.optimisation import Optimisation
from finetune.recon.tuner import Tuner
from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

CASES = (("digits", "MX4", "adaquant", "block"), ("digits", "XINT8", "adaround", "layer"), ("transformer", "MX4", "adaquant", "block"))
READING = ("item", "__bool__", "__int__", "__float__", "tolist", "numpy")  # what makes a GPU tensor's value cross to the host


class Counter:
    """Synchronisations seen while a step runs, by the line of finetune's code that caused them."""

    def __init__(self) -> None:
        self.inside = False
        self.steps = 0
        self.sites: collections.Counter[str] = collections.Counter()

    def saw(self) -> None:
        """Count one, at the innermost frame of finetune's code on the stack."""
        if not self.inside:
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "/finetune/" in f.filename and "sync_count" not in f.filename]
        self.sites[f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"] += 1


@contextlib.contextmanager
def counting(counter: Counter, device: torch.device) -> Iterator[None]:
    """Count inside every step (Optimisation._step, with its batch drawn, and the reading of its losses: Tuner.hear_steps)."""
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrapper: Any) -> None:
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    step, hear = Optimisation._step, Tuner.hear_steps

    def counted_step(self: Optimisation, model: Any, optimizer: Any, batch: Any, *args: Any) -> Any:
        counter.steps += 1
        counter.inside = True
        try:
            return step(self, model, optimizer, batch, *args)
        finally:
            counter.inside = False

    def counted_hear(self: Tuner, *args: Any) -> None:
        counter.inside = True
        try:
            hear(self, *args)
        finally:
            counter.inside = False

    patch(Optimisation, "_step", counted_step)
    patch(Tuner, "hear_steps", counted_hear)
    if device.type == "cpu":
        for name in READING:
            original = getattr(torch.Tensor, name)
            patch(torch.Tensor, name, lambda *a, _original=original, **k: (counter.saw(), _original(*a, **k))[1])
        yield
    else:
        shown = warnings.showwarning
        warnings.showwarning = lambda message, *rest: counter.saw() if "synchroniz" in str(message) else shown(message, *rest)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    for owner, name, original in reversed(patched):
        setattr(owner, name, original)


def run(model_name: str, preset: str, algorithm: str, unit: str, device: str, iterations: int, folder: Path) -> dict[str, Any]:
    """One case's steps and synchronisations."""
    network = train_digits_cnn() if model_name == "digits" else train_digits_transformer()
    x_train, _, x_test, _ = digits_split()
    path = export_onnx(network, x_test[:2], folder / f"{model_name}.onnx", 17)
    feeds = [{"x": b.numpy()} for b in x_train[:256].split(32)]
    quantized = quantize_model(path, preset, feeds).model
    config = FastFinetune(algorithm=algorithm, unit=unit, iterations=iterations, device=device, seed=0)
    counter = Counter()
    with counting(counter, torch.device(device)):
        finetune_model(quantized, feeds, config)
    total = sum(counter.sites.values())
    return {"model": model_name, "preset": preset, "algorithm": algorithm, "unit": unit, "device": device,
            "steps": counter.steps, "syncs": total, "syncs_per_step": total / max(1, counter.steps),
            "sites": dict(counter.sites.most_common(12))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        cases = [run(*case, args.device, args.iterations, Path(scratch)) for case in CASES]
    print(json.dumps({"torch": torch.__version__, "cases": cases}, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
