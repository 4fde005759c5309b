"""Fine-tuning with compiled quantize-dequantize kernels gives the bytes of an eager run (same seed,
same config, on the CPU), and the report says what was compiled and what stayed eager."""

from __future__ import annotations

import pytest

from finetune.config import FastFinetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.zoo import digits_split

from .recon_helpers import export_digits_cnn, one_thread  # noqa: F401  (one_thread: autouse fixture)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    x_train, _, x_test, _ = digits_split()
    path = export_digits_cnn(tmp_path_factory.mktemp("digits") / "digits.onnx", x_test[:1])
    return {"path": path, "data": [{"x": x_train[i : i + 12].numpy()} for i in range(0, 72, 12)]}


@pytest.mark.parametrize(("preset", "algorithm", "eager"), [("MX4", "adaquant", set()),
                                                             ("XINT8", "adaround", {"INT with a rounding hook"})])
def test_compiled_kernels_tune_to_the_bytes_of_eager_ones(digits: dict, preset: str, algorithm: str, eager: set[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 16 from the 60 samples of 5 calibration batches, the sixth held out and measured
    every 10 steps in its 12 rows, so the dynamic batch axis is used too; the units end at the same
    held-out measurements. The digits CNN's tensors are below the size a run compiles for: every one
    compiles here."""
    monkeypatch.setattr("finetune.formats.compiled.MIN_COMPILED_ELEMENTS", 0)
    monkeypatch.setattr("finetune.formats.compiled.PAYBACK_ELEMENT_CALLS", 0)
    quantized = quantize_model(digits["path"], preset, digits["data"]).model
    runs = {}
    for setting in (False, True):
        config = FastFinetune(algorithm=algorithm, iterations=20, batch_size=16, seed=5, compile=setting)
        runs[setting] = finetune_model(quantized, digits["data"], config)
    (plain, plain_report), (compiled, report) = runs[False], runs[True]
    assert compiled.SerializeToString() == plain.SerializeToString()
    assert report["held_out"]["batches"] == 1
    assert [u["best_iteration"] for u in report["units"]] == [u["best_iteration"] for u in plain_report["units"]]
    assert plain_report["kernels"] == {"compiled": False, "eager_formats": {}, "kernels": 0, "kernels_over_limit": 0,
                                       "shapes_left_eager_as_too_few_calls": 0, "compiles": 0, "warm_compiles": 0,
                                       "compile_seconds": 0}
    assert report["kernels"]["compiled"] is True and report["kernels"]["kernels"] > 0
    assert set(report["kernels"]["eager_formats"]) == eager


def test_a_run_compiles_only_the_shapes_its_iterations_pay_for(digits: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape is compiled only where elements x iterations reach PAYBACK_ELEMENT_CALLS (a cold compile
    costs seconds a short run never wins back): set between the digits CNN's tensor sizes x 20
    iterations, the small shapes stay eager and are counted, the large compile, and the bytes are
    those of the eager run."""
    monkeypatch.setattr("finetune.formats.compiled.MIN_COMPILED_ELEMENTS", 0)
    monkeypatch.setattr("finetune.formats.compiled.PAYBACK_ELEMENT_CALLS", 20 * 4096)
    monkeypatch.setattr("finetune.formats.compiled._kernels", {})  # none compiled earlier in the process
    quantized = quantize_model(digits["path"], "MX4", digits["data"]).model
    runs = {setting: finetune_model(quantized, digits["data"], FastFinetune(algorithm="adaquant", iterations=20, seed=5,
                                                                             compile=setting)) for setting in (False, True)}
    (plain, _), (compiled, report) = runs[False], runs[True]
    assert compiled.SerializeToString() == plain.SerializeToString()
    kernels = report["kernels"]
    assert kernels["kernels"] > 0 and kernels["shapes_left_eager_as_too_few_calls"] > 0

