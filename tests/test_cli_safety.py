"""What every command does with bad output paths and interruptions: an output that is an input, a
folder or unwritable is refused before any work with one line naming the path, the input is never
touched, Ctrl-C ends with status 130 and writes nothing, and a traceback shows only with --debug."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from finetune.cli import main
from finetune.quantize import quantize_model

from .test_calibrate import conv_matmul_model


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A float model, its A8W8 quantization, a calibration folder and a link to the float model."""
    model = conv_matmul_model()
    data = tmp_path / "calib"
    data.mkdir()
    batches = [np.random.default_rng(i).standard_normal((2, 3, 8, 8)).astype(np.float32) for i in range(3)]
    for i, batch in enumerate(batches):
        np.save(data / f"{i}.npy", batch)
    float_path, qdq_path = tmp_path / "model.onnx", tmp_path / "qdq.onnx"
    onnx.save(model, float_path)
    onnx.save(quantize_model(model, "A8W8", [{"x": b} for b in batches]).model, qdq_path)
    (tmp_path / "link.onnx").symlink_to(float_path)
    return {"float": float_path, "qdq": qdq_path, "data": data, "link": tmp_path / "link.onnx"}


def run(caplog: pytest.LogCaptureFixture, *args: str | Path) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code = main([str(a) for a in args])
    return code, caplog.text


def commands(files: dict[str, Path], output: Path | str) -> dict[str, list]:
    """Each command with the given output; the float model is the input of all but tune."""
    model, data = files["float"], files["data"]
    return {
        "quantize": ["quantize", model, "--config", "A8W8", "--data", data, "-o", output],
        "quantize --finetune": ["quantize", model, "--config", "A8W8", "--data", data, "--finetune", "adaround", "-o", output],
        "tune": ["tune", files["qdq"], "--float-model", model, "--data", data, "-o", output],
        "attach-ops": ["attach-ops", model, output],
        "convert-bf16": ["convert-bf16", "--input", model, "--output", output],
    }


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any quantization or tuning would fail the test: refusals must come before the work."""

    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("the command started its work before refusing its output")

    monkeypatch.setattr("finetune.cli.quantize_and_finetune", forbidden)
    monkeypatch.setattr("finetune.recon.finetune_model", forbidden)
    monkeypatch.setattr("finetune.cli.attach_custom_ops", forbidden)
    monkeypatch.setattr("finetune.tools.bf16.conversion.convert", forbidden)


@pytest.mark.usefixtures("no_work")
def test_an_output_that_is_an_input_is_refused_before_any_work(files: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    before = {name: path.read_bytes() for name, path in files.items() if path.is_file()}
    for target in ("float", "link"):
        for name, args in commands(files, files[target]).items():
            if name == "tune":
                args = commands(files, files["qdq"])["tune"]
            code, log = run(caplog, *args)
            assert code == 2, (name, log)
            assert "inputs are never overwritten" in log and "Traceback" not in log, (name, log)
    assert {name: path.read_bytes() for name, path in files.items() if path.is_file()} == before


@pytest.mark.usefixtures("no_work")
def test_a_folder_or_an_unwritable_output_is_one_line_naming_it(files: dict[str, Path], tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    for output, message in ((tmp_path, "is a folder; give a file name"),
                            ("/proc/finetune/out.onnx", "cannot write /proc/finetune/out.onnx: /proc refuses new files")):
        for name, args in commands(files, output).items():
            code, log = run(caplog, *args)
            assert code == 2 and message in log and "Traceback" not in log, (name, log)
            assert len([line for line in log.splitlines() if line.startswith("ERROR")]) == 1


def test_ctrl_c_ends_with_130_and_writes_nothing(files: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("finetune.cli.quantize_and_finetune", interrupted)
    out = tmp_path / "out" / "q.onnx"
    code, log = run(caplog, *commands(files, out)["quantize"])
    assert code == 130 and "interrupted: the output was not written" in log and "Traceback" not in log
    assert not out.parent.exists()


def test_debug_shows_the_traceback_of_a_user_error(files: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "missing.onnx"
    code, log = run(caplog, "attach-ops", missing, tmp_path / "out.onnx")
    assert code == 2 and f"ONNX model {missing} does not exist" in log and "Traceback" not in log
    code, log = run(caplog, "--debug", "attach-ops", missing, tmp_path / "out.onnx")
    assert code == 2 and "Traceback" in log


def test_infer_with_bad_data_leaves_no_output_folder(files: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    np.save(bad / "0.npy", np.zeros((2, 5), np.float32))  # the model takes [N, 3, 8, 8]
    out = tmp_path / "results"
    code, log = run(caplog, "infer", files["float"], "--data", bad, "--out", out)
    assert code == 2 and "input 'x' has rank 2" in log
    assert not out.exists()
    code, log = run(caplog, "infer", files["float"], "--data", files["data"], "--out", files["data"])
    assert code == 2 and "is the data folder" in log
    assert sorted(os.listdir(files["data"])) == ["0.npy", "1.npy", "2.npy"]
