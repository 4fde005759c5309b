"""Peak memory of a model over 2 GB (JSON on stdout, progress on stderr): a stack of seeded-weight
MatMul layers (fp32, external data), or with `--model decoder` a Llama-style decoder LLM of seeded
weights (finetune.zoo_decoder: RMS norms, grouped-query rotary attention, SwiGLU; width `--width`,
blocks enough for the size; exported by torch.onnx), is loaded, quantized to INT4 weight-only in groups of 128 along
the reduction axis (codes stored: INT4_BLOCK32 with block_size 128, weight_storage compact, or float with --storage float) and
written by the pipeline; then the output is loaded and run in onnxruntime beside the float model.
With `--finetune gptq` (or adaquant) the quantizing step tunes too, on a few seeded calibration
batches (one thread; `--cache-budget` bytes of activations in memory, the rest spilled; AdaQuant on
the decoder tunes one decoder block per unit).
Each step runs in a process of its own, so each peak RSS (ru_maxrss) is that step's alone; the
target for quantizing (and tuning) is the weights' size + 2 GB.

    python scripts/bench_large.py                                   # 2.5 GB of weights
    python scripts/bench_large.py --finetune gptq                   # + GPTQ
    python scripts/bench_large.py --model decoder --width 2048 --finetune adaquant   # a 2.5 GB decoder, block by block
    python scripts/bench_large.py --gigabytes 0.3 --threshold 100000000   # develop: external path below 2 GB
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CONFIG = {"preset": "INT4_BLOCK32", "weight": {"block_size": 128}}  # weight_storage: --storage
SEED = 0
VOCABULARY = 32000  # the decoder's, as Llama-2's


def build(path: Path, gigabytes: float, width: int) -> dict[str, Any]:
    """Write a chain of MatMul layers of `width` x `width` seeded weights (scaled to keep the
    activations' size) holding about `gigabytes` of fp32 weights, with external data."""
    import onnx
    from onnx import helper, numpy_helper

    from finetune.onnx.io import save_model_atomic

    layers = max(1, round(gigabytes * 1e9 / (width * width * 4)))
    rng = np.random.default_rng(SEED)
    graph = helper.make_graph([], "large", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    for index in range(layers):  # one layer's weights at a time, straight into the model (make_graph would copy them)
        weight = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
        model.graph.initializer.append(numpy_helper.from_array(weight, f"w{index}"))
        model.graph.node.append(helper.make_node("MatMul", ["x" if index == 0 else f"h{index - 1}", f"w{index}"],
                                                 [f"h{index}" if index < layers - 1 else "y"], name=f"layer{index}"))
    save_model_atomic(model, path, external_data=True)
    return {"layers": layers, "width": width, "weight_bytes": layers * width * width * 4}


def decoder_shape(gigabytes: float, width: int) -> Any:
    """A Llama-like DecoderShape of `width` (heads of 128 wide, a quarter as many key/value heads, an
    MLP 2.75x as wide, a 32,000-token vocabulary, untied head) with as many blocks as make about
    `gigabytes` of fp32 weights."""
    from finetune.zoo_decoder import DecoderShape

    heads = max(1, width // 128)
    shape = DecoderShape(vocabulary=VOCABULARY, width=width, blocks=1, heads=heads, kv_heads=max(1, heads // 4),
                         mlp=64 * round(width * 2.75 / 64))
    block_bytes = 4 * width * (2 * width + 2 * shape.kv_heads * shape.head_size + 3 * shape.mlp)
    blocks = round((gigabytes * 1e9 - 4 * 2 * VOCABULARY * width) / block_bytes)
    return dataclasses.replace(shape, blocks=max(1, blocks))


def build_decoder(path: Path, gigabytes: float, width: int) -> dict[str, Any]:
    """Export a decoder of decoder_shape with seeded weights (torch's default initialisation) by
    torch.onnx's TorchScript exporter, then write it as one model file and one data file."""
    import onnx
    import torch

    from finetune.onnx.io import save_model_atomic
    from finetune.zoo_decoder import TinyDecoder, export_module

    shape = decoder_shape(gigabytes, width)
    torch.manual_seed(SEED)
    module = TinyDecoder(shape, cache=False).eval()
    weight_bytes = 4 * sum(p.numel() for p in module.parameters())
    exported = path.parent / "export" / path.name  # over 2 GB, the exporter writes a file per tensor
    exported.parent.mkdir()
    with torch.no_grad():
        export_module(module, exported, dynamo=False)
    del module
    save_model_atomic(onnx.load(exported), path, external_data=True)
    shutil.rmtree(exported.parent)
    return {"shape": dataclasses.asdict(shape), "weight_bytes": weight_bytes}


def feeds(args: argparse.Namespace, count: int, rows: int, seed: int) -> list[dict[str, np.ndarray]]:
    """`count` seeded feeds of `rows` rows: normal inputs for the stack, `args.length` uniform
    tokens a row (mask of ones, positions from 0) for the decoder."""
    rng = np.random.default_rng(seed)
    if args.model == "stack":
        return [{"x": rng.standard_normal((rows, args.width), dtype=np.float32)} for _ in range(count)]
    positions = np.broadcast_to(np.arange(args.length, dtype=np.int64), (rows, args.length)).copy()
    return [{"input_ids": rng.integers(0, VOCABULARY, (rows, args.length), dtype=np.int64),
             "attention_mask": np.ones((rows, args.length), np.int64), "position_ids": positions} for _ in range(count)]


def quantize(path: Path, output: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Load, quantize (and tune, with `args.finetune`) and write through the pipeline, as
    `finetune quantize [--finetune ...]` does."""
    from finetune.pipeline import quantize_and_finetune

    config = settings(args)
    data = feeds(args, args.batches, args.batch, SEED + 2) if args.finetune else None
    result = quantize_and_finetune(path, config, data, model_path=output, output_dir=output.parent)
    tuned = {}
    if result.report is not None:
        tuned = {"report_peak_rss_kib": result.report["peak_rss_kib"], "units": len(result.report["units"]),
                 "kept": result.report["kept"], "cache": result.report["cache"],
                 "tuning_seconds": round(result.report["total_seconds"], 1)}
    return {"quantized_nodes": result.summary["quantized_nodes"], "summary_peak_rss_kib": result.summary["peak_rss_kib"],
            **tuned}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's config: the preset with `args.storage` as weight_storage, and the fast_finetune
    section with `args.finetune`."""
    return {**CONFIG, "weight_storage": args.storage, **({"fast_finetune": tuning(args)} if args.finetune else {})}


def tuning(args: argparse.Namespace) -> dict[str, Any]:
    """The fast_finetune section: one thread, the batches given, no held-out batches (the
    benchmark measures memory and time)."""
    section = {"algorithm": args.finetune, "threads": 1, "batch_size": args.batch, "validation_share": 0.0,
               "cache_budget_bytes": args.cache_budget}
    if args.finetune == "adaquant":
        section.update(iterations=args.iterations, **({"unit": "block"} if args.model == "decoder" else {}))
    return section


def check(path: Path, output: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Load the output in onnxruntime and run it beside the float model on one seeded input."""
    from finetune.onnx.session import inference_session

    feed = feeds(args, 1, 4 if args.model == "stack" else 2, SEED + 1)[0]
    quantized = inference_session(output).run(None, feed)[0]
    reference = inference_session(path).run(None, feed)[0]
    return {"loads_in_onnxruntime": True,
            "relative_error": float(np.linalg.norm(quantized - reference) / np.linalg.norm(reference))}


def files_bytes(path: Path) -> int:
    """Bytes of a model file and the data files beside it named after it."""
    return sum(f.stat().st_size for f in path.parent.iterdir() if f.name == path.name or f.name.startswith(path.name + "."))


def step(name: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run one step in a fresh process (one thread) and return its JSON, with its seconds."""
    command = [sys.executable, __file__, "--step", name, "--folder", str(folder), "--gigabytes", str(args.gigabytes),
               "--width", str(args.width), "--threshold", str(args.threshold), "--batches", str(args.batches),
               "--batch", str(args.batch), "--iterations", str(args.iterations), "--cache-budget", str(args.cache_budget),
               "--storage", args.storage, "--model", args.model, "--length", str(args.length),
               *(["--finetune", args.finetune] if args.finetune else [])]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print(f"bench_large: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, env=environment, check=True, stdout=subprocess.PIPE, text=True)
    return {**json.loads(result.stdout), "seconds": round(time.perf_counter() - start, 1)}


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    """This process's step, with its peak RSS."""
    import torch

    import finetune.onnx.io

    torch.set_num_threads(1)
    finetune.onnx.io.EXTERNAL_DATA_THRESHOLD = args.threshold
    folder = Path(args.folder)
    model, output = folder / "large.onnx", folder / "large.int4.onnx"
    if args.step == "build":
        result = (build if args.model == "stack" else build_decoder)(model, args.gigabytes, args.width)
    elif args.step == "quantize":
        result = quantize(model, output, args)
    else:
        result = check(model, output, args)
    return {**result, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=2.5, help="fp32 weights to generate (10^9 bytes)")
    parser.add_argument("--model", choices=["stack", "decoder"], default="stack", help="MatMul stack or decoder LLM")
    parser.add_argument("--width", type=int, default=4096, help="each layer's input and output width (the decoder's model width)")
    parser.add_argument("--length", type=int, default=128, help="the decoder's tokens per row")
    parser.add_argument("--threshold", type=int, default=2**31 - 1, help="EXTERNAL_DATA_THRESHOLD in bytes")
    parser.add_argument("--finetune", choices=["gptq", "adaquant"], help="tune after quantizing")
    parser.add_argument("--storage", choices=["compact", "float"], default="compact",
                        help="weight_storage: codes (compact) or float weights beside their quantizers")
    parser.add_argument("--batches", type=int, default=4, help="calibration batches for tuning")
    parser.add_argument("--batch", type=int, default=8, help="rows per calibration batch")
    parser.add_argument("--iterations", type=int, default=10, help="AdaQuant iterations per unit")
    parser.add_argument("--cache-budget", type=int, default=2**20, help="fast_finetune.cache_budget_bytes")
    parser.add_argument("--step", choices=["build", "quantize", "check"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(run_step(args)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-large-") as folder:
        built = step("build", args, Path(folder))
        quantized = step("quantize", args, Path(folder))
        checked = step("check", args, Path(folder))
        model, output = Path(folder) / "large.onnx", Path(folder) / "large.int4.onnx"
        sizes = {"model_bytes": files_bytes(model), "output_bytes": files_bytes(output),
                 "output_files": sorted(f.name for f in Path(folder).iterdir() if f.name.startswith(output.name))}
    target_kib = (built["weight_bytes"] + 2 * 2**30) // 1024
    print(json.dumps({"config": settings(args), **sizes, "build": built, "quantize": quantized, "check": checked,
                      "quantize_target_kib": target_kib, "quantize_within_target": quantized["peak_rss_kib"] <= target_kib},
                     indent=1))


if __name__ == "__main__":
    main()
