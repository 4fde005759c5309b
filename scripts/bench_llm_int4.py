"""INT4 weight-only on the seeded Llama-style decoder (finetune.zoo_decoder), JSON on stdout, progress
on stderr: perplexity and next-token agreement with float of RTN INT4 (symmetric int4 and asymmetric
uint4, per channel and groups of 32/64/128 along the reduction axis), and onnxruntime's time per
evaluation pass of the QDQ form (DequantizeLinear(block_size)) beside the MatMulNBits form, measured
alternately in one run, with graph optimisations off and on. Tokens are sampled from the float model
(seeded), so its perplexity is that of its own text; calibration and evaluation sequences differ.

    python scripts/bench_llm_int4.py                                   # the tests' decoder (width 64)
    python scripts/bench_llm_int4.py --width 512 --mlp 1408 --blocks 4 --vocabulary 4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

from finetune.automp.metrics import METRICS
from finetune.calibrate.tokens import next_token_targets
from finetune.export.matmul_nbits import to_matmul_nbits
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model
from finetune.zoo_decoder import DecoderShape, export_decoder

SETTINGS = {  # name -> config: RTN weight-only, codes stored (weight_storage compact)
    "int4_per_channel": {"preset": "INT4_PER_CHANNEL"},
    **{f"int4_g{g}": {"preset": "INT4_BLOCK32", "weight": {"block_size": g}} for g in (32, 64, 128)},
    **{f"uint4_g{g}": {"preset": "UINT4_BLOCK32", "weight": {"block_size": g}} for g in (32, 128)},
}
TIMED = ("int4_g32", "int4_g128")


def sampled_feeds(session: onnxruntime.InferenceSession, count: int, batch: int, length: int, vocabulary: int,
                  seed: int) -> list[dict[str, np.ndarray]]:
    """`count` feeds of `batch` sequences of `length` tokens sampled from the model (one random first token)."""
    rng, feeds = np.random.default_rng(seed), []
    for _ in range(count):
        tokens = rng.integers(0, vocabulary, (batch, 1))
        while tokens.shape[1] < length:
            logits = session.run(None, _feed(tokens))[0][:, -1].astype(np.float64)
            probabilities = np.exp(logits - logits.max(-1, keepdims=True))
            probabilities /= probabilities.sum(-1, keepdims=True)
            picked = [rng.choice(vocabulary, p=row) for row in probabilities]
            tokens = np.concatenate([tokens, np.array(picked)[:, None]], axis=1)
        feeds.append(_feed(tokens))
    return feeds


def _feed(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The decoder's inputs for whole sequences."""
    tokens = tokens.astype(np.int64)
    return {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
            "position_ids": np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).copy()}


def logits(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The model's logits over the feeds in onnxruntime (exact session: optimisations off)."""
    session = inference_session(model)
    return np.concatenate([session.run(None, feed)[0] for feed in feeds])


def seconds_per_pass(models: dict[str, onnx.ModelProto], feeds: list[dict[str, np.ndarray]], threads: int,
                     repeats: int, optimize: bool) -> dict[str, float]:
    """Median seconds of one pass over the feeds per model, the models timed in turn each repeat."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = (onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL)
    sessions = {name: onnxruntime.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, session in sessions.items():
            begin = time.perf_counter()
            for feed in feeds:
                session.run(None, feed)
            times[name].append(time.perf_counter() - begin)
    return {name: float(np.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--mlp", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--vocabulary", type=int, default=96)
    parser.add_argument("--sequences", type=int, default=8, help="feeds of 4 sequences, for calibration and for evaluation")
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shape = DecoderShape(vocabulary=args.vocabulary, width=args.width, blocks=args.blocks, mlp=args.mlp)
    with tempfile.TemporaryDirectory() as folder:
        path = export_decoder(Path(folder) / "decoder.onnx", cache=False, dynamo=False, shape=shape)
        float_model = onnx.load(path)
    sampler = inference_session(float_model)
    calibration = sampled_feeds(sampler, args.sequences, 4, args.length, args.vocabulary, seed=1)
    evaluation = sampled_feeds(sampler, args.sequences, 4, args.length, args.vocabulary, seed=2)
    targets = next_token_targets(evaluation)
    reference = logits(float_model, evaluation)
    result = {"shape": vars(shape), "evaluation_tokens": int((targets >= 0).sum()),
              "perplexity": {"float": METRICS["perplexity"](reference, reference, targets)}, "next_token_agreement": {}}
    quantized = {}
    for name, config in SETTINGS.items():
        print(f"quantizing {name}", file=sys.stderr)
        quantized[name] = quantize_model(float_model, {**config, "weight_storage": "compact"}, calibration).model
        out = logits(quantized[name], evaluation)
        result["perplexity"][name] = METRICS["perplexity"](out, reference, targets)
        result["next_token_agreement"][name] = METRICS["next_token_agreement"](out, reference, targets)
    timed = {"float": float_model}
    for name in TIMED:
        timed[f"{name}_qdq"], timed[f"{name}_matmul_nbits"] = quantized[name], to_matmul_nbits(quantized[name])[0]
        packed = logits(timed[f"{name}_matmul_nbits"], evaluation)
        result["perplexity"][f"{name}_matmul_nbits"] = METRICS["perplexity"](packed, reference, targets)
    for optimize in (False, True):
        print(f"timing, graph optimisations {'on' if optimize else 'off'}", file=sys.stderr)
        result[f"seconds_per_pass_{'optimized' if optimize else 'unoptimized'}"] = seconds_per_pass(
            timed, evaluation, args.threads, args.repeats, optimize)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
