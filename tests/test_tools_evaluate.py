"""The evaluate tool against values computed independently: hand-computed cosine and L2 on tiny
arrays, the PSNR of a known MSE, SSIM of identical images and of a perturbed 7x7 image by the
formula itself; pairing and shape errors; table and JSON output."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from skimage.io import imsave
from skimage.metrics import structural_similarity

from finetune import cli
from finetune.tools.evaluate import compare, evaluate_folders, main


def folders(tmp_path: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[Path, Path]:
    """Baseline and quantized folders holding the given pairs (.npy, or images by suffix)."""
    a, b = tmp_path / "baseline", tmp_path / "quantized"
    for folder in (a, b):
        folder.mkdir(exist_ok=True)
    for name, (x, y) in pairs.items():
        for folder, value in ((a, x), (b, y)):
            if name.endswith(".npy"):
                np.save(folder / name, value)
            else:
                imsave(folder / name, value, check_contrast=False)
    return a, b


def test_hand_computed_cosine_l2_and_psnr_of_arrays(tmp_path: Path) -> None:
    """[3, 4] vs [4, 3]: cosine 24/25, L2 sqrt(2), relative L2 sqrt(2)/5, peak-to-peak 1 and MSE 1
    so PSNR 0 dB. [1, 0, 0, 0] vs [1, 0, 0, 0.5]: cosine 1/sqrt(1.25), L2 0.5, relative 0.5, MSE
    1/16 so PSNR 10 log10(16) dB."""
    a, b = folders(tmp_path, {"p.npy": (np.array([3.0, 4.0]), np.array([4.0, 3.0])),
                              "q.npy": (np.array([1.0, 0, 0, 0], np.float32), np.array([1.0, 0, 0, 0.5], np.float32))})
    report = evaluate_folders(a, b)
    p, q = report["files"]
    assert [(p.pop("name"), p.pop("shape")), (q.pop("name"), q.pop("shape"))] == [("p.npy", (2,)), ("q.npy", (4,))]
    expected_p = {"cosine": 0.96, "l2": math.sqrt(2), "relative_l2": math.sqrt(2) / 5, "psnr": 0.0, "ssim": None}
    expected_q = {"cosine": 1 / math.sqrt(1.25), "l2": 0.5, "relative_l2": 0.5, "psnr": 10 * math.log10(16), "ssim": None}
    assert p == pytest.approx(expected_p, abs=1e-12) and q == pytest.approx(expected_q, abs=1e-12)
    overall = report["overall"]
    assert overall == pytest.approx({
        "files": 2, "images": 0, "mean_cosine": (0.96 + 1 / math.sqrt(1.25)) / 2, "min_cosine": 1 / math.sqrt(1.25),
        "mean_l2": (math.sqrt(2) + 0.5) / 2, "max_l2": math.sqrt(2), "mean_relative_l2": (math.sqrt(2) / 5 + 0.5) / 2,
        "max_relative_l2": 0.5, "mean_psnr": 5 * math.log10(16), "min_psnr": 0.0, "mean_ssim": None, "min_ssim": None,
    }, abs=1e-12)


def test_cosine_of_zero_arrays() -> None:
    zero, one = np.zeros(3), np.ones(3)
    assert compare("z.npy", zero, zero).cosine == 1.0
    assert compare("z.npy", zero, one).cosine == 0.0
    assert compare("z.npy", zero, one).relative_l2 == math.inf


def test_psnr_of_a_known_mse_on_8bit_images(tmp_path: Path) -> None:
    """Every pixel one level off: MSE 1, so PSNR = 20 log10(255) on the 8-bit peak."""
    image = np.random.default_rng(0).integers(1, 255, (16, 16, 3), dtype=np.uint8)
    a, b = folders(tmp_path, {"img.png": (image, image + 1), "same.png": (image, image)})
    files = {f["name"]: f for f in evaluate_folders(a, b)["files"]}
    assert files["img.png"]["psnr"] == pytest.approx(20 * math.log10(255), abs=1e-9)
    assert files["same.png"]["psnr"] == math.inf and files["same.png"]["ssim"] == 1.0
    assert files["same.png"]["cosine"] == pytest.approx(1.0, abs=1e-12) and files["same.png"]["l2"] == 0.0


def ssim_formula(x: np.ndarray, y: np.ndarray, peak: float) -> float:
    """SSIM over one window covering the whole image (sample variances, K1 = 0.01, K2 = 0.03)."""
    x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    n = x.size
    mx, my = x.mean(), y.mean()
    vx, vy = ((x - mx) ** 2).sum() / (n - 1), ((y - my) ** 2).sum() / (n - 1)
    cxy = ((x - mx) * (y - my)).sum() / (n - 1)
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    return ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))


def test_ssim_of_a_perturbed_7x7_image_equals_the_formula(tmp_path: Path) -> None:
    """On a 7x7 image the 7x7 window fits once, so SSIM is the formula over the whole image."""
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (7, 7), dtype=np.uint8)
    noisy = np.clip(image.astype(int) + rng.integers(-20, 21, (7, 7)), 0, 255).astype(np.uint8)
    a, b = folders(tmp_path, {"g.png": (image, noisy)})
    (result,) = evaluate_folders(a, b)["files"]
    expected = ssim_formula(image, noisy, 255.0)
    assert 0.3 < expected < 0.99
    assert result["ssim"] == pytest.approx(expected, rel=1e-9)


def test_image_shaped_arrays_get_ssim_others_not() -> None:
    """A [1, 3, 8, 8] output is an image (channels first); logits and 2-D matrices are not."""
    rng = np.random.default_rng(3)
    x = rng.random((1, 3, 8, 8))
    y = x + 0.05 * rng.standard_normal(x.shape)
    peak = float(np.ptp(x))
    expected = structural_similarity(np.moveaxis(x[0], 0, -1), np.moveaxis(y[0], 0, -1), data_range=peak, channel_axis=-1)
    assert compare("img.npy", x, y).ssim == pytest.approx(expected, rel=1e-12)
    assert compare("hwc.npy", x[0].transpose(1, 2, 0), y[0].transpose(1, 2, 0)).ssim == pytest.approx(expected, rel=1e-12)
    assert compare("logits.npy", x.reshape(1, 192), y.reshape(1, 192)).ssim is None
    assert compare("matrix.npy", x[0, 0], y[0, 0]).ssim is None


def test_unpaired_files_and_shape_mismatches_are_named(tmp_path: Path) -> None:
    a, b = folders(tmp_path, {"both.npy": (np.zeros(3), np.zeros(4))})
    np.save(a / "only_a.npy", np.zeros(1))
    np.save(b / "only_b.npy", np.zeros(1))
    with pytest.raises(ValueError, match=r"only in .*baseline: \['only_a.npy'\]; only in .*quantized: \['only_b.npy'\]"):
        evaluate_folders(a, b)
    (a / "only_a.npy").unlink()
    (b / "only_b.npy").unlink()
    with pytest.raises(ValueError, match=r"both.npy: \[3\] vs \[4\]"):
        evaluate_folders(a, b)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        evaluate_folders(tmp_path / "nowhere", b)


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    image = np.random.default_rng(0).integers(0, 255, (8, 8), dtype=np.uint8)
    a, b = folders(tmp_path, {"000000.npy": (np.array([3.0, 4.0]), np.array([4.0, 3.0])), "pic.jpg": (image, image)})
    assert cli.main(["evaluate", str(a), str(b), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overall"]["min_cosine"] == pytest.approx(0.96) and report["overall"]["images"] == 1
    assert {f["name"]: f["psnr"] for f in report["files"]}["pic.jpg"] == "inf"
    assert main(["--baseline_results_folder", str(a), "--quantized_results_folder", str(b), "--json", str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["file", "cosine", "l2", "relative_l2", "psnr", "ssim"]
    assert table.splitlines()[-1].startswith("worst") and "0.96" in table
    assert json.loads((tmp_path / "r.json").read_text()) == report
    np.save(b / "extra.npy", np.zeros(1))
    with caplog.at_level(logging.ERROR):
        assert cli.main(["evaluate", str(a), str(b)]) == 2
    assert "extra.npy" in caplog.text


def test_module_runs_with_the_option_names_users_know(tmp_path: Path) -> None:
    a, b = folders(tmp_path, {"x.npy": (np.array([3.0, 4.0]), np.array([4.0, 3.0]))})
    result = subprocess.run([sys.executable, "-m", "finetune.tools.evaluate", "--baseline_results_folder", str(a),
                             "--quantized_results_folder", str(b)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "x.npy" in result.stdout and "0.96" in result.stdout
