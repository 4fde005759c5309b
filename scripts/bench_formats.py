"""Benchmark: quantize-dequantize time of every format in torch and in onnxruntime (our ONNX
function bodies or the standard Q/DQ ops), beside torch.clone of the same tensor measured in the
same run (the memory-bandwidth floor), for each tensor shape given (by default the two of issue 31:
64x256x56x56 and a unit-sized 16x64x56x56). With --compile, also forward + backward
(straight-through gradient of a random incoming gradient) eager and through the compiled kernels,
the first compiled step's time (the compile, from inductor's on-disk cache where it has the
kernels) and whether the compiled values and gradient have eager's bits. Times are medians of the
repeats; prints JSON, one entry per shape; ratios are time / clone time.

    python scripts/bench_formats.py --compile --threads 2 --formats MX4 MX9 BFP16 MXFP4 --no-onnx
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from finetune.formats import (
    BF16,
    BFP16,
    FP8_E4M3FN,
    FP8_E5M2,
    FP16,
    MX4,
    MX6,
    MX9,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8_E4M3,
    MXFP8_E5M2,
    MXINT8,
    FormatSpec,
    IntSpec,
    quantize_dequantize,
)
from finetune.formats.compiled import quantize_dequantize_compiled
from finetune.onnx import attach_custom_ops
from finetune.onnx.qdq import STANDARD_QDQ_OPSET, make_qdq
from finetune.onnx.session import inference_session

Case = tuple[FormatSpec, np.ndarray | None, np.ndarray | None]


def cases(shape: tuple[int, ...]) -> dict[str, Case]:
    """Every format with plausible scales for a standard-normal tensor of `shape` (axis 1 = channels)."""
    channels = shape[1]
    blocks = list(shape)
    blocks[1] = -(-channels // 32)
    per_channel = np.full(channels, 4 / 127, np.float32)
    return {
        "BFP16": (BFP16, None, None), "MX9": (MX9, None, None), "MX6": (MX6, None, None), "MX4": (MX4, None, None),
        "MXINT8": (MXINT8, None, None), "MXFP8_E4M3": (MXFP8_E4M3, None, None),
        "MXFP8_E5M2": (MXFP8_E5M2, None, None), "MXFP6_E3M2": (MXFP6_E3M2, None, None),
        "MXFP6_E2M3": (MXFP6_E2M3, None, None), "MXFP4": (MXFP4, None, None),
        "BF16": (BF16, None, None), "FP16": (FP16, None, None),
        "FP8_E4M3FN": (FP8_E4M3FN, np.array(0.01, np.float32), None),
        "FP8_E5M2": (FP8_E5M2, np.array(0.01, np.float32), None),
        "INT8 per tensor": (IntSpec("int8"), np.array(4 / 127, np.float32), None),
        "INT8 per channel": (IntSpec("int8", axis=1), per_channel, None),
        "UINT8 asymmetric": (IntSpec("uint8", symmetric=False), np.array(8 / 255, np.float32), np.array(128, np.float32)),
        "INT4 block 32": (IntSpec("int4", axis=1, block_size=32), np.full(blocks, 4 / 7, np.float32), None),
        "INT16 per tensor": (IntSpec("int16"), np.array(4 / 32767, np.float32), None),
        "INT32 per tensor": (IntSpec("int32"), np.array(1e-6, np.float32), None),
    }


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median of `repeats` timed runs after one warm-up (a machine shared with other jobs makes
    single runs noisy both ways)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def onnx_session(case: Case, shape: tuple[int, ...]) -> ort.InferenceSession:
    """A session over x -> qdq -> y with custom-op bodies attached, at full optimisation."""
    spec, scale, zero_point = case
    qdq = make_qdq("x", "y", spec, "q", scale, zero_point)
    graph = helper.make_graph(qdq.nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], qdq.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", STANDARD_QDQ_OPSET)])
    model.ir_version = 10
    return inference_session(attach_custom_ops(model), optimization="all")


def forward_backward(qdq: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     grad: torch.Tensor) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """One step (qdq of a leaf copy of x, backward of `grad`; returns the output) and the leaf,
    which holds the gradient after it."""
    leaf = x.clone().requires_grad_()

    def step() -> torch.Tensor:
        leaf.grad = None
        y = qdq(leaf)
        y.backward(grad)
        return y

    return step, leaf


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, NaN where NaN (which NaN is the machine's)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))


def compiled_columns(case: Case, x: torch.Tensor, repeats: int) -> dict:
    """Eager and compiled forward + backward times, the first compiled step's and bit identity."""
    spec, scale, zero_point = case
    s, zp = (None if v is None else torch.from_numpy(v) for v in (scale, zero_point))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    eager, eager_leaf = forward_backward(lambda t: quantize_dequantize(t, spec, s, zp), x, grad)
    compiled, compiled_leaf = forward_backward(lambda t: quantize_dequantize_compiled(t, spec, s, zp), x, grad)
    start = time.perf_counter()
    first = compiled()
    compile_s = time.perf_counter() - start
    identical = same_bits(first, eager()) and same_bits(compiled_leaf.grad, eager_leaf.grad)
    return {"eager_fb_s": median_time(eager, repeats), "compiled_fb_s": median_time(compiled, repeats),
            "compile_s": round(compile_s, 2), "same_bits": identical}


def run(shape: tuple[int, ...], repeats: int, names: list[str] | None, compile_kernels: bool = False,
        with_onnx: bool = True) -> dict:
    """Measure every (or the named) format; clone is measured before each format and the median of
    those kept."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x_np = x.numpy()
    rows, clone_times = [], []
    for name, case in cases(shape).items():
        if names and name not in names:
            continue
        clone_times.append(median_time(x.clone, repeats))
        spec, scale, zero_point = case
        torch_s = median_time(partial(quantize_dequantize, x, spec, None if scale is None else torch.from_numpy(scale),
                                    None if zero_point is None else torch.from_numpy(zero_point)), repeats)
        onnx_s = median_time(partial(onnx_session(case, shape).run, None, {"x": x_np}), repeats) if with_onnx else None
        rows.append({"format": name, "torch_s": torch_s, **({"onnxruntime_s": onnx_s} if with_onnx else {}),
                     **(compiled_columns(case, x, repeats) if compile_kernels else {})})
    clone_s = float(np.median(clone_times))
    for row in rows:
        for column in ("torch", "onnxruntime", "eager_fb", "compiled_fb"):
            if f"{column}_s" in row:
                row[f"{column}_vs_clone"] = round(row[f"{column}_s"] / clone_s, 2)
                row[f"{column}_s"] = round(row[f"{column}_s"], 5)
    return {
        "benchmark": "bench_formats", "shape": list(shape), "elements": int(x.numel()), "repeats": repeats,
        "clone_s": round(clone_s, 5), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__,
        "machine": platform.machine(), "formats": rows,
        "max_torch_vs_clone": max(r["torch_vs_clone"] for r in rows),
        **({"max_onnxruntime_vs_clone": max(r["onnxruntime_vs_clone"] for r in rows)} if with_onnx else {}),
        **({"max_eager_fb_vs_clone": max(r["eager_fb_vs_clone"] for r in rows),
            "max_compiled_fb_vs_clone": max(r["compiled_fb_vs_clone"] for r in rows),
            "all_same_bits": all(r["same_bits"] for r in rows)} if compile_kernels else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", type=int, nargs="+", action="append",
                        help="a tensor shape (repeat the option for several; default 64 256 56 56 and 16 64 56 56)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", nargs="*", help="only these formats (names as in the output)")
    parser.add_argument("--compile", action="store_true",
                        help="also forward + backward eager and through the compiled kernels (torch.compile)")
    parser.add_argument("--no-onnx", action="store_true", help="skip the onnxruntime column")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shape or [[64, 256, 56, 56], [16, 64, 56, 56]]
    print(json.dumps([run(tuple(shape), args.repeats, args.formats, args.compile, not args.no_onnx) for shape in shapes],
                     indent=1))


if __name__ == "__main__":
    main()
