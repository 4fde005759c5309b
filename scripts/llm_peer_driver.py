"""Run one peer's INT4 weight-only quantizer on a decoder LLM, for bench_llm.py. It runs in the Python
of the peer's own virtual environment (never ours) and imports nothing of finetune: the float ONNX
model and the calibration tokens (an npz of whole-sequence decoder inputs) come as files, the
quantized ONNX model goes to a file, and one JSON line is printed with the quantizer's wall
seconds, this process's peak RSS and the peer's options as set.

    PEER_PYTHON scripts/llm_peer_driver.py METHOD SETTING FLOAT.onnx CALIBRATION.npz OUT.onnx [--batch 4]

METHOD: ort_rtn, ort_hqq, ort_gptq (onnxruntime.quantization.matmul_nbits_quantizer), nncf_awq_se
(nncf.compress_weights, AWQ + scale estimation), quark_gptq (AMD Quark, MatMulNBits with GPTQ).
SETTING: g128 (groups of 128 along the reduction axis) or channel (one group over the whole axis)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

GROUPS = {"g128": 128, "channel": -1}  # setting -> group size as the peers spell it (-1: per channel)
EMBEDDING = "/embed_tokens/Gather"  # the token table's Gather: NNCF's all_layers would quantize it; the others touch MatMuls only


def feeds(path: str, batch: int) -> list[dict[str, np.ndarray]]:
    """The calibration inputs, `batch` whole sequences a feed."""
    with np.load(path) as stored:
        arrays = {name: stored[name] for name in stored.files}
    count = len(next(iter(arrays.values())))
    return [{name: value[start:start + batch] for name, value in arrays.items()} for start in range(0, count, batch)]


class Reader:
    """onnxruntime's CalibrationDataReader protocol (get_next, iteration) over a list of feeds."""

    def __init__(self, items: list[dict[str, np.ndarray]]) -> None:
        self.items, self.position = items, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next feed, or None at the end."""
        if self.position == len(self.items):
            return None
        self.position += 1
        return self.items[self.position - 1]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """Every remaining feed (onnxruntime's GPTQ iterates the reader)."""
        return iter(self.get_next, None)


def ort(algorithm: str, group: int, model: str, calibration: list[dict[str, np.ndarray]], output: str) -> dict[str, Any]:
    """onnxruntime's MatMulNBitsQuantizer with RTN, HQQ or GPTQ at 4 bits on every MatMul with a
    constant weight (its default op types), symmetric where the algorithm allows (HQQ always has zero
    points), MatMulNBits (QOperator) output; the algorithms' own options at their defaults."""
    from onnxruntime.quantization import matmul_nbits_quantizer as q

    configs: dict[str, Callable[[], Any]] = {
        "rtn": lambda: q.RTNWeightOnlyQuantConfig(),
        "hqq": lambda: q.HQQWeightOnlyQuantConfig(block_size=group, bits=4),
        "gptq": lambda: q.GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(calibration)),
    }
    config = configs[algorithm]()
    quantizer = q.MatMulNBitsQuantizer(model, bits=4, block_size=group, is_symmetric=True, algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(output, False)
    options = {k: v for k, v in vars(config).items() if isinstance(v, int | float | str | bool | type(None))}
    return {"call": f"MatMulNBitsQuantizer(bits=4, block_size={group}, is_symmetric=True, algo_config={type(config).__name__})",
            "options": options}


def nncf_awq(group: int, model: str, calibration: list[dict[str, np.ndarray]], output: str) -> dict[str, Any]:
    """NNCF's data-aware INT4 symmetric weight compression with AWQ and scale estimation of every
    MatMul (all_layers: the LM head too, ratio 1: no INT8 backup layers), the token table left float.
    NNCF refuses a group that does not divide the reduction axis (576 = 4.5 x 128 here): its ADJUST
    fallback gives such weights the largest power-of-two group below that divides it (64)."""
    import nncf
    import onnx

    single = [{name: value[i:i + 1] for name, value in feed.items()} for feed in calibration for i in range(len(feed["input_ids"]))]
    options = {"mode": "INT4_SYM", "group_size": group, "ratio": 1.0, "all_layers": True, "awq": True, "scale_estimation": True,
               "subset_size": len(single), "ignored_scope": {"names": [EMBEDDING]}, "dataset": "one sequence a sample",
               "advanced_parameters": {"group_size_fallback_mode": "ADJUST"}}
    compressed = nncf.compress_weights(
        onnx.load(model), mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group, ratio=1.0, all_layers=True, awq=True,
        scale_estimation=True, subset_size=len(single), ignored_scope=nncf.IgnoredScope(names=[EMBEDDING]),
        dataset=nncf.Dataset(single),
        advanced_parameters=nncf.AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))
    onnx.save(compressed, output)
    return {"call": "nncf.compress_weights", "options": options}


def quark_gptq(group: int, model: str, calibration: list[dict[str, np.ndarray]], output: str) -> dict[str, Any]:
    """AMD Quark for ONNX: MatMul weights as 4-bit symmetric MatMulNBits with GPTQ, activations float.
    Quark's GPTQ reads its group from GPTQParams (default -1, whatever MatMulNBitsParams says) and by
    default (PerChannel false) gives a group one scale for all output channels: both are set here."""
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.config import Config, QuantizationConfig

    params = {"GroupSize": group, "Symmetric": True, "Bits": 4, "AccuracyLevel": 0, "Algorithm": "GPTQ"}
    gptq = {"GroupSize": group, "PerChannel": True, "WeightSymmetric": True}
    config = QuantizationConfig(extra_options={"UseMatMulNBits": True, "MatMulNBitsParams": params, "GPTQParams": gptq})
    with tempfile.TemporaryDirectory() as scratch:
        here = os.getcwd()
        os.chdir(scratch)  # Quark writes scratch files into the working folder
        try:
            ModelQuantizer(Config(global_quant_config=config)).quantize_model(model, output, Reader(calibration))
        finally:
            os.chdir(here)
    return {"call": "ModelQuantizer(Config(global_quant_config=QuantizationConfig(extra_options=...)))",
            "options": {"UseMatMulNBits": True, "MatMulNBitsParams": params, "GPTQParams": gptq,
                        "defaults": "GPTQParams PercDamp 0.01, BlockSize 128, ActOrder false, MSE false"}}


def main() -> None:
    """Parse the arguments, quantize, print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=["ort_rtn", "ort_hqq", "ort_gptq", "nncf_awq_se", "quark_gptq"])
    parser.add_argument("setting", choices=sorted(GROUPS))
    for name in ("float_model", "calibration", "output"):
        parser.add_argument(name)
    parser.add_argument("--batch", type=int, default=4, help="sequences a calibration feed")
    args = parser.parse_args()
    model, output = str(Path(args.float_model).resolve()), str(Path(args.output).resolve())
    calibration, group = feeds(args.calibration, args.batch), GROUPS[args.setting]
    run: dict[str, Callable[[], dict[str, Any]]] = {
        "ort_rtn": lambda: ort("rtn", group, model, calibration, output),
        "ort_hqq": lambda: ort("hqq", group, model, calibration, output),
        "ort_gptq": lambda: ort("gptq", group, model, calibration, output),
        "nncf_awq_se": lambda: nncf_awq(group, model, calibration, output),
        "quark_gptq": lambda: quark_gptq(group, model, calibration, output)}
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the peers' progress bars: stdout holds only the JSON line
        result = run[args.method]()
    print(json.dumps({**result, "quantize_seconds": round(time.perf_counter() - start, 1),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
