"""Inference dumps: run a model in onnxruntime over a data folder (read as the quantizer reads
calibration data) and save one output per sample as an index-named .npy file, so the results of
a float and a quantized model can be compared with the evaluate tool."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from finetune.calibrate import CalibrationData, sample_count
from finetune.files import write_atomic
from finetune.onnx.io import load_model
from finetune.onnx.session import OPTIMIZATION

from .command import run_command, tool_parser
from .session import DEFAULT_PROVIDERS, make_session

logger = logging.getLogger(__name__)



def run_inference(
    model: str | os.PathLike | onnx.ModelProto, data: str | os.PathLike, out: str | os.PathLike,
    providers: Sequence[str] = DEFAULT_PROVIDERS, output: str | None = None, optimization: str = "basic",
) -> list[Path]:
    """Run `model` on every sample of the .npy/.npz folder `data` and write output `output` (the
    first by default) of sample k to `out`/k.npy (six digits); returns the files written."""
    model = load_model(model)
    session = make_session(model, providers, optimization)
    names = [o.name for o in session.get_outputs()]
    if output is not None and output not in names:
        raise ValueError(f"the model has no output {output!r}; its outputs are {names}")
    output = output or names[0]
    folder = Path(out)
    if folder.resolve() == Path(data).resolve():
        raise ValueError(f"--out {folder} is the data folder; outputs go to a folder of their own")
    written: list[Path] = []  # the folder appears with the first output: bad data leaves no empty folder behind
    for feed in CalibrationData(Path(data), model):
        (result,) = session.run([output], feed)
        for sample in _samples(result, sample_count(feed), output):
            written.append(_save(folder / f"{len(written):06d}.npy", sample))
    logger.info("wrote %d output(s) %r to %s", len(written), output, folder)
    stale = sorted(set(folder.glob("*.npy")) - set(written))
    if stale:
        logger.warning("%s also holds %d .npy file(s) this run did not write, e.g. %s", folder, len(stale), stale[0].name)
    return written


def _samples(result: np.ndarray, batch: int, output: str) -> list[np.ndarray]:
    """One array per sample: rows of the output's leading (batch) dimension; a lone sample whole."""
    if result.ndim and result.shape[0] == batch:
        return list(result)
    if batch == 1:
        return [result]
    raise ValueError(f"output {output!r} has shape {list(result.shape)}, not one row per sample of a batch of {batch}")


def _save(path: Path, array: np.ndarray) -> Path:
    """Write an .npy file atomically."""

    def write(tmp: Path) -> None:
        with tmp.open("wb") as handle:  # a handle: np.save would add ".npy" to the temporary's name
            np.save(handle, array, allow_pickle=False)

    write_atomic(path, write)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The infer options, shared by `finetune infer` and `python -m finetune.tools.infer`."""
    parser.add_argument("model", type=Path, help="ONNX model (custom-op bodies are attached automatically)")
    parser.add_argument("--data", type=Path, required=True,
                        help="folder of .npy (one input) or .npz (keys = input names) files, one sample or batch each")
    parser.add_argument("--out", type=Path, required=True, help="folder for the outputs, one 000000.npy per sample")
    parser.add_argument("--providers", nargs="+", default=list(DEFAULT_PROVIDERS),
                        help="onnxruntime execution providers in order of preference (default: CPUExecutionProvider)")
    parser.add_argument("--output", help="name of the model output to save (default: the first)")
    parser.add_argument("--optimization", choices=tuple(OPTIMIZATION), default="basic",
                        help="onnxruntime graph optimisation level (default basic: higher levels fuse a QDQ model's "
                             "DequantizeLinear -> MatMul into kernels that change its results)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    """Run the tool on parsed arguments."""
    run_inference(args.model, args.data, args.out, args.providers, args.output, args.optimization)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m finetune.tools.infer", __doc__)
    add_arguments(parser)
    return run_command(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
