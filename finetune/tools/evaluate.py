"""Compare the results of a baseline (float) and a quantized model, file by file: cosine
similarity, L2 distance and relative L2, PSNR, and SSIM for images, per file and overall.

Files pair by name across the two folders (.npy, .png, .jpg, .jpeg). Images are read with
scikit-image; their PSNR/SSIM peak is their type's range (255 for 8-bit). For .npy arrays the
peak is the baseline's peak-to-peak range, and SSIM is computed when the array is image-shaped:
after dropping leading size-1 axes, three axes with 1, 3 or 4 channels first (CHW, as models lay
out images) or last (HWC) and both spatial sides at least 7 (SSIM's window). Other arrays
(logits, token features, 2-D matrices) get no SSIM.

With `--tokens FOLDER` (a token folder: .npy of input_ids or .npz with input_ids and optionally
attention_mask, named as the result files), the results are a decoder's logits and the report adds
each model's perplexity and their next-token agreement over all files (finetune.calibrate.tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from finetune.calibrate.tokens import IGNORED, negative_log_likelihoods, next_token_agreement, next_token_targets
from finetune.files import check_output, write_text_atomic

from .command import run_command, tool_parser

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SUFFIXES = (".npy", *IMAGE_SUFFIXES)
CHANNELS = (1, 3, 4)
SSIM_WINDOW = 7  # scikit-image's default window side


@dataclasses.dataclass(frozen=True)
class FileMetrics:
    """The comparison of one pair of files; `ssim` is None where the data are not an image."""

    name: str
    shape: tuple[int, ...]
    cosine: float
    l2: float
    relative_l2: float
    psnr: float
    ssim: float | None


def evaluate_folders(baseline: str | Path, quantized: str | Path, tokens: str | Path | None = None) -> dict:
    """Metrics of every file pair and over all of them: {'files': [...], 'overall': {...}}, and with
    `tokens` {'language_model': {...}} (language_model_metrics)."""
    pairs = pair_files(Path(baseline), Path(quantized))
    loaded = [(name, _load(a), _load(b)) for name, a, b in pairs]
    mismatched = [f"{name}: {list(a.shape)} vs {list(b.shape)}" for name, a, b in loaded if a.shape != b.shape]
    if mismatched:
        raise ValueError("files differ in shape between the folders:\n  " + "\n  ".join(mismatched))
    files = [compare(name, a, b) for name, a, b in loaded]
    report = {"files": [dataclasses.asdict(f) for f in files], "overall": overall(files)}
    if tokens is not None:
        report["language_model"] = language_model_metrics(loaded, Path(tokens))
    return report


def language_model_metrics(loaded: list[tuple[str, np.ndarray, np.ndarray]], tokens: Path) -> dict[str, float | int]:
    """Perplexity of the baseline and the quantized logits and their next-token agreement, over the
    predicted positions of all files (each result file's tokens: the token file of its stem)."""
    nll: dict[str, list[np.ndarray]] = {"baseline": [], "quantized": []}
    agreements, positions = 0.0, 0
    for name, baseline, quantized in loaded:
        targets = next_token_targets([_token_feed(tokens, Path(name).stem)])
        if baseline.ndim != 3 or baseline.shape[:2] != targets.shape:
            raise ValueError(f"{name}: {list(baseline.shape)} are not logits [batch, seq, vocabulary] for the tokens "
                             f"{list(targets.shape)} in {tokens}: give the logits output's results")
        count = int((targets != IGNORED).sum())
        nll["baseline"].append(negative_log_likelihoods(baseline, targets))
        nll["quantized"].append(negative_log_likelihoods(quantized, targets))
        agreements += next_token_agreement(quantized, baseline, targets) * count
        positions += count
    if not positions:
        raise ValueError(f"no position of the tokens in {tokens} predicts a next token (one-token or masked sequences)")
    result: dict[str, float | int] = {"positions": positions, "next_token_agreement": agreements / positions}
    for side, values in nll.items():
        result[f"{side}_perplexity"] = float(np.exp(np.concatenate(values).mean()))
    return result


def _token_feed(tokens: Path, stem: str) -> dict[str, np.ndarray]:
    """The token file `stem`.npz (input_ids, attention_mask) or `stem`.npy (input_ids) of a token folder."""
    for suffix in (".npz", ".npy"):
        path = tokens / f"{stem}{suffix}"
        if path.is_file():
            loaded = np.load(path, allow_pickle=False)
            return dict(loaded) if suffix == ".npz" else {"input_ids": loaded}
    raise FileNotFoundError(f"no token file {stem}.npz or {stem}.npy in {tokens}: name token files as the result files")


def pair_files(baseline: Path, quantized: Path) -> list[tuple[str, Path, Path]]:
    """(name, baseline file, quantized file) for each result file name present in both folders."""
    found = [_results(folder) for folder in (baseline, quantized)]
    only = [sorted(set(found[k]) - set(found[1 - k])) for k in (0, 1)]
    if only[0] or only[1]:
        raise ValueError(f"unpaired result files: only in {baseline}: {only[0]}; only in {quantized}: {only[1]}")
    if not found[0]:
        raise ValueError(f"no {'/'.join(SUFFIXES)} files in {baseline} and {quantized}")
    return [(name, found[0][name], found[1][name]) for name in sorted(found[0])]


def _results(folder: Path) -> dict[str, Path]:
    """The result files of a folder by name."""
    if not folder.is_dir():
        raise FileNotFoundError(f"results folder {folder} does not exist or is not a folder")
    return {p.name: p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES}


def _load(path: Path) -> np.ndarray:
    """An .npy array or an image (scikit-image's reader, imported here: every command imports this module)."""
    from skimage.io import imread

    try:
        return np.load(path, allow_pickle=False) if path.suffix.lower() == ".npy" else imread(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read: {error}") from error


def compare(name: str, baseline: np.ndarray, quantized: np.ndarray) -> FileMetrics:
    """Cosine similarity, L2, relative L2 (to the baseline), PSNR and, for images, SSIM."""
    from skimage.metrics import peak_signal_noise_ratio  # scikit-image takes ~0.5 s to import: only when comparing

    a, b = baseline.astype(np.float64).ravel(), quantized.astype(np.float64).ravel()
    l2 = float(np.linalg.norm(a - b))
    norm = float(np.linalg.norm(a))
    peak = _peak(name, baseline)
    with np.errstate(divide="ignore"):
        psnr = float(peak_signal_noise_ratio(a, b, data_range=peak))
    return FileMetrics(
        name, tuple(baseline.shape), cosine_similarity(a, b), l2, l2 / norm if norm else (0.0 if l2 == 0 else math.inf),
        psnr, _ssim(name, baseline, quantized, peak),
    )


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """a·b / (|a||b|); 1 for two zero arrays, 0 when only one is zero."""
    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    if norms == 0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b) / norms)


def _peak(name: str, baseline: np.ndarray) -> float:
    """The PSNR/SSIM peak: an image type's range, else the baseline's peak-to-peak range (1 if flat)."""
    if name.lower().endswith(IMAGE_SUFFIXES) and baseline.dtype.kind in "ui":
        return float(np.iinfo(baseline.dtype).max)
    spread = float(np.ptp(baseline.astype(np.float64))) if baseline.size else 0.0
    return spread if spread > 0 else 1.0


def _ssim(name: str, baseline: np.ndarray, quantized: np.ndarray, peak: float) -> float | None:
    """SSIM (scikit-image, 7x7 uniform window) of an image or image-shaped array, else None."""
    from skimage.metrics import structural_similarity

    layout = _image_layout(name, baseline.shape)
    if layout is None:
        return None
    a, b = (_channels_last(x, layout).astype(np.float64) for x in (baseline, quantized))
    channel_axis = -1 if a.ndim == 3 else None
    return float(structural_similarity(a, b, data_range=peak, channel_axis=channel_axis))


def _image_layout(name: str, shape: tuple[int, ...]) -> str | None:
    """'HW', 'HWC' or 'CHW' for data SSIM applies to, else None."""
    if name.lower().endswith(IMAGE_SUFFIXES):
        layout = {2: "HW", 3: "HWC"}.get(len(shape))
        spatial = shape[:2]
    else:
        while len(shape) > 3 and shape[0] == 1:
            shape = shape[1:]
        if len(shape) != 3:
            return None
        layout = "CHW" if shape[0] in CHANNELS and min(shape[1:]) >= SSIM_WINDOW else "HWC" if shape[2] in CHANNELS else None
        spatial = shape[1:] if layout == "CHW" else shape[:2]
    return layout if layout and min(spatial) >= SSIM_WINDOW else None


def _channels_last(array: np.ndarray, layout: str) -> np.ndarray:
    """The image as HW or HWC."""
    if layout == "HW":
        return array
    image = array.reshape(array.shape[-3:])
    return np.moveaxis(image, 0, -1) if layout == "CHW" else image


def overall(files: Sequence[FileMetrics]) -> dict[str, float | int | None]:
    """Mean and worst value of each metric over the files (SSIM over the images only)."""
    def stats(values: list[float], worst: str) -> tuple[float | None, float | None]:
        if not values:
            return None, None
        return float(np.mean(values)), float(min(values) if worst == "min" else max(values))

    result: dict[str, float | int | None] = {"files": len(files)}
    for metric, worst in (("cosine", "min"), ("l2", "max"), ("relative_l2", "max"), ("psnr", "min"), ("ssim", "min")):
        values = [getattr(f, metric) for f in files if getattr(f, metric) is not None]
        result[f"mean_{metric}"], result[f"{worst}_{metric}"] = stats(values, worst)
    result["images"] = sum(f.ssim is not None for f in files)
    return result


def format_table(report: dict) -> str:
    """The report as a text table: one row per file, then the overall means and worst values."""
    columns = ("cosine", "l2", "relative_l2", "psnr", "ssim")
    width = max([len("file"), *(len(f["name"]) for f in report["files"])])
    lines = [f"{'file':<{width}}  " + "  ".join(f"{c:>12}" for c in columns)]
    for f in report["files"]:
        lines.append(f"{f['name']:<{width}}  " + "  ".join(_cell(f[c]) for c in columns))
    o = report["overall"]
    lines.append(f"{'mean':<{width}}  " + "  ".join(_cell(o[f"mean_{c}"]) for c in columns))
    worst = ("min_cosine", "max_l2", "max_relative_l2", "min_psnr", "min_ssim")
    lines.append(f"{'worst':<{width}}  " + "  ".join(_cell(o[w]) for w in worst))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{'-':>12}" if value is None else f"{value:>12.6g}"


def to_json(report: dict) -> str:
    """The report as strict JSON: non-finite numbers (PSNR of identical data) as strings 'inf'/'nan'."""
    def clean(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(report), indent=1, allow_nan=False)


def run(args: argparse.Namespace) -> None:
    """Print the table, or the JSON with `--json` (to a file with `--json PATH`)."""
    if args.json not in (None, "-"):
        check_output(args.json, args.baseline_results_folder, args.quantized_results_folder)
    report = evaluate_folders(args.baseline_results_folder, args.quantized_results_folder, args.tokens)
    if args.json == "-":
        print(to_json(report))
        return
    if args.json:
        write_text_atomic(args.json, to_json(report) + "\n")
    print(format_table(report))
    if "language_model" in report:
        print(" ".join(f"{key} {value:.6g}" for key, value in report["language_model"].items()))


def add_arguments(parser: argparse.ArgumentParser, positional: bool) -> None:
    """The evaluate options: folders as positional arguments (`finetune evaluate A B`) or as the
    --baseline_results_folder / --quantized_results_folder options users know."""
    help_a, help_b = "folder of the baseline (float) model's results", "folder of the quantized model's results"
    if positional:
        parser.add_argument("baseline_results_folder", type=Path, help=help_a)
        parser.add_argument("quantized_results_folder", type=Path, help=help_b)
    else:
        parser.add_argument("--baseline_results_folder", type=Path, required=True, help=help_a)
        parser.add_argument("--quantized_results_folder", type=Path, required=True, help=help_b)
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="print the report as JSON instead of the table, or write it to PATH as well")
    parser.add_argument("--tokens", type=Path, metavar="FOLDER",
                        help="the token folder the results are logits of: adds perplexity and next-token agreement")
    parser.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m finetune.tools.evaluate", __doc__)
    add_arguments(parser, positional=False)
    return run_command(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
