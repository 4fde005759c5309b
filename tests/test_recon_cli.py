"""Fast finetune from the command line and the pipeline: `finetune quantize` with a fast_finetune
section or flags, `finetune tune` on models quantized by us, by onnxruntime's quantize_static and
with com.amd.quark nodes, runs killed or interrupted and resumed, the saved run config, and the
benchmark's smoke run."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from finetune.cli import main
from finetune.config import load_config
from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN
from finetune.pipeline import quantize_and_finetune, with_finetune
from finetune.quantize import quantize_model
from finetune.recon import Unit
from finetune.recon.data.cache import remove_stale_spills
from finetune.recon.tuner import Tuner
from finetune.zoo import digits_split

from .recon_helpers import export_digits_cnn, one_thread, run  # noqa: F401  (one_thread: autouse fixture)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN as ONNX, a folder of 4 calibration batches (.npy) and the held-out split."""
    root = tmp_path_factory.mktemp("digits_cli")
    x_train, _, x_test, y_test = digits_split()
    path = export_digits_cnn(root / "digits.onnx", x_test[:1])
    folder = root / "calib"
    folder.mkdir()
    feeds = [{"x": x_train[i : i + 32].numpy()} for i in range(0, 128, 32)]
    for i, feed in enumerate(feeds):
        np.save(folder / f"{i:03d}.npy", feed["x"])
    return {"path": path, "data": folder, "feeds": feeds, "x": x_test.numpy(), "y": y_test.numpy()}


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str  # the log


@pytest.fixture
def cli(capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> Iterator[Callable[..., Outcome]]:
    """`finetune ARGS` in this process (a subprocess would spend most of its time importing torch)."""
    caplog.set_level(logging.INFO)

    def call(*args: str) -> Outcome:
        capsys.readouterr()
        caplog.clear()
        code = main(list(args))
        return Outcome(code, capsys.readouterr().out, caplog.text)

    yield call


def test_flags_override_and_add_a_fast_finetune_section() -> None:
    adaround = load_config("XINT8_ADAROUND")
    switched = with_finetune(adaround, {"algorithm": "adaquant", "iterations": 7, "early_stop": True, "seed": None})
    assert (switched.fast_finetune.algorithm, switched.fast_finetune.lr, switched.fast_finetune.iterations) == ("adaquant", None, 7)
    assert switched.fast_finetune.early_stop.enabled and switched.fast_finetune.batch_size == adaround.fast_finetune.batch_size
    added = with_finetune(load_config("MX4"), {"algorithm": "adaquant", "lr": 1e-3})
    assert added.fast_finetune.lr == 1e-3 and added.activation == load_config("MX4").activation
    assert with_finetune(adaround, {"lr": None}) is adaround


def test_cli_quantize_with_finetune_writes_model_config_and_report(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    out = tmp_path / "out" / "digits.onnx"
    result = cli("quantize", str(digits["path"]), "--config", "XINT8", "--data", str(digits["data"]), "--finetune", "adaround",
                 "--iterations", "20", "--seed", "1", "--no-early-stop", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "fast finetune (adaround, cpu" in result.stdout and "5 units" in result.stdout
    assert "float reference: the given float model" in result.stderr  # the quantizer's: int32 biases are codes
    config_text = out.with_name("digits.onnx.config.yaml").read_text()
    assert config_text.startswith("# finetune ") and "torch " in config_text.splitlines()[0]
    saved = load_config(out.with_name("digits.onnx.config.yaml"))
    assert saved.fast_finetune.iterations == 20 and saved.fast_finetune.seed == 1 and saved.activation.dtype == "int8"
    report = json.loads(out.with_name("digits.onnx.finetune.json").read_text())
    assert len(report["units"]) == 5 and report["config"]["iterations"] == 20
    assert out.with_name("digits.onnx.finetune.png").is_file()
    assert (out.parent / "digits.onnx.finetune.logs" / "metrics.csv").is_file()
    assert (run(out, digits["x"]).argmax(1) == digits["y"]).mean() >= 0.95


def test_data_size_alone_does_not_turn_finetuning_on(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    out = tmp_path / "q.onnx"
    result = cli("quantize", str(digits["path"]), "--config", "XINT8", "--data", str(digits["data"]), "--data-size", "64",
                 "-o", str(out))
    assert result.returncode == 0 and "fast finetune" not in result.stdout
    assert load_config(out.with_name("q.onnx.config.yaml")).fast_finetune is None
    assert not out.with_name("q.onnx.finetune.json").exists()


def test_cli_quantize_honours_a_config_with_fast_finetune(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    config = tmp_path / "mx4_adaquant.yaml"
    config.write_text("preset: MX4_ADAQUANT\nfast_finetune: {iterations: 10, lr: 1.0e-3}\n")
    out = tmp_path / "mx4.onnx"
    result = cli("quantize", str(digits["path"]), "--config", str(config), "--data", str(digits["data"]), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.with_name("mx4.onnx.finetune.json").read_text())["algorithm"] == "adaquant"
    run(out, digits["x"])


def test_cli_errors_name_the_problem(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    config = tmp_path / "block_tail.yaml"
    config.write_text("preset: XINT8\nfast_finetune: {include_output_quant: true}\n")
    block = cli("quantize", str(digits["path"]), "--config", str(config), "--data", str(digits["data"]), "--unit", "block",
                "-o", str(tmp_path / "b.onnx"))
    assert block.returncode == 2 and "include_output_quant" in block.stderr and "unit: layer only" in block.stderr
    rounding = cli("quantize", str(digits["path"]), "--config", "MX4", "--data", str(digits["data"]), "--finetune", "adaround",
                   "-o", str(tmp_path / "r.onnx"))
    assert rounding.returncode == 2 and "AdaRound needs INT weights" in rounding.stderr
    device = cli("quantize", str(digits["path"]), "--config", "XINT8", "--data", str(digits["data"]), "--finetune", "adaround",
                 "--device", "hip:0", "-o", str(tmp_path / "d.onnx"))
    assert device.returncode == 2 and "'hip:0' is not available" in device.stderr
    assert "calibrating" not in device.stderr  # refused before the quantizer's calibration pass


@pytest.mark.slow
@pytest.mark.parametrize("kill", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_run_leaves_no_spilled_activations(digits: dict, tmp_path: Path, kill: signal.Signals) -> None:
    """Killed while tuning: SIGTERM (a scheduler's time limit) exits with 128 + 15 and removes its
    spill folder; SIGKILL (kill -9, the out-of-memory killer) cannot clean up, but its spill files
    were unlinked when mapped, so it leaves an empty folder, which the next run removes. Neither
    leaves a partial output."""
    config, out, spill_root = tmp_path / "long.yaml", tmp_path / "out.onnx", tmp_path / "tmp"
    config.write_text("preset: XINT8\nfast_finetune: {iterations: 1000000, cache_budget_bytes: 1}\n")
    spill_root.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "finetune.cli", "quantize", str(digits["path"]), "--config", str(config),
                                "--data", str(digits["data"]), "-o", str(out)],
                               env={**os.environ, "TMPDIR": str(spill_root)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(spill_root.glob("finetune-activations-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # well into the spilling stream
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    process.send_signal(kill)
    assert process.wait(timeout=60) == (128 + signal.SIGTERM if kill == signal.SIGTERM else -signal.SIGKILL)
    left = list(spill_root.glob("finetune-activations-*"))
    assert all(not any(folder.iterdir()) for folder in left) and not out.exists()
    assert (left == []) if kill == signal.SIGTERM else (left and remove_stale_spills(spill_root) == left)
    assert list(spill_root.glob("finetune-activations-*")) == []


def finished_units(checkpoint: Path) -> int:
    """How many units a run's checkpoint holds (0 while it has none)."""
    try:
        return len(torch.load(checkpoint / "progress.pt", weights_only=True)["results"])
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_a_run_killed_outright_resumes_to_the_bytes_of_an_uninterrupted_run(digits: dict, tmp_path: Path,
                                                                             cli: Callable[..., Outcome]) -> None:
    """`quantize --finetune` killed with SIGKILL once its checkpoint holds two units, then run again
    with --resume: it continues from the units the checkpoint holds, and writes the bytes an
    uninterrupted run writes (one thread in both, as the checkpoint requires)."""
    config = tmp_path / "long.yaml"
    config.write_text("preset: XINT8\nfast_finetune: {iterations: 300, seed: 4}\n")
    args = ["quantize", str(digits["path"]), "--config", str(config), "--data", str(digits["data"])]
    out, whole = tmp_path / "killed" / "q.onnx", tmp_path / "whole.onnx"
    checkpoint = out.with_name("q.onnx.finetune.ckpt")
    process = subprocess.Popen([sys.executable, "-m", "finetune.cli", *args, "-o", str(out)],
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},  # SIGKILL leaves its temporaries
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while finished_units(checkpoint) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    finished = finished_units(checkpoint)
    assert 2 <= finished < 5 and not out.exists()
    resumed = cli(*args, "--resume", "-o", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {checkpoint}: {finished} of 5 units finished earlier" in resumed.stderr
    assert f"{finished} restored from the checkpoint" in resumed.stdout
    assert cli(*args, "-o", str(whole)).returncode == 0
    assert out.read_bytes() == whole.read_bytes() and not checkpoint.exists()


def test_cli_tune_stopped_by_ctrl_c_resumes_to_the_same_bytes(digits: dict, tmp_path: Path, cli: Callable[..., Outcome],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`tune` interrupted while tuning its third unit exits with 130, writes no model and says where
    its two finished units are kept; `tune --resume` completes it to the bytes of an uninterrupted run."""
    qdq, whole, out = tmp_path / "q.onnx", tmp_path / "whole.onnx", tmp_path / "tuned.onnx"
    onnx.save(quantize_model(digits["path"], "XINT8", digits["feeds"]).model, qdq)
    args = ["tune", str(qdq), "--data", str(digits["data"]), "--iterations", "15"]
    assert cli(*args, "-o", str(whole)).returncode == 0
    tune = Tuner.tune

    def interrupted(tuner: Tuner, k: int, *rest: object, **keywords: object) -> object:
        if k == 2:
            raise KeyboardInterrupt
        return tune(tuner, k, *rest, **keywords)

    monkeypatch.setattr(Tuner, "tune", interrupted)
    stopped = cli(*args, "-o", str(out))
    checkpoint = out.with_name("tuned.onnx.finetune.ckpt")
    assert stopped.returncode == 130 and not out.exists() and checkpoint.is_dir()
    assert f"the run stopped after 2 of 5 units; they are kept in {checkpoint}: run again with --resume" in stopped.stderr
    monkeypatch.undo()
    resumed = cli(*args, "--resume", "-o", str(out))
    assert resumed.returncode == 0 and re.search(r"5 units, \d kept, \d reverted, 2 restored from the checkpoint", resumed.stdout)
    assert out.read_bytes() == whole.read_bytes() and not checkpoint.exists()


def test_cli_refuses_a_model_with_nothing_to_tune_and_a_resume_without_tuning(digits: dict, tmp_path: Path,
                                                                                cli: Callable[..., Outcome]) -> None:
    """`tune` on a float model (it reported success, having tuned nothing) and `quantize --resume`
    without fine-tuning: each an error that says why, with no output."""
    out = tmp_path / "out.onnx"
    floating = cli("tune", str(digits["path"]), "--data", str(digits["data"]), "-o", str(out))
    assert floating.returncode == 2 and "the model has no quantizers" in floating.stderr and "nothing to tune" in floating.stderr
    resume = cli("quantize", str(digits["path"]), "--config", "XINT8", "--data", str(digits["data"]), "--resume", "-o", str(out))
    assert resume.returncode == 2 and "--resume continues a fine-tuning run: add --finetune" in resume.stderr
    assert not out.exists()


class _Reader(CalibrationDataReader):
    """onnxruntime's calibration reader over the test feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def test_cli_tune_a_quantize_static_model_with_and_without_the_float_model(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    """onnxruntime's QDQ output stores int8 weight codes: with --float-model the units start from
    the float weights; without it the log says the reference is the quantized model."""
    qdq = tmp_path / "ort_qdq.onnx"
    quantize_static(str(digits["path"]), str(qdq), _Reader(digits["feeds"]), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    for extra, reference in [(["--float-model", str(digits["path"]), "--data-size", "64"], "float model"),
                             ([], "quantized model with quantizers disabled")]:
        out = tmp_path / f"tuned{len(extra)}.onnx"
        result = cli("tune", str(qdq), *extra, "--data", str(digits["data"]), "--finetune", "adaround", "--iterations", "30",
                     "-o", str(out))
        assert result.returncode == 0, result.stderr
        assert f"float reference: {reference}" in result.stdout
        report = json.loads(out.with_name(out.name + ".finetune.json").read_text())
        assert report["kept"] >= 1 and report["float_reference"] == reference
        assert report["samples"] == (64 if extra else 128)
        weights = {t.data_type for t in onnx.load(out).graph.initializer if len(t.dims) == 4}
        assert weights == {onnx.TensorProto.INT8}
        assert (run(out, digits["x"]).argmax(1) == digits["y"]).mean() >= 0.95
    assert "stored as quantized codes" in result.stderr


def test_cli_tune_a_model_with_amd_quark_nodes(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    """Our MX4 model with its BFP nodes moved to the com.amd.quark domain, imported at version 1000
    beside com.vai.quantize and com.microsoft, and the function bodies dropped (as AMD Quark 0.13
    writes it): tuned with AdaQuant and written back in that form (Quark's nodes, domains and
    versions, no bodies); with --attach-ops the same weights with bodies, which stock onnxruntime
    runs, as it runs the first after `attach-ops`."""
    model = quantize_model(digits["path"], "MX4", None).model
    for node in model.graph.node:
        if node.domain == CUSTOM_DOMAIN:
            node.domain, node.overload = QUARK_DOMAIN, ""
    del model.functions[:]
    del model.opset_import[1:]
    model.opset_import.extend([onnx.helper.make_opsetid(domain, version)
                               for domain, version in ((QUARK_DOMAIN, 1000), ("com.vai.quantize", 1000), ("com.microsoft", 1))])
    source, out, attached = tmp_path / "quark.onnx", tmp_path / "tuned.onnx", tmp_path / "attached.onnx"
    onnx.save(model, source)
    config = tmp_path / "tune.yaml"
    config.write_text("fast_finetune: {algorithm: adaquant, iterations: 15, lr: 1.0e-3}\n")
    for output, flags in ((out, []), (attached, ["--attach-ops"])):
        result = cli("tune", str(source), "--data", str(digits["data"]), "--config", str(config), "-o", str(output), *flags)
        assert result.returncode == 0, result.stderr
    tuned, with_bodies = onnx.load(out), onnx.load(attached)
    assert list(tuned.graph.node) == list(model.graph.node) and list(tuned.opset_import) == list(model.opset_import)
    assert not tuned.functions and {f.domain for f in with_bodies.functions} == {QUARK_DOMAIN}
    assert list(tuned.graph.initializer) == list(with_bodies.graph.initializer)
    assert list(tuned.graph.initializer) != list(model.graph.initializer)
    assert cli("attach-ops", str(out), str(tmp_path / "later.onnx")).returncode == 0
    assert np.array_equal(run(tmp_path / "later.onnx", digits["x"]), run(attached, digits["x"]))
    assert (run(attached, digits["x"]).argmax(1) == digits["y"]).mean() >= 0.95


class UnitNames:
    """A user's callback that notes the name of each unit as it ends."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_unit_end(self, unit: Unit) -> None:
        self.names.append(unit.name)


def test_pipeline_uses_the_float_model_for_compact_weights_and_passes_callbacks_on(digits: dict) -> None:
    config = {"preset": "XINT8_ADAROUND", "weight_storage": "compact", "fast_finetune": {"iterations": 10}}
    heard = UnitNames()
    result = quantize_and_finetune(digits["path"], config, digits["feeds"], callbacks=[heard])
    assert result.report["float_reference"] == "float model" and result.summary["quantized_nodes"] == 5
    assert heard.names == [u["name"] for u in result.report["units"]]
    assert quantize_and_finetune(digits["path"], "XINT8", digits["feeds"]).report is None


@pytest.mark.slow
def test_bench_finetune_smoke_run_on_digits(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_finetune.py"), "--models", "digits", "--presets", "XINT8,MX4",
                             "--iterations", "10", "--calibration", "128", "--threads", "1"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(result.stdout)["cases"]
    assert [(c["model"], c["preset"], c["algorithm"], c["unit"], c["units"]) for c in cases] == [
        ("digits", "XINT8", "adaround", "layer", 5), ("digits", "MX4", "adaquant", "block", 2)]
    for case in cases:
        assert case["calibration_samples"] == 128 and case["peak_rss_mb"] > 0
        assert case["evaluation_samples"] == 449  # the digits test split
        share = case["after"] / 100
        assert case["after_standard_error"] == pytest.approx(100 * (share * (1 - share) / 449) ** 0.5)
        assert case["recovered_fraction"] is None and case["recovered_standard_error"] is None  # neither loses 2 points
        assert 0 <= case["change_standard_error"] <= 100 / 448**0.5  # per-item differences lie in [-1, 1]
        assert case["after"] == case["before"] or case["change_standard_error"] > 0
        assert case["activation_cache_peak_mb_in_memory"] > 0 and case["activation_cache_peak_mb_on_disk"] == 0
        assert 0 < case["seconds_per_unit_iteration"] and case["activation_seconds_ort_rerun_per_unit"] > 0
        assert 90 <= case["float"] <= 100 and case["after"] >= 80


def test_quantize_with_codes_writes_the_float_model_tune_takes(digits: dict, tmp_path: Path, cli: Callable[..., Outcome]) -> None:
    """Weights stored as codes lose their float values: `quantize` writes the float graph they were
    made from beside the output (`<output>.float.onnx`), and `tune --float-model` takes it as the
    reference with nothing set aside. With float storage the QDQ model holds the weights: none is written."""
    out = tmp_path / "q.onnx"
    result = cli("quantize", str(digits["path"]), "--config", "XINT8", "--data", str(digits["data"]), "--weight-storage",
                 "compact", "-o", str(out))
    assert result.returncode == 0, result.stderr
    float_path = out.with_name("q.onnx.float.onnx")
    assert "Conv" in {node.op_type for node in onnx.load(float_path).graph.node}
    assert not any(node.op_type == "QuantizeLinear" for node in onnx.load(float_path).graph.node)
    tuned = tmp_path / "t.onnx"
    result = cli("tune", str(out), "--float-model", str(float_path), "--data", str(digits["data"]), "--iterations", "5",
                 "-o", str(tuned))
    assert result.returncode == 0, result.stderr
    report = json.loads(tuned.with_name("t.onnx.finetune.json").read_text())
    assert report["float_reference"] == "float model" and not [w for w in report["warnings"] if "model" in w]
    plain = tmp_path / "p.onnx"
    assert cli("quantize", str(digits["path"]), "--config", "XINT8", "--data", str(digits["data"]), "-o", str(plain)).returncode == 0
    assert not plain.with_name("p.onnx.float.onnx").exists()
