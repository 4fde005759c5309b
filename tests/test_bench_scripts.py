"""The benchmark scripts run end to end on a small tensor and report every format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_bench_formats_reports_every_format_as_json() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_formats.py"), "--shape", "2", "64", "5", "7", "--repeats", "1"],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(result.stdout)
    assert report["shape"] == [2, 64, 5, 7]
    names = [row["format"] for row in report["formats"]]
    assert {"BFP16", "MX9", "MX6", "MX4", "MXINT8", "MXFP8_E4M3", "MXFP8_E5M2", "MXFP6_E3M2", "MXFP6_E2M3",
            "MXFP4", "BF16", "FP16", "FP8_E4M3FN", "INT8 per channel", "INT4 block 32", "INT32 per tensor"} <= set(names)
    for row in report["formats"]:
        assert row["torch_s"] > 0 and row["onnxruntime_s"] > 0 and row["torch_vs_clone"] > 0


def test_demo_prints_every_format(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPTS / "demo.py"), "--json"], capture_output=True, text=True, check=True)
    rows = {row["format"]: row for row in json.loads(result.stdout)}
    assert len(rows) == 16
    assert rows["FP16"]["sqnr_db"] > rows["BF16"]["sqnr_db"] > rows["MX6"]["sqnr_db"] > rows["MX4"]["sqnr_db"]
    assert rows["MX9"]["sqnr_db"] > 40 and rows["INT8 per channel"]["sqnr_db"] > 35
