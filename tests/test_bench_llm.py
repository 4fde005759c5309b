"""scripts/bench_llm.py and its peer driver without the model or any peer: the done-when ratios, the
reason recorded for a peer whose environment is absent, the command line's checks, and the driver's
calibration feeds (the peers themselves never run in the test suite)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A script of scripts/ imported as a module, its siblings importable as when it runs."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_hold_our_gap_to_the_best_peer_and_our_time_to_the_fastest_data_aware_one(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = script("bench_llm", monkeypatch)
    rows = {"ours_rtn": {"gap": 3.0, "quantize_seconds": 2.0, "next_token_agreement": 0.7},
            "ours_gptq": {"gap": 1.0, "quantize_seconds": 30.0, "next_token_agreement": 0.9},
            "ort_rtn": {"gap": 5.0, "quantize_seconds": 1.0, "next_token_agreement": 0.6},  # fastest, but not data-aware
            "ort_gptq": {"gap": 4.0, "quantize_seconds": 60.0, "next_token_agreement": 0.8},  # agrees most, not the best gap
            "nncf_awq_se": {"gap": 2.0, "quantize_seconds": 40.0, "next_token_agreement": 0.75},
            "quark_gptq": {"error": "no model"}}
    done = bench.ratios(rows)
    assert done["best_peer"] == "nncf_awq_se" and done["best_peer_gap"] == 2.0
    assert done["fastest_data_aware_peer"] == "nncf_awq_se"
    assert done["ours_gptq_gap_over_best_peer_gap"] == 0.5 and done["ours_rtn_gap_over_best_peer_gap"] == 1.5
    assert done["ours_gptq_seconds_over_fastest_data_aware_peer"] == 0.75
    assert done["most_agreeing_peer"] == "ort_gptq" and done["ours_gptq_disagreement_over_best_peer"] == 0.5
    assert "note" in bench.ratios({"ours_rtn": rows["ours_rtn"], "quark_gptq": rows["quark_gptq"]})


def test_an_absent_peer_environment_is_recorded_with_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = script("bench_llm", monkeypatch)
    args = argparse.Namespace(quark_python=str(tmp_path / "none" / "python"), peer_timeout=None)
    result = bench.peer("quark_gptq", "g128", args, tmp_path)
    assert str(tmp_path / "none" / "python") in result["error"] and "amd-quark" in result["error"]


@pytest.mark.parametrize(("arguments", "message"), [(["--methods", "ours_rtn,awq"], "unknown ['awq']"),
                                                    (["--settings", "g32"], "unknown ['g32']"),
                                                    (["--calibration", "6"], "multiple of 4")])
def test_the_command_line_refuses_unknown_methods_and_odd_counts(arguments: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_llm.py"), *arguments], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and message in done.stderr


def test_the_driver_feeds_every_calibration_sequence_in_batches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    driver = script("llm_peer_driver", monkeypatch)
    ids = np.arange(6 * 3).reshape(6, 3)
    np.savez(tmp_path / "calibration.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    feeds = driver.feeds(str(tmp_path / "calibration.npz"), 4)
    assert [f["input_ids"].shape for f in feeds] == [(4, 3), (2, 3)]
    assert np.array_equal(np.concatenate([f["input_ids"] for f in feeds]), ids)
    assert list(driver.Reader(feeds)) == feeds  # onnxruntime's GPTQ iterates the reader to its end
    reader = driver.Reader(feeds)
    assert [reader.get_next() is f for f in feeds] == [True, True] and reader.get_next() is None
    done = subprocess.run([sys.executable, str(SCRIPTS / "llm_peer_driver.py"), "awq", "g128", "a", "b", "c"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "invalid choice: 'awq'" in done.stderr


def test_every_method_of_ours_is_a_valid_config_at_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """ours_awq and ours_awq_gptq add an awq section (with GPTQ after it for the latter) to the setting's config."""
    from finetune.config import load_config

    bench = script("bench_llm", monkeypatch)
    for setting, base in bench.SETTINGS.items():
        if "smooth_quant" in base:  # awq and smooth_quant exclude each other: those methods do not run there
            assert not bench.runs_at("ours_awq", setting) and bench.runs_at("ours_gptq", setting)
            assert load_config({**base, **bench.OURS["ours_gptq"]}).smooth_quant is not None
            continue
        assert bench.runs_at("nncf_awq_se", setting) == (setting in ("g128", "channel"))
        configs = {method: load_config({**base, **extra}) for method, extra in bench.OURS.items()}
        assert configs["ours_awq"].awq is not None and configs["ours_awq"].fast_finetune is None
        assert configs["ours_awq_gptq"].awq is not None and configs["ours_awq_gptq"].fast_finetune.algorithm == "gptq"
        assert configs["ours_rtn"].awq is None and configs["ours_gptq"].weight == configs["ours_awq_gptq"].weight, setting
