"""Real models with control flow and recurrent layers, from registry packages (JSON on stdout, progress
on stderr): for each model and preset, whether the quantized model runs in stock onnxruntime, how far
the lifted torch model is from onnxruntime on it, the quantize and lift seconds, and the model's metric
against the float model on held-out data made here.

Models:
- `silero_v5`: silero's voice-activity detector v5 from livekit-plugins-silero, its whole network
  inside a top-level If on the sample rate (nested Ifs, an LSTM, weights as Constants in branches).
- `silero_v6`: silero's v6 from faster-whisper, Convs and an LSTM at the top level.
- `crnn`: ddddocr's text recogniser (`pip install --no-deps ddddocr`; a 76 MB wheel, so not a test
  dependency): a Conv backbone and a bidirectional LSTM, CTC over 8,000+ characters; skipped when absent.
Voice-activity metric: the speech probability over a stream of speech-like audio made here (state
carried from window to window), as its mean and largest distance from the float model's and the share
of windows on the same side of 0.5. CRNN metric: whole-line agreement of the greedy CTC reading with
the float model's on text lines rendered here.

With `--iterations N` each quantized model is also tuned on its calibration feeds (AdaRound for INT
weights, AdaQuant otherwise; N iterations a unit) and the metric of the tuned model is reported under
`tuned` beside the quantized model's (both as measured: a tuning that makes the metric worse shows as
worse), with the tuning seconds, each unit's status and losses (on the training batches and on the
batches held out of training) and the tuner's own held-out check of the whole model (`held_out`): a
stream metric can get worse where that check, which runs each window on the float model's states,
saw the model come closer.

    python scripts/conformance.py                                   # every model, presets MX6 XINT8 BF16 MXFP4
    python scripts/conformance.py --models silero_v5 --presets MX9,A8W8
    python scripts/conformance.py --models silero_v5,silero_v6 --presets MX6,MX4 --iterations 300
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from bench_finetune import ctc_reading, log  # a sibling script: python puts scripts/ on the path
from PIL import Image

from finetune.config import FastFinetune, load_config
from finetune.lift import lift_model
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.zoo import package_file, silero_vad_lstm_onnx_path, silero_vad_onnx_path, speech_like_audio, text_lines, vad_windows

PRESETS = ("MX6", "XINT8", "BF16", "MXFP4")
CALIBRATION_SECONDS, EVALUATION_SECONDS = 4.0, 8.0
CRNN_HEIGHT, CRNN_LINES = 64, (16, 64)  # ddddocr reads 64-pixel-high grey lines; calibration and held-out lines

Feed = dict[str, np.ndarray]


@dataclass
class Case:
    """A model file, its calibration feeds, and its metric of a model (path or proto) against float."""

    path: Path
    calibration: list[Feed]
    metric: Callable[[Any], dict[str, float]]


def silero(path: Path, states: dict[str, tuple[int, ...]], extra: Feed) -> Case:
    """A silero detector: every second window of the calibration audio with the states the float model
    carries to it (as the model runs when streamed) for calibration, the streamed probability as metric."""
    calibration = streamed_feeds(path, vad_windows(speech_like_audio(CALIBRATION_SECONDS, seed=1)), states, extra)[::2]
    windows = vad_windows(speech_like_audio(EVALUATION_SECONDS, seed=2))

    def stream(model: Any) -> np.ndarray:
        session, carried, probabilities = inference_session(model), zero_states(states), []
        for row in windows:
            probability, *after = session.run(None, {"input": row[None], **carried, **extra})
            carried = dict(zip(states, after))
            probabilities.append(float(probability.reshape(-1)[0]))
        return np.array(probabilities)

    reference = stream(path)

    def metric(model: Any) -> dict[str, float]:
        probabilities = stream(model)
        gaps = np.abs(probabilities - reference)
        decisions = float(((probabilities > 0.5) == (reference > 0.5)).mean())
        return {"mean_probability_gap": float(gaps.mean()), "max_probability_gap": float(gaps.max()), "decision_agreement": decisions}

    return Case(path, calibration, metric)


def zero_states(states: dict[str, tuple[int, ...]]) -> Feed:
    """A detector's states at the start of a stream."""
    return {name: np.zeros(shape, np.float32) for name, shape in states.items()}


def streamed_feeds(path: Path, windows: np.ndarray, states: dict[str, tuple[int, ...]], extra: Feed) -> list[Feed]:
    """The feeds of a detector streamed over `windows` by the float model: each window with the states
    carried to it. Tuning on zero states alone (every window as a stream's first) lowered each unit's
    loss yet moved silero v6's streamed probability further from float (MX4: mean gap 0.11 -> 0.24)."""
    session, carried, feeds = inference_session(path), zero_states(states), []
    for row in windows:
        feeds.append({"input": row[None], **carried, **extra})
        _, *after = session.run(None, feeds[-1])
        carried = dict(zip(states, after))
    return feeds


def crnn() -> Case:
    """ddddocr's recogniser on grey text lines 64 pixels high: CTC reading agreement as metric."""
    path = package_file("ddddocr", "common.onnx")
    calibration = [{"input1": line[None]} for line in _grey_lines(CRNN_LINES[0], seed=1)]
    held_out = _grey_lines(CRNN_LINES[1], seed=2)

    def readings(model: Any) -> list[tuple[int, ...]]:
        session = inference_session(model)
        return [ctc_reading(np.moveaxis(session.run(None, {"input1": line[None]})[0], 0, 1))[0] for line in held_out]

    reference = readings(path)
    return Case(path, calibration, lambda model: {"line_agreement": float(np.mean([a == b for a, b in zip(readings(model), reference)]))})


def _grey_lines(count: int, seed: int) -> np.ndarray:
    """Rendered text lines (finetune.zoo.text_lines) as ddddocr's input: grey, 64 pixels high, in [-1, 1]."""
    lines = text_lines(count, seed)
    width = round(lines.shape[-1] * CRNN_HEIGHT / lines.shape[-2])
    resized = [np.asarray(Image.fromarray(line.mean(0)).resize((width, CRNN_HEIGHT), Image.BILINEAR)) for line in lines]
    return np.stack(resized)[:, None].astype(np.float32)


MODELS: dict[str, Callable[[], Case]] = {
    "silero_v5": lambda: silero(silero_vad_onnx_path(), {"state": (2, 1, 128)}, {"sr": np.array(16000)}),
    "silero_v6": lambda: silero(silero_vad_lstm_onnx_path(), {"h": (1, 1, 128), "c": (1, 1, 128)}, {}),
    "crnn": crnn,
}


def lifted_gap(model: onnx.ModelProto, feeds: list[Feed]) -> tuple[float, float]:
    """Seconds to lift, and the largest absolute difference of the lifted model's outputs from onnxruntime's."""
    start = time.perf_counter()
    module = lift_model(model)
    seconds = time.perf_counter() - start
    session, names = inference_session(model), [value.name for value in model.graph.input]
    gap = 0.0
    with torch.no_grad():
        for feed in feeds:
            expected = session.run(None, feed)
            got = module(*(torch.from_numpy(feed[name]) for name in names))
            got = got if isinstance(got, (tuple, list)) else (got,)
            gap = max(gap, *(float(np.abs(g.numpy() - e).max()) for g, e in zip(got, expected)))
    return seconds, gap


def run(name: str, case: Case, preset: str, iterations: int) -> dict[str, Any]:
    """One (model, preset) row; with `iterations`, the tuned model's under `tuned`."""
    start = time.perf_counter()
    result = quantize_model(case.path, preset, case.calibration)
    quantize_seconds = time.perf_counter() - start
    lift_seconds, gap = lifted_gap(result.model, case.calibration[:4])
    row = {"model": name, "preset": preset, "quantize_seconds": quantize_seconds, "quantized_nodes": result.summary["quantized_nodes"],
           "warnings": len(result.summary["warnings"]), "lift_seconds": lift_seconds, "lifted_vs_onnxruntime_max_abs": gap,
           **case.metric(result.model)}
    return {**row, "tuned": tuned(case, preset, result.model, iterations)} if iterations else row


def tuned(case: Case, preset: str, model: onnx.ModelProto, iterations: int) -> dict[str, Any]:
    """The metric of the quantized model tuned on the calibration feeds (AdaRound for INT weights,
    AdaQuant otherwise), the tuning seconds, each unit's status and losses, and the run's warnings."""
    weight = load_config(preset).weight
    algorithm = "adaround" if weight is not None and weight.format == "int" else "adaquant"
    start = time.perf_counter()
    model, report = finetune_model(model, case.calibration, FastFinetune(algorithm=algorithm, iterations=iterations))
    keys = ("name", "status", "loss_before", "loss_after", "held_out_before", "held_out_after", "iterations")
    units = [{key: unit[key] for key in keys} for unit in report["units"]]
    return {"algorithm": algorithm, "iterations": iterations, "tune_seconds": time.perf_counter() - start, "units": units,
            "held_out": report["held_out"], "warnings": [w["reason"] for w in report["warnings"]], **case.metric(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--iterations", type=int, default=0, help="also tune each quantized model, N iterations a unit (0: no tuning)")
    args = parser.parse_args()
    rows, skipped = [], {}
    for name in args.models.split(","):
        if name == "crnn" and importlib.util.find_spec("ddddocr") is None:
            skipped[name] = "ddddocr is not installed (pip install --no-deps ddddocr)"
            continue
        case = MODELS[name]()
        rows.append({"model": name, "preset": "float", **case.metric(case.path)})
        for preset in args.presets.split(","):
            log(f"{name} {preset}")
            rows.append(run(name, case, preset, args.iterations))
            log(json.dumps(rows[-1]))
    print(json.dumps({"rows": rows, "skipped": skipped, "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
